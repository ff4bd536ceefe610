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

use super::pod_status::{pod_status, same_pod_status, Observed};
use super::Agent;
use crate::events::Reason;
use crate::identity::{resolve, Refusal, ResolveError};
use crate::v1alpha1::{PowerOffMode, VirtualMachine};
use crate::vmpod::PodVm;
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
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

/// Requeue after a failed pass.
pub fn error_policy(pod: Arc<Pod>, error: &Error, _agent: Arc<Agent>) -> Action {
    warn!(pod.name = %pod.name_any(), pod.namespace = pod.namespace().unwrap_or_default(), %error, "pod sync failed");
    Action::requeue(Duration::from_secs(5))
}

/// One pass over one pod.
#[instrument(skip_all, fields(node.name = %agent.host.name, pod.namespace = pod.namespace().unwrap_or_default(), pod.name = %pod.name_any()))]
pub async fn reconcile(pod: Arc<Pod>, agent: Arc<Agent>) -> Result<Action, Error> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let vm = match resolve(&pod, &agent.vms, &agent.client).await {
        Ok(vm) => vm,
        Err(ResolveError::Refused(Refusal::InvalidPod { source, .. })) => {
            let message = source.to_string();
            if deleting {
                // Nothing of ours to stop.
                return finish_deletion(&pod, &agent).await;
            }
            agent.events.publish(&*pod, Reason::ProviderFailed, &message).await;
            write_status(&pod, &agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: "InvalidVmPod", message: &message }, false)
            })
            .await?;
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
        Err(ResolveError::Refused(refusal)) => {
            // Not a VirtualMachine's own pod (a plain pod, or one carrying
            // another VM's labels and annotations): it must not start, stop or
            // adopt anything. See crate::identity.
            return refuse_plain_pod(&pod, &agent, &refusal.to_string()).await;
        }
        Err(e @ ResolveError::Kube { .. }) => return Err(Error::Identity(e)),
    };
    if deleting {
        return stop(&pod, &vm, &agent).await;
    }
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return Ok(Action::await_change());
    }
    start(&pod, &vm, &agent).await
}

/// What a start pass did.
enum Started {
    /// The VM is defined and was powered on, or already ran; `restarted` when
    /// the pod had seen it running before (the guest powered off meanwhile).
    Synced { status: VmStatus, restarted: bool },
    /// The VM no longer wants this pod (the reason): nothing was left defined
    /// or powered on by this pass.
    Abandoned(&'static str),
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
        Ok(Started::Refused(refusal)) => super::storage::refuse(pod, agent, &refusal).await,
        Err(Error::Provider(e)) => {
            let message = e.to_string();
            agent.events.publish(pod, Reason::ProviderFailed, &message).await;
            write_status(pod, agent, |p| {
                pod_status(p, &agent.host_ip, &Observed::Waiting { reason: "ProviderFailed", message: &message }, false)
            })
            .await?;
            Err(e.into())
        }
        Err(e) => Err(e),
    }
}

/// Define the VM if the host has none with its identity, then power it on.
///
/// Provider calls can take long (a libvirtd busy probing QEMU once took
/// minutes), and the VM may be deleted or stopped meanwhile. So the
/// VirtualMachine and the pod are read again from the API server before the
/// define, after it, and before the power-on; when they no longer want the VM
/// here, a domain defined by this very pass (never started) is undefined again
/// and nothing is powered on.
async fn start_vm(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Started, Error> {
    let provider = &agent.provider;
    let status = match provider.get(&vm.spec.id).await? {
        Some(status) => status,
        None => {
            if let Some(why) = unwanted(pod, vm, agent).await? {
                return Ok(Started::Abandoned(why));
            }
            if let Err(refusal) = agent.storage.check_on_host(&vm.spec).await {
                return Ok(Started::Refused(refusal));
            }
            let status = provider.ensure_defined(&vm.spec).await?;
            if let Some(why) = unwanted(pod, vm, agent).await? {
                // Defined by this pass a moment ago and never started: nothing
                // of the user's is lost by removing it again.
                provider.undefine(&vm.spec.id).await?;
                warn!(vm.uid = %vm.spec.id, domain = %status.backend_name, why, "undefined a late definition");
                return Ok(Started::Abandoned(why));
            }
            info!(vm.uid = %vm.spec.id, domain = %status.backend_name, "defined");
            agent
                .events
                .publish(pod, Reason::Defined, &format!("defined {} on {}", status.backend_name, agent.host.name))
                .await;
            status
        }
    };
    if status.power.is_active() {
        return Ok(Started::Synced { status, restarted: false });
    }
    if let Some(why) = unwanted(pod, vm, agent).await? {
        return Ok(Started::Abandoned(why));
    }
    let restarted = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    provider.start(&vm.spec.id).await?;
    info!(vm.uid = %vm.spec.id, domain = %status.backend_name, "started");
    agent.events.publish(pod, Reason::Started, &format!("powered on {}", status.backend_name)).await;
    let status = provider.get(&vm.spec.id).await?.unwrap_or(status);
    Ok(Started::Synced { status, restarted })
}

/// Why the VM of `pod` must not be defined or powered on now, read fresh from
/// the API server (not from a watch cache, which may lag): its VirtualMachine
/// is gone, replaced (another UID), being deleted or scaled to 0, or the pod is
/// gone or being deleted. `None` when it still wants to run here. Errors: the
/// API server could not be read (the pass retries; nothing was done).
async fn unwanted(pod: &Pod, vm: &PodVm, agent: &Agent) -> Result<Option<&'static str>, Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let kube_err = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let why = match vms.get_opt(&vm.spec.name).await.map_err(kube_err("read the VirtualMachine of"))? {
        None => Some("its VirtualMachine was deleted"),
        Some(v) if v.uid().as_deref() != Some(vm.spec.id.0.as_str()) => Some("its VirtualMachine was replaced"),
        Some(v) if v.metadata.deletion_timestamp.is_some() => Some("its VirtualMachine is being deleted"),
        Some(v) if v.spec.replicas == 0 => Some("its VirtualMachine was scaled to 0"),
        Some(_) => None,
    };
    if why.is_some() {
        return Ok(why);
    }
    let pods: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
    Ok(match pods.get_opt(&pod.name_any()).await.map_err(kube_err("read"))? {
        None => Some("the pod was deleted"),
        Some(p) if p.uid() != pod.uid() => Some("the pod was replaced"),
        Some(p) if p.metadata.deletion_timestamp.is_some() => Some("the pod is being deleted"),
        Some(_) => None,
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
