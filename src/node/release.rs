//! Deleted VirtualMachines with `deletionPolicy: Delete`: once their pods are
//! gone, power off what still runs, undefine the VM on every host of this
//! process that holds it (asked by UID, not from a record that may be
//! missing), and only then release the finalizer.
//!
//! One loop per process (not one per host), fed by the shared VirtualMachine
//! watch. It acts only on a VM object that is being deleted and still carries
//! [`FINALIZER`] (an explicit user action), and only through the host that
//! holds the VM.

use super::{console, Hosts};
use crate::cache::{compact_ref, decoded, decoded_policy};
use crate::controller::release_finalizer;
use crate::events::{EventSink, Reason};
use crate::v1alpha1::{DeletionPolicy, VirtualMachine, FINALIZER};
use crate::watches::{Triggers, Watches};
use crate::written::Recent;
use futures::StreamExt;
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};
use vmlet_provider::VmId;

/// What the release loop works with.
pub struct Releaser {
    client: Client,
    hosts: Hosts,
    watches: Watches,
    events: EventSink,
    /// Root of vmlet's state (console history, removed with the VM).
    state_dir: PathBuf,
    /// UIDs of VMs whose finalizer this loop released: the pass that the
    /// watch runs before it shows the release (a status write in between)
    /// does not patch once more.
    released: Recent,
}

/// How long a released finalizer is trusted to show up in the watch.
const RELEASED_FOR: Duration = Duration::from_secs(10);

/// Run the release loop until `shutdown`, fed by `triggers` (subscribed from
/// `watches` before they started).
pub async fn run(
    client: Client,
    hosts: Hosts,
    watches: Watches,
    triggers: Triggers<VirtualMachine>,
    state_dir: PathBuf,
    shutdown: CancellationToken,
) {
    let releaser = Arc::new(Releaser {
        events: EventSink::new(client.clone(), "vmlet"),
        client,
        hosts,
        watches: watches.clone(),
        state_dir,
        released: Recent::new(RELEASED_FOR),
    });
    let Some(controller) = watches.vm_controller(&shutdown).await else { return };
    controller
        .reconcile_on(triggers.map(compact_ref))
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(decoded(reconcile), decoded_policy(error_policy), releaser)
        .for_each(|_| async {})
        .await;
}

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
fn error_policy(vm: Arc<VirtualMachine>, error: &Error, _releaser: Arc<Releaser>) -> Action {
    warn!(vm.name = %vm.name_any(), %error, "VM cleanup failed");
    Action::requeue(Duration::from_secs(5))
}

/// One pass over one VirtualMachine.
#[instrument(skip_all, fields(vm.namespace = vm.namespace().unwrap_or_default(), vm.name = %vm.name_any()))]
async fn reconcile(vm: Arc<VirtualMachine>, releaser: Arc<Releaser>) -> Result<Action, Error> {
    let deleting = vm.metadata.deletion_timestamp.is_some() && vm.finalizers().iter().any(|f| f == FINALIZER);
    if !deleting || vm.spec.deletion_policy != DeletionPolicy::Delete {
        return Ok(Action::await_change());
    }
    let uid = vm.uid().unwrap_or_default();
    if releaser.released.contains(&uid) {
        return Ok(Action::await_change());
    }
    // The record names a host of another process: that process releases it.
    if let Some(node) = super::placement::recorded_node(&vm) {
        if releaser.hosts.get(node).is_none() {
            return Ok(Action::await_change());
        }
    }
    let namespace = vm.namespace().unwrap_or_default();
    if !releaser.watches.pods_of_vm(&namespace, &vm.name_any(), &uid).is_empty() {
        // The pod sync stops the VM first; come back when its pods are gone.
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    let id = VmId(uid.clone());
    // Wherever a host of this process holds it (normally the recorded one
    // alone); the recorded host not answering holds the finalizer back.
    let backend_name = vmlet_provider::backend_name(&namespace, &vm.name_any());
    let recorded = super::placement::recorded_node(&vm);
    for host in super::placement::holders(&releaser.hosts, &id, &backend_name, recorded).await? {
        let Some(status) = host.provider.get(&id).await? else { continue };
        if status.power.is_active() {
            host.provider.destroy(&id).await?;
        }
        host.provider.undefine(&id).await?;
        info!(node.name = %host.name, domain = %status.backend_name, "undefined");
        releaser.events.publish(
            &*vm,
            Reason::Undefined,
            &format!("undefined {} on {} (deletionPolicy Delete)", status.backend_name, host.name),
        );
    }
    let history = console::vm_log_dir(&releaser.state_dir, &namespace, &vm.name_any(), &id.0);
    if let Err(e) = tokio::fs::remove_dir_all(&history).await {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(path = %history.display(), error = %e, "console history not removed");
        }
    }
    let vms: Api<VirtualMachine> = Api::namespaced(releaser.client.clone(), &namespace);
    release_finalizer(&vms, &vm).await.map_err(|e| Error::Kube("remove finalizer", e))?;
    releaser.released.mark(&uid);
    Ok(Action::await_change())
}
