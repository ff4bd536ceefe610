//! Deleted VirtualMachines with `deletionPolicy: Delete` whose domain is defined on
//! this host: once their pod is gone, power off what still runs, undefine the
//! domain and release the finalizer.
//!
//! Only the agent of `status.nodeName` acts, and only on a VM object that is being
//! deleted and still carries [`FINALIZER`]: an explicit user action.

use super::Agent;
use crate::controller::release_finalizer;
use crate::events::Reason;
use crate::v1alpha1::{DeletionPolicy, VirtualMachine, FINALIZER};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, instrument, warn};
use vmlet_provider::VmId;

/// Why a cleanup pass failed; the VM requeues with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A provider call failed.
    #[error(transparent)]
    Provider(#[from] vmlet_provider::Error),
    /// Reading or writing an object failed.
    #[error("{0}: {1}")]
    Kube(&'static str, #[source] kube::Error),
}

/// Requeue after a failed pass.
pub fn error_policy(vm: Arc<VirtualMachine>, error: &Error, _agent: Arc<Agent>) -> Action {
    warn!(vm.name = %vm.name_any(), %error, "VM cleanup failed");
    Action::requeue(Duration::from_secs(5))
}

/// One pass over one VirtualMachine.
#[instrument(skip_all, fields(node.name = %agent.host.name, vm.namespace = vm.namespace().unwrap_or_default(), vm.name = %vm.name_any()))]
pub async fn reconcile(vm: Arc<VirtualMachine>, agent: Arc<Agent>) -> Result<Action, Error> {
    let ours = vm.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(agent.host.name.as_str());
    let deleting = vm.metadata.deletion_timestamp.is_some() && vm.finalizers().iter().any(|f| f == FINALIZER);
    if !ours || !deleting || vm.spec.deletion_policy != DeletionPolicy::Delete {
        return Ok(Action::await_change());
    }
    let namespace = vm.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
    if pods.get_opt(&vm.name_any()).await.map_err(|e| Error::Kube("get pod", e))?.is_some() {
        // The pod sync stops the VM first; come back when the pod is gone.
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    let id = VmId(vm.uid().unwrap_or_default());
    if let Some(status) = agent.provider.get(&id).await? {
        if status.power.is_active() {
            agent.provider.destroy(&id).await?;
        }
        agent.provider.undefine(&id).await?;
        info!(domain = %status.backend_name, "undefined");
        let history = super::console::vm_log_dir(&agent.state_dir, &namespace, &vm.name_any(), &id.0);
        if let Err(e) = tokio::fs::remove_dir_all(&history).await {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(path = %history.display(), error = %e, "console history not removed");
            }
        }
        agent
            .events
            .publish(
                &*vm,
                Reason::Undefined,
                &format!("undefined {} on {} (deletionPolicy Delete)", status.backend_name, agent.host.name),
            )
            .await;
    }
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    release_finalizer(&vms, &vm).await.map_err(|e| Error::Kube("remove finalizer", e))?;
    Ok(Action::await_change())
}
