//! The VirtualMachine controller: one pod per running VM, status mirrored back.
//!
//! Expected flow, level-triggered on every VM and VM-pod change (the shared
//! watches of [`crate::watches`]); the VM's pods are found by label and
//! owner, never by name, and its *current* pod is the one its `status.podName`
//! names (what to do is decided by [`decide::next_step`]):
//! - a live VM gets the finalizer [`FINALIZER`];
//! - `replicas: 1` and no current pod → name a new pod `<vm>-<suffix>` in
//!   `status.podName`, then create it ([`crate::vmpod::pod_for_vm`]); a
//!   terminal pod (Failed/Succeeded) is deleted so the next pass replaces it;
//!   earlier pods still terminating are left to their agents;
//! - `replicas: 0` and a pod → delete the pod; the node agent shuts the VM down
//!   and completes the deletion;
//! - a deleted VM → delete its pods, then release the finalizer at once for
//!   `deletionPolicy: Retain`; otherwise the release loop
//!   ([`crate::node::release`]) undefines the VM wherever a host holds it and
//!   releases it;
//! - always write status ([`status::status_from_pod`]) when it changed, then
//!   return the error of the sync, if any, so the VM requeues with backoff.
//!
//! The controller never talks to a provider: only the node agents do.

pub mod backups;
pub mod decide;
pub mod endpoints;
mod expected;
pub mod restores;
pub mod snapshots;
pub mod status;
pub mod task_jobs;
pub mod vm_tasks;

use crate::cache::{compact_ref, decoded, decoded_policy};
use crate::conditions::{new_condition, same_conditions, set_condition};
use crate::events::{EventSink, Reason};
use crate::v1alpha1::{DeletionPolicy, Migration, MigrationPhase, VirtualMachine, VirtualMachineStatus, FINALIZER};
use crate::vmpod::{
    migration_target_pod, new_pod_name, pod_for_vm, resize_annotations, vm_amounts, ResizeNeeded, CONTAINER_NAME,
};
use crate::watches::{Triggers, Watches};
use crate::written::Written;
use decide::Step;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
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
}

struct Context {
    client: Client,
    watches: Watches,
    events: EventSink,
    /// The scope label value VM pods select (see `Config::scope`).
    scope: String,
    /// The controller's last write per VM ([`crate::written`]).
    written: Written,
    /// Pods it created that the watch has not shown yet ([`expected`]).
    expected: expected::Expected,
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
    let ctx = Arc::new(Context {
        events: EventSink::new(client.clone(), FIELD_MANAGER),
        client,
        watches: watches.clone(),
        scope,
        written: Written::default(),
        expected: expected::Expected::default(),
    });
    info!("VirtualMachine controller starting");
    let Some(controller) = watches.vm_controller(&shutdown).await else { return };
    let queue = crate::metrics::QueueDepth::new(
        crate::metrics::QueueLabels { controller: "virtualmachine", node: None },
        watches.vms.store(),
    );
    controller
        .reconcile_on(queue.track(triggers.map(compact_ref)))
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(queue.counted(decoded(reconcile)), decoded_policy(error_policy), ctx)
        .for_each(|result| async move {
            match result {
                // A VM deleted meanwhile: nothing to do.
                Err(kube::runtime::controller::Error::ObjectNotFound(_)) | Ok(_) => {}
                Err(e) => warn!(error = %e, "reconcile failed"),
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

    if ctx.written.behind(&*vm) {
        // Our own last write is on its way through the watch, which runs
        // this pass again; deciding from the older version would only redo it.
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    if vm.metadata.deletion_timestamp.is_some() {
        let owned = ctx.watches.pods_of_vm(&namespace, &name, &vm.uid().unwrap_or_default());
        // A pod of the designated name that this controller's create found
        // there already (someone else made it, e.g. a tenant racing the
        // create) is never the VM's: a new pod is named instead.
        let taken = vm
            .status
            .as_ref()
            .and_then(|s| s.pod_name.as_deref())
            .is_some_and(|n| ctx.expected.is_taken(&namespace, n));
        // The designated pod, when the cache lacks it, is read from the API
        // server only if this controller created it a moment ago: otherwise
        // the listed and watched cache not holding it means it is gone (a
        // mass delete read each VM's deleted pod once more, to a 404).
        let unseen = vm
            .status
            .as_ref()
            .and_then(|s| s.pod_name.as_deref())
            .is_some_and(|n| !owned.iter().any(|p| p.name_any() == n) && !ctx.expected.pending(&namespace, n));
        let current = if taken || unseen {
            None
        } else {
            current_pod(&vm, &owned, &pods).await.map_err(|e| kube_err("get pod", e))?
        };
        return cleanup(&vm, &owned, current.as_deref(), &pods, &vms, &ctx).await;
    }

    let mut vm = vm;
    if !vm.finalizers().iter().any(|f| f == FINALIZER) {
        // Server-side apply of our one entry: `metadata.finalizers` is a set,
        // so other controllers' finalizers stay, no resourceVersion guard is
        // needed, and a cache that lags behind our own earlier add costs one
        // no-op request instead of a conflict and a retry.
        let patch = serde_json::json!({
            "apiVersion": VirtualMachine::api_version(&()),
            "kind": VirtualMachine::kind(&()),
            "metadata": {"name": name, "finalizers": [FINALIZER]},
        });
        match vms.patch(&name, &PatchParams::apply(FIELD_MANAGER), &Patch::Apply(&patch)).await {
            // Go on with the object as written (its new resourceVersion), not
            // a round trip through the watch later.
            Ok(updated) if updated.uid() == vm.uid() => {
                ctx.written.record(&updated);
                vm = Arc::new(updated)
            }
            Ok(_) => return Ok(Action::await_change()),
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
            Err(e) => return Err(kube_err("add finalizer", e)),
        }
    }
    // From here on, every decision is made from this one version of the VM
    // (the cache's, or the apply's answer when the cache lagged): its
    // `status.podName` names the current pod, and status writes are guarded
    // by its resourceVersion.
    if vm.metadata.deletion_timestamp.is_some() {
        return Ok(Action::requeue(CONFLICT_RETRY));
    }
    let owned = ctx.watches.pods_of_vm(&namespace, &name, &vm.uid().unwrap_or_default());
    if let Some(designated) = vm.status.as_ref().and_then(|s| s.pod_name.as_deref()) {
        if owned.iter().any(|p| p.name_any() == designated) {
            ctx.expected.seen(&namespace, designated);
        } else if ctx.expected.pending(&namespace, designated) {
            // Created by this controller a moment ago: its watch event runs
            // this pass again; reading it now would only cost a request.
            return Ok(Action::requeue(Duration::from_millis(500)));
        }
    }
    // A spec change (not yet in status.observedGeneration) may have grown
    // the root disk: its claim asks for the new size, once.
    if let Some(root) = &vm.spec.root_disk {
        if vm.status.as_ref().and_then(|s| s.observed_generation) != vm.metadata.generation {
            grow_root_claim(&vm, root, &ctx).await?;
        }
    }
    let current = current_pod(&vm, &owned, &pods).await.map_err(|e| kube_err("get pod", e))?;

    let active = vm.status.as_ref().and_then(|s| s.migration.clone()).filter(|m| m.is_active());
    let target = match &active {
        Some(m) => owned_pod(&vm, &owned, &pods, &m.target_pod).await.map_err(|e| kube_err("get pod", e))?,
        None => None,
    };
    let waiting_target = target.as_ref().is_some_and(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none());
    let source_schedulable = match &active {
        Some(m) if m.phase == MigrationPhase::Pending && waiting_target => Some(
            schedulable(&ctx.client, &m.source_node)
                .await
                .map_err(|e| kube_err("read the source node of the migration of", e))?,
        ),
        _ => None,
    };
    let view = decide::MigrationView { target: target.as_deref(), source_schedulable };
    match decide::next_step(&vm, current.as_deref(), view) {
        Step::StartMigration => {
            let pod = current.as_deref().expect("a migration starts from a current pod");
            start_migration(&vm, pod, &pods, &vms, &ctx).await
        }
        Step::CancelMigration(why) => {
            if let Some(target) = target.as_deref() {
                delete_pod(target, &pods, &ctx, &vm, why).await?;
            }
            let mut migration = active.expect("cancelling means an active migration");
            migration.phase = MigrationPhase::Cancelled;
            migration.message = Some(why.to_owned());
            migration.end_time = Some(now_rfc3339());
            info!(why, "migration cancelled");
            ctx.events.publish(&*vm, Reason::MigrationCancelled, why);
            let designated = current.as_ref().map(|p| p.name_any());
            if !write_status_with(&vm, current.as_deref(), designated.as_deref(), Some(migration), &vms, &ctx.written)
                .await?
            {
                return Ok(Action::requeue(CONFLICT_RETRY));
            }
            Ok(Action::requeue(Duration::from_secs(300)))
        }
        Step::CreatePod => create_pod(&vm, &pods, &vms, &ctx).await,
        Step::DeletePod(why) => {
            let pod = current.as_deref().expect("deleting means a current pod");
            if let Some(wait) = rejected_recently(pod) {
                // A node rejected it (crate::node::admission): replace it, but
                // at most once per REJECTED_BACKOFF.
                return Ok(Action::requeue(wait));
            }
            delete_pod(pod, &pods, &ctx, &vm, why).await?;
            Ok(Action::requeue(Duration::from_secs(300)))
        }
        Step::ResizePod(needed) => {
            let pod = current.as_deref().expect("resizing means a current pod");
            let refused = resize_pod(pod, needed, &pods, &ctx, &vm).await?;
            // The resized pod comes back through the watch; its agent applies it.
            let designated = current.as_ref().map(|p| p.name_any());
            let mut new = status::status_from_pod(&vm, current.as_deref(), designated.as_deref());
            if let Some(message) = &refused {
                let condition = new_condition("ResourcesSynced", false, "Infeasible", message, vm.metadata.generation);
                set_condition(&mut new.conditions, condition);
            }
            if !write_derived(&vm, new, current.as_deref(), designated.as_deref(), &vms, &ctx.written).await? {
                return Ok(Action::requeue(CONFLICT_RETRY));
            }
            Ok(Action::requeue(Duration::from_secs(300)))
        }
        Step::Observe => {
            if let Some(wait) = current.as_deref().and_then(|pod| just_bound(pod, &vm)) {
                // Its agent is starting it: the next write says Running
                // (or why not), and the agent's placement record is not
                // raced by a write of ours meanwhile.
                return Ok(Action::requeue(wait));
            }
            let designated = current.as_ref().map(|p| p.name_any());
            let mut new = status::status_from_pod(&vm, current.as_deref(), designated.as_deref());
            // A migration whose target the scheduler cannot place says so,
            // and why, once: the drain that asked for it waits meanwhile.
            let generation = vm.metadata.generation;
            if let Some(message) = status::mark_unschedulable_target(&mut new, target.as_deref(), generation) {
                let said = vm.status.as_ref().is_some_and(|s| {
                    s.conditions.iter().any(|c| c.type_ == "Migrating" && c.reason == "TargetUnschedulable")
                });
                if !said {
                    ctx.events.publish(&*vm, Reason::TargetUnschedulable, &message);
                }
            }
            if !write_derived(&vm, new, current.as_deref(), designated.as_deref(), &vms, &ctx.written).await? {
                return Ok(Action::requeue(CONFLICT_RETRY));
            }
            // A target pod waiting for the scheduler: look again soon whether
            // its source host was uncordoned (Nodes are not watched).
            Ok(Action::requeue(if waiting_target { Duration::from_secs(3) } else { Duration::from_secs(300) }))
        }
    }
}

/// How long the controller leaves the status of a VM whose pod was just
/// bound to its agent, which is starting it (see [`just_bound`]).
const BOUND_GRACE: Duration = Duration::from_secs(2);

/// How much longer to leave the status of `vm` as it is, when its current
/// pod `pod` was bound less than [`BOUND_GRACE`] ago (its `PodScheduled`
/// condition's time) and is still pending, its agent having reported
/// nothing yet, on a VM that has no migration under way: the mirror would only say `Starting` for a moment, at the
/// cost of a write that races the agent's placement record. `None`: write
/// now (a slow start shows `Starting` after the grace).
fn just_bound(pod: &Pod, vm: &VirtualMachine) -> Option<Duration> {
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
    let status = pod.status.as_ref()?;
    // Pending, and nothing from its agent yet: a reason it waits (a refused
    // disk, a missing image) is shown at once.
    let pending = status.phase.as_deref().is_none_or(|p| p == "Pending")
        && status.container_statuses.as_ref().is_none_or(Vec::is_empty)
        && pod.metadata.deletion_timestamp.is_none();
    let migrating = vm.status.as_ref().and_then(|s| s.migration.as_ref()).is_some_and(|m| m.is_active());
    if !bound || !pending || migrating {
        return None;
    }
    let scheduled = status.conditions.iter().flatten().find(|c| c.type_ == "PodScheduled" && c.status == "True")?;
    let at = scheduled.last_transition_time.as_ref()?.0;
    let since = Duration::try_from(k8s_openapi::jiff::Timestamp::now().duration_since(at)).unwrap_or_default();
    BOUND_GRACE.checked_sub(since).filter(|left| !left.is_zero())
}

/// How long a VM pod that its node rejected stays before it is replaced.
const REJECTED_BACKOFF: Duration = Duration::from_secs(10);

/// How much longer `pod`, when its node rejected it
/// ([`crate::node::admission`]: reason `NodeAffinity` or `TaintToleration`),
/// stays before it is replaced; `None` when it may go now.
fn rejected_recently(pod: &Pod) -> Option<Duration> {
    let reason = pod.status.as_ref().and_then(|s| s.reason.as_deref());
    if !matches!(reason, Some("NodeAffinity" | "TaintToleration")) {
        return None;
    }
    let created = pod.metadata.creation_timestamp.as_ref()?;
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(created.0);
    let age = Duration::try_from(age).unwrap_or_default();
    REJECTED_BACKOFF.checked_sub(age).filter(|left| !left.is_zero())
}

/// How soon a pass that lost a write race (409 Conflict: the object changed
/// since the cache showed it) runs again.
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

/// The VM's current pod: the one named by `status.podName` ([`owned_pod`]).
async fn current_pod(
    vm: &VirtualMachine,
    owned: &[Arc<Pod>],
    pods: &Api<Pod>,
) -> Result<Option<Arc<Pod>>, kube::Error> {
    let Some(name) = vm.status.as_ref().and_then(|s| s.pod_name.clone()) else { return Ok(None) };
    owned_pod(vm, owned, pods, &name).await
}

/// The VM's pod named `name`, among the pods it owns (`owned`, from the watch
/// cache), or read from the API server when the cache does not hold it yet.
/// `None` when that pod is gone (or was replaced by a pod of the same name
/// that the VM does not own).
async fn owned_pod(
    vm: &VirtualMachine,
    owned: &[Arc<Pod>],
    pods: &Api<Pod>,
    name: &str,
) -> Result<Option<Arc<Pod>>, kube::Error> {
    if let Some(pod) = owned.iter().find(|p| p.name_any() == name) {
        return Ok(Some(pod.clone()));
    }
    let uid = vm.uid().unwrap_or_default();
    Ok(pods.get_opt(name).await?.filter(|p| crate::identity::vm_owner(p).is_some_and(|o| o.uid == uid)).map(Arc::new))
}

/// Whether Node `name` takes new pods (not cordoned); a Node that is gone
/// does not.
async fn schedulable(client: &Client, name: &str) -> Result<bool, kube::Error> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    Ok(nodes.get_opt(name).await?.is_some_and(|n| !n.spec.and_then(|s| s.unschedulable).unwrap_or(false)))
}

/// Now as RFC 3339, for `status.migration` times.
fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// The evicted `source` pod's VM moves: name a target pod in
/// `status.migration` (phase Pending; guarded by the resourceVersion the pass
/// read, as for `status.podName`), then create it, kept off the source host
/// ([`migration_target_pod`]). The scheduler places it; its host's agent moves
/// the VM ([`crate::node`]'s migration).
async fn start_migration(
    vm: &VirtualMachine,
    source: &Pod,
    pods: &Api<Pod>,
    vms: &Api<VirtualMachine>,
    ctx: &Context,
) -> Result<Action, Error> {
    let object = || format!("{}/{}", vm.namespace().unwrap_or_default(), vm.name_any());
    let Some(source_node) = source.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        return Ok(Action::requeue(Duration::from_secs(5)));
    };
    let name = new_pod_name(&vm.name_any());
    let target = match migration_target_pod(vm, &name, &ctx.scope, &source_node) {
        Ok(pod) => pod,
        Err(e) => {
            let error = Error::InvalidSpec(object(), e.to_string());
            ctx.events.publish(vm, Reason::InvalidSpec, &error.to_string());
            return Err(error);
        }
    };
    let migration = Migration {
        source_node: source_node.clone(),
        source_pod: source.name_any(),
        target_pod: name.clone(),
        phase: MigrationPhase::Pending,
        message: Some(format!("pod {} was evicted from {source_node}; waiting for the scheduler", source.name_any())),
        ..Migration::default()
    };
    let designated = Some(source.name_any());
    if !write_status_with(vm, Some(source), designated.as_deref(), Some(migration), vms, &ctx.written).await? {
        return Ok(Action::requeue(CONFLICT_RETRY));
    }
    match pods.create(&PostParams::default(), &target).await {
        Ok(_) => {
            info!(pod.name = %name, source = %source_node, "created migration target pod");
            let note = format!(
                "pod {} was evicted from {source_node}: the VM moves to the host the scheduler picks for pod {name}",
                source.name_any()
            );
            ctx.events.publish(vm, Reason::Migrating, &note);
        }
        Err(kube::Error::Api(s)) if s.code == 409 => warn!(pod.name = %name, "pod name taken; choosing another"),
        Err(e) => return Err(Error::Kube { action: "create migration target pod", object: object(), source: e }),
    }
    Ok(Action::requeue(Duration::from_secs(3)))
}

/// Name a new pod in the VM's status, then create it. The name is written
/// first, guarded by the resourceVersion the pass read: of two passes that both
/// saw no pod, only one writes a name, and only the pod named there ever drives
/// the VM ([`crate::identity`]).
async fn create_pod(
    vm: &VirtualMachine,
    pods: &Api<Pod>,
    vms: &Api<VirtualMachine>,
    ctx: &Context,
) -> Result<Action, Error> {
    let object = || format!("{}/{}", vm.namespace().unwrap_or_default(), vm.name_any());
    let name = new_pod_name(&vm.name_any());
    // A placed VM's pod is pinned to the host that holds it: the placement
    // record, which only an agent writes once it defined the VM, never the
    // node of an earlier pod (which anyone could have bound anywhere).
    let home = vm.status.as_ref().and_then(|s| s.placement.as_ref()).map(|p| p.node_name.clone());
    let new_pod = match pod_for_vm(vm, &name, &ctx.scope, home.as_deref()) {
        Ok(pod) => pod,
        Err(e) => {
            let error = Error::InvalidSpec(object(), e.to_string());
            ctx.events.publish(vm, Reason::InvalidSpec, &error.to_string());
            return Err(error);
        }
    };
    if let Some(root) = &vm.spec.root_disk {
        ensure_root_claim(vm, root, &ctx.client).await?;
    }
    // The claim states the status the pod will give once it exists
    // (waiting for the scheduler), so seeing it created changes nothing: no
    // mirror write per VM for that step.
    if !write_status(vm, Some(&new_pod), Some(&name), vms, &ctx.written).await? {
        return Ok(Action::requeue(CONFLICT_RETRY));
    }
    match pods.create(&PostParams::default(), &new_pod).await {
        Ok(_) => {
            ctx.expected.created(&vm.namespace().unwrap_or_default(), &name);
            info!(pod.name = %name, vm.home = home, "created pod");
            // The first pod is in the VM's status (podName) and the agent's
            // Started Event tells the rest: one Event per VM on the way to
            // Running. A pod that replaces another is worth its own.
            if let Some(previous) = vm.status.as_ref().and_then(|s| s.pod_name.as_deref()) {
                ctx.events.publish(vm, Reason::CreatedPod, &format!("created pod {name} in place of {previous}"));
            }
        }
        // Taken by a pod this controller did not make (even one the VM
        // owns): the next pass adopts nothing under that name and names
        // another.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            warn!(pod.name = %name, "pod name taken by a pod vmlet did not make; choosing another");
            ctx.expected.taken(&vm.namespace().unwrap_or_default(), &name);
            return Ok(Action::requeue(CONFLICT_RETRY));
        }
        Err(e) => return Err(Error::Kube { action: "create pod", object: object(), source: e }),
    }
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Create the claim of `vm`'s root disk `root` unless it exists: `<vm>-root`
/// in the VM's namespace, of the root disk's size and class, filled from
/// the VM's image (`dataSourceRef` to its `VirtualMachineImage`, which
/// vmlet's provisioner makes a qcow2 overlay on). With `deletionPolicy:
/// Delete` the VM owns it, so the garbage collector deletes it (and the
/// provisioner its volume) once the VM is gone; with `Retain` it stays.
/// A claim of that name made by someone else is left as it is (it is the
/// namespace's own). Errors: the create failed otherwise.
async fn ensure_root_claim(
    vm: &VirtualMachine,
    root: &crate::v1alpha1::RootDisk,
    client: &Client,
) -> Result<(), Error> {
    let namespace = vm.namespace().unwrap_or_default();
    let name = crate::v1alpha1::root_claim_name(&vm.name_any());
    let owner = (vm.spec.deletion_policy == DeletionPolicy::Delete).then(|| {
        serde_json::json!([{"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "name": vm.name_any(),
                            "uid": vm.uid(), "controller": true, "blockOwnerDeletion": true}])
    });
    let claim: k8s_openapi::api::core::v1::PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {crate::v1alpha1::VM_LABEL: vm.name_any()}, "ownerReferences": owner},
        "spec": {
            "storageClassName": root.storage_class_name,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": root.size}},
            "dataSourceRef": {"apiGroup": crate::v1alpha1::GROUP, "kind": "VirtualMachineImage", "name": vm.spec.image},
        },
    }))
    .expect("a claim serializes");
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
    match claims.create(&PostParams::default(), &claim).await {
        Ok(_) => {
            info!(claim = %name, "created the root disk's claim");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::Kube {
            action: "create the root disk claim of",
            object: format!("{namespace}/{}", vm.name_any()),
            source,
        }),
    }
}

/// Make the claim of `vm`'s root disk `root` (the controller's: it carries
/// the VM's label) ask for `root.size` when it asks for less, so that the
/// provisioner grows the volume (live, on a running VM: the guest sees the
/// larger disk). A smaller size is not applied (volumes never shrink), nor
/// is one the claim's class does not let grow (`allowVolumeExpansion`):
/// either gets an `InvalidSpec` Warning Event naming `spec.rootDisk.size`.
/// A missing claim is [`ensure_root_claim`]'s to make.
/// Errors: reading or patching the claim failed otherwise (retried).
async fn grow_root_claim(vm: &VirtualMachine, root: &crate::v1alpha1::RootDisk, ctx: &Context) -> Result<(), Error> {
    let namespace = vm.namespace().unwrap_or_default();
    let name = crate::v1alpha1::root_claim_name(&vm.name_any());
    let kube_err = |action, source| Error::Kube { action, object: format!("{namespace}/{name}"), source };
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &namespace);
    let Some(claim) = claims.get_opt(&name).await.map_err(|e| kube_err("read the root disk claim", e))? else {
        return Ok(());
    };
    if claim.labels().get(crate::v1alpha1::VM_LABEL) != Some(&vm.name_any()) {
        return Ok(());
    }
    let (Ok(wanted), Some(asked)) = (
        crate::quantity::parse_bytes(&root.size.0),
        claim.spec.as_ref().and_then(|s| s.resources.as_ref()).and_then(|r| r.requests.as_ref()?.get("storage")),
    ) else {
        return Ok(());
    };
    let asked_bytes = crate::quantity::parse_bytes(&asked.0).unwrap_or(0);
    if wanted < asked_bytes {
        let note = format!(
            "spec.rootDisk.size {} is less than claim {name}'s {}: a root disk never shrinks (the guest's data would \
             be cut off); set it to {} or more",
            root.size.0, asked.0, asked.0
        );
        ctx.events.publish(vm, Reason::InvalidSpec, &note);
        return Ok(());
    }
    if wanted == asked_bytes {
        return Ok(());
    }
    let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": root.size}}}});
    match claims.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {
            info!(claim = %name, size = %root.size.0, "root disk claim grown");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => {
            let note = format!(
                "spec.rootDisk.size {}: claim {name} cannot grow ({}); its StorageClass must allow volume expansion",
                root.size.0, s.message
            );
            ctx.events.publish(vm, Reason::InvalidSpec, &note);
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(kube_err("grow the root disk claim", e)),
    }
}

/// Bring the VM's pod to the VM's size in place: its ceiling and
/// resize-policy annotations (a merge patch), then its container's requests
/// and limits through the `resize` subresource (KEP-1287), so that the
/// scheduler's accounting of the node follows. A resize the API server
/// refuses (more than the node can allocate at all: 403; invalid: 422)
/// becomes an Event on the VM and the returned message, which the caller
/// shows as `ResourcesSynced=False` with reason `Infeasible`; it is tried
/// again at the next pass (the node may have grown).
async fn resize_pod(
    pod: &Pod,
    needed: ResizeNeeded,
    pods: &Api<Pod>,
    ctx: &Context,
    vm: &VirtualMachine,
) -> Result<Option<String>, Error> {
    let name = pod.name_any();
    let kube_err = |action, source| Error::Kube { action, object: name.clone(), source };
    if needed.annotations {
        let mut annotations: serde_json::Map<String, serde_json::Value> = [
            crate::vmpod::RESIZE_POLICY_ANNOTATION,
            crate::vmpod::MAX_CPU_ANNOTATION,
            crate::vmpod::MAX_MEMORY_ANNOTATION,
        ]
        .iter()
        .map(|key| ((*key).to_owned(), serde_json::Value::Null))
        .collect();
        for (key, value) in resize_annotations(vm) {
            annotations.insert(key, value.into());
        }
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        match pods.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
            Err(e) => return Err(kube_err("update resize annotations of pod", e)),
        }
    }
    if needed.resources {
        let amounts = vm_amounts(vm);
        let patch = serde_json::json!({"spec": {"containers": [{
            "name": CONTAINER_NAME,
            "resources": {"requests": amounts, "limits": amounts},
        }]}});
        match pods.patch_subresource("resize", &name, &PatchParams::default(), &Patch::Strategic(&patch)).await {
            Ok(_) => {
                let size = format!("{} vCPUs, {}", vm.spec.resources.cpu, vm.spec.resources.memory);
                info!(pod.name = %name, %size, "resized pod");
                ctx.events.publish(vm, Reason::Resized, &format!("resized pod {name} to {size}"));
            }
            Err(kube::Error::Api(s)) if matches!(s.code, 400 | 403 | 422) => {
                let message = format!("pod {name} cannot be resized to spec.resources: {}", s.message);
                warn!(pod.name = %name, error = %s.message, "resize refused");
                ctx.events.publish(vm, Reason::ResizeNotApplied, &message);
                return Ok(Some(message));
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(kube_err("resize pod", e)),
        }
    }
    Ok(None)
}

async fn delete_pod(pod: &Pod, pods: &Api<Pod>, ctx: &Context, vm: &VirtualMachine, why: &str) -> Result<bool, Error> {
    let uid = pod.uid().unwrap_or_default();
    if ctx.expected.deleting(&uid) {
        // Deleted by an earlier pass; the watch has not shown it yet.
        return Ok(false);
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: pod.uid(), resource_version: None }),
        ..DeleteParams::default()
    };
    match pods.delete(&pod.name_any(), &params).await {
        Ok(_) => {
            ctx.expected.deleted(&uid);
            info!(pod.name = %pod.name_any(), why, "deleted pod");
            // Not for a VM being deleted, as Kubernetes' controllers say
            // nothing of the dependents a deletion takes along: the event
            // would go to an object about to vanish, and the pod's own
            // events (stopped, destroyed) and the VM's `Undefined` tell it.
            if vm.metadata.deletion_timestamp.is_none() {
                ctx.events.publish(vm, Reason::DeletedPod, &format!("{why} (pod {})", pod.name_any()));
            }
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false),
        Err(e) => Err(Error::Kube { action: "delete pod", object: pod.name_any(), source: e }),
    }
}

async fn cleanup(
    vm: &VirtualMachine,
    owned: &[Arc<Pod>],
    current: Option<&Pod>,
    pods: &Api<Pod>,
    vms: &Api<VirtualMachine>,
    ctx: &Context,
) -> Result<Action, Error> {
    if !vm.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    if !owned.is_empty() || current.is_some() {
        for pod in owned.iter().map(|p| &**p).chain(current) {
            if pod.metadata.deletion_timestamp.is_none() {
                delete_pod(pod, pods, ctx, vm, "VirtualMachine deleted: stopping the VM").await?;
            }
        }
        let designated = current.map(|p| p.name_any());
        write_status(vm, current, designated.as_deref(), vms, &ctx.written).await?;
        // The pods' disappearance triggers the next pass.
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    match vm.spec.deletion_policy {
        DeletionPolicy::Delete => {
            // The release loop of the process serving the VM's host undefines
            // it wherever a host holds it, then releases the finalizer.
            info!("waiting for the VM to be undefined");
            Ok(Action::requeue(Duration::from_secs(60)))
        }
        DeletionPolicy::Retain => {
            let why = "deletionPolicy Retain: the VM stays defined on its host";
            ctx.events.publish(vm, Reason::ReleasedVm, why);
            release_finalizer(vms, vm).await.map_err(|e| Error::Kube {
                action: "remove finalizer",
                object: vm.name_any(),
                source: e,
            })?;
            Ok(Action::await_change())
        }
    }
}

/// Remove [`FINALIZER`] from a VM. Shared with the node agent, which releases
/// it after undefining the domain.
///
/// One JSON patch (RFC 6902) that tests the object's UID and that the entry
/// at our index is ours, then removes it: another controller's finalizers
/// are never touched, and a status write in between (which changes the
/// resourceVersion but not the finalizers) costs no conflict and no retry,
/// as a resourceVersion guard did (thousands of them in a mass delete).
/// Errors: the API server's, including 422 when a test failed (the list
/// changed meanwhile; the pass runs again). A VM that is gone is success.
pub async fn release_finalizer(vms: &Api<VirtualMachine>, vm: &VirtualMachine) -> Result<(), kube::Error> {
    let Some(at) = vm.finalizers().iter().position(|f| f == FINALIZER) else { return Ok(()) };
    let entry = format!("/metadata/finalizers/{at}");
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "test", "path": "/metadata/uid", "value": vm.uid()},
        {"op": "test", "path": entry, "value": FINALIZER},
        {"op": "remove", "path": entry},
    ]))
    .expect("a well-formed JSON patch");
    match vms.patch(&vm.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Write the status that `pod` (the VM's current pod, if any) and
/// `designated` (the name in `status.podName`) give, when it changed: the
/// whole status, guarded by the resourceVersion the pass read, so a write
/// based on a stale view (the cache lagging behind another writer: a pass of
/// this controller, an agent's placement record) is refused. On such a
/// conflict the status is derived once more from the object read fresh and
/// written again, unless this write names a new pod (a claim that must hold
/// against what the pass read) or the VM's current pod changed meanwhile.
/// Returns false when the write lost; the pass runs again soon.
async fn write_status(
    vm: &VirtualMachine,
    pod: Option<&Pod>,
    designated: Option<&str>,
    vms: &Api<VirtualMachine>,
    written: &Written,
) -> Result<bool, Error> {
    let new = status::status_from_pod(vm, pod, designated);
    write_derived(vm, new, pod, designated, vms, written).await
}

/// [`write_status`] with `status.migration` set to `migration` (a claim: it
/// holds only against the version the pass read).
async fn write_status_with(
    vm: &VirtualMachine,
    pod: Option<&Pod>,
    designated: Option<&str>,
    migration: Option<Migration>,
    vms: &Api<VirtualMachine>,
    written: &Written,
) -> Result<bool, Error> {
    let mut claimed = vm.clone();
    claimed.status.get_or_insert_with(Default::default).migration = migration;
    let new = status::status_from_pod(&claimed, pod, designated);
    let params = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    claimed.status = Some(new);
    match vms.replace_status(&vm.name_any(), &params, &claimed).await {
        Ok(updated) => {
            written.record(&updated);
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(true),
        Err(e) => Err(Error::Kube { action: "write status", object: vm.name_any(), source: e }),
    }
}

/// Write `new`, derived from `vm`, `pod` and `designated` (see [`write_status`]).
async fn write_derived(
    vm: &VirtualMachine,
    new: VirtualMachineStatus,
    pod: Option<&Pod>,
    designated: Option<&str>,
    vms: &Api<VirtualMachine>,
    written: &Written,
) -> Result<bool, Error> {
    let old = vm.status.clone().unwrap_or_default();
    if same_status(&old, &new) {
        return Ok(true);
    }
    let kube_err = |e| Error::Kube { action: "write status", object: vm.name_any(), source: e };
    if mirrors_only(&old, &new) {
        // Only what the controller alone writes changed: a merge patch of
        // those fields needs no resourceVersion guard, so it never loses a
        // race with an agent's placement record (a conflict, a fresh read
        // and a second write, per VM, under load).
        let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
        let patch = serde_json::json!({"status": mirror_patch(&new)});
        return match vms.patch_status(&vm.name_any(), &params, &Patch::Merge(&patch)).await {
            Ok(updated) => {
                written.record(&updated);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(true),
            Err(e) => Err(kube_err(e)),
        };
    }
    let mut updated = vm.clone();
    updated.status = Some(new);
    let params = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    match vms.replace_status(&vm.name_any(), &params, &updated).await {
        Ok(updated) => {
            written.record(&updated);
            return Ok(true);
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(true),
        Err(e) => return Err(kube_err(e)),
    }
    // Another writer (an agent's placement record, or this controller ahead
    // of its cache) came first. Derive once more from the object as it is now
    // rather than wait for the cache; a second conflict waits for the next pass.
    // Not when this write names a new pod: that claim must hold against the
    // version the pass read.
    let claims = designated.is_some() && vm.status.as_ref().and_then(|s| s.pod_name.as_deref()) != designated;
    if claims {
        return Ok(false);
    }
    let Some(mut fresh) = vms.get_opt(&vm.name_any()).await.map_err(kube_err)? else { return Ok(true) };
    if fresh.uid() != vm.uid() {
        return Ok(true);
    }
    let pod_name = |v: &VirtualMachine| v.status.as_ref().and_then(|s| s.pod_name.clone());
    if pod_name(&fresh) != pod_name(vm) {
        // The VM's current pod changed meanwhile: the next pass sees it.
        return Ok(false);
    }
    let new = status::status_from_pod(&fresh, pod, designated);
    if same_status(&fresh.status.clone().unwrap_or_default(), &new) {
        return Ok(true);
    }
    fresh.status = Some(new);
    match vms.replace_status(&vm.name_any(), &params, &fresh).await {
        Ok(updated) => {
            written.record(&updated);
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(true),
        Err(e) => Err(kube_err(e)),
    }
}

/// The status fields only the controller writes, mirrored from the VM's
/// pod and spec. The others are claims and records that hold only against
/// the version they were decided from: `podName` (the controller's claim),
/// `migration` (the controller's and the agents'), `placement` (the agents').
const MIRRORED_FIELDS: [&str; 10] = [
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "selector",
    "phase",
    "nodeName",
    "providerId",
    "addresses",
    "currentResources",
    "conditions",
];

/// Whether `new` differs from `old` in [`MIRRORED_FIELDS`] only.
fn mirrors_only(old: &VirtualMachineStatus, new: &VirtualMachineStatus) -> bool {
    old.pod_name == new.pod_name && old.migration == new.migration && old.placement == new.placement
}

/// A JSON merge patch body for `status` that sets [`MIRRORED_FIELDS`] to
/// what `new` has, with `null` for those it lacks (so that, e.g., addresses
/// that went away are removed), and nothing else.
fn mirror_patch(new: &VirtualMachineStatus) -> serde_json::Value {
    let full = serde_json::to_value(new).expect("a status serializes");
    MIRRORED_FIELDS
        .iter()
        .map(|field| ((*field).to_owned(), full.get(*field).cloned().unwrap_or(serde_json::Value::Null)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn same_status(a: &VirtualMachineStatus, b: &VirtualMachineStatus) -> bool {
    let strip = |s: &VirtualMachineStatus| VirtualMachineStatus { conditions: vec![], ..s.clone() };
    strip(a) == strip(b) && same_conditions(&a.conditions, &b.conditions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1alpha1::{CurrentResources, Placement, VmPhase};

    /// `pod`, bound by the scheduler `ago` ago.
    fn bound(pod: Pod, ago: Duration) -> Pod {
        let mut pod = pod;
        let at = k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::try_from(ago).unwrap();
        pod.status.get_or_insert_with(Default::default).conditions =
            Some(vec![k8s_openapi::api::core::v1::PodCondition {
                type_: "PodScheduled".into(),
                status: "True".into(),
                last_transition_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at)),
                ..Default::default()
            }]);
        pod
    }

    #[test]
    fn a_just_bound_pod_leaves_the_status_to_its_agent_for_a_moment_unless_something_is_to_say() {
        use crate::testing::{PodBuilder, VmBuilder};
        let vm = VmBuilder::new("web").pod_name("web-x7k2p").build();
        let fresh = bound(PodBuilder::for_vm(&vm).on_node("host-a").build(), Duration::from_millis(200));
        let left = just_bound(&fresh, &vm).expect("just bound: wait");
        assert!(left <= BOUND_GRACE && left >= Duration::from_millis(500), "{left:?}");
        let old = bound(PodBuilder::for_vm(&vm).on_node("host-a").build(), Duration::from_secs(5));
        assert_eq!(just_bound(&old, &vm), None, "past the grace: Starting is shown");
        let unbound = bound(PodBuilder::for_vm(&vm).build(), Duration::from_millis(200));
        assert_eq!(just_bound(&unbound, &vm), None);
        let mut waiting = fresh.clone();
        waiting.status.as_mut().unwrap().container_statuses = Some(vec![Default::default()]);
        assert_eq!(just_bound(&waiting, &vm), None, "the agent said why it waits: shown at once");
        let deleting = bound(PodBuilder::for_vm(&vm).on_node("host-a").deleting().build(), Duration::ZERO);
        assert_eq!(just_bound(&deleting, &vm), None);
        let migrating = VmBuilder::new("web")
            .pod_name("web-x7k2p")
            .migrating("host-a", "web-x7k2p", "web-2", MigrationPhase::Pending)
            .build();
        assert_eq!(just_bound(&fresh, &migrating), None);
    }

    fn full_status() -> VirtualMachineStatus {
        VirtualMachineStatus {
            observed_generation: Some(3),
            replicas: 1,
            ready_replicas: 1,
            selector: Some("vmlet.io/vm=web".into()),
            phase: Some(VmPhase::Running),
            node_name: Some("host-a".into()),
            placement: Some(Placement { node_name: "host-a".into(), backend_id: Some("7".into()) }),
            pod_name: Some("web-x7k2p".into()),
            provider_id: Some("libvirt:///host-a/7".into()),
            addresses: vec!["10.0.0.5".into()],
            migration: Some(Migration::default()),
            current_resources: Some(CurrentResources { cpu: 2, memory: "1Gi".into() }),
            conditions: vec![new_condition("Ready", true, "Running", "it runs", Some(3))],
        }
    }

    #[test]
    fn every_status_field_is_either_mirrored_or_a_guarded_claim() {
        let serialized = serde_json::to_value(full_status()).unwrap();
        let claims = ["podName", "migration", "placement"];
        for field in serialized.as_object().unwrap().keys() {
            let mirrored = MIRRORED_FIELDS.contains(&field.as_str());
            assert!(
                mirrored != claims.contains(&field.as_str()),
                "status.{field} must be in exactly one of MIRRORED_FIELDS and the claims"
            );
        }
    }

    #[test]
    fn a_mirror_patch_sets_the_mirrored_fields_clears_missing_ones_and_leaves_claims_alone() {
        let mut new = full_status();
        new.addresses.clear();
        new.provider_id = None;
        let patch = mirror_patch(&new);
        let patch = patch.as_object().unwrap();
        assert_eq!(patch.len(), MIRRORED_FIELDS.len());
        assert_eq!(patch["phase"], "Running");
        assert_eq!(patch["readyReplicas"], 1);
        assert_eq!(patch["addresses"], serde_json::Value::Null, "addresses that went away are removed");
        assert_eq!(patch["providerId"], serde_json::Value::Null);
        for claim in ["podName", "migration", "placement"] {
            assert!(!patch.contains_key(claim), "{claim} is never in a mirror patch");
        }
    }

    #[test]
    fn a_change_to_a_claim_is_not_a_mirror_only_change() {
        let old = full_status();
        let mut new = old.clone();
        new.phase = Some(VmPhase::Stopped);
        assert!(mirrors_only(&old, &new));
        new.pod_name = None;
        assert!(!mirrors_only(&old, &new));
        let mut moved = old.clone();
        moved.placement = None;
        assert!(!mirrors_only(&old, &moved));
    }
}
