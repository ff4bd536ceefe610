//! The VirtualMachineBackup controller: one Job per backup, placed next to
//! the VM; the agent on the VM's host runs the copy and writes the backup's
//! status ([`crate::node::tasks`]). What the controller writes around it is
//! [`super::vm_tasks`]'s.

use super::task_jobs::run_job_owner;
use super::vm_tasks::{run_task, VmTaskObject};
use crate::v1alpha1::{OperationPhase, VirtualMachineBackup, BACKUP_ANNOTATION};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument};

/// Why a pass failed; it is retried.
#[derive(Debug, thiserror::Error)]
#[error("VirtualMachineBackup {object}: {source}")]
pub struct Error {
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

impl VmTaskObject for VirtualMachineBackup {
    const WORD: &'static str = "backup";
    const ANNOTATION: &'static str = BACKUP_ANNOTATION;
    const COMPLETE_REASON: &'static str = "BackupComplete";
    const FAILED_REASON: &'static str = "BackupFailed";

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

    fn claim(&self) -> Option<String> {
        self.spec.target.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone())
    }

    fn nothing_yet(&self) -> &'static str {
        "there is no disk to back up yet"
    }

    fn ended_fields(&self, _succeeded: bool) -> serde_json::Value {
        serde_json::json!({"completionTime": Timestamp::now().to_string()})
    }
}

#[instrument(skip_all, fields(backup.namespace = backup.namespace().unwrap_or_default(), backup.name = %backup.name_any()))]
async fn reconcile(backup: Arc<VirtualMachineBackup>, ctx: Arc<Context>) -> Result<Action, Error> {
    if matches!(backup.phase(), Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    run_task(backup.as_ref(), &ctx.client, &ctx.scope).await.map_err(|source| Error {
        object: format!("{}/{}", backup.namespace().unwrap_or_default(), backup.name_any()),
        source,
    })
}
