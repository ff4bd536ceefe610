//! Pod sync: the pods bound to this host's node drive the provider.
//!
//! Level-triggered per pod (watch `spec.nodeName=<host>`, plus a periodic requeue
//! that doubles as the polling adapter for providers that do not push):
//! - live pod → define the VM if the host has none with its identity, power it on,
//!   write pod status;
//! - deleting pod → power the VM off (per `powerOffMode`: ACPI shutdown, destroy
//!   after the grace period), keep its definition, then complete the deletion;
//!   an evicted pod whose VM should still run is held, never powered off;
//! - a backup's or restore's pod → [`super::tasks`];
//! - any other pod that is not a VM pod → marked Failed with reason `NotAVirtualMachine`.
//!
//! Nothing here undefines a VM, and nothing powers one off unless its pod was
//! deleted on purpose.

use super::decide::{start_step, stop_step, unwanted, OnHost, StartStep, StartView, StopStep, StopView};
use super::disks::Unavailable;
use super::placement::{self, Recorded};
use super::pod_status::{pod_status, same_pod_status, Observed};
use super::resize::{self, Shown};
use super::restart::Ended;
use super::Agent;
use crate::controller::decide::was_evicted;
use crate::events::Reason;
use crate::failure::{self, PodEffect, Retry};
use crate::identity::{resolve, Refusal, ResolveError};
use crate::v1alpha1::EvictionStrategy;
use crate::v1alpha1::{Placement, VirtualMachine};
use crate::vmpod::{PodRole, PodVm};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, instrument, warn};
use vmlet_provider::{ErrorKind, PowerState, ResizeScope, Resources, VmStatus};

/// How often a running VM's state is read again (the polling adapter).
const RESYNC: Duration = Duration::from_secs(15);
/// How often a VM in transition (starting, stopping) is read again.
const TRANSITION: Duration = Duration::from_secs(1);

/// How often a running VM with network interfaces is read again, so that
/// its pod's IPs follow the guest's addresses (DHCP renewals, changes in the
/// guest, a migration).
const ADDRESS_RESYNC: Duration = Duration::from_secs(5);
/// How often a running VM whose interfaces have no address yet is read
/// again: a booting guest takes its DHCP lease within seconds.
const ADDRESS_PENDING: Duration = Duration::from_secs(2);

/// How often a running VM is read again while its size moves towards its
/// pod's after a live resize (a guest's balloon takes seconds).
const CONVERGING: Duration = Duration::from_secs(2);

/// When to read a VM in `status` again: in transition soon, running every
/// [`RESYNC`] (every [`super::POD_RESYNC_PUSHED`] when its back end
/// `pushed` its changes), or sooner while it has network interfaces
/// ([`ADDRESS_RESYNC`], [`ADDRESS_PENDING`] until one has an address: a
/// guest's addresses are not pushed).
fn resync_after(status: &VmStatus, pushed: bool) -> Duration {
    match (status.power, status.network_interfaces, status.addresses.is_empty()) {
        (PowerState::Running, 0, _) if pushed => super::POD_RESYNC_PUSHED,
        (PowerState::Running, 0, _) => RESYNC,
        (PowerState::Running, _, true) => ADDRESS_PENDING,
        (PowerState::Running, _, false) => ADDRESS_RESYNC,
        _ => TRANSITION * 2,
    }
}

/// Why a pod pass failed; the pod requeues with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A provider call failed.
    #[error(transparent)]
    Provider(#[from] vmlet_provider::Error),
    /// The pod's VirtualMachine could not be read to check the pod is its own.
    #[error(transparent)]
    Identity(ResolveError),
    /// Writing to the API server failed.
    #[error("{action} pod {pod}: {source}")]
    Kube {
        /// What was attempted.
        action: &'static str,
        /// `namespace/name`.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// Requeue after a failed pass, with the pod's own backoff (1 s doubling to
/// 5 min, see [`failure::Backoff`]).
pub fn error_policy(pod: Arc<Pod>, error: &Error, agent: Arc<Agent>) -> Action {
    let delay = agent.backoff.failed(&pod.uid().unwrap_or_default());
    warn!(pod.name = %pod.name_any(), pod.namespace = pod.namespace().unwrap_or_default(), %error, retry_seconds = delay.as_secs(), "pod sync failed");
    Action::requeue(delay)
}

/// One pass over one pod; a success resets the pod's backoff.
#[instrument(skip_all, fields(node.name = %agent.host.name, pod.namespace = pod.namespace().unwrap_or_default(), pod.name = %pod.name_any()))]
pub async fn reconcile(pod: Arc<Pod>, agent: Arc<Agent>) -> Result<Action, Error> {
    if agent.written.behind(&*pod) {
        // This agent's own status write is on its way through the watch,
        // which runs this pass again; deciding from the older pod would
        // only write again, lose the race (409) and read the pod fresh.
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    if pod.metadata.deletion_timestamp.is_some() && agent.finished.contains(&pod.uid().unwrap_or_default()) {
        // Its deletion is complete; the watch has not shown it gone yet.
        return Ok(Action::await_change());
    }
    let action = sync(&pod, &agent).await?;
    agent.backoff.succeeded(&pod.uid().unwrap_or_default());
    Ok(action)
}

async fn sync(pod: &Pod, agent: &Arc<Agent>) -> Result<Action, Error> {
    let pod_namespace = pod.namespace().unwrap_or_default();
    if let Some(served) = agent.namespace.as_deref().filter(|served| **served != pod_namespace) {
        // Its VirtualMachine is not this vmlet's to run (nor to clean up).
        let why = format!(
            "pod {pod_namespace}/{} is in namespace {pod_namespace}, and this vmlet serves namespace {served} only",
            pod.name_any()
        );
        return refuse_plain_pod(pod, agent, &why).await;
    }
    if let Some((kind, name)) = super::tasks::claimed_task(pod).filter(|_| crate::identity::vm_owner(pod).is_none()) {
        // A backup's or restore's pod: see crate::node::tasks.
        return super::tasks::sync(pod, agent, kind, &name).await;
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let vm = match resolve(pod, &agent.watches.vms, &agent.client).await {
        Ok(vm) => vm,
        Err(ResolveError::Refused(Refusal::InvalidPod { source, .. })) => {
            let message = source.to_string();
            if deleting {
                // Nothing of ours to stop.
                return finish_deletion(pod, agent).await;
            }
            agent.events.publish(pod, Reason::ProviderFailed, &message);
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: "InvalidVmPod", message: &message }, false)
            })
            .await?;
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
        Err(ResolveError::Refused(refusal)) => {
            // Not a VirtualMachine's own pod (a plain pod, or one carrying
            // another VM's labels and annotations): it must not start, stop or
            // adopt anything. See crate::identity.
            return refuse_plain_pod(pod, agent, &refusal.to_string()).await;
        }
        Err(e @ ResolveError::Kube { .. }) => return Err(Error::Identity(e)),
    };
    if vm.role == PodRole::MigrationTarget {
        return super::migration::run(pod, &vm, agent).await;
    }
    if deleting {
        return stop(pod, &vm, agent).await;
    }
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return Ok(Action::await_change());
    }
    start(pod, &vm, agent).await
}

/// What a start pass did.
enum Started {
    /// The VM is defined and was powered on, or already ran; `restarted` when
    /// the pod had seen it running before (the guest powered off meanwhile).
    Synced { status: VmStatus, restarted: bool },
    /// The VM no longer wants this pod (the reason): nothing was left defined
    /// or powered on by this pass.
    Abandoned(&'static str),
    /// The VM lives on another host (the placement record, or another host
    /// holds it): nothing was defined or powered on here.
    Elsewhere(String),
    /// The VM stopped by itself and its restart policy leaves it off.
    LeftOff { status: VmStatus, ended: Ended },
    /// The VM names a file outside the host's storage roots: nothing was defined.
    Refused(Box<crate::storage::StorageRefusal>),
    /// The VM's cloud-init data cannot be read: nothing was defined.
    CloudInitMissing(super::cloud_init::Missing),
    /// A data disk's volume is not bound yet, a host image is missing, or a
    /// disk cannot be used here: nothing was defined.
    DisksNotReady(super::disks::NotReady),
    /// A restore in place (named) writes under the VM: it is not started.
    Restoring(String),
    /// This node does not satisfy the VM's placement fields (the pod was
    /// bound here without the scheduler): nothing was defined.
    Rejected(super::admission::Rejection),
}

async fn start(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Action, Error> {
    match start_vm(pod, vm, agent).await {
        Ok(Started::Synced { status, restarted }) => {
            debug!(domain = %status.backend_name, power = ?status.power, "pod in sync");
            let (status, resize) = if status.power.is_active() {
                let (status, shown) = resize_vm(pod, vm, agent, status).await?;
                (status, Some(shown))
            } else {
                (status, None)
            };
            if let Some(fault) = status.fault.as_ref().filter(|f| !f.resumable) {
                if vm.restart_policy != crate::v1alpha1::RestartPolicy::Never {
                    // A failure, for the restart policy: powered off here,
                    // the next pass finds it off and starts it again.
                    let note = format!(
                        "{}; restarting it (restartPolicy {})",
                        super::pod_status::fault_message(fault),
                        vm.restart_policy.as_str()
                    );
                    warn!(vm.uid = %vm.spec.id, domain = %status.backend_name, %fault, "the hypervisor stopped the guest; restarting it");
                    agent.events.publish(pod, Reason::Faulted, &note);
                    agent.provider.destroy(&vm.spec.id).await?;
                    return Ok(Action::requeue(Duration::from_millis(100)));
                }
            }
            if let Some(fault) = &status.fault {
                // Once per fault: the pod says Faulted from then on.
                let already = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref()?.first()?.state.as_ref()?.waiting.as_ref())
                    .is_some_and(|w| w.reason.as_deref() == Some(super::pod_status::FAULTED));
                if !already {
                    warn!(vm.uid = %vm.spec.id, domain = %status.backend_name, fault = %fault, "the hypervisor stopped the guest");
                    agent.events.publish(pod, Reason::Faulted, &super::pod_status::fault_message(fault));
                }
            }
            let provider_kind = agent.provider.kind();
            let running = Resources { cpus: status.cpus, memory_bytes: status.memory_bytes };
            write_status(pod, agent, |p| {
                let new = pod_status(
                    p,
                    &agent.host_ip,
                    &Observed::Vm { status: &status, provider: provider_kind },
                    restarted,
                );
                match &resize {
                    Some(shown) => resize::show(new, running, shown),
                    None => new,
                }
            })
            .await?;
            // A live resize the guest is still taking in (its balloon moving
            // towards the new size) pushes no event when it is done.
            let converging = matches!(resize, Some(Shown::Synced)) && running != pods_size(vm);
            Ok(Action::requeue(if converging { CONVERGING } else { resync_after(&status, agent.pushed) }))
        }
        Ok(Started::Abandoned(why)) => {
            info!(vm.uid = %vm.spec.id, why, "not starting the VM");
            Ok(Action::requeue(TRANSITION * 2))
        }
        Ok(Started::Elsewhere(node)) => {
            let message = if agent.hosts.get(&node).is_some() {
                format!(
                    "VirtualMachine {} lives on host {node} (status.placement): it is not defined or started on \
                     {}; the controller replaces this pod with one pinned to {node}",
                    vm.spec.name, agent.host.name
                )
            } else {
                format!(
                    "VirtualMachine {} lives on {node}, which no node of this vmlet serves (moved there outside \
                     vmlet, or recorded by another vmlet): it is not defined or started on {}; serve that host, or \
                     move the VM back to one of this vmlet's hosts",
                    vm.spec.name, agent.host.name
                )
            };
            warn!(vm.uid = %vm.spec.id, placement = %node, "VM lives on another host; not defining it here");
            agent.events.publish(pod, Reason::PlacedOnAnotherHost, &message);
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: PLACED_ELSEWHERE, message: &message }, false)
            })
            .await?;
            Ok(Action::requeue(RESYNC))
        }
        Ok(Started::LeftOff { status, ended }) => {
            let message = format!(
                "{} stopped ({}); restartPolicy {} leaves it off. spec.replicas stays 1: start it again with \
                 kubectl scale vm/{} --replicas=0, then --replicas=1",
                status.backend_name,
                ended.reason,
                vm.restart_policy.as_str(),
                vm.spec.name
            );
            info!(vm.uid = %vm.spec.id, domain = %status.backend_name, reason = ended.reason, "left off by its restart policy");
            agent.events.publish(pod, Reason::LeftOff, &message);
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Ended { ended, message: &message }, false)
            })
            .await?;
            Ok(Action::await_change())
        }
        Ok(Started::Refused(refusal)) => super::storage::refuse(pod, agent, &refusal).await,
        Ok(Started::Rejected(rejection)) => reject(pod, agent, &rejection).await,
        Ok(Started::DisksNotReady(not_ready)) => {
            let message = not_ready.to_string();
            info!(vm.uid = %vm.spec.id, %message, "data disk not ready; not defining the VM");
            agent.events.publish(pod, Reason::ProviderFailed, &message);
            let reason = not_ready.reason();
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason, message: &message }, false)
            })
            .await?;
            Ok(Action::requeue(not_ready.recheck()))
        }
        Ok(Started::Restoring(restore)) => {
            let message =
                format!("VirtualMachineRestore {restore} puts this VM's disk back; it starts once the restore ended");
            info!(vm.uid = %vm.spec.id, %restore, "restore in place runs; not starting the VM");
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: RESTORING, message: &message }, false)
            })
            .await?;
            Ok(Action::requeue(Duration::from_secs(5)))
        }
        Ok(Started::CloudInitMissing(missing)) => {
            // Waits, and looks again: the Secret may be created after the VM.
            let message = missing.to_string();
            warn!(vm.uid = %vm.spec.id, %message, "cloud-init data missing; not defining the VM");
            agent.events.publish(pod, Reason::ProviderFailed, &message);
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: missing.reason(), message: &message }, false)
            })
            .await?;
            Ok(Action::requeue(Duration::from_secs(15)))
        }
        Err(Error::Provider(e)) => provider_failed(pod, agent, e).await,
        Err(e) => Err(e),
    }
}

/// Show a failed provider call on the pod as [`failure::handling`] says, with
/// one Event per cause; then retry with backoff, or wait for a change.
async fn provider_failed(pod: &Pod, agent: &Agent, e: vmlet_provider::Error) -> Result<Action, Error> {
    let handling = failure::handling(e.kind);
    let message = e.to_string();
    agent.events.publish(pod, handling.reason, &message);
    let reason = handling.reason.as_str();
    let observed = match handling.pod {
        PodEffect::Waiting => Some(Observed::Waiting { reason, message: &message }),
        PodEffect::KeepLastKnown => Some(Observed::HostNotResponding { message: &message }),
        PodEffect::Unchanged => None,
    };
    if let Some(observed) = observed {
        write_status(pod, agent, |p| pod_status(p, &agent.host_ip, &observed, false)).await?;
    }
    match handling.retry {
        Retry::Backoff => Err(e.into()),
        Retry::OnChange => Ok(Action::await_change()),
    }
}

/// Waiting reason of a pod whose VM a restore in place writes under.
pub const RESTORING: &str = "Restoring";

/// Waiting reason of a pod whose VM lives on another host; the controller
/// replaces such a pod ([`crate::controller::decide`]).
pub const PLACED_ELSEWHERE: &str = "PlacedOnAnotherHost";

/// Run the VM here if it may run here ([`placement::verdict`]): define it if
/// the host has none with its identity, record the placement, power it on.
///
/// Provider calls can take long (a libvirtd busy probing QEMU once took
/// minutes), and the VM may be deleted, stopped or placed elsewhere meanwhile.
/// So the watch cache is asked before the define, and the placement record is
/// written after the define and before the power-on: that write reads the
/// VirtualMachine fresh and is guarded by its resourceVersion, so it both
/// claims the VM for this host and proves the VM still wants this pod. A VM
/// recorded here already is read fresh instead. When any of these says no, a
/// domain defined by this very pass (never started) is undefined again and
/// nothing is powered on.
/// How long [`start_vm`] waits for the VirtualMachine watch to catch up
/// with a pod before it reads the VirtualMachine from the API server.
const CACHE_CATCH_UP: Duration = Duration::from_millis(500);

async fn start_vm(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Started, Error> {
    let provider = &agent.provider;
    let here_name = agent.host.name.as_str();
    let on_host = provider.get(&vm.spec.id).await?;
    let cached = agent.watches.vms.get(&ObjectRef::new(&vm.spec.name).within(&vm.spec.namespace));
    if let Some(status) = on_host.as_ref().filter(|s| s.power.is_active()) {
        // Steady state: it runs here. The record follows it (from the cache;
        // a write reads fresh), unless the cache is only behind this agent's
        // own record.
        let recorded = cached.as_deref().and_then(placement::recorded_node).map(str::to_owned);
        let lagging = cached.as_deref().is_some_and(|c| agent.written.behind(c));
        if recorded.as_deref() != Some(here_name) && !lagging {
            record_here(pod, vm, agent, cached.as_deref(), recorded.as_deref(), status).await?;
        }
        return Ok(Started::Synced { status: status.clone(), restarted: false });
    }

    // The cache's "yes" is enough before a define (the guarded placement
    // write checks again); its "no" may only be lag (the pod's event came
    // before its VM's claim of it): the watch gets a moment to say yes,
    // then the API server is asked.
    let cached = match cached.filter(|c| unwanted(pod, &vm.spec.id.0, c).is_none()) {
        Some(cached) => Some(cached),
        None => {
            let key = ObjectRef::new(&vm.spec.name).within(&vm.spec.namespace);
            agent.watches.vm_when(&key, CACHE_CATCH_UP, |c| unwanted(pod, &vm.spec.id.0, c).is_none()).await
        }
    };
    let cached = match cached {
        Some(cached) => cached,
        None => {
            let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
            let fresh = vms.get_opt(&vm.spec.name).await.map_err(|source| Error::Kube {
                action: "read the VirtualMachine of",
                pod: pod.name_any(),
                source,
            })?;
            let Some(fresh) = fresh else { return Ok(Started::Abandoned("its VirtualMachine was deleted")) };
            if let Some(why) = unwanted(pod, &vm.spec.id.0, &fresh) {
                return Ok(Started::Abandoned(why));
            }
            Arc::new(fresh)
        }
    };
    let recorded = placement::recorded_node(&cached).map(str::to_owned);
    let elsewhere = placement::held_elsewhere(&agent.hosts, here_name, &vm.spec.id, &vm.spec.backend_name()).await;
    let restarted = crate::vmpod::was_running(pod);
    let view = StartView {
        here: here_name,
        on_host: on_host.as_ref().map_or(OnHost::Absent, |s| OnHost::Defined(s.power, s.stop_reason)),
        record: recorded.as_deref(),
        held_elsewhere: &elsewhere,
        pod_saw_running: restarted,
        restart_policy: vm.restart_policy,
    };
    let (status, defined_now, write_record) = match start_step(view, |node| agent.hosts.get(node).is_some()) {
        StartStep::LivesElsewhere { node, record_it } => {
            if record_it {
                // Another host of ours holds it: the record says so from now on.
                let placement = Placement { node_name: node.clone(), backend_id: None };
                let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
                placement::record(&vms, &vm.spec.name, &vm.spec.id.0, recorded.as_deref(), placement, |_| None)
                    .await
                    .map_err(|source| Error::Kube { action: "record the placement of", pod: pod.name_any(), source })?;
            }
            return Ok(Started::Elsewhere(node));
        }
        // The pod saw the VM running: it stopped by itself (the guest powered
        // off, or it was destroyed behind vmlet), and its restart policy
        // leaves it off.
        StartStep::LeaveOff(ended) => {
            let status = on_host.expect("only a VM defined here is left off");
            return Ok(Started::LeftOff { status, ended });
        }
        StartStep::Running { .. } => {
            // It started meanwhile (it was inactive when read above).
            let status = on_host.expect("only a VM defined here runs");
            return Ok(Started::Synced { status, restarted: false });
        }
        StartStep::Start { .. } if agent.restoring(&vm.spec.id).is_some() => {
            return Ok(Started::Restoring(agent.restoring(&vm.spec.id).unwrap_or_default()));
        }
        StartStep::Start { record } => (on_host.expect("only a VM defined here is started"), false, record),
        StartStep::DefineAndStart { record } => {
            // Only files under the host's storage roots; a VM defined
            // already is never checked (nothing running is stopped). The
            // data disks are the VirtualMachine's (host images are no pod
            // volumes), read with it above.
            let disks = &cached.spec.disks;
            if let Err(not_ready) = super::host_images::check_supported(provider.as_ref(), disks) {
                return Ok(Started::DisksNotReady(not_ready.into()));
            }
            // Only a node that satisfies the VM's own placement fields,
            // whoever bound the pod here.
            if let Err(rejection) = super::admission::admit_here(agent, &cached.spec).await? {
                return Ok(Started::Rejected(rejection));
            }
            // Host files only from trusted namespaces, judged on the VM's
            // own spec; then a catalogue image becomes its files here, and
            // every file must lie under the roots.
            if let Err(refusal) = agent.storage.check_trust(&vm.spec, disks) {
                return Ok(Started::Refused(refusal));
            }
            let (kind, reference) = (provider.kind(), provider.image_reference());
            let resolved = match super::images::resolve(&agent.client, kind, reference, &vm.spec).await {
                Ok(resolved) => resolved,
                Err(super::images::Error::NotReady(not_ready)) => return Ok(Started::DisksNotReady(not_ready.into())),
                Err(super::images::Error::Kube { source, .. }) => {
                    return Err(Error::Kube { action: "read the catalogue image of", pod: pod.name_any(), source })
                }
            };
            if let Err(refusal) = agent.storage.check_own_boot_disk(&vm.spec, cached.spec.root_disk.is_some()) {
                return Ok(Started::Refused(refusal));
            }
            if let Err(refusal) = agent.storage.check_on_host(&resolved, disks).await {
                return Ok(Started::Refused(refusal));
            }
            let mut spec = match super::cloud_init::with_cloud_init(&agent.client, vm).await {
                Ok(spec) => spec,
                Err(missing) => return Ok(Started::CloudInitMissing(missing)),
            };
            // A root disk is the VM's own boot volume: an overlay on the
            // image, its chain (the image's included) pinned by the claim's
            // resolution, so the image's own chain is not walked again.
            let root = match super::disks::root_disk(agent, vm, &cached).await {
                Ok(root) => root,
                Err(not_ready) => return Ok(Started::DisksNotReady(not_ready)),
            };
            spec.kernel_boot = resolved.kernel_boot;
            spec.image = match &root {
                Some(root) => Some(root.path.clone()),
                None => resolved.image,
            };
            let chains = super::disks::chains(agent, pod, root.is_none().then_some(&spec), disks).await;
            (spec.image_backing_chain, spec.disks) = match chains {
                Ok(chains) => chains,
                Err(Unavailable::NotReady(not_ready)) => return Ok(Started::DisksNotReady(not_ready)),
                Err(Unavailable::Refused(refusal)) => return Ok(Started::Refused(refusal)),
                Err(Unavailable::Provider(e)) => return Err(e.into()),
            };
            if let Some(root) = root {
                spec.image_backing_chain = Some(root.backing_chain);
            }
            spec.networks = cached.spec.networks.iter().map(|network| network.request()).collect();
            (provider.ensure_defined(&spec).await?, true, record)
        }
    };
    let still_wanted = if write_record {
        match record_here(pod, vm, agent, Some(&cached), recorded.as_deref(), &status).await? {
            Recorded::Done => Ok(()),
            Recorded::Changed => Err("the placement record changed meanwhile"),
            Recorded::Refused(why) => Err(why),
        }
    } else {
        wanted(pod, vm, agent).await?
    };
    if let Err(why) = still_wanted {
        return abandon(vm, agent, &status, defined_now, why).await;
    }
    if pod_deleted_meanwhile(pod, agent) {
        return abandon(vm, agent, &status, defined_now, "the pod is being deleted").await;
    }
    if !defined_now {
        // A resize that waited for this start, or one made while it was off.
        define_pods_size(vm, agent, &status).await?;
    }
    provider.start(&vm.spec.id).await?;
    info!(vm.uid = %vm.spec.id, domain = %status.backend_name, defined = defined_now, "started");
    if !defined_now {
        // A VM that was off starts again: worth an Event. A VM defined by
        // this pass is on its way from create to Running, which the pod's
        // conditions and the VirtualMachine's placement record (host and
        // domain) tell already; the scheduler's Event is that path's one.
        agent.events.publish(pod, Reason::Started, &format!("powered {} on", status.backend_name));
    }
    let status = provider.get(&vm.spec.id).await?.unwrap_or(status);
    Ok(Started::Synced { status, restarted })
}

/// The size the pod asks for (its container limits).
fn pods_size(vm: &PodVm) -> Resources {
    Resources { cpus: vm.spec.cpus, memory_bytes: vm.spec.memory_bytes }
}

/// The ceilings the pod asks for, never below its size.
fn pods_ceilings(vm: &PodVm) -> Resources {
    let size = pods_size(vm);
    Resources {
        cpus: vm.spec.max_cpus.unwrap_or(size.cpus).max(size.cpus),
        memory_bytes: vm.spec.max_memory_bytes.unwrap_or(size.memory_bytes).max(size.memory_bytes),
    }
}

/// Before an inactive VM starts: give its definition the pod's size and
/// ceilings, where they differ and the backend can resize.
async fn define_pods_size(vm: &PodVm, agent: &Agent, status: &VmStatus) -> Result<(), Error> {
    let Some(resizer) = agent.provider.resize() else { return Ok(()) };
    let (size, ceilings) = (pods_size(vm), pods_ceilings(vm));
    let defined = Resources { cpus: status.cpus, memory_bytes: status.memory_bytes };
    let defined_ceilings = Resources { cpus: status.max_cpus, memory_bytes: status.max_memory_bytes };
    if defined != size || defined_ceilings != ceilings {
        resizer.resize(&vm.spec.id, size, ceilings, ResizeScope::NextStart).await?;
        info!(vm.uid = %vm.spec.id, cpus = size.cpus, memory_bytes = size.memory_bytes, "definition resized before start");
    }
    Ok(())
}

/// Give a running VM its pod's size as [`resize::plan`] says, and say what the
/// pod shows about it; returns the VM's status after any change.
async fn resize_vm(pod: &Pod, vm: &PodVm, agent: &Agent, status: VmStatus) -> Result<(VmStatus, Shown), Error> {
    let wanted = pods_size(vm);
    let now = Resources { cpus: status.cpus, memory_bytes: status.memory_bytes };
    if now == wanted && status.next_start.is_none_or(|next| next == wanted) {
        return Ok((status, Shown::Synced));
    }
    let resizer = agent.provider.resize();
    let fit = node_fit(pod, agent, now, wanted).await?;
    let plan = resize::plan(wanted, vm.resize_policy, resizer.is_some(), &status, fit);
    let (resizer, scope, restart_required) = match (plan, resizer) {
        (resize::Plan::InSync, _) => return Ok((status, Shown::Synced)),
        (resize::Plan::Pending(reason, message), _) => {
            agent.events.publish(pod, Reason::ResizeNotApplied, &format!("{reason}: {message}"));
            return Ok((status, Shown::Pending(reason, message)));
        }
        (_, None) => {
            let message = format!("the {} backend cannot resize VMs", agent.provider.kind());
            agent.events.publish(pod, Reason::ResizeNotApplied, &message);
            return Ok((status, Shown::Pending("Infeasible", message)));
        }
        (resize::Plan::Live, Some(resizer)) => (resizer, ResizeScope::Live, false),
        (resize::Plan::NextStart { restart_required }, Some(resizer)) => {
            (resizer, ResizeScope::NextStart, restart_required)
        }
    };
    match resizer.resize(&vm.spec.id, wanted, pods_ceilings(vm), scope).await {
        Ok(()) => {}
        Err(e) if matches!(e.kind, ErrorKind::InvalidInput | ErrorKind::Unsupported) => {
            let message = e.to_string();
            agent.events.publish(pod, Reason::ResizeNotApplied, &message);
            return Ok((status, Shown::Failed(message)));
        }
        Err(e) => return Err(e.into()),
    }
    let size = format!("{} vCPUs, {}", wanted.cpus, crate::quantity::format_bytes(wanted.memory_bytes));
    let status = agent.provider.get(&vm.spec.id).await?.unwrap_or(status);
    if restart_required {
        let message = format!(
            "{size} is in the VM's definition and applies at its next start (resizePolicy {}, ceilings {} vCPUs, {}): \
             kubectl scale vm/{} --replicas=0, then --replicas=1",
            vm.resize_policy.as_str(),
            status.max_cpus,
            crate::quantity::format_bytes(status.max_memory_bytes),
            vm.spec.name
        );
        info!(vm.uid = %vm.spec.id, %size, "resize waits for a restart");
        agent.events.publish(pod, Reason::RestartRequired, &message);
        return Ok((status, Shown::RestartRequired(message)));
    }
    if scope == ResizeScope::Live {
        info!(vm.uid = %vm.spec.id, %size, "resized live");
        agent.events.publish(pod, Reason::Resized, &format!("resized {} live to {size}", status.backend_name));
    }
    Ok((status, Shown::Synced))
}

/// Whether this node has room for the pod's VM to grow from `now` to `wanted`:
/// its allocatable resources against the requests of its other pods that
/// have not ended (from the watch cache), as the kubelet admits a resize.
async fn node_fit(pod: &Pod, agent: &Agent, now: Resources, wanted: Resources) -> Result<resize::Fit, Error> {
    if wanted.cpus <= now.cpus && wanted.memory_bytes <= now.memory_bytes {
        return Ok(resize::Fit::Fits);
    }
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(agent.client.clone());
    let node = nodes.get(&agent.host.name).await.map_err(|source| Error::Kube {
        action: "read the node of",
        pod: pod.name_any(),
        source,
    })?;
    let allocatable = node.status.and_then(|s| s.allocatable).unwrap_or_default();
    let amount = |map: &std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
                  key: &str,
                  parse: fn(&str) -> Result<u64, crate::quantity::QuantityError>| {
        map.get(key).and_then(|q| parse(&q.0).ok()).unwrap_or(0)
    };
    let total = (
        amount(&allocatable, "cpu", crate::quantity::parse_millicores),
        amount(&allocatable, "memory", crate::quantity::parse_bytes),
    );
    let mut others = (0, 0);
    for other in agent.watches.pods_on(&agent.host.name) {
        let ended = matches!(other.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
        if other.uid() == pod.uid() || ended {
            continue;
        }
        for container in other.spec.iter().flat_map(|s| &s.containers) {
            if let Some(requests) = container.resources.as_ref().and_then(|r| r.requests.as_ref()) {
                others.0 += amount(requests, "cpu", crate::quantity::parse_millicores);
                others.1 += amount(requests, "memory", crate::quantity::parse_bytes);
            }
        }
    }
    Ok(resize::fit(now, wanted, total, others))
}

/// Give up this pass: a definition made by it (never started) is removed
/// again, so nothing of it is left on this host; an earlier one is kept.
async fn abandon(
    vm: &PodVm,
    agent: &Agent,
    status: &VmStatus,
    defined_now: bool,
    why: &'static str,
) -> Result<Started, Error> {
    if defined_now {
        agent.provider.undefine(&vm.spec.id).await?;
        warn!(vm.uid = %vm.spec.id, domain = %status.backend_name, why, "undefined a late definition");
    }
    Ok(Started::Abandoned(why))
}

/// Record that this host holds the VM (`status.placement`), if the record
/// still names `expected` and the VirtualMachine still wants `pod`
/// ([`unwanted`]), deciding first from `cached` (the write is guarded by its
/// resourceVersion: a stale copy costs a conflict and a fresh read).
async fn record_here(
    pod: &Pod,
    vm: &PodVm,
    agent: &Agent,
    cached: Option<&VirtualMachine>,
    expected: Option<&str>,
    status: &VmStatus,
) -> Result<Recorded, Error> {
    let placement = Placement { node_name: agent.host.name.clone(), backend_id: Some(status.backend_id.clone()) };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
    let (name, uid) = (&vm.spec.name, &vm.spec.id.0);
    let refuse = |fresh: &VirtualMachine| unwanted(pod, &vm.spec.id.0, fresh);
    let done = placement::record_from(&vms, name, uid, cached.cloned(), expected, placement, refuse)
        .await
        .map(|(done, written)| {
            if let Some(written) = written {
                agent.written.record(&written);
            }
            done
        })
        .map_err(|source| Error::Kube { action: "record the placement of", pod: vm.spec.name.clone(), source })?;
    if done == Recorded::Done {
        info!(vm.uid = %vm.spec.id, node.name = %agent.host.name, "placement recorded");
    }
    Ok(done)
}

/// Whether the watch cache shows `pod` deleted, replaced or being deleted
/// since this pass began (its deletion pass then runs next).
fn pod_deleted_meanwhile(pod: &Pod, agent: &Agent) -> bool {
    let key = ObjectRef::new(&pod.name_any()).within(&pod.namespace().unwrap_or_default());
    match agent.watches.pods.get(&key) {
        Some(now) => now.uid() != pod.uid() || now.metadata.deletion_timestamp.is_some(),
        None => true,
    }
}

/// The pod's VirtualMachine, read fresh from the API server (not from a watch
/// cache, which may lag), when it still wants to run through this pod
/// ([`unwanted`]), and the pod is not gone or being deleted; else why not.
/// Errors: the API server could not be read (the pass retries; nothing was
/// done).
async fn wanted(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Result<(), &'static str>, Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let kube_err = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    match vms.get_opt(&vm.spec.name).await.map_err(kube_err("read the VirtualMachine of"))? {
        None => return Ok(Err("its VirtualMachine was deleted")),
        Some(fresh) => {
            if let Some(why) = unwanted(pod, &vm.spec.id.0, &fresh) {
                return Ok(Err(why));
            }
        }
    }
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
    Ok(match pods.get_opt(&pod.name_any()).await.map_err(kube_err("read"))? {
        None => Err("the pod was deleted"),
        Some(p) if p.uid() != pod.uid() => Err("the pod was replaced"),
        Some(p) if p.metadata.deletion_timestamp.is_some() => Err("the pod is being deleted"),
        Some(_) => Ok(()),
    })
}

async fn stop(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Action, Error> {
    let provider = &agent.provider;
    let uid = pod.uid().unwrap_or_default();
    let status = provider.get(&vm.spec.id).await?;
    let active = status.as_ref().map(|s| s.power.is_active());
    let may_hold = active == Some(true) && vm.eviction_strategy != EvictionStrategy::None && was_evicted(pod);
    let view = StopView {
        active,
        evicted_and_wanted: may_hold && still_wanted(pod, agent).await,
        power_off_mode: vm.power_off_mode,
        asked_ago: agent.shutdown_sent.lock().expect("agent set poisoned").get(&uid).map(Instant::elapsed),
        grace: Duration::from_secs(
            pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(30).max(0) as u64,
        ),
    };
    let step = stop_step(view);
    let Some(status) = status else { return finish_deletion(pod, agent).await };
    match step {
        StopStep::FinishDeletion => {
            agent.forget(&uid);
            if !agent.destroyed.contains(&uid) {
                let note = format!("{} is off; its definition and disks are kept", status.backend_name);
                agent.events.publish(pod, Reason::Stopped, &note);
            }
            return finish_deletion(pod, agent).await;
        }
        StopStep::Hold => {
            if agent.remember(&agent.held, &uid) {
                warn!("evicted pod's VM still wants to run; keeping it powered on");
                agent.events.publish(
                    pod,
                    Reason::EvictionHeld,
                    "the pod was evicted but its VirtualMachine still has replicas 1: the VM keeps running here \
                     until it has moved to another host (status.migration) or is stopped (kubectl scale \
                     virtualmachine/<name> --replicas=0)",
                );
            }
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        StopStep::Destroy => {
            provider.destroy(&vm.spec.id).await?;
            info!(domain = %status.backend_name, "destroyed");
            agent.destroyed.mark(&uid);
            let note = format!("powered {} off; its definition and disks are kept", status.backend_name);
            agent.events.publish(pod, Reason::Destroyed, &note);
        }
        StopStep::Shutdown => {
            provider.shutdown(&vm.spec.id).await?;
            agent.shutdown_sent.lock().expect("agent set poisoned").insert(uid.clone(), Instant::now());
            info!(domain = %status.backend_name, grace_seconds = view.grace.as_secs(), "asked the guest to shut down");
            agent.events.publish(pod, Reason::ShuttingDown, &format!("asked {} to shut down", status.backend_name));
        }
        StopStep::Wait => {}
    }
    Ok(Action::requeue(TRANSITION))
}

/// Whether the pod's VirtualMachine still exists, is not being deleted and wants
/// to run. When in doubt (read error) the answer is yes: keeping a VM running is
/// the safe side.
async fn still_wanted(pod: &Pod, agent: &Agent) -> bool {
    let Some(owner) = pod.owner_references().iter().find(|o| o.kind == "VirtualMachine") else {
        return false;
    };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &pod.namespace().unwrap_or_default());
    match vms.get_opt(&owner.name).await {
        Ok(Some(vm)) => {
            vm.uid().as_deref() == Some(&owner.uid) && vm.metadata.deletion_timestamp.is_none() && vm.spec.replicas == 1
        }
        Ok(None) => false,
        Err(_) => true,
    }
}

/// Complete a pod's deletion (grace period 0), as the kubelet does once its
/// containers are gone.
pub(super) async fn finish_deletion(pod: &Pod, agent: &Agent) -> Result<Action, Error> {
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &pod.namespace().unwrap_or_default());
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions { uid: pod.uid(), resource_version: None }),
        ..DeleteParams::default()
    };
    match pods.delete(&pod.name_any(), &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(source) => return Err(Error::Kube { action: "delete", pod: pod.name_any(), source }),
    }
    let uid = pod.uid().unwrap_or_default();
    agent.finished.mark(&uid);
    agent.forget(&uid);
    Ok(Action::await_change())
}

/// Mark a VM pod that this node does not admit Failed, with the
/// rejection's reason and message, as the kubelet does a pod its admission
/// rejects: the controller replaces a failed pod, and the scheduler places
/// the new one.
async fn reject(pod: &Pod, agent: &Agent, rejection: &super::admission::Rejection) -> Result<Action, Error> {
    warn!(pod.name = %pod.name_any(), reason = rejection.reason, message = %rejection.message, "pod rejected; nothing defined");
    agent.events.publish(pod, Reason::Rejected, &rejection.message);
    write_status(pod, agent, |p| PodStatus {
        phase: Some("Failed".into()),
        reason: Some(rejection.reason.into()),
        message: Some(rejection.message.clone()),
        host_ip: Some(agent.host_ip.clone()),
        ..p.status.clone().unwrap_or_default()
    })
    .await?;
    Ok(Action::await_change())
}

/// Mark a pod that is not a VirtualMachine's own Failed (reason
/// `NotAVirtualMachine`, with `why`), or complete its deletion; nothing else.
async fn refuse_plain_pod(pod: &Pod, agent: &Agent, why: &str) -> Result<Action, Error> {
    if pod.metadata.deletion_timestamp.is_some() {
        return finish_deletion(pod, agent).await;
    }
    if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed") {
        return Ok(Action::await_change());
    }
    let message = format!("{why}; only VirtualMachines run on vmlet's nodes");
    agent.events.publish(pod, Reason::NotAVirtualMachine, &message);
    write_status(pod, agent, |p| PodStatus {
        phase: Some("Failed".into()),
        reason: Some("NotAVirtualMachine".into()),
        message: Some(message.clone()),
        host_ip: Some(agent.host_ip.clone()),
        ..p.status.clone().unwrap_or_default()
    })
    .await?;
    Ok(Action::await_change())
}

/// Write the status computed by `derive` from the pod's latest version; skipped
/// when unchanged; retried on conflict with a fresh read (the current
/// resourceVersion), up to 5 times.
pub(super) async fn write_status(pod: &Pod, agent: &Agent, derive: impl Fn(&Pod) -> PodStatus) -> Result<(), Error> {
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &pod.namespace().unwrap_or_default());
    let kube_err = |source| Error::Kube { action: "write status of", pod: pod.name_any(), source };
    let mut current = pod.clone();
    for attempt in 0..5 {
        let new = derive(&current);
        if current.status.as_ref().is_some_and(|old| same_pod_status(old, &new)) {
            return Ok(());
        }
        current.status = Some(new);
        match pods.replace_status(&current.name_any(), &PostParams::default(), &current).await {
            Ok(written) => {
                agent.written.record(&written);
                return Ok(());
            }
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < 4 => {
                current = match pods.get_opt(&pod.name_any()).await.map_err(kube_err)? {
                    Some(p) if p.uid() == pod.uid() => p,
                    _ => return Ok(()),
                };
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(kube_err(e)),
        }
    }
    Ok(())
}
