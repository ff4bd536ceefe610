//! EndpointSlices for selector-less Services that VirtualMachines name in
//! `spec.services`: the second way (beside a Service selecting VM pods by
//! label) for Services to reach VMs.
//!
//! Both sides must agree: the VM names the Service, and the Service opts in
//! with the annotation [`OPT_IN_ANNOTATION`]` = "true"` (so a tenant who may
//! create VMs cannot take over a selector-less Service someone else keeps,
//! such as an external database's; `default/kubernetes` is never served).
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
/// Annotation by which a selector-less Service lets VMs that name it in
/// `spec.services` be its endpoints (value `"true"`).
pub const OPT_IN_ANNOTATION: &str = "vmlet.io/virtual-machine-endpoints";
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
    /// `namespace/service` of the slices this process wrote, so that a
    /// Service that stops qualifying loses its slice (others are never
    /// touched: their slice, if any, is not vmlet's).
    written: Mutex<BTreeSet<String>>,
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
        let before = {
            let mut named = named.lock().expect("named poisoned");
            let before = if now.is_empty() { named.remove(&vm_ref) } else { named.insert(vm_ref.clone(), now.clone()) };
            before.unwrap_or_default()
        };
        let namespace = vm_ref.namespace.clone().unwrap_or_default();
        let refs: Vec<ObjectRef<Service>> =
            now.union(&before).map(|name| ObjectRef::new(name).within(&namespace)).collect();
        futures::stream::iter(refs)
    });
    // A slice written before the caches hold every VM and pod would take
    // endpoints away (after a vmlet restart) until their events came.
    if !watches.wait_listed(&shutdown).await {
        return;
    }
    let ctx = Arc::new(Context { client, watches, written: Mutex::default() });
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
    let key = format!("{namespace}/{name}");
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &namespace);
    let error = |action, source| Error { action, service: key.clone(), source };
    let vms: Vec<Arc<VirtualMachine>> = ctx
        .watches
        .vms
        .state()
        .into_iter()
        .filter(|vm| vm.namespace().as_deref() == Some(&namespace) && vm.spec.services.iter().any(|s| s.name == name))
        .collect();
    // Each VM's current pod only (`status.podName`): a pod a tenant made
    // with the VM's label and owner is none of its endpoints.
    let pods: Vec<Arc<Pod>> = vms
        .iter()
        .flat_map(|vm| {
            let current = vm.status.as_ref().and_then(|s| s.pod_name.clone());
            ctx.watches
                .pods_of_vm(&namespace, &vm.name_any(), &vm.uid().unwrap_or_default())
                .into_iter()
                .filter(move |pod| current.as_deref() == Some(pod.name_any().as_str()))
        })
        .collect();
    let wrote = ctx.written.lock().expect("written poisoned").contains(&key);
    match desired_slice(&service, &pods) {
        Some(slice) => {
            let params = PatchParams::apply(FIELD_MANAGER).force();
            slices
                .patch(&slice_name(&name), &params, &Patch::Apply(&slice))
                .await
                .map_err(|e| error("apply EndpointSlice", e))?;
            ctx.written.lock().expect("written poisoned").insert(key.clone());
            Ok(Action::requeue(RESYNC))
        }
        // Not vmlet's to keep, and no slice of ours: nothing is read or written.
        None if !wrote => Ok(Action::await_change()),
        None => {
            match slices.delete(&slice_name(&name), &Default::default()).await {
                Ok(_) => {
                    info!(service = %key, "removed vmlet's EndpointSlice of a Service that no longer asks for one")
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(error("delete EndpointSlice", e)),
            }
            ctx.written.lock().expect("written poisoned").remove(&key);
            Ok(Action::await_change())
        }
    }
}

/// Whether vmlet keeps `service`'s EndpointSlice: it has no selector
/// (Kubernetes keeps the slices of those), carries [`OPT_IN_ANNOTATION`]
/// `"true"`, and is not `default/kubernetes` (the API server's own).
pub fn serves(service: &Service) -> bool {
    let selector = service.spec.as_ref().and_then(|s| s.selector.as_ref()).is_some_and(|s| !s.is_empty());
    let opted_in = service.annotations().get(OPT_IN_ANNOTATION).is_some_and(|v| v == "true");
    let api_server = service.namespace().as_deref() == Some("default") && service.name_any() == "kubernetes";
    !selector && opted_in && !api_server
}

/// The EndpointSlice vmlet keeps for `service` with the VM pods `pods` (the
/// current pods of the VMs that name it); `None` when vmlet does not keep
/// the Service's slice ([`serves`]). IPv4 addresses only (the slice's
/// address type).
pub fn desired_slice(service: &Service, pods: &[Arc<Pod>]) -> Option<EndpointSlice> {
    if !serves(service) {
        return None;
    }
    let spec = service.spec.as_ref()?;
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
        // No blockOwnerDeletion: setting it needs delete rights on the Service.
        block_owner_deletion: None,
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
        serde_json::from_value(json!({"metadata": {"name": "shop", "namespace": "team-a", "uid": "s-1",
            "annotations": {OPT_IN_ANNOTATION: "true"}}, "spec": spec}))
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
    fn only_a_selector_less_service_that_opts_in_is_served_and_never_the_api_servers() {
        let mut opted = service(None);
        assert!(serves(&opted));
        opted.annotations_mut().insert(OPT_IN_ANNOTATION.into(), "yes".into());
        assert!(!serves(&opted), "only \"true\" opts in");
        opted.annotations_mut().remove(OPT_IN_ANNOTATION);
        assert!(!serves(&opted), "a Service that did not opt in is not taken over");
        let mut api = service(None);
        api.metadata.name = Some("kubernetes".into());
        api.metadata.namespace = Some("default".into());
        assert!(!serves(&api));
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
