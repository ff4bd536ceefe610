//! Pod status derived from what the provider reports (pure functions).
//!
//! A VM pod has one container, `vm`, that stands for the guest: running while the
//! VM is powered on, waiting (with the reason) while it is being defined or started
//! or while the provider fails.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, HostIP,
    Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use vmlet_provider::{PowerState, VmStatus};

use crate::failure::HOST_RESPONDING;
use crate::node::restart::Ended;
use crate::vmpod::{CONTAINER_IMAGE, CONTAINER_NAME};

/// What the agent learned about a pod's VM in this pass.
#[derive(Debug, Clone)]
pub enum Observed<'a> {
    /// The provider reports the VM.
    Vm {
        /// The provider's report.
        status: &'a VmStatus,
        /// Backend name for the container ID scheme (`libvirt://<uuid>`).
        provider: &'a str,
    },
    /// The VM cannot run yet or the provider failed: the container waits.
    Waiting {
        /// PascalCase reason, e.g. `ProviderFailed`.
        reason: &'a str,
        /// What happened and what to do.
        message: &'a str,
    },
    /// The host does not answer: nothing is known of the VM now, so the pod
    /// keeps its last known status (a Running VM stays Running and Ready) and
    /// gains the condition [`HOST_RESPONDING`] = False with `message`.
    HostNotResponding {
        /// What the provider said.
        message: &'a str,
    },
    /// The VM stopped and its restart policy leaves it off: the pod ends
    /// (phase and reason from `ended`), its container terminated.
    Ended {
        /// Phase and reason.
        ended: Ended,
        /// What happened and how to start the VM again.
        message: &'a str,
    },
}

/// The status `pod` should have, given what was observed. `host_ip` is the node's
/// InternalIP. Keeps `startTime`, the scheduler's `PodScheduled` condition,
/// transition times of unchanged conditions, and `restartCount`; counts a restart
/// when a container that was running is found powered off (`restarted`).
pub fn pod_status(pod: &Pod, host_ip: &str, observed: &Observed<'_>, restarted: bool) -> PodStatus {
    let old = pod.status.clone().unwrap_or_default();
    let now = Time(Timestamp::now());
    if let Observed::HostNotResponding { message } = observed {
        let mut conditions = old.conditions.clone().unwrap_or_default();
        set_pod_condition(&mut conditions, HOST_RESPONDING, false, &now);
        if let Some(c) = conditions.iter_mut().find(|c| c.type_ == HOST_RESPONDING) {
            c.reason = Some("HostNotResponding".into());
            c.message = Some((*message).to_owned());
        }
        return PodStatus { conditions: Some(conditions), ..old };
    }
    if let Observed::Ended { ended, message } = observed {
        return ended_status(old, &now, *ended, message);
    }
    let old_container = old.container_statuses.as_ref().and_then(|c| c.first()).cloned();
    let mut restart_count = old_container.as_ref().map_or(0, |c| c.restart_count);
    if restarted {
        restart_count += 1;
    }
    let was_running_since = old_container
        .as_ref()
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.running.as_ref())
        .and_then(|r| r.started_at.clone());
    let last_state = if restarted {
        Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 0,
                reason: Some("PoweredOff".into()),
                message: Some("the VM was found powered off and was started again".into()),
                started_at: was_running_since.clone(),
                finished_at: Some(now.clone()),
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        })
    } else {
        old_container.as_ref().and_then(|c| c.last_state.clone())
    };

    let (running, ready, state, container_id, addresses) = match observed {
        Observed::Vm { status, provider } => {
            let running = status.power.is_active();
            let ready = status.power == PowerState::Running;
            let state = if let Some(fault) = &status.fault {
                // Active (it holds the host's CPU and memory: the pod stays
                // Running) but its guest does not run.
                waiting(FAULTED, &fault_message(fault))
            } else if running {
                ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: Some(if restarted {
                            now.clone()
                        } else {
                            was_running_since.unwrap_or(now.clone())
                        }),
                    }),
                    ..ContainerState::default()
                }
            } else {
                waiting("PoweredOff", &format!("the VM is {:?}; starting it", status.power))
            };
            let addresses = pod_ips(&status.addresses);
            (running, ready, state, Some(format!("{provider}://{}", status.backend_id)), addresses)
        }
        Observed::Waiting { reason, message } => (
            false,
            false,
            waiting(reason, message),
            old_container.as_ref().and_then(|c| c.container_id.clone()),
            vec![],
        ),
        Observed::HostNotResponding { .. } | Observed::Ended { .. } => unreachable!("handled above"),
    };

    let mut conditions = old.conditions.clone().unwrap_or_default();
    // The host answered in this pass.
    conditions.retain(|c| c.type_ != HOST_RESPONDING);
    for (type_, status) in [("PodScheduled", true), ("Initialized", true), ("ContainersReady", ready), ("Ready", ready)]
    {
        // The scheduler owns PodScheduled; only add it when missing.
        if type_ == "PodScheduled" && conditions.iter().any(|c| c.type_ == type_) {
            continue;
        }
        set_pod_condition(&mut conditions, type_, status, &now);
    }

    PodStatus {
        phase: Some(if running { "Running" } else { "Pending" }.into()),
        conditions: Some(conditions),
        host_ip: Some(host_ip.to_owned()),
        host_ips: Some(vec![HostIP { ip: host_ip.to_owned() }]),
        pod_ip: addresses.first().cloned(),
        pod_ips: (!addresses.is_empty()).then(|| addresses.iter().map(|ip| PodIP { ip: ip.clone() }).collect()),
        start_time: old.start_time.clone().or(Some(now)),
        qos_class: old.qos_class.clone(),
        container_statuses: Some(vec![ContainerStatus {
            name: CONTAINER_NAME.into(),
            image: CONTAINER_IMAGE.into(),
            image_id: String::new(),
            container_id,
            ready,
            started: Some(running),
            restart_count,
            state: Some(state),
            last_state,
            ..ContainerStatus::default()
        }]),
        ..old
    }
}

/// The status of a pod whose VM was left off: `ended.phase`, not Ready, the
/// container terminated with `ended.reason` (exit code 0 when Succeeded).
fn ended_status(old: PodStatus, now: &Time, ended: Ended, message: &str) -> PodStatus {
    let mut conditions = old.conditions.clone().unwrap_or_default();
    conditions.retain(|c| c.type_ != HOST_RESPONDING);
    for type_ in ["ContainersReady", "Ready"] {
        set_pod_condition(&mut conditions, type_, false, now);
    }
    let containers = old.container_statuses.clone().unwrap_or_default().into_iter().map(|c| {
        let started_at = c.state.as_ref().and_then(|s| s.running.as_ref()).and_then(|r| r.started_at.clone());
        ContainerStatus {
            ready: false,
            started: Some(false),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: if ended.phase == "Succeeded" { 0 } else { 1 },
                    reason: Some(ended.reason.into()),
                    message: Some(message.into()),
                    started_at,
                    finished_at: Some(now.clone()),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..c
        }
    });
    PodStatus {
        phase: Some(ended.phase.into()),
        reason: Some(ended.reason.into()),
        message: Some(message.into()),
        conditions: Some(conditions),
        container_statuses: Some(containers.collect()),
        pod_ip: None,
        pod_ips: None,
        ..old
    }
}

/// The pod IPs for a VM's addresses (first interface first): the first
/// address and the first of the other family, as the API server allows at
/// most one IP per family (`status.podIPs`: one, or a dual-stack pair). A
/// VM's further addresses (a second NIC's) are not the pod's.
fn pod_ips(addresses: &[std::net::IpAddr]) -> Vec<String> {
    let Some(first) = addresses.first() else { return Vec::new() };
    let other = addresses.iter().find(|a| a.is_ipv4() != first.is_ipv4());
    std::iter::once(first).chain(other).map(ToString::to_string).collect()
}

/// The container's waiting reason while the hypervisor holds the VM
/// stopped for an error ([`vmlet_provider::Fault`]); the controller shows
/// the VM `Failed` with it.
pub const FAULTED: &str = "Faulted";

/// What a pod (and its VM) says about `fault`.
pub fn fault_message(fault: &vmlet_provider::Fault) -> String {
    format!("the hypervisor stopped the guest: {fault}; resume it (virsh resume) or restart the VM (scale to 0 and 1)")
}

fn waiting(reason: &str, message: &str) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting { reason: Some(reason.into()), message: Some(message.into()) }),
        ..ContainerState::default()
    }
}

fn set_pod_condition(conditions: &mut Vec<PodCondition>, type_: &str, status: bool, now: &Time) {
    let status = if status { "True" } else { "False" }.to_owned();
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) if c.status == status => {}
        Some(c) => {
            c.status = status;
            c.last_transition_time = Some(now.clone());
            c.reason = None;
            c.message = None;
        }
        None => conditions.push(PodCondition {
            type_: type_.into(),
            status,
            last_transition_time: Some(now.clone()),
            ..PodCondition::default()
        }),
    }
}

/// True when two statuses say the same to a reader, ignoring timestamps that
/// [`pod_status`] would refresh; used to skip needless writes.
pub fn same_pod_status(a: &PodStatus, b: &PodStatus) -> bool {
    let strip = |s: &PodStatus| {
        let mut s = s.clone();
        for c in s.conditions.iter_mut().flatten() {
            c.last_transition_time = None;
            c.last_probe_time = None;
        }
        for c in s.container_statuses.iter_mut().flatten() {
            if let Some(r) = c.state.as_mut().and_then(|st| st.running.as_mut()) {
                r.started_at = None;
            }
        }
        s
    };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};
    use vmlet_provider::VmId;

    fn vm_status(power: PowerState) -> VmStatus {
        VmStatus {
            id: VmId("u1".into()),
            backend_name: "default_web".into(),
            backend_id: "0b5c3b3e-1111-4000-8000-00000000000a".into(),
            power,
            stop_reason: None,
            fault: None,
            cpus: 2,
            memory_bytes: 1 << 30,
            max_cpus: 2,
            max_memory_bytes: 1 << 30,
            next_start: None,
            addresses: vec!["192.0.2.7".parse().unwrap()],
            network_interfaces: 0,
        }
    }

    fn bound_pod() -> Pod {
        PodBuilder::for_vm(&VmBuilder::new("web").build()).on_node("host-a").build()
    }

    #[test]
    fn pod_ips_are_the_first_address_and_the_first_of_the_other_family() {
        let ips = |list: &[&str]| list.iter().map(|a| a.parse().unwrap()).collect::<Vec<std::net::IpAddr>>();
        assert_eq!(pod_ips(&ips(&[])), Vec::<String>::new());
        assert_eq!(pod_ips(&ips(&["10.0.0.5", "10.1.0.5"])), ["10.0.0.5"], "a second NIC's IPv4 is not the pod's");
        assert_eq!(pod_ips(&ips(&["10.0.0.5", "10.1.0.5", "fd00::5"])), ["10.0.0.5", "fd00::5"]);
        assert_eq!(pod_ips(&ips(&["fd00::5", "fd00::6", "10.0.0.5"])), ["fd00::5", "10.0.0.5"]);
    }

    #[test]
    fn running_vm_makes_a_running_ready_pod() {
        let vm = vm_status(PowerState::Running);
        let status = pod_status(&bound_pod(), "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(status.host_ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(status.pod_ip.as_deref(), Some("192.0.2.7"));
        let conditions = status.conditions.as_ref().unwrap();
        for type_ in ["PodScheduled", "Initialized", "ContainersReady", "Ready"] {
            assert_eq!(conditions.iter().find(|c| c.type_ == type_).unwrap().status, "True", "{type_}");
        }
        let container = &status.container_statuses.as_ref().unwrap()[0];
        assert_eq!(container.container_id.as_deref(), Some("libvirt://0b5c3b3e-1111-4000-8000-00000000000a"));
        assert!(container.ready);
        assert_eq!(container.started, Some(true));
        assert!(container.state.as_ref().unwrap().running.is_some());
        assert!(status.start_time.is_some());
    }

    #[test]
    fn a_vm_the_hypervisor_paused_for_an_error_is_running_but_waits_faulted_and_is_not_ready() {
        let mut vm = vm_status(PowerState::Paused);
        vm.fault = Some(vmlet_provider::Fault {
            reason: "paused (I/O error): a disk failed".into(),
            detail: Some("block I/O error in device 'vda'".into()),
            resumable: true,
        });
        let status = pod_status(&bound_pod(), "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        assert_eq!(status.phase.as_deref(), Some("Running"), "it still holds the host's CPU and memory");
        let container = &status.container_statuses.as_ref().unwrap()[0];
        assert!(!container.ready);
        let waiting = container.state.as_ref().unwrap().waiting.as_ref().unwrap();
        assert_eq!(waiting.reason.as_deref(), Some(FAULTED));
        assert_eq!(
            waiting.message.as_deref(),
            Some(
                "the hypervisor stopped the guest: paused (I/O error): a disk failed; the hypervisor's log says: \
                 block I/O error in device 'vda'; resume it (virsh resume) or restart the VM (scale to 0 and 1)"
            )
        );
        vm.fault = None;
        let resumed = pod_status(&bound_pod(), "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        let container = &resumed.container_statuses.as_ref().unwrap()[0];
        assert!(container.state.as_ref().unwrap().running.is_some(), "a pause asked for is no fault");
        assert!(!container.ready, "a paused guest is not ready");
    }

    #[test]
    fn provider_failure_makes_the_container_wait_with_the_reason() {
        let status = pod_status(
            &bound_pod(),
            "127.0.0.1",
            &Observed::Waiting { reason: "ProviderFailed", message: "define domain: boom" },
            false,
        );
        assert_eq!(status.phase.as_deref(), Some("Pending"));
        let container = &status.container_statuses.as_ref().unwrap()[0];
        let waiting = container.state.as_ref().unwrap().waiting.as_ref().unwrap();
        assert_eq!(waiting.reason.as_deref(), Some("ProviderFailed"));
        assert_eq!(waiting.message.as_deref(), Some("define domain: boom"));
        assert!(!container.ready);
    }

    #[test]
    fn a_host_that_does_not_answer_leaves_a_running_pod_running_and_ready_with_a_condition() {
        let vm = vm_status(PowerState::Running);
        let mut pod = bound_pod();
        pod.status = Some(pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false));
        let silent = Observed::HostNotResponding { message: "list domains: cannot connect to libvirtd" };
        let status = pod_status(&pod, "127.0.0.1", &silent, false);
        assert_eq!(status.phase.as_deref(), Some("Running"));
        let find = |s: &PodStatus, t: &str| s.conditions.iter().flatten().find(|c| c.type_ == t).cloned();
        assert_eq!(find(&status, "Ready").unwrap().status, "True");
        let silent_condition = find(&status, HOST_RESPONDING).unwrap();
        assert_eq!(silent_condition.status, "False");
        assert_eq!(silent_condition.message.as_deref(), Some("list domains: cannot connect to libvirtd"));
        assert_eq!(
            status.container_statuses,
            pod.status.as_ref().unwrap().container_statuses,
            "the container as it was"
        );

        pod.status = Some(status);
        let back = pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        assert!(find(&back, HOST_RESPONDING).is_none(), "the condition clears once the host answers");
        assert_eq!(back.container_statuses.unwrap()[0].restart_count, 0);
    }

    #[test]
    fn a_restart_is_counted_and_the_old_run_kept_in_last_state() {
        let mut pod = bound_pod();
        let vm = vm_status(PowerState::Running);
        pod.status = Some(pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false));
        let again = pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, true);
        let container = &again.container_statuses.as_ref().unwrap()[0];
        assert_eq!(container.restart_count, 1);
        let terminated = container.last_state.as_ref().unwrap().terminated.as_ref().unwrap();
        assert_eq!(terminated.reason.as_deref(), Some("PoweredOff"));
    }

    #[test]
    fn an_unchanged_observation_is_the_same_status() {
        let mut pod = bound_pod();
        let vm = vm_status(PowerState::Running);
        let first = pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        pod.status = Some(first.clone());
        let second = pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &vm, provider: "libvirt" }, false);
        assert!(same_pod_status(&first, &second));
        let off = vm_status(PowerState::Off);
        let third = pod_status(&pod, "127.0.0.1", &Observed::Vm { status: &off, provider: "libvirt" }, false);
        assert!(!same_pod_status(&first, &third));
    }
}
