//! The VirtualMachineRestore controller: a new VirtualMachine from a backup.
//!
//! 1. The backup must have succeeded and the target VM must not exist (a
//!    restore never writes over a VM).
//! 2. A Job on the backup's host makes the new disk ([`crate::node::tasks`]);
//!    the agent writes `status.disk`.
//! 3. This controller creates the VirtualMachine: the backed-up VM's spec
//!    (`status.virtualMachineSpec` of the backup), its `image` the new disk,
//!    pinned to the host by `nodeSelector`, labelled
//!    `vmlet.io/restored-from=<backup>`; then the restore is `Succeeded`.

use super::task_jobs::{job_failure, run_job_owner, task_job, TaskJob, TaskPlacement};
use crate::conditions::new_condition;
use crate::v1alpha1::{
    OperationPhase, VirtualMachine, VirtualMachineBackup, VirtualMachineRestore, RESTORE_ANNOTATION,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument};

/// Label on a VirtualMachine a restore created, naming the backup.
pub const RESTORED_FROM_LABEL: &str = "vmlet.io/restored-from";

/// Annotation on a VirtualMachine a restore created: the restore's UID.
pub const RESTORED_BY_ANNOTATION: &str = "vmlet.io/restored-by";

/// Seconds a restore's Job may run.
const JOB_DEADLINE_SECONDS: i64 = 3600 + 120;

/// Why a pass failed; it is retried.
#[derive(Debug, thiserror::Error)]
#[error("{action} of VirtualMachineRestore {object}: {source}")]
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

/// Run the controller over the VirtualMachineRestores of `namespace` (all when
/// `None`) and their Jobs until `shutdown`.
pub async fn run(client: Client, namespace: Option<String>, scope: String, shutdown: CancellationToken) {
    info!("VirtualMachineRestore controller starting");
    let ctx = Arc::new(Context { client: client.clone(), scope });
    run_job_owner::<VirtualMachineRestore, _, Error, _>(
        client,
        namespace.as_deref(),
        RESTORE_ANNOTATION,
        reconcile,
        ctx,
        shutdown,
    )
    .await;
}

#[instrument(skip_all, fields(restore.namespace = restore.namespace().unwrap_or_default(), restore.name = %restore.name_any()))]
async fn reconcile(restore: Arc<VirtualMachineRestore>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let name = restore.name_any();
    let err = |action| {
        let object = format!("{namespace}/{name}");
        move |source| Error { action, object, source }
    };
    let status = restore.status.clone().unwrap_or_default();
    if matches!(status.phase, Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let restores: Api<VirtualMachineRestore> = Api::namespaced(ctx.client.clone(), &namespace);
    let backups: Api<VirtualMachineBackup> = Api::namespaced(ctx.client.clone(), &namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let fail = |message: String| {
        let (restores, name) = (restores.clone(), name.clone());
        async move { end(&restores, &name, OperationPhase::Failed, &message, None).await }
    };

    let backup_name = &restore.spec.source.backup;
    let Some(backup) = backups.get_opt(backup_name).await.map_err(err("read the backup"))? else {
        return fail(format!("spec.source.backup: namespace {namespace} has no VirtualMachineBackup {backup_name}"))
            .await
            .map_err(err("write status"));
    };
    let backup_status = backup.status.clone().unwrap_or_default();
    match backup_status.phase {
        Some(OperationPhase::Succeeded) => {}
        Some(OperationPhase::Failed) => {
            return fail(format!("spec.source.backup: VirtualMachineBackup {backup_name} failed; restore from another"))
                .await
                .map_err(err("write status"))
        }
        _ => {
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending,
                "message": format!("waiting for VirtualMachineBackup {backup_name} to succeed")}});
            restores
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(err("write status"))?;
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
    }
    let (Some(node), Some(spec)) = (backup_status.node_name.clone(), backup_status.virtual_machine_spec.clone()) else {
        return fail(format!("VirtualMachineBackup {backup_name} records no host or VM spec; it cannot be restored"))
            .await
            .map_err(err("write status"));
    };
    let vm_name = &restore.spec.target.virtual_machine;
    if let Some(existing) = vms.get_opt(vm_name).await.map_err(err("read the target VM"))? {
        let made_by_this_restore = existing.annotations().get(RESTORED_BY_ANNOTATION) == restore.uid().as_ref();
        if made_by_this_restore {
            // Created by an earlier pass whose status write did not land.
            let message = format!("VirtualMachine {vm_name} created from VirtualMachineBackup {backup_name}");
            return end(&restores, &name, OperationPhase::Succeeded, &message, existing.uid())
                .await
                .map_err(err("write status"));
        }
        return fail(format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} exists; a restore never writes over a VM: name one \
             that does not exist"
        ))
        .await
        .map_err(err("write status"));
    }

    let Some(disk) = status.disk.clone() else {
        // Step 2: the Job that makes the disk on the backup's host.
        let job_name = format!("{name}-restore");
        match jobs.get_opt(&job_name).await.map_err(err("read the Job"))? {
            Some(job) => {
                let ours = job.owner_references().iter().any(|r| Some(&r.uid) == restore.meta().uid.as_ref());
                if !ours {
                    return fail(format!(
                        "Job {job_name} exists and is not this restore's; delete it or rename the restore"
                    ))
                    .await
                    .map_err(err("write status"));
                }
                if let Some(message) = job_failure(&job) {
                    return fail(message).await.map_err(err("write status"));
                }
            }
            None => {
                let owner = restore.controller_owner_ref(&()).expect("a stored object has a name and UID");
                let job = task_job(&TaskJob {
                    name: job_name.clone(),
                    namespace: &namespace,
                    owner,
                    annotation: (RESTORE_ANNOTATION, &name),
                    container: "restore",
                    placement: TaskPlacement::OnNode(node.clone()),
                    deadline_seconds: JOB_DEADLINE_SECONDS,
                    scope: &ctx.scope,
                    tolerations: spec.tolerations.clone().unwrap_or_default(),
                });
                match jobs.create(&PostParams::default(), &job).await {
                    Ok(_) => info!(job = %job_name, node = %node, "restore Job created"),
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) => return Err(err("create the Job")(e)),
                }
                let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "jobName": job_name,
                    "nodeName": node}});
                restores
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(err("write status"))?;
            }
        }
        return Ok(Action::requeue(Duration::from_secs(30)));
    };

    // Step 3: the VirtualMachine, on the disk's host.
    let mut spec = spec;
    spec.image = Some(disk.clone());
    spec.replicas = 1;
    spec.node_selector.get_or_insert_with(BTreeMap::new).insert("kubernetes.io/hostname".to_owned(), node.clone());
    let vm = VirtualMachine {
        metadata: ObjectMeta {
            name: Some(vm_name.clone()),
            namespace: Some(namespace.clone()),
            labels: Some(BTreeMap::from([(RESTORED_FROM_LABEL.to_owned(), backup_name.clone())])),
            annotations: Some(BTreeMap::from([(RESTORED_BY_ANNOTATION.to_owned(), restore.uid().unwrap_or_default())])),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    };
    let created = vms.create(&PostParams::default(), &vm).await.map_err(err("create the VirtualMachine"))?;
    info!(vm = %vm_name, disk = %disk, node = %node, "VirtualMachine restored");
    let message = format!("VirtualMachine {vm_name} created on host {node} with disk {disk}");
    end(&restores, &name, OperationPhase::Succeeded, &message, created.uid()).await.map_err(err("write status"))
}

/// End the restore with `phase` and `message` (condition `Complete` or `Failed`).
async fn end(
    restores: &Api<VirtualMachineRestore>,
    name: &str,
    phase: OperationPhase,
    message: &str,
    vm_uid: Option<String>,
) -> Result<Action, kube::Error> {
    let (type_, reason) = match phase {
        OperationPhase::Succeeded => ("Complete", "Restored"),
        _ => ("Failed", "RestoreFailed"),
    };
    let condition = new_condition(type_, true, reason, message, None);
    let mut status = serde_json::json!({"phase": phase, "message": message, "conditions": [condition]});
    if let Some(uid) = vm_uid {
        status["virtualMachineUid"] = uid.into();
    }
    restores.patch_status(name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({"status": status}))).await?;
    Ok(Action::await_change())
}
