//! EndpointSlices for selector-less Services that VirtualMachines name in
//! `spec.services`: the second way (beside a Service selecting VM pods by
//! label) for Services to reach VMs.
//!
//! For each Service without a selector, vmlet keeps one EndpointSlice,
//! `<service>-vmlet`, labelled `kubernetes.io/service-name=<service>` and
//! `endpointslice.kubernetes.io/managed-by=vmlet.io` (so Kubernetes' own
//! EndpointSlice controllers leave it alone), owned by the Service (so it goes
//! with it). Its endpoints are the pods of the VMs of the Service's namespace
//! that name it: the addresses are the pods' `podIPs`, which only the VM's
//! node agent writes, never the VM's status (a tenant who may write a VM's
//! status could otherwise point a Service anywhere, CVE-2021-25740's hole).
//! Ready follows the pod's Ready condition. Ports are the Service's, each
//! with its numeric `targetPort` (a named one cannot be resolved on a VM:
//! the Service's `port` is used). Spec: <https://kubernetes.io/docs/concepts/services-networking/endpoint-slices/>.

use crate::v1alpha1::VirtualMachine;
use crate::watches::{Triggers, Watches};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Service};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Value of `endpointslice.kubernetes.io/managed-by` on vmlet's slices.
pub const MANAGED_BY: &str = "vmlet.io";
/// Field manager of vmlet's EndpointSlice writes.
const FIELD_MANAGER: &str = "vmlet-endpoints";
/// How often a Service is looked at again without a change.
const RESYNC: Duration = Duration::from_secs(60);

/// A failed pass; the Service is looked at again after a backoff.
#[derive(Debug, thiserror::Error)]
#[error("{action} for Service {service}: {source}")]
pub struct Error {
    action: &'static str,
    service: String,
    #[source]
    source: kube::Error,
}

struct Context {
    client: Client,
    watches: Watches,
}

/// The name of vmlet's EndpointSlice for Service `service`.
pub fn slice_name(service: &str) -> String {
    format!("{service}-vmlet")
}

/// Keep the EndpointSlices of selector-less Services named by VMs until
/// `shutdown`, over the Services of `namespace` (all when `None`). `triggers`
/// is a VirtualMachine queue input ([`Watches::vm_triggers`]): a change of a
/// VM or its pod requeues the Services it names now and named before.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    watches: Watches,
    triggers: Triggers<VirtualMachine>,
    shutdown: CancellationToken,
) {
    let services: Api<Service> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let named: Arc<Mutex<HashMap<ObjectRef<VirtualMachine>, BTreeSet<String>>>> = Arc::default();
    let store = watches.vms.clone();
    let service_triggers = triggers.flat_map(move |vm_ref| {
        let now: BTreeSet<String> =
            store.get(&vm_ref).map(|vm| vm.spec.services.iter().map(|s| s.name.clone()).collect()).unwrap_or_default();
        let before = named.lock().expect("named poisoned").insert(vm_ref.clone(), now.clone()).unwrap_or_default();
        let namespace = vm_ref.namespace.clone().unwrap_or_default();
        let refs: Vec<ObjectRef<Service>> =
            now.union(&before).map(|name| ObjectRef::new(name).within(&namespace)).collect();
        futures::stream::iter(refs)
    });
    let ctx = Arc::new(Context { client, watches });
    info!("EndpointSlice controller for VMs' selector-less Services starting");
    Controller::new(services, watcher::Config::default())
        .reconcile_on(service_triggers)
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                if !matches!(e, kube::runtime::controller::Error::ObjectNotFound(_)) {
                    warn!(error = %e, "EndpointSlice pass failed");
                }
            }
        })
        .await;
}

fn error_policy(service: Arc<Service>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(service = %service.name_any(), %error, "requeue");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(service: Arc<Service>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &namespace);
    let error = |action, source| Error { action, service: format!("{namespace}/{name}"), source };
    let vms: Vec<Arc<VirtualMachine>> = ctx
        .watches
        .vms
        .state()
        .into_iter()
        .filter(|vm| vm.namespace().as_deref() == Some(&namespace) && vm.spec.services.iter().any(|s| s.name == name))
        .collect();
    let pods: Vec<Arc<Pod>> = vms
        .iter()
        .flat_map(|vm| ctx.watches.pods_of_vm(&namespace, &vm.name_any(), &vm.uid().unwrap_or_default()))
        .collect();
    match desired_slice(&service, &pods) {
        Some(slice) => {
            let params = PatchParams::apply(FIELD_MANAGER).force();
            slices
                .patch(&slice_name(&name), &params, &Patch::Apply(&slice))
                .await
                .map_err(|e| error("apply EndpointSlice", e))?;
        }
        None => match slices.delete(&slice_name(&name), &Default::default()).await {
            Ok(_) => {
                info!(service = %name, namespace = %namespace, "removed vmlet's EndpointSlice of a Service with a selector")
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(error("delete EndpointSlice", e)),
        },
    }
    Ok(Action::requeue(RESYNC))
}

/// The EndpointSlice vmlet keeps for `service` with the VM pods `pods` (of
/// the VMs that name it); `None` when the Service has a selector (Kubernetes
/// keeps its slices). IPv4 addresses only (the slice's address type).
pub fn desired_slice(service: &Service, pods: &[Arc<Pod>]) -> Option<EndpointSlice> {
    let spec = service.spec.as_ref()?;
    if spec.selector.as_ref().is_some_and(|selector| !selector.is_empty()) {
        return None;
    }
    let name = service.name_any();
    let mut endpoints: Vec<Endpoint> = pods
        .iter()
        .filter_map(|pod| {
            let status = pod.status.as_ref()?;
            let addresses: Vec<String> = status
                .pod_ips
                .iter()
                .flatten()
                .map(|ip| ip.ip.clone())
                .filter(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok())
                .collect();
            if addresses.is_empty() {
                return None;
            }
            let terminating = pod.metadata.deletion_timestamp.is_some();
            let ready =
                !terminating && status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
            Some(Endpoint {
                addresses,
                conditions: Some(EndpointConditions {
                    ready: Some(ready),
                    serving: Some(ready || terminating),
                    terminating: Some(terminating),
                }),
                node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    namespace: pod.namespace(),
                    name: Some(pod.name_any()),
                    uid: pod.uid(),
                    ..ObjectReference::default()
                }),
                ..Endpoint::default()
            })
        })
        .collect();
    endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
    let ports = spec
        .ports
        .iter()
        .flatten()
        .map(|port| EndpointPort {
            name: port.name.clone(),
            protocol: port.protocol.clone(),
            app_protocol: port.app_protocol.clone(),
            port: Some(match &port.target_port {
                Some(IntOrString::Int(target)) => *target,
                _ => port.port,
            }),
        })
        .collect();
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Service".into(),
        name: name.clone(),
        uid: service.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    Some(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(&name)),
            namespace: service.namespace(),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/service-name".to_owned(), name),
                ("endpointslice.kubernetes.io/managed-by".to_owned(), MANAGED_BY.to_owned()),
            ])),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(ports),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(selector: Option<serde_json::Value>) -> Service {
        let mut spec =
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}, {"port": 22, "targetPort": "ssh"}]});
        if let Some(selector) = selector {
            spec["selector"] = selector;
        }
        serde_json::from_value(json!({"metadata": {"name": "shop", "namespace": "team-a", "uid": "s-1"}, "spec": spec}))
            .unwrap()
    }

    fn pod(name: &str, ips: &[&str], ready: bool, deleting: bool) -> Arc<Pod> {
        let mut pod = json!({
            "metadata": {"name": name, "namespace": "team-a", "uid": format!("u-{name}")},
            "spec": {"nodeName": "host-a", "containers": []},
            "status": {"podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>(),
                       "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]},
        });
        if deleting {
            pod["metadata"]["deletionTimestamp"] = json!("2026-12-03T10:00:00Z");
        }
        Arc::new(serde_json::from_value(pod).unwrap())
    }

    #[test]
    fn a_service_with_a_selector_is_left_to_kubernetes() {
        assert!(
            desired_slice(&service(Some(json!({"app": "shop"}))), &[pod("a", &["10.0.0.5"], true, false)]).is_none()
        );
        assert!(desired_slice(&service(Some(json!({}))), &[]).is_some(), "an empty selector selects nothing");
    }

    #[test]
    fn the_slice_lists_the_vm_pods_ipv4_addresses_with_readiness_and_the_target_ports() {
        let pods = [
            pod("b", &["10.0.0.6", "fd00::6"], false, false),
            pod("a", &["10.0.0.5"], true, false),
            pod("c", &[], true, false),
            pod("d", &["10.0.0.7"], true, true),
        ];
        let slice = desired_slice(&service(None), &pods).unwrap();
        assert_eq!(slice.metadata.name.as_deref(), Some("shop-vmlet"));
        let labels = slice.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["kubernetes.io/service-name"], "shop");
        assert_eq!(labels["endpointslice.kubernetes.io/managed-by"], "vmlet.io");
        let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Service", "s-1"));
        let seen: Vec<(Vec<String>, bool, bool)> = slice
            .endpoints
            .iter()
            .flatten()
            .map(|e| {
                let c = e.conditions.as_ref().unwrap();
                (e.addresses.clone(), c.ready.unwrap(), c.terminating.unwrap())
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                (vec!["10.0.0.5".to_owned()], true, false),
                (vec!["10.0.0.6".to_owned()], false, false),
                (vec!["10.0.0.7".to_owned()], false, true),
            ],
            "pods without an IPv4 address are left out, IPv6 ones dropped"
        );
        let ports: Vec<(Option<String>, Option<i32>)> =
            slice.ports.unwrap().into_iter().map(|p| (p.name, p.port)).collect();
        assert_eq!(ports, vec![(Some("http".into()), Some(8080)), (None, Some(22))], "a named targetPort: the port");
    }
}
