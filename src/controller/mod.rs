//! The VirtualMachine controller: one pod per running VM, status mirrored back.
//!
//! Expected flow, level-triggered on every VM and VM-pod change:
//! - a live VM gets the finalizer [`FINALIZER`];
//! - `replicas: 1` and no pod → create the pod ([`crate::vmpod::pod_for_vm`]);
//!   a terminal pod (Failed/Succeeded) is deleted so the next pass replaces it;
//! - `replicas: 0` and a pod → delete the pod; the node agent shuts the VM down
//!   and completes the deletion;
//! - a deleted VM → delete its pod, then release the finalizer: at once for
//!   `deletionPolicy: Retain` or a VM that never reached a host; otherwise the
//!   agent of `status.nodeName` undefines the domain and releases it;
//! - always write status ([`status::status_from_pod`]) when it changed, then
//!   return the error of the sync, if any, so the VM requeues with backoff.
//!
//! The controller never talks to a provider: only the node agents do.

pub mod status;

use crate::conditions::same_conditions;
use crate::events::{EventSink, Reason};
use crate::v1alpha1::{DeletionPolicy, VirtualMachine, VirtualMachineStatus, FINALIZER};
use crate::vmpod::pod_for_vm;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use crate::watches::{no_objects, Triggers, Watches};
use kube::runtime::controller::{Action, Controller};
use kube::{Api, Client, Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

/// Field manager of the controller's writes.
pub const FIELD_MANAGER: &str = "vmlet-controller";

/// Why a reconcile pass failed; the VM requeues with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a Kubernetes object failed.
    #[error("{action} {object}: {source}")]
    Kube {
        /// What was attempted, e.g. `create pod`.
        action: &'static str,
        /// `namespace/name` of the object.
        object: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The VM's spec cannot become a pod.
    #[error("VirtualMachine {0}: {1}")]
    InvalidSpec(String, String),
    /// A pod of the VM's name exists but belongs to something else.
    #[error("pod {0} exists and is not owned by this VirtualMachine; rename or delete that pod")]
    PodNameTaken(String),
}

struct Context {
    client: Client,
    events: EventSink,
    /// The scope label value VM pods select (see `Config::scope`).
    scope: String,
}

/// Run the controller until `shutdown` is cancelled, over the VirtualMachines of
/// `namespace` (all namespaces when `None`), fed by the process's shared
/// watches ([`crate::watches`]).
pub async fn run(
    client: Client,
    namespace: Option<String>,
    watches: Watches,
    triggers: Triggers<VirtualMachine>,
    shutdown: CancellationToken,
) {
    let scope = namespace.clone().unwrap_or_else(|| crate::config::ALL_NAMESPACES_SCOPE.to_owned());
    let ctx = Arc::new(Context { events: EventSink::new(client.clone(), FIELD_MANAGER), client, scope });
    info!("VirtualMachine controller starting");
    Controller::for_stream(no_objects(), watches.vms.clone())
        .reconcile_on(triggers)
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                warn!(error = %e, "reconcile failed");
            }
        })
        .await;
    info!("VirtualMachine controller stopped");
}

fn error_policy(vm: Arc<VirtualMachine>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(vm.name = %vm.name_any(), vm.namespace = vm.namespace().unwrap_or_default(), %error, "requeue");
    Action::requeue(Duration::from_secs(5))
}

#[instrument(skip_all, fields(vm.namespace = vm.namespace().unwrap_or_default(), vm.name = %vm.name_any()))]
async fn reconcile(vm: Arc<VirtualMachine>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = vm.namespace().unwrap_or_default();
    let name = vm.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let kube_err = |action, source| Error::Kube { action, object: format!("{namespace}/{name}"), source };

    let pod = pods.get_opt(&name).await.map_err(|e| kube_err("get pod", e))?;
    if let Some(p) = &pod {
        let owned = p.owner_references().iter().any(|o| Some(&o.uid) == vm.uid().as_ref());
        if !owned {
            let error = Error::PodNameTaken(format!("{namespace}/{name}"));
            ctx.events.publish(&*vm, Reason::InvalidSpec, &error.to_string()).await;
            return Err(error);
        }
    }

    if vm.metadata.deletion_timestamp.is_some() {
        return cleanup(&vm, pod.as_ref(), &pods, &vms, &ctx).await;
    }

    if !vm.finalizers().iter().any(|f| f == FINALIZER) {
        // A merge patch replaces the whole list: keep other controllers' finalizers,
        // and guard with the resourceVersion so a concurrent change is not lost.
        let mut finalizers = vm.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        let patch =
            serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": vm.resource_version()}});
        vms.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| kube_err("add finalizer", e))?;
    }

    let sync = sync_pod(&vm, pod.as_ref(), &pods, &ctx).await;
    // Re-read after our own change so the status reflects it.
    let pod = match &sync {
        Ok(true) => pods.get_opt(&name).await.map_err(|e| kube_err("get pod", e))?,
        _ => pod,
    };
    write_status(&vm, pod.as_ref(), &vms).await?;
    if let Err(Error::InvalidSpec(_, message)) = &sync {
        ctx.events.publish(&*vm, Reason::InvalidSpec, message).await;
    }
    sync?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Create or delete the VM's pod to match `spec.replicas`. Returns whether it
/// changed anything.
async fn sync_pod(vm: &VirtualMachine, pod: Option<&Pod>, pods: &Api<Pod>, ctx: &Context) -> Result<bool, Error> {
    let name = vm.name_any();
    let object = || format!("{}/{}", vm.namespace().unwrap_or_default(), name);
    let deleting = pod.is_some_and(|p| p.metadata.deletion_timestamp.is_some());
    let terminal = pod
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Failed" || phase == "Succeeded");
    match (vm.spec.replicas, pod) {
        (1, None) => {
            let home = vm.status.as_ref().and_then(|s| s.node_name.as_deref());
            let new_pod = pod_for_vm(vm, &ctx.scope, home).map_err(|e| Error::InvalidSpec(object(), e.to_string()))?;
            match pods.create(&PostParams::default(), &new_pod).await {
                Ok(_) => {
                    info!(vm.home = home, "created pod");
                    ctx.events.publish(vm, Reason::CreatedPod, &format!("created pod {name}")).await;
                    Ok(true)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(Error::Kube { action: "create pod", object: object(), source: e }),
            }
        }
        (1, Some(p)) if terminal && !deleting => delete_pod(p, pods, ctx, vm, "pod ended; replacing it").await,
        (0, Some(p)) if !deleting => delete_pod(p, pods, ctx, vm, "spec.replicas is 0: stopping the VM").await,
        _ => Ok(false),
    }
}

async fn delete_pod(pod: &Pod, pods: &Api<Pod>, ctx: &Context, vm: &VirtualMachine, why: &str) -> Result<bool, Error> {
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: pod.uid(), resource_version: None }),
        ..DeleteParams::default()
    };
    match pods.delete(&pod.name_any(), &params).await {
        Ok(_) => {
            info!(why, "deleted pod");
            ctx.events.publish(vm, Reason::DeletedPod, why).await;
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false),
        Err(e) => Err(Error::Kube { action: "delete pod", object: pod.name_any(), source: e }),
    }
}

async fn cleanup(
    vm: &VirtualMachine,
    pod: Option<&Pod>,
    pods: &Api<Pod>,
    vms: &Api<VirtualMachine>,
    ctx: &Context,
) -> Result<Action, Error> {
    if !vm.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    if let Some(pod) = pod {
        if pod.metadata.deletion_timestamp.is_none() {
            delete_pod(pod, pods, ctx, vm, "VirtualMachine deleted: stopping the VM").await?;
        }
        write_status(vm, Some(pod), vms).await?;
        // The pod's disappearance triggers the next pass.
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    let home = vm.status.as_ref().and_then(|s| s.node_name.clone());
    match (vm.spec.deletion_policy, home) {
        (DeletionPolicy::Delete, Some(host)) => {
            // The agent of `host` undefines the domain and releases the finalizer.
            info!(node.name = %host, "waiting for the host's agent to undefine the VM");
            Ok(Action::requeue(Duration::from_secs(60)))
        }
        (policy, _) => {
            let why = match policy {
                DeletionPolicy::Retain => "deletionPolicy Retain: the VM stays defined on its host",
                DeletionPolicy::Delete => "the VM never reached a host: nothing to undefine",
            };
            ctx.events.publish(vm, Reason::ReleasedVm, why).await;
            release_finalizer(vms, vm).await.map_err(|e| Error::Kube {
                action: "remove finalizer",
                object: vm.name_any(),
                source: e,
            })?;
            Ok(Action::await_change())
        }
    }
}

/// Remove [`FINALIZER`] from a VM, guarded by its resourceVersion. Shared with the
/// node agent, which releases it after undefining the domain.
pub async fn release_finalizer(vms: &Api<VirtualMachine>, vm: &VirtualMachine) -> Result<(), kube::Error> {
    let finalizers: Vec<&String> = vm.finalizers().iter().filter(|f| *f != FINALIZER).collect();
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": vm.resource_version()}});
    match vms.patch(&vm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

async fn write_status(vm: &VirtualMachine, pod: Option<&Pod>, vms: &Api<VirtualMachine>) -> Result<(), Error> {
    let new = status::status_from_pod(vm, pod);
    let old = vm.status.clone().unwrap_or_default();
    if same_status(&old, &new) {
        return Ok(());
    }
    let patch = serde_json::json!({
        "apiVersion": VirtualMachine::api_version(&()),
        "kind": VirtualMachine::kind(&()),
        "status": new,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match vms.patch_status(&vm.name_any(), &params, &Patch::Apply(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::Kube { action: "write status", object: vm.name_any(), source: e }),
    }
}

fn same_status(a: &VirtualMachineStatus, b: &VirtualMachineStatus) -> bool {
    let strip = |s: &VirtualMachineStatus| VirtualMachineStatus { conditions: vec![], ..s.clone() };
    strip(a) == strip(b) && same_conditions(&a.conditions, &b.conditions)
}
