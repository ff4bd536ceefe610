//! Pod sync: the pods bound to this host's node drive the provider.
//!
//! Level-triggered per pod (watch `spec.nodeName=<host>`, plus a periodic requeue
//! that doubles as the polling adapter for providers that do not push):
//! - live pod → define the VM if the host has none with its identity, power it on,
//!   write pod status;
//! - deleting pod → power the VM off (per `powerOffMode`: ACPI shutdown, destroy
//!   after the grace period), keep its definition, then complete the deletion;
//!   an evicted pod whose VM should still run is held, never powered off;
//! - a pod that is not a VM pod → marked Failed with reason `NotAVirtualMachine`.
//!
//! Nothing here undefines a VM, and nothing powers one off unless its pod was
//! deleted on purpose.

use super::placement::{self, HereState, Recorded, Verdict};
use super::pod_status::{pod_status, same_pod_status, Observed};
use super::restart::{self, AfterStop, Ended};
use super::Agent;
use crate::events::Reason;
use crate::failure::{self, PodEffect, Retry};
use crate::identity::{resolve, Refusal, ResolveError};
use crate::v1alpha1::{Placement, PowerOffMode, VirtualMachine};
use crate::vmpod::PodVm;
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, instrument, warn};
use vmlet_provider::{PowerState, VmStatus};

/// How often a running VM's state is read again (the polling adapter).
const RESYNC: Duration = Duration::from_secs(15);
/// How often a VM in transition (starting, stopping) is read again.
const TRANSITION: Duration = Duration::from_secs(1);

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
    let action = sync(&pod, &agent).await?;
    agent.backoff.succeeded(&pod.uid().unwrap_or_default());
    Ok(action)
}

async fn sync(pod: &Pod, agent: &Agent) -> Result<Action, Error> {
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
            agent.events.publish(pod, Reason::ProviderFailed, &message).await;
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
    Refused(crate::storage::StorageRefusal),
}

async fn start(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Action, Error> {
    match start_vm(pod, vm, agent).await {
        Ok(Started::Synced { status, restarted }) => {
            debug!(domain = %status.backend_name, power = ?status.power, "pod in sync");
            let provider_kind = agent.provider.kind();
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Vm { status: &status, provider: provider_kind }, restarted)
            })
            .await?;
            Ok(Action::requeue(if status.power == PowerState::Running { RESYNC } else { TRANSITION * 2 }))
        }
        Ok(Started::Abandoned(why)) => {
            info!(vm.uid = %vm.spec.id, why, "not starting the VM");
            Ok(Action::requeue(TRANSITION * 2))
        }
        Ok(Started::Elsewhere(node)) => {
            let message = format!(
                "VirtualMachine {} lives on host {node} (status.placement): it is not defined or started on {}; \
                 the controller replaces this pod with one pinned to {node}",
                vm.spec.name, agent.host.name
            );
            warn!(vm.uid = %vm.spec.id, placement = %node, "VM lives on another host; not defining it here");
            agent.events.publish(pod, Reason::PlacedOnAnotherHost, &message).await;
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
            agent.events.publish(pod, Reason::LeftOff, &message).await;
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Ended { ended, message: &message }, false)
            })
            .await?;
            Ok(Action::await_change())
        }
        Ok(Started::Refused(refusal)) => super::storage::refuse(pod, agent, &refusal).await,
        Err(Error::Provider(e)) => provider_failed(pod, agent, e).await,
        Err(e) => Err(e),
    }
}

/// Show a failed provider call on the pod as [`failure::handling`] says, with
/// one Event per cause; then retry with backoff, or wait for a change.
async fn provider_failed(pod: &Pod, agent: &Agent, e: vmlet_provider::Error) -> Result<Action, Error> {
    let handling = failure::handling(e.kind);
    let message = e.to_string();
    agent.events.publish(pod, handling.reason, &message).await;
    let reason = handling.reason.as_str();
    write_status(pod, agent, |p| {
        let observed = match handling.pod {
            PodEffect::Waiting => Observed::Waiting { reason, message: &message },
            PodEffect::KeepLastKnown => Observed::HostNotResponding { message: &message },
        };
        pod_status(p, &agent.host_ip, &observed, false)
    })
    .await?;
    match handling.retry {
        Retry::Backoff => Err(e.into()),
        Retry::OnChange => Ok(Action::await_change()),
    }
}

/// Waiting reason of a pod whose VM lives on another host; the controller
/// replaces such a pod ([`crate::controller::decide`]).
pub const PLACED_ELSEWHERE: &str = "PlacedOnAnotherHost";

/// Run the VM here if it may run here ([`placement::verdict`]): define it if
/// the host has none with its identity, record the placement, power it on.
///
/// Provider calls can take long (a libvirtd busy probing QEMU once took
/// minutes), and the VM may be deleted, stopped or placed elsewhere meanwhile.
/// So the VirtualMachine and the pod are read again from the API server before
/// the define and before the power-on; the placement record is written (guarded
/// by the resourceVersion) after the define and before the power-on; when
/// any of these says no, a domain defined by this very pass (never started) is
/// undefined again and nothing is powered on.
async fn start_vm(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Started, Error> {
    let provider = &agent.provider;
    let here_name = agent.host.name.as_str();
    let on_host = provider.get(&vm.spec.id).await?;
    if let Some(status) = on_host.as_ref().filter(|s| s.power.is_active()) {
        // Steady state: it runs here. The record follows it (from the cache;
        // a write reads fresh).
        let cached = agent.watches.vms.get(&ObjectRef::new(&vm.spec.name).within(&vm.spec.namespace));
        let recorded = cached.as_deref().and_then(placement::recorded_node).map(str::to_owned);
        if recorded.as_deref() != Some(here_name) {
            record_here(vm, agent, recorded.as_deref(), status).await?;
        }
        return Ok(Started::Synced { status: status.clone(), restarted: false });
    }

    let fresh = match wanted(pod, vm, agent).await? {
        Ok(fresh) => fresh,
        Err(why) => return Ok(Started::Abandoned(why)),
    };
    let recorded = placement::recorded_node(&fresh).map(str::to_owned);
    let state = if on_host.is_some() { HereState::Inactive } else { HereState::Absent };
    let elsewhere = placement::held_elsewhere(&agent.hosts, here_name, &vm.spec.id, &vm.spec.backend_name()).await;
    let ours = |node: &str| agent.hosts.get(node).is_some();
    let write_record = match placement::verdict(here_name, state, recorded.as_deref(), &elsewhere, ours) {
        Verdict::LivesElsewhere { node } => {
            if elsewhere.contains(&node) && recorded.as_deref() != Some(node.as_str()) {
                // Another host of ours holds it: the record says so from now on.
                let placement = Placement { node_name: node.clone(), backend_id: None };
                let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
                placement::record(&vms, &vm.spec.name, &vm.spec.id.0, recorded.as_deref(), placement)
                    .await
                    .map_err(|source| Error::Kube { action: "record the placement of", pod: pod.name_any(), source })?;
            }
            return Ok(Started::Elsewhere(node));
        }
        Verdict::RunHere { record } => record,
    };

    // The pod saw the VM running: it stopped by itself (the guest powered
    // off, or it was destroyed behind vmlet). Its restart policy decides.
    let restarted = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    if let (Some(status), true) = (&on_host, restarted) {
        if let AfterStop::LeaveOff(ended) = restart::after_stop(vm.restart_policy, status.stop_reason) {
            return Ok(Started::LeftOff { status: status.clone(), ended });
        }
    }
    let (status, defined_now) = match on_host {
        Some(status) => (status, false),
        None => {
            // Only files under the host's storage roots; a VM defined
            // already is never checked (nothing running is stopped).
            if let Err(refusal) = agent.storage.check_on_host(&vm.spec).await {
                return Ok(Started::Refused(refusal));
            }
            (provider.ensure_defined(&vm.spec).await?, true)
        }
    };
    if write_record && !record_here(vm, agent, recorded.as_deref(), &status).await? {
        return abandon(vm, agent, &status, defined_now, "the placement record changed meanwhile").await;
    }
    if let Err(why) = wanted(pod, vm, agent).await? {
        return abandon(vm, agent, &status, defined_now, why).await;
    }
    if defined_now {
        info!(vm.uid = %vm.spec.id, domain = %status.backend_name, "defined");
        agent.events.publish(pod, Reason::Defined, &format!("defined {} on {}", status.backend_name, here_name)).await;
    }
    provider.start(&vm.spec.id).await?;
    info!(vm.uid = %vm.spec.id, domain = %status.backend_name, "started");
    agent.events.publish(pod, Reason::Started, &format!("powered on {}", status.backend_name)).await;
    let status = provider.get(&vm.spec.id).await?.unwrap_or(status);
    Ok(Started::Synced { status, restarted })
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
/// still names `expected`. Returns false when it changed meanwhile.
async fn record_here(vm: &PodVm, agent: &Agent, expected: Option<&str>, status: &VmStatus) -> Result<bool, Error> {
    let placement = Placement { node_name: agent.host.name.clone(), backend_id: Some(status.backend_id.clone()) };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &vm.spec.namespace);
    let done = placement::record(&vms, &vm.spec.name, &vm.spec.id.0, expected, placement)
        .await
        .map_err(|source| Error::Kube { action: "record the placement of", pod: vm.spec.name.clone(), source })?;
    if done == Recorded::Done {
        info!(vm.uid = %vm.spec.id, node.name = %agent.host.name, "placement recorded");
    }
    Ok(done == Recorded::Done)
}

/// The pod's VirtualMachine, read fresh from the API server (not from a watch
/// cache, which may lag), when it still wants to run through this pod; else
/// why not: its VirtualMachine is gone, replaced (another UID), being deleted,
/// scaled to 0 or has another current pod, or the pod is gone or being deleted.
/// Errors: the API server could not be read (the pass retries; nothing was
/// done).
async fn wanted(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Result<VirtualMachine, &'static str>, Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let kube_err = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let fresh = match vms.get_opt(&vm.spec.name).await.map_err(kube_err("read the VirtualMachine of"))? {
        None => return Ok(Err("its VirtualMachine was deleted")),
        Some(v) if v.uid().as_deref() != Some(vm.spec.id.0.as_str()) => {
            return Ok(Err("its VirtualMachine was replaced"))
        }
        Some(v) if v.metadata.deletion_timestamp.is_some() => return Ok(Err("its VirtualMachine is being deleted")),
        Some(v) if v.spec.replicas == 0 => return Ok(Err("its VirtualMachine was scaled to 0")),
        Some(v) if v.status.as_ref().and_then(|s| s.pod_name.as_deref()) != Some(pod.name_any().as_str()) => {
            return Ok(Err("its VirtualMachine has another current pod"))
        }
        Some(v) => v,
    };
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
    Ok(match pods.get_opt(&pod.name_any()).await.map_err(kube_err("read"))? {
        None => Err("the pod was deleted"),
        Some(p) if p.uid() != pod.uid() => Err("the pod was replaced"),
        Some(p) if p.metadata.deletion_timestamp.is_some() => Err("the pod is being deleted"),
        Some(_) => Ok(fresh),
    })
}

async fn stop(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Action, Error> {
    let provider = &agent.provider;
    let uid = pod.uid().unwrap_or_default();
    let Some(status) = provider.get(&vm.spec.id).await? else {
        return finish_deletion(pod, agent).await;
    };
    if !status.power.is_active() {
        agent.forget(&uid);
        agent
            .events
            .publish(
                pod,
                Reason::Stopped,
                &format!("{} is off; its definition and disks are kept", status.backend_name),
            )
            .await;
        return finish_deletion(pod, agent).await;
    }
    if was_evicted(pod) && still_wanted(pod, agent).await {
        if agent.remember(&agent.held, &uid) {
            warn!("evicted pod's VM still wants to run; keeping it powered on");
            agent
                .events
                .publish(
                    pod,
                    Reason::EvictionHeld,
                    "the pod was evicted but its VirtualMachine still has replicas 1: the VM keeps running until it \
                     is stopped (kubectl scale virtualmachine/<name> --replicas=0)",
                )
                .await;
        }
        return Ok(Action::requeue(Duration::from_secs(10)));
    }

    // The grace period runs from the first shutdown request, not from the
    // deletion: a pod held after an eviction may have been deleted long ago.
    let grace = Duration::from_secs(
        pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds).unwrap_or(30).max(0) as u64,
    );
    let asked_at = agent.shutdown_sent.lock().expect("agent set poisoned").get(&uid).copied();
    let hard = match (vm.power_off_mode, asked_at) {
        (PowerOffMode::Hard, _) => true,
        (PowerOffMode::TrySoft, Some(at)) => at.elapsed() >= grace,
        _ => false,
    };
    if hard {
        provider.destroy(&vm.spec.id).await?;
        info!(domain = %status.backend_name, "destroyed");
        agent.events.publish(pod, Reason::Destroyed, &format!("powered {} off", status.backend_name)).await;
    } else if asked_at.is_none() {
        provider.shutdown(&vm.spec.id).await?;
        agent.shutdown_sent.lock().expect("agent set poisoned").insert(uid.clone(), Instant::now());
        info!(domain = %status.backend_name, grace_seconds = grace.as_secs(), "asked the guest to shut down");
        agent.events.publish(pod, Reason::ShuttingDown, &format!("asked {} to shut down", status.backend_name)).await;
    }
    Ok(Action::requeue(TRANSITION))
}

/// The pod carries the DisruptionTarget condition set by an eviction or the
/// taint manager.
fn was_evicted(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "DisruptionTarget" && c.status == "True"))
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
async fn finish_deletion(pod: &Pod, agent: &Agent) -> Result<Action, Error> {
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
    agent.forget(&pod.uid().unwrap_or_default());
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
    agent.events.publish(pod, Reason::NotAVirtualMachine, &message).await;
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
            Ok(_) => return Ok(()),
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
