//! The VirtualMachineBackup controller: one Job per backup, placed next to
//! the VM ([`task_jobs`]); the agent on the VM's host runs the copy and
//! writes the backup's status ([`crate::node::tasks`]). This controller writes
//! status only for what happens before a pod runs: the Job it made, a VM that
//! does not exist or never ran, a Job that failed without its pod ever
//! reaching an agent (a deadline passed while it could not be scheduled).

use super::task_jobs::{job_failure, job_outcome, run_job_owner, task_job, vm_task_placement, TaskJob, VmTask};
use crate::conditions::new_condition;
use crate::v1alpha1::{OperationPhase, VirtualMachine, VirtualMachineBackup, BACKUP_ANNOTATION};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

/// Seconds a backup's Job gets beyond the copy's own deadline, so that the
/// agent's message (the copy timed out) arrives before the Job's.
const JOB_SLACK_SECONDS: i64 = 120;

/// Why a pass failed; it is retried.
#[derive(Debug, thiserror::Error)]
#[error("{action} of VirtualMachineBackup {object}: {source}")]
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

/// Run the controller over the VirtualMachineBackups of `namespace` (all when
/// `None`) and their Jobs until `shutdown`. `scope` is the scope label value
/// of this vmlet's nodes.
pub async fn run(client: Client, namespace: Option<String>, scope: String, shutdown: CancellationToken) {
    info!("VirtualMachineBackup controller starting");
    let ctx = Arc::new(Context { client: client.clone(), scope });
    run_job_owner::<VirtualMachineBackup, _, Error, _>(
        client,
        namespace.as_deref(),
        BACKUP_ANNOTATION,
        reconcile,
        ctx,
        shutdown,
    )
    .await;
}

#[instrument(skip_all, fields(backup.namespace = backup.namespace().unwrap_or_default(), backup.name = %backup.name_any()))]
async fn reconcile(backup: Arc<VirtualMachineBackup>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = backup.namespace().unwrap_or_default();
    let name = backup.name_any();
    let err = |action| {
        let object = format!("{namespace}/{name}");
        move |source| Error { action, object, source }
    };
    let status = backup.status.clone().unwrap_or_default();
    if matches!(status.phase, Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let backups: Api<VirtualMachineBackup> = Api::namespaced(ctx.client.clone(), &namespace);
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let job_name = format!("{name}-backup");
    if let Some(job) = jobs.get_opt(&job_name).await.map_err(err("read the Job"))? {
        let ours = job.owner_references().iter().any(|r| Some(&r.uid) == backup.meta().uid.as_ref());
        if !ours {
            let message = format!("Job {job_name} exists and is not this backup's; delete it or rename the backup");
            return fail(&backups, &name, &message).await.map_err(err("write status"));
        }
        if let (Some(message), None) = (job_failure(&job), status.pod_uid.as_ref()) {
            // The pod never reached an agent (the agent reports its own failures).
            return fail(&backups, &name, &message).await.map_err(err("write status"));
        }
        if let Some((succeeded, message)) = job_outcome(&ctx.client, &job).await.map_err(err("read the Job's pod"))? {
            // The agent ends the pod after it wrote the outcome; a backup
            // still Running now lost that write (read again: not the cache).
            let fresh = backups.get_status(&name).await.map_err(err("read"))?;
            if fresh.status.and_then(|s| s.phase) == Some(OperationPhase::Running) {
                warn!(backup = %name, succeeded, "the agent's final status was lost; taking the Job's outcome");
                let message = format!("{message} (from Job {job_name}: the agent's final status was not written)");
                if !succeeded {
                    return fail(&backups, &name, &message).await.map_err(err("write status"));
                }
                let condition = new_condition("Complete", true, "BackupComplete", &message, None);
                let patch = serde_json::json!({"status": {"phase": OperationPhase::Succeeded, "message": message,
                    "completionTime": Timestamp::now().to_string(), "conditions": [condition]}});
                backups
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(err("write status"))?;
                return Ok(Action::await_change());
            }
        }
        return Ok(Action::requeue(Duration::from_secs(60)));
    }

    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let vm_name = &backup.spec.virtual_machine;
    let Some(vm) = vms.get_opt(vm_name).await.map_err(err("read the VirtualMachine"))? else {
        let message = format!("spec.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}");
        return fail(&backups, &name, &message).await.map_err(err("write status"));
    };
    let placement = match vm_task_placement(&vm) {
        VmTask::Run(placement) => placement,
        VmTask::Migrating => {
            // It waits: the pod would land on the host the VM leaves.
            let message = format!("waiting for VirtualMachine {vm_name}'s migration to end");
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "message": message}});
            backups
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(err("write status"))?;
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        VmTask::NeverDefined => {
            let message =
                format!("VirtualMachine {vm_name} has never been defined on a host: there is no disk to back up yet");
            return fail(&backups, &name, &message).await.map_err(err("write status"));
        }
    };
    let owner = backup.controller_owner_ref(&()).expect("a stored object has a name and UID");
    let job = task_job(&TaskJob {
        name: job_name.clone(),
        namespace: &namespace,
        owner,
        annotation: (BACKUP_ANNOTATION, &name),
        container: "backup",
        placement,
        deadline_seconds: backup.spec.active_deadline_seconds + JOB_SLACK_SECONDS,
        scope: &ctx.scope,
        tolerations: vm.spec.tolerations.clone().unwrap_or_default(),
        claim: backup.spec.target.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone()),
    });
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => info!(job = %job_name, "backup Job created"),
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(err("create the Job")(e)),
    }
    let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "jobName": job_name}});
    backups.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(err("write status"))?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Mark the backup Failed with `message` (condition `Failed`).
async fn fail(backups: &Api<VirtualMachineBackup>, name: &str, message: &str) -> Result<Action, kube::Error> {
    warn!(backup = name, message, "backup failed");
    let condition = new_condition("Failed", true, "BackupFailed", message, None);
    let patch = serde_json::json!({"status": {
        "phase": OperationPhase::Failed, "message": message, "completionTime": Timestamp::now().to_string(),
        "conditions": [condition],
    }});
    backups.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::await_change())
}
