//! Migration through scheduling, the target host's side.
//!
//! `kubectl drain` evicts a VM's pod; its agent keeps the VM running (the
//! pod stays terminating) and the controller creates a target pod, kept off
//! the source host, that the scheduler places here. This agent then moves the
//! VM from the source host (live where the back end can and
//! `spec.evictionStrategy` allows, else cold: shut down, move the definition,
//! start here), and only when the move completed writes, in one status write
//! guarded by the resourceVersion, the placement record (this host), the
//! VM's current pod (the target pod) and the migration's result. The source
//! pod's deletion then completes: its VM is no longer on its host.
//!
//! Safety: the back end's migration never runs the VM on both hosts (libvirt
//! pauses the source before the target resumes); a failed or timed-out move
//! leaves the VM running on the source, says why (status, Events), and is
//! tried again with the pod's backoff while the target pod exists.

use super::placement::{update_status, Change, Updated};
use super::pod_status::{pod_status, Observed};
use super::pods::{write_status, Error};
use super::Agent;
use crate::events::Reason;
use crate::v1alpha1::{EvictionStrategy, Migration, MigrationPhase, MigrationProgress, Placement, VirtualMachine};
use crate::vmpod::PodVm;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::time::Duration;
use tracing::{info, warn};
use vmlet_provider::{ErrorKind, MigrationMode};

/// How long one move may take before it is aborted (the VM stays on the
/// source) and tried again.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How often a running move's progress is written to `status.migration`.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// How often a cold move polls the source VM while it shuts down.
const SHUTDOWN_POLL: Duration = Duration::from_millis(500);

/// One pass over a migration's target pod: move the VM here if the VM's
/// active migration still targets this pod. Errors: a failed move that may
/// succeed later (the pass retries with backoff); the API server.
pub(super) async fn run(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Action, Error> {
    if pod.metadata.deletion_timestamp.is_some() {
        // Cancelled (or deleted by hand) before it completed: nothing of the
        // VM is here to stop.
        return super::pods::finish_deletion(pod, agent).await;
    }
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
    let kube_err = |source| Error::Kube { action: "read the VirtualMachine of", pod: pod.name_any(), source };
    let Some(fresh) = vms.get_opt(&vm.spec.name).await.map_err(kube_err)? else { return Ok(Action::await_change()) };
    let Some(migration) = active_for(&fresh, pod) else {
        return Ok(Action::await_change());
    };
    let here = agent.host.name.clone();

    // Already here (a pass that moved it ended before it could record it).
    if let Some(status) = agent.provider.get(&vm.spec.id).await? {
        return complete(pod, vm, agent, &vms, &migration, &status.backend_id, status.power.is_active()).await;
    }
    // A target pod bound here without the scheduler moves nothing here.
    if let Err(rejection) = super::admission::admit_here(agent, &fresh.spec).await? {
        return failed(pod, vm, agent, &vms, &migration, ErrorKind::InvalidInput, rejection.message).await;
    }
    let Some(source) = agent.hosts.get(&migration.source_node) else {
        let message = format!(
            "the source host {} is not served by this vmlet process; a VM moves only between hosts of one process",
            migration.source_node
        );
        return failed(pod, vm, agent, &vms, &migration, ErrorKind::Unsupported, message).await;
    };
    let (Some(outgoing), Some(incoming)) = (source.provider.migration(), agent.provider.migration()) else {
        let message = format!(
            "the {} back end of host {} or {here} cannot move VMs; stop the VM (kubectl scale vm/{} --replicas=0) \
             or set spec.evictionStrategy None to let an eviction stop it",
            source.provider.kind(),
            migration.source_node,
            vm.spec.name
        );
        return failed(pod, vm, agent, &vms, &migration, ErrorKind::Unsupported, message).await;
    };
    let Some(at_source) = source.provider.get(&vm.spec.id).await? else {
        let message = format!("the VM is on neither {} nor {here}", migration.source_node);
        return failed(pod, vm, agent, &vms, &migration, ErrorKind::Permanent, message).await;
    };
    let live = vm.eviction_strategy == EvictionStrategy::LiveMigrate && at_source.power.is_active();
    let mode = if live { MigrationMode::Live } else { MigrationMode::Cold };
    let mode_name = if live { "Live" } else { "Cold" };

    let started = Migration {
        target_node: Some(here.clone()),
        mode: Some(mode_name.to_owned()),
        phase: MigrationPhase::Running,
        start_time: Some(k8s_openapi::jiff::Timestamp::now().to_string()),
        end_time: None,
        progress: None,
        message: None,
        ..migration.clone()
    };
    if !write_migration(pod, &vms, &vm.spec.id.0, started.clone()).await? {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let message = format!("moving {} {mode_name} from {} to {here}", at_source.backend_name, migration.source_node);
    info!(vm.uid = %vm.spec.id, source = %migration.source_node, mode = mode_name, "migration started");
    agent.events.publish(pod, Reason::Migrating, &message);
    write_status(pod, agent, |p| {
        pod_status(p, &agent.host_ip, &Observed::Waiting { reason: "Migrating", message: &message }, false)
    })
    .await?;

    let was_active = at_source.power.is_active();
    if !live && was_active {
        if let Err(e) = power_off(vm, source.provider.as_ref(), pod).await {
            return failed(pod, vm, agent, &vms, &started, e.kind, e.to_string()).await;
        }
    }
    let target = incoming.target();
    let moved = {
        let migrate = outgoing.migrate(&vm.spec.id, &target, mode, MIGRATION_TIMEOUT);
        tokio::pin!(migrate);
        let mut ticks = tokio::time::interval(PROGRESS_EVERY);
        ticks.tick().await;
        loop {
            tokio::select! {
                result = &mut migrate => break result,
                _ = ticks.tick() => {
                    if let Ok(Some(progress)) = outgoing.progress(&vm.spec.id).await {
                        let progress = MigrationProgress {
                            processed_bytes: i64::try_from(progress.processed_bytes).unwrap_or(i64::MAX),
                            remaining_bytes: i64::try_from(progress.remaining_bytes).unwrap_or(i64::MAX),
                            total_bytes: i64::try_from(progress.total_bytes).unwrap_or(i64::MAX),
                        };
                        let update = Migration { progress: Some(progress), ..started.clone() };
                        // Best effort: a lost progress write is not worth failing a move.
                        let _ = write_migration(pod, &vms, &vm.spec.id.0, update).await;
                    }
                }
            }
        }
    };
    if let Err(e) = moved {
        return failed(pod, vm, agent, &vms, &started, e.kind, e.to_string()).await;
    }
    let Some(status) = agent.provider.get(&vm.spec.id).await? else {
        let message = format!("the move reported success but {here} does not have the VM");
        return failed(pod, vm, agent, &vms, &started, ErrorKind::Transient, message).await;
    };
    if !live && was_active && !status.power.is_active() {
        agent.provider.start(&vm.spec.id).await?;
    }
    complete(pod, vm, agent, &vms, &started, &status.backend_id, true).await
}

/// The VM's active migration, when it targets `pod`.
fn active_for(vm: &VirtualMachine, pod: &Pod) -> Option<Migration> {
    vm.status.as_ref().and_then(|s| s.migration.clone()).filter(|m| m.is_active() && m.target_pod == pod.name_any())
}

/// Shut the source VM down for a cold move: ask the guest, and cut power after
/// the pod's grace period.
async fn power_off(vm: &PodVm, source: &dyn vmlet_provider::Provider, pod: &Pod) -> vmlet_provider::Result<()> {
    let grace = Duration::from_secs(
        pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(30).max(0) as u64,
    );
    source.shutdown(&vm.spec.id).await?;
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        match source.get(&vm.spec.id).await? {
            Some(s) if s.power.is_active() => tokio::time::sleep(SHUTDOWN_POLL).await,
            _ => return Ok(()),
        }
    }
    source.destroy(&vm.spec.id).await
}

/// Record the completed move: placement on this host, the target pod as the
/// VM's current pod, the migration Succeeded, in one guarded write.
async fn complete(
    pod: &Pod,
    vm: &PodVm,
    agent: &Agent,
    vms: &Api<VirtualMachine>,
    migration: &Migration,
    backend_id: &str,
    running: bool,
) -> Result<Action, Error> {
    let here = agent.host.name.clone();
    let pod_name = pod.name_any();
    let updated = update_status(vms, &vm.spec.name, &vm.spec.id.0, |fresh| {
        if active_for(fresh, pod).is_none() {
            return Change::Refuse("the migration no longer targets this pod");
        }
        let mut status = fresh.status.clone().unwrap_or_default();
        status.placement = Some(Placement { node_name: here.clone(), backend_id: Some(backend_id.to_owned()) });
        status.pod_name = Some(pod_name.clone());
        status.migration = Some(Migration {
            target_node: Some(here.clone()),
            phase: MigrationPhase::Succeeded,
            end_time: Some(k8s_openapi::jiff::Timestamp::now().to_string()),
            progress: None,
            message: None,
            ..migration.clone()
        });
        Change::Write(Box::new(status))
    })
    .await
    .map_err(|source| Error::Kube { action: "record the migration of", pod: pod_name.clone(), source })?;
    match updated {
        Updated::Written | Updated::Unchanged => {
            let note = format!("the VM now runs on {here} (moved from {})", migration.source_node);
            info!(vm.uid = %vm.spec.id, source = %migration.source_node, running, "migration completed");
            agent.events.publish(pod, Reason::Migrated, &note);
            // The pod is now the VM's current pod: the next pass reports it.
            Ok(Action::requeue(Duration::from_millis(100)))
        }
        Updated::Refused(why) => {
            warn!(vm.uid = %vm.spec.id, why, "migration completed but could not be recorded");
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        Updated::Gone => Ok(Action::await_change()),
    }
}

/// Record a failed attempt (phase Failed with `message`) and show it on the
/// pod and in Events; a transient failure is tried again with backoff, any
/// other waits for a change.
async fn failed(
    pod: &Pod,
    vm: &PodVm,
    agent: &Agent,
    vms: &Api<VirtualMachine>,
    migration: &Migration,
    kind: ErrorKind,
    message: String,
) -> Result<Action, Error> {
    warn!(vm.uid = %vm.spec.id, source = %migration.source_node, %message, "migration failed; the VM stays where it was");
    let record = Migration {
        phase: MigrationPhase::Failed,
        end_time: Some(k8s_openapi::jiff::Timestamp::now().to_string()),
        message: Some(message.clone()),
        ..migration.clone()
    };
    write_migration(pod, vms, &vm.spec.id.0, record).await?;
    let note = format!("{message}; the VM keeps running on {}", migration.source_node);
    agent.events.publish(pod, Reason::MigrationFailed, &note);
    write_status(pod, agent, |p| {
        pod_status(p, &agent.host_ip, &Observed::Waiting { reason: "MigrationFailed", message: &note }, false)
    })
    .await?;
    match kind {
        ErrorKind::Transient => Err(Error::Provider(vmlet_provider::Error::new("migrate", kind, message))),
        _ => Ok(Action::await_change()),
    }
}

/// Write `migration` as the VM's `status.migration` while the VM's active
/// migration still targets `pod`. Returns false when it no longer does.
async fn write_migration(pod: &Pod, vms: &Api<VirtualMachine>, uid: &str, migration: Migration) -> Result<bool, Error> {
    let name = crate::identity::vm_owner(pod).map(|o| o.name.clone()).unwrap_or_default();
    let updated = update_status(vms, &name, uid, |fresh| {
        if active_for(fresh, pod).is_none() {
            return Change::Refuse("the migration no longer targets this pod");
        }
        let mut status = fresh.status.clone().unwrap_or_default();
        if status.migration.as_ref() == Some(&migration) {
            return Change::Unchanged;
        }
        status.migration = Some(migration.clone());
        Change::Write(Box::new(status))
    })
    .await
    .map_err(|source| Error::Kube { action: "record the migration of", pod: pod.name_any(), source })?;
    Ok(matches!(updated, Updated::Written | Updated::Unchanged))
}
