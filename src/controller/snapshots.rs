//! The VirtualMachineSnapshot controller: one Job takes the snapshot on the
//! VM's host, another deletes it there when the object is deleted
//! ([`super::vm_tasks`]); the agent of that host writes the snapshot's status and
//! releases its finalizer ([`crate::node::tasks`]).
//!
//! A live snapshot carries the finalizer [`SNAPSHOT_FINALIZER`], so the back
//! end's snapshot is never left behind unnamed. The finalizer goes without a
//! Job when nothing can be on a host: no pod ever claimed the snapshot, or
//! the VM it was taken of is gone (its domain went, and the snapshot with
//! it).

use super::task_jobs::{job_failure, run_job_owner, vm_task_placement, VmTask};
use super::vm_tasks::{run_task, vm_task_job, VmTaskObject};
use crate::v1alpha1::{
    OperationPhase, VirtualMachine, VirtualMachineSnapshot, SNAPSHOT_ANNOTATION, SNAPSHOT_FINALIZER,
};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

/// Why a pass failed; it is retried.
#[derive(Debug, thiserror::Error)]
#[error("{action} of VirtualMachineSnapshot {object}: {source}")]
pub struct Error {
    action: &'static str,
    object: String,
    #[source]
    source: kube::Error,
}

struct Context {
    client: Client,
    scope: String,
}

/// Run the controller over the VirtualMachineSnapshots of `namespace` (all
/// when `None`) and their Jobs until `shutdown`. `scope` is the scope label
/// value of this vmlet's nodes.
pub async fn run(client: Client, namespace: Option<String>, scope: String, shutdown: CancellationToken) {
    info!("VirtualMachineSnapshot controller starting");
    let ctx = Arc::new(Context { client: client.clone(), scope });
    run_job_owner::<VirtualMachineSnapshot, _, Error, _>(
        client,
        namespace.as_deref(),
        SNAPSHOT_ANNOTATION,
        reconcile,
        ctx,
        shutdown,
    )
    .await;
}

#[instrument(skip_all, fields(snapshot.namespace = snapshot.namespace().unwrap_or_default(), snapshot.name = %snapshot.name_any()))]
async fn reconcile(snapshot: Arc<VirtualMachineSnapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = snapshot.namespace().unwrap_or_default();
    let name = snapshot.name_any();
    let err = |action| {
        let object = format!("{namespace}/{name}");
        move |source| Error { action, object, source }
    };
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(ctx.client.clone(), &namespace);
    let has_finalizer = snapshot.finalizers().iter().any(|f| f == SNAPSHOT_FINALIZER);
    if snapshot.metadata.deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(Action::await_change());
        }
        return delete(&snapshot, &ctx).await.map_err(err("delete"));
    }
    if !has_finalizer {
        let mut finalizers = snapshot.finalizers().to_vec();
        finalizers.push(SNAPSHOT_FINALIZER.to_owned());
        let patch =
            serde_json::json!({"metadata": {"resourceVersion": snapshot.resource_version(), "finalizers": finalizers}});
        snapshots
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(err("add the finalizer"))?;
        return Ok(Action::await_change());
    }
    if snapshot.phase() == Some(OperationPhase::Succeeded) {
        return follow_vm(&snapshot, &snapshots, &ctx.client).await.map_err(err("follow its VM"));
    }
    if snapshot.phase() == Some(OperationPhase::Failed) {
        return Ok(Action::await_change());
    }
    run_task(snapshot.as_ref(), &ctx.client, &ctx.scope).await.map_err(err("run the Job"))
}

impl VmTaskObject for VirtualMachineSnapshot {
    const WORD: &'static str = "snapshot";
    const ANNOTATION: &'static str = SNAPSHOT_ANNOTATION;
    const COMPLETE_REASON: &'static str = "SnapshotTaken";
    const FAILED_REASON: &'static str = "SnapshotFailed";

    fn vm_name(&self) -> &str {
        &self.spec.virtual_machine
    }

    fn phase(&self) -> Option<OperationPhase> {
        self.status.as_ref()?.phase
    }

    fn pod_uid(&self) -> Option<&str> {
        self.status.as_ref()?.pod_uid.as_deref()
    }

    fn job_name(&self) -> Option<&str> {
        self.status.as_ref()?.job_name.as_deref()
    }

    fn deadline_seconds(&self) -> i64 {
        self.spec.active_deadline_seconds
    }

    fn nothing_yet(&self) -> &'static str {
        "there is nothing to snapshot yet"
    }

    fn ended_fields(&self, succeeded: bool) -> serde_json::Value {
        serde_json::json!({"readyToUse": succeeded})
    }
}

/// A taken snapshot stays ready to use while the VM it was taken of (by UID)
/// exists; once that VM is deleted it says so (libvirt's record went with the
/// domain; the data stays inside the disk file). Looked at every few minutes.
async fn follow_vm(
    snapshot: &VirtualMachineSnapshot,
    snapshots: &Api<VirtualMachineSnapshot>,
    client: &Client,
) -> Result<Action, kube::Error> {
    let status = snapshot.status.clone().unwrap_or_default();
    if !status.ready_to_use {
        return Ok(Action::await_change());
    }
    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), &snapshot.namespace().unwrap_or_default());
    let vm = vms.get_opt(&snapshot.spec.virtual_machine).await?;
    if vm.is_some_and(|vm| vm.uid().is_some() && vm.uid() == status.virtual_machine_uid) {
        return Ok(Action::requeue(Duration::from_secs(180)));
    }
    let message = format!(
        "no longer usable: VirtualMachine {} (UID {}) it was taken of was deleted; its data stays inside that VM's \
         disk file",
        snapshot.spec.virtual_machine,
        status.virtual_machine_uid.as_deref().unwrap_or("?")
    );
    let patch = serde_json::json!({"status": {"readyToUse": false, "message": message}});
    snapshots.patch_status(&snapshot.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::await_change())
}

/// A deleted snapshot: release it at once when nothing can be on a host,
/// else run (and, after a failure, rerun) the Job `<name>-delete` where the
/// VM is. The agent releases the finalizer once the back end's snapshot is
/// gone.
async fn delete(snapshot: &VirtualMachineSnapshot, ctx: &Context) -> Result<Action, kube::Error> {
    let namespace = snapshot.namespace().unwrap_or_default();
    let name = snapshot.name_any();
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(ctx.client.clone(), &namespace);
    let status = snapshot.status.clone().unwrap_or_default();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    if status.phase == Some(OperationPhase::Running) {
        // Being taken: delete it once that ended (or its Job did).
        let taking = jobs.get_opt(&format!("{name}-snapshot")).await?;
        let job_ended = |job: &Job| {
            let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions
                .into_iter()
                .flatten()
                .any(|c| matches!(c.type_.as_str(), "Complete" | "Failed") && c.status == "True")
        };
        if taking.is_some_and(|job| !job_ended(&job)) {
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    }
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let vm = vms
        .get_opt(&snapshot.spec.virtual_machine)
        .await?
        .filter(|vm| vm.uid().is_some() && vm.uid() == status.virtual_machine_uid);
    if vm.as_ref().is_some_and(|vm| vm_task_placement(vm) == VmTask::Migrating) {
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let placement = vm.as_ref().and_then(|vm| match vm_task_placement(vm) {
        VmTask::Run(placement) => Some(placement),
        VmTask::Migrating | VmTask::NeverDefined => None,
    });
    let (Some(vm), Some(placement), Some(_)) = (vm.as_ref(), placement, status.pod_uid.as_ref()) else {
        // Never taken, or its VM is gone (and the snapshot with its domain).
        return release(&snapshots, snapshot).await;
    };
    let job_name = format!("{name}-delete");
    if let Some(job) = jobs.get_opt(&job_name).await? {
        if let Some(message) = job_failure(&job) {
            warn!(snapshot = %name, %message, "deleting the snapshot failed; trying again");
            let message = format!(
                "{message}; trying again in a minute (to give up and leave the snapshot on the host, remove the \
                 finalizer {SNAPSHOT_FINALIZER})"
            );
            let patch = serde_json::json!({"status": {"readyToUse": false, "message": message}});
            snapshots.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            let background =
                DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
            jobs.delete(&job_name, &background).await?;
        }
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    let job = vm_task_job(snapshot, vm, job_name.clone(), placement, &ctx.scope);
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => info!(job = %job_name, "snapshot deletion Job created"),
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e),
    }
    let patch = serde_json::json!({"status": {"readyToUse": false,
        "message": format!("being deleted by Job {job_name}")}});
    snapshots.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Remove [`SNAPSHOT_FINALIZER`], guarded by the object's resourceVersion.
async fn release(
    snapshots: &Api<VirtualMachineSnapshot>,
    snapshot: &VirtualMachineSnapshot,
) -> Result<Action, kube::Error> {
    let finalizers: Vec<&String> = snapshot.finalizers().iter().filter(|f| *f != SNAPSHOT_FINALIZER).collect();
    let patch =
        serde_json::json!({"metadata": {"resourceVersion": snapshot.resource_version(), "finalizers": finalizers}});
    match snapshots.patch(&snapshot.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(Action::await_change()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Action::requeue(Duration::from_secs(1))),
        Err(e) => Err(e),
    }
}
