//! The Node object of one hypervisor host: built from the config and the probed
//! host (pure), and written to the API server.

use crate::config::{Config, HostConfig};
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus, NodeSystemInfo, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use std::collections::BTreeMap;
use vmlet_provider::HostInfo;

/// Value of `nodeInfo.kubeletVersion`: `vmlet/<version>`.
pub const KUBELET_VERSION: &str = concat!("vmlet/", env!("CARGO_PKG_VERSION"));

/// Node label saying how guests run on the host (`kvm`, `tcg`), where the
/// provider reports it ([`HostInfo::accelerator`]).
pub const ACCELERATOR_LABEL: &str = "vmlet.io/accelerator";

/// Labels of a host's Node: the virtual-kubelet set, the scope of the
/// VirtualMachines it serves, the accelerator where known, plus the host's own.
pub fn node_labels(host: &HostConfig, provider: &str, info: &HostInfo, scope: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), host.name.clone()),
        ("kubernetes.io/role".to_owned(), "agent".to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), info.architecture.clone()),
        ("type".to_owned(), "virtual-kubelet".to_owned()),
        ("vmlet.io/provider".to_owned(), provider.to_owned()),
        (crate::config::SCOPE_LABEL.to_owned(), scope.to_owned()),
    ]);
    if let Some(accelerator) = &info.accelerator {
        labels.insert(ACCELERATOR_LABEL.to_owned(), accelerator.clone());
    }
    labels.extend(host.labels.clone());
    labels
}

/// The host's configured taints as Node taints.
pub fn node_taints(host: &HostConfig) -> Vec<Taint> {
    host.effective_taints()
        .into_iter()
        .map(|t| Taint { key: t.key, value: Some(t.value), effect: t.effect, time_added: None })
        .collect()
}

/// A new Node for `host` (metadata and spec; status is written separately).
pub fn node_for_host(host: &HostConfig, provider: &str, info: &HostInfo, scope: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(host.name.clone()),
            labels: Some(node_labels(host, provider, info, scope)),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: Some(node_taints(host)),
            provider_id: Some(format!("vmlet://{provider}/{}", host.name)),
            ..NodeSpec::default()
        }),
        status: None,
    }
}

/// Whether the node reports Ready, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness<'a> {
    /// The provider answers; pod loops run.
    Ready,
    /// vmlet is shutting down; the VMs keep running.
    Stopping,
    /// The host's back end does not answer vmlet's calls (the ping failed):
    /// `reason` names the kind (`HostNotResponding`, `PermissionDenied`, ...),
    /// `message` what the back end said, so that `kubectl describe node`
    /// shows whether it is down, refusing credentials or failing TLS.
    BackendFailing {
        /// PascalCase reason.
        reason: &'a str,
        /// The provider's error.
        message: &'a str,
    },
}

/// The Node status for `host`: capacity from the probed host (cpu in cores,
/// memory in bytes, pods = maxPods), allocatable = capacity × the host's
/// allocation ratios, addresses, the kubelet endpoint, node info and the four
/// kubelet conditions.
pub fn node_status(config: &Config, host: &HostConfig, info: &HostInfo, readiness: Readiness) -> NodeStatus {
    let now = Time(Timestamp::now());
    let capacity = BTreeMap::from([
        ("cpu".to_owned(), Quantity(info.cpus.to_string())),
        ("memory".to_owned(), Quantity(crate::quantity::format_bytes(info.memory_bytes))),
        ("pods".to_owned(), Quantity(host.max_pods.to_string())),
    ]);
    let millicores = (f64::from(info.cpus) * 1000.0 * host.cpu_allocation_ratio).floor() as u64;
    let memory = (info.memory_bytes as f64 * host.memory_allocation_ratio).floor() as u64;
    let allocatable = BTreeMap::from([
        ("cpu".to_owned(), Quantity(crate::quantity::format_millicores(millicores))),
        ("memory".to_owned(), Quantity(crate::quantity::format_bytes(memory))),
        ("pods".to_owned(), Quantity(host.max_pods.to_string())),
    ]);
    let condition = |type_: &str, status: &str, reason: &str, message: &str| NodeCondition {
        type_: type_.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
    };
    let ready = match readiness {
        Readiness::Ready => condition("Ready", "True", "KubeletReady", "vmlet is posting ready status"),
        Readiness::Stopping => {
            condition("Ready", "False", "KubeletNotReady", "vmlet is stopping; the host's VMs keep running")
        }
        Readiness::BackendFailing { reason, message } => condition(
            "Ready",
            "False",
            reason,
            &format!("the host's back end fails vmlet's calls; its VMs are left as they are: {message}"),
        ),
    };
    NodeStatus {
        capacity: Some(capacity),
        allocatable: Some(allocatable),
        // Only the InternalIP: a virtual node's name is no resolvable host name,
        // and the API server tries a Hostname address first by default.
        addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: config.node_ip.to_string() }]),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: config.kubelet_port_of(&host.name).unwrap_or(config.kubelet_port).into(),
            }),
        }),
        node_info: Some(NodeSystemInfo {
            architecture: info.architecture.clone(),
            operating_system: "linux".into(),
            kubelet_version: KUBELET_VERSION.into(),
            container_runtime_version: info.hypervisor.clone(),
            os_image: info.hypervisor.clone(),
            kernel_version: String::new(),
            kube_proxy_version: String::new(),
            boot_id: String::new(),
            machine_id: host.name.clone(),
            system_uuid: String::new(),
            ..NodeSystemInfo::default()
        }),
        conditions: Some(vec![
            ready,
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "the hypervisor has memory available"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "the hypervisor has no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "the hypervisor has PIDs available"),
        ]),
        // The kubelet API speaks WebSocket (v4/v5.channel.k8s.io): a 1.36+ API
        // server then proxies kubectl's WebSocket straight through instead of
        // translating it to SPDY.
        declared_features: Some(vec!["ExtendWebSocketsToKubelet".to_owned()]),
        ..NodeStatus::default()
    }
}

/// Create the Node, or bring an existing one's labels and taints up to date
/// (taints the node lifecycle controller added, `node.kubernetes.io/*`, are kept).
/// Returns the Node's UID (the Lease's owner).
pub async fn register(nodes: &Api<Node>, desired: &Node) -> Result<String, kube::Error> {
    let name = desired.metadata.name.clone().unwrap_or_default();
    let node = match nodes.get_opt(&name).await? {
        None => match nodes.create(&PostParams::default(), desired).await {
            Ok(node) => node,
            Err(kube::Error::Api(s)) if s.code == 409 => nodes.get(&name).await?,
            Err(e) => return Err(e),
        },
        Some(existing) => {
            let mut taints: Vec<Taint> = existing
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default()
                .into_iter()
                .filter(|t| t.key.starts_with("node.kubernetes.io/"))
                .collect();
            taints.extend(desired.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default());
            let patch = serde_json::json!({
                "metadata": {"labels": desired.metadata.labels},
                "spec": {"taints": taints},
            });
            nodes.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?
        }
    };
    Ok(node.metadata.uid.unwrap_or_default())
}

/// Write the Node's status (a merge patch of the whole status we own).
pub async fn write_status(nodes: &Api<Node>, name: &str, status: &NodeStatus) -> Result<(), kube::Error> {
    let patch = serde_json::json!({ "status": status });
    nodes.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| ())
}

/// Report an existing Node `name` NotReady because its host's back end fails
/// (`reason`, `message`) before vmlet could probe the host at all (e.g. a
/// vmlet restarted with refused credentials): only its Ready condition
/// changes (a strategic merge by condition type), with a fresh heartbeat so
/// that the node lifecycle controller keeps this condition instead of its
/// own "stopped posting". Errors: the API server's (404 when there is no
/// such Node yet: nothing to report on).
pub async fn report_failing(nodes: &Api<Node>, name: &str, reason: &str, message: &str) -> Result<(), kube::Error> {
    let now = Time(Timestamp::now());
    let current = nodes.get_status(name).await?;
    let ready = current.status.and_then(|s| s.conditions).unwrap_or_default().into_iter().find(|c| c.type_ == "Ready");
    let message = format!("the host's back end fails vmlet's calls; its VMs are left as they are: {message}");
    let transition = match ready {
        Some(c) if c.status == "False" && c.reason.as_deref() == Some(reason) => c.last_transition_time,
        _ => None,
    };
    let condition = NodeCondition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: Some(reason.into()),
        message: Some(message),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(transition.unwrap_or(now)),
    };
    let patch = serde_json::json!({ "status": { "conditions": [condition] } });
    nodes.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> (Config, HostInfo) {
        let config = Config::from_yaml(
            "kubeletPort: 10251\nhosts: [{name: host-a, provider: libvirt, uri: 'test:///x', labels: {zone: z1}, maxPods: 20}]",
            &["libvirt"],
        )
        .unwrap();
        let info = HostInfo {
            cpus: 8,
            memory_bytes: 16 << 30,
            architecture: "amd64".into(),
            hypervisor: "libvirt 9.0.0 (TEST)".into(),
            accelerator: None,
            storage_roots: vec!["/var/lib/libvirt/images".into()],
        };
        (config, info)
    }

    #[test]
    fn each_node_publishes_its_own_kubelet_port_in_config_order() {
        let (_, info) = host();
        let config = Config::from_yaml(
            "kubeletPort: 10251\nhosts: [{name: host-a, provider: libvirt, uri: 'test:///x'}, \
             {name: host-b, provider: libvirt, uri: 'test:///y'}]",
            &["libvirt"],
        )
        .unwrap();
        let port = |i: usize| {
            let status = node_status(&config, &config.hosts[i], &info, Readiness::Ready);
            status.daemon_endpoints.unwrap().kubelet_endpoint.unwrap().port
        };
        assert_eq!((port(0), port(1)), (10251, 10252));
        assert_eq!(config.kubelet_port_of("host-b"), Some(10252));
        assert_eq!(config.kubelet_port_of("elsewhere"), None);
        let error = Config::from_yaml(
            "kubeletPort: 65535\nhosts: [{name: host-a, provider: libvirt, uri: 'test:///x'}, \
             {name: host-b, provider: libvirt, uri: 'test:///y'}]",
            &["libvirt"],
        )
        .unwrap_err();
        assert!(error.to_string().contains("kubeletPort"), "{error}");
    }

    #[test]
    fn node_reports_the_hosts_accelerator_as_a_label() {
        let (config, mut info) = host();
        info.accelerator = Some("kvm".into());
        let labels = node_for_host(&config.hosts[0], "libvirt", &info, config.scope()).metadata.labels.unwrap();
        assert_eq!(labels.get(ACCELERATOR_LABEL).map(String::as_str), Some("kvm"));
    }

    #[test]
    fn node_has_virtual_kubelet_labels_and_the_default_taint() {
        let (config, info) = host();
        let node = node_for_host(&config.hosts[0], "libvirt", &info, config.scope());
        let labels = node.metadata.labels.unwrap();
        for (k, v) in [
            ("kubernetes.io/hostname", "host-a"),
            ("kubernetes.io/role", "agent"),
            ("type", "virtual-kubelet"),
            ("vmlet.io/provider", "libvirt"),
            ("zone", "z1"),
            ("vmlet.io/scope", "AllNamespaces"),
        ] {
            assert_eq!(labels.get(k).map(String::as_str), Some(v), "{k}");
        }
        assert!(!labels.contains_key(ACCELERATOR_LABEL), "a test-driver host has no accelerator: {labels:?}");
        let taints = node.spec.unwrap().taints.unwrap();
        assert_eq!(taints.len(), 1);
        assert_eq!(
            (taints[0].key.as_str(), taints[0].value.as_deref(), taints[0].effect.as_str()),
            ("virtual-kubelet.io/provider", Some("vmlet"), "NoSchedule")
        );
    }

    #[test]
    fn status_reports_probed_capacity_and_the_kubelet_endpoint() {
        let (config, info) = host();
        let status = node_status(&config, &config.hosts[0], &info, Readiness::Ready);
        let capacity = status.capacity.unwrap();
        assert_eq!(capacity["cpu"].0, "8");
        assert_eq!(capacity["memory"].0, "16Gi");
        assert_eq!(capacity["pods"].0, "20");
        assert_eq!(status.daemon_endpoints.unwrap().kubelet_endpoint.unwrap().port, 10251);
        assert_eq!(status.node_info.unwrap().kubelet_version, KUBELET_VERSION);
        let conditions = status.conditions.unwrap();
        let types: Vec<_> = conditions.iter().map(|c| (c.type_.as_str(), c.status.as_str())).collect();
        assert_eq!(
            types,
            [("Ready", "True"), ("MemoryPressure", "False"), ("DiskPressure", "False"), ("PIDPressure", "False")]
        );
        assert_eq!(status.declared_features.unwrap(), ["ExtendWebSocketsToKubelet"]);
        let addresses = status.addresses.unwrap();
        assert_eq!(addresses.len(), 1, "{addresses:?}");
        assert_eq!((addresses[0].type_.as_str(), addresses[0].address.as_str()), ("InternalIP", "127.0.0.1"));
    }

    #[test]
    fn allocation_ratios_scale_allocatable_but_not_capacity() {
        let (mut config, info) = host();
        config.hosts[0].cpu_allocation_ratio = 4.0;
        config.hosts[0].memory_allocation_ratio = 1.5;
        let status = node_status(&config, &config.hosts[0], &info, Readiness::Ready);
        assert_eq!(status.capacity.as_ref().unwrap()["cpu"].0, "8");
        let allocatable = status.allocatable.unwrap();
        assert_eq!(allocatable["cpu"].0, "32");
        assert_eq!(allocatable["memory"].0, "24Gi");
    }

    #[test]
    fn a_failing_back_end_is_named_in_the_ready_condition() {
        let (config, info) = host();
        let failing = Readiness::BackendFailing { reason: "PermissionDenied", message: "keystone: 401 wrong password" };
        let ready = node_status(&config, &config.hosts[0], &info, failing).conditions.unwrap().remove(0);
        assert_eq!((ready.status.as_str(), ready.reason.as_deref()), ("False", Some("PermissionDenied")));
        assert!(ready.message.unwrap().ends_with("keystone: 401 wrong password"));
    }

    #[test]
    fn a_stopping_vmlet_reports_not_ready() {
        let (config, info) = host();
        let status = node_status(&config, &config.hosts[0], &info, Readiness::Stopping);
        assert_eq!(status.conditions.unwrap()[0].status, "False");
    }
}
