//! The VirtualMachineSnapshot controller: one Job takes the snapshot on the
//! VM's host, another deletes it there when the object is deleted
//! ([`task_jobs`]); the agent of that host writes the snapshot's status and
//! releases its finalizer ([`crate::node::tasks`]).
//!
//! A live snapshot carries the finalizer [`SNAPSHOT_FINALIZER`], so the back
//! end's snapshot is never left behind unnamed. The finalizer goes without a
//! Job when nothing can be on a host: no pod ever claimed the snapshot, or
//! the VM it was taken of is gone (its domain went, and the snapshot with
//! it).

use super::task_jobs::{
    job_failure, job_outcome, run_job_owner, task_job, vm_task_placement, TaskJob, TaskPlacement, VmTask,
};
use crate::conditions::new_condition;
use crate::v1alpha1::{
    OperationPhase, VirtualMachine, VirtualMachineSnapshot, SNAPSHOT_ANNOTATION, SNAPSHOT_FINALIZER,
};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

/// Seconds a snapshot's Job gets beyond the snapshot's own deadline, so that
/// the agent's message arrives before the Job's.
const JOB_SLACK_SECONDS: i64 = 120;

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
    let status = snapshot.status.clone().unwrap_or_default();
    if matches!(status.phase, Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let job_name = format!("{name}-snapshot");
    if let Some(job) = jobs.get_opt(&job_name).await.map_err(err("read the Job"))? {
        let ours = job.owner_references().iter().any(|r| Some(&r.uid) == snapshot.meta().uid.as_ref());
        if !ours {
            let message = format!("Job {job_name} exists and is not this snapshot's; delete it or rename the snapshot");
            return fail(&snapshots, &name, &message).await.map_err(err("write status"));
        }
        if let (Some(message), None) = (job_failure(&job), status.pod_uid.as_ref()) {
            // The pod never reached an agent (the agent reports its own failures).
            return fail(&snapshots, &name, &message).await.map_err(err("write status"));
        }
        if let Some((succeeded, message)) = job_outcome(&ctx.client, &job).await.map_err(err("read the Job's pod"))? {
            // The agent ends the pod after it wrote the outcome; a snapshot
            // still Running now lost that write (read again: not the cache).
            let fresh = snapshots.get_status(&name).await.map_err(err("read"))?;
            if fresh.status.and_then(|s| s.phase) == Some(OperationPhase::Running) {
                warn!(snapshot = %name, succeeded, "the agent's final status was lost; taking the Job's outcome");
                let message = format!("{message} (from Job {job_name}: the agent's final status was not written)");
                if !succeeded {
                    return fail(&snapshots, &name, &message).await.map_err(err("write status"));
                }
                let condition = new_condition("Complete", true, "SnapshotTaken", &message, None);
                let patch = serde_json::json!({"status": {"phase": OperationPhase::Succeeded, "readyToUse": true,
                    "message": message, "conditions": [condition]}});
                snapshots
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(err("write status"))?;
                return Ok(Action::await_change());
            }
        }
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let vm_name = &snapshot.spec.virtual_machine;
    let Some(vm) = vms.get_opt(vm_name).await.map_err(err("read the VirtualMachine"))? else {
        let message = format!("spec.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}");
        return fail(&snapshots, &name, &message).await.map_err(err("write status"));
    };
    let placement = match vm_task_placement(&vm) {
        VmTask::Run(placement) => placement,
        VmTask::Migrating => {
            let message = format!("waiting for VirtualMachine {vm_name}'s migration to end");
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "message": message}});
            snapshots
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(err("write status"))?;
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        VmTask::NeverDefined => {
            let message =
                format!("VirtualMachine {vm_name} has never been defined on a host: there is nothing to snapshot yet");
            return fail(&snapshots, &name, &message).await.map_err(err("write status"));
        }
    };
    let job = snapshot_job(&snapshot, &vm, job_name.clone(), placement, &ctx.scope);
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => info!(job = %job_name, "snapshot Job created"),
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(err("create the Job")(e)),
    }
    let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "jobName": job_name}});
    snapshots.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(err("write status"))?;
    Ok(Action::requeue(Duration::from_secs(60)))
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
    let job = snapshot_job(snapshot, vm, job_name.clone(), placement, &ctx.scope);
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

/// The Job `job_name` for `snapshot` of `vm`.
fn snapshot_job(
    snapshot: &VirtualMachineSnapshot,
    vm: &VirtualMachine,
    job_name: String,
    placement: TaskPlacement,
    scope: &str,
) -> Job {
    let name = snapshot.name_any();
    task_job(&TaskJob {
        name: job_name,
        namespace: &snapshot.namespace().unwrap_or_default(),
        owner: snapshot.controller_owner_ref(&()).expect("a stored object has a name and UID"),
        annotation: (SNAPSHOT_ANNOTATION, &name),
        container: "snapshot",
        placement,
        deadline_seconds: snapshot.spec.active_deadline_seconds + JOB_SLACK_SECONDS,
        scope,
        tolerations: vm.spec.tolerations.clone().unwrap_or_default(),
        claim: None,
    })
}

/// Mark the snapshot Failed with `message` (condition `Failed`).
async fn fail(snapshots: &Api<VirtualMachineSnapshot>, name: &str, message: &str) -> Result<Action, kube::Error> {
    warn!(snapshot = name, message, "snapshot failed");
    let condition = new_condition("Failed", true, "SnapshotFailed", message, None);
    let patch = serde_json::json!({"status": {
        "phase": OperationPhase::Failed, "readyToUse": false, "message": message, "conditions": [condition],
    }});
    snapshots.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::await_change())
}
