//! What a host's agent does next for one VM pod, decided from the pod, its
//! VirtualMachine, the placement record and what the provider reports
//! (pure; [`super::pods`] reads all of these and carries the step out).
//!
//! The controller's counterpart is [`crate::controller::decide`]; the scenario
//! suite ([`super::scenarios`]) runs both against an in-memory back end.

use super::placement::{verdict, HereState, Verdict};
use super::restart::{after_stop, AfterStop, Ended};
use crate::v1alpha1::{PowerOffMode, RestartPolicy, VirtualMachine};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use std::time::Duration;
use vmlet_provider::{PowerState, StopReason};

/// What the host reports about the VM, for [`start_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnHost {
    /// The host has no VM with this identity.
    Absent,
    /// Defined here, in this power state, stopped for this reason.
    Defined(PowerState, Option<StopReason>),
}

/// Everything [`start_step`] decides from.
#[derive(Debug, Clone, Copy)]
pub struct StartView<'a> {
    /// This host's node name.
    pub here: &'a str,
    /// What this host reports.
    pub on_host: OnHost,
    /// The node `status.placement` names, if any.
    pub record: Option<&'a str>,
    /// Other hosts (of this process, or of the back end) that hold the VM.
    pub held_elsewhere: &'a [String],
    /// The pod saw the VM running before (its container was running).
    pub pod_saw_running: bool,
    /// The VM's `spec.restartPolicy`.
    pub restart_policy: RestartPolicy,
}

/// The agent's next step for a live VM pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartStep {
    /// The VM runs here: nothing to start; write the record first when
    /// `record` (it follows a running VM).
    Running {
        /// The placement record must be (re)written to this host.
        record: bool,
    },
    /// Do not define or power on anything: the VM lives on `node`;
    /// `record_it` when another host holds it and the record does not say so.
    LivesElsewhere {
        /// Where it lives.
        node: String,
        /// The record must be corrected to `node`.
        record_it: bool,
    },
    /// The VM stopped by itself and its restart policy leaves it off.
    LeaveOff(Ended),
    /// Define the VM here (the host has none), record the placement, power on.
    DefineAndStart {
        /// The placement record must be written to this host before power-on.
        record: bool,
    },
    /// Power the VM defined here on, after recording it when `record`.
    Start {
        /// The placement record must be written to this host before power-on.
        record: bool,
    },
}

/// The next step for a live VM pod on host `view.here`, from
/// [`placement::verdict`](super::placement::verdict) and the restart policy
/// ([`after_stop`]). `ours` says whether a node is served by this process.
///
/// - a VM that runs here runs on (the record follows it);
/// - a VM another host holds, or recorded on a host this process cannot ask,
///   is never defined or started here;
/// - a VM the pod saw running that stopped by itself is started again or
///   left off as its restart policy says;
/// - otherwise it is defined if the host has none, recorded, powered on.
pub fn start_step(view: StartView<'_>, ours: impl Fn(&str) -> bool) -> StartStep {
    let state = match view.on_host {
        OnHost::Absent => HereState::Absent,
        OnHost::Defined(power, _) if power.is_active() => HereState::Active,
        OnHost::Defined(..) => HereState::Inactive,
    };
    let record = match verdict(view.here, state, view.record, view.held_elsewhere, &ours) {
        Verdict::LivesElsewhere { node } => {
            // Only a node of this process is recorded: a host of the back end
            // that no node serves keeps the VM from being defined here, but a
            // record naming it would pin the VM's pods to no node.
            let record_it = view.held_elsewhere.contains(&node) && view.record != Some(node.as_str()) && ours(&node);
            return StartStep::LivesElsewhere { node, record_it };
        }
        Verdict::RunHere { record } => record,
    };
    match view.on_host {
        OnHost::Absent => StartStep::DefineAndStart { record },
        OnHost::Defined(..) if state == HereState::Active => StartStep::Running { record },
        OnHost::Defined(_, reason) if view.pod_saw_running => match after_stop(view.restart_policy, reason) {
            AfterStop::LeaveOff(ended) => StartStep::LeaveOff(ended),
            AfterStop::StartAgain => StartStep::Start { record },
        },
        OnHost::Defined(..) => StartStep::Start { record },
    }
}

/// Everything [`stop_step`] decides from, for a pod being deleted.
#[derive(Debug, Clone, Copy)]
pub struct StopView {
    /// The host's VM is active; `None`: the host has no such VM.
    pub active: Option<bool>,
    /// The pod was evicted, its VM may migrate (`evictionStrategy` not
    /// `None`) and its VirtualMachine still wants it to run.
    pub evicted_and_wanted: bool,
    /// The VM's `spec.powerOffMode`.
    pub power_off_mode: PowerOffMode,
    /// How long ago the guest was asked to shut down, if it was.
    pub asked_ago: Option<Duration>,
    /// The pod's grace period (`terminationGracePeriodSeconds`).
    pub grace: Duration,
}

/// The agent's next step for a pod being deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopStep {
    /// Nothing (left) runs: complete the pod's deletion; the definition and
    /// disks stay.
    FinishDeletion,
    /// Keep the VM running: the pod was evicted but its VM moves, or is
    /// stopped, by the controller's decision, not by the eviction.
    Hold,
    /// Ask the guest to shut down (ACPI), then wait.
    Shutdown,
    /// Power off at once: `Hard` mode, or the grace period since the
    /// shutdown request passed.
    Destroy,
    /// The guest was asked and the grace period still runs: wait.
    Wait,
}

/// The next step for a pod being deleted: nothing powered off while an
/// evicted VM still wants to run; `Hard` powers off at once; `Soft` asks the
/// guest and waits however long it takes; `TrySoft` asks the guest first and
/// powers off once the grace period since that request passed (not since the
/// deletion: a held pod may have been deleted long ago).
pub fn stop_step(view: StopView) -> StopStep {
    match view.active {
        None | Some(false) => StopStep::FinishDeletion,
        Some(true) if view.evicted_and_wanted => StopStep::Hold,
        Some(true) => match (view.power_off_mode, view.asked_ago) {
            (PowerOffMode::Hard, _) => StopStep::Destroy,
            (PowerOffMode::TrySoft, Some(ago)) if ago >= view.grace => StopStep::Destroy,
            (PowerOffMode::TrySoft | PowerOffMode::Soft, Some(_)) => StopStep::Wait,
            (PowerOffMode::TrySoft | PowerOffMode::Soft, None) => StopStep::Shutdown,
        },
    }
}

/// Why the VirtualMachine `current` no longer wants to run through `pod`
/// (whose VM has UID `uid`): it is another object (replaced under the same
/// name), being deleted, scaled to 0, or names another current pod. `None`:
/// it does.
pub fn unwanted(pod: &Pod, uid: &str, current: &VirtualMachine) -> Option<&'static str> {
    if current.uid().as_deref() != Some(uid) {
        Some("its VirtualMachine was replaced")
    } else if current.metadata.deletion_timestamp.is_some() {
        Some("its VirtualMachine is being deleted")
    } else if current.spec.replicas == 0 {
        Some("its VirtualMachine was scaled to 0")
    } else if current.status.as_ref().and_then(|s| s.pod_name.as_deref()) != Some(pod.name_any().as_str()) {
        Some("its VirtualMachine has another current pod")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    fn ours(node: &str) -> bool {
        node.starts_with("host-")
    }

    fn view<'a>(on_host: OnHost, record: Option<&'a str>, elsewhere: &'a [String]) -> StartView<'a> {
        StartView {
            here: "host-a",
            on_host,
            record,
            held_elsewhere: elsewhere,
            pod_saw_running: false,
            restart_policy: RestartPolicy::Always,
        }
    }

    const OFF: OnHost = OnHost::Defined(PowerState::Off, None);
    const RUNNING: OnHost = OnHost::Defined(PowerState::Running, None);

    fn powered_off_by(reason: StopReason) -> OnHost {
        OnHost::Defined(PowerState::Off, Some(reason))
    }

    #[test]
    fn a_new_vm_is_defined_here_and_recorded_before_it_starts() {
        assert_eq!(start_step(view(OnHost::Absent, None, &[]), ours), StartStep::DefineAndStart { record: true });
    }

    #[test]
    fn a_vm_running_here_keeps_running_even_if_another_host_claims_it() {
        let b = ["host-b".to_owned()];
        assert_eq!(start_step(view(RUNNING, Some("host-b"), &b), ours), StartStep::Running { record: true });
        assert_eq!(start_step(view(RUNNING, Some("host-a"), &[]), ours), StartStep::Running { record: false });
    }

    #[test]
    fn a_vm_another_host_holds_is_not_defined_here_and_the_record_is_corrected() {
        let b = ["host-b".to_owned()];
        let step = start_step(view(OnHost::Absent, None, &b), ours);
        assert_eq!(step, StartStep::LivesElsewhere { node: "host-b".into(), record_it: true });
        let step = start_step(view(OnHost::Absent, Some("host-b"), &b), ours);
        assert_eq!(step, StartStep::LivesElsewhere { node: "host-b".into(), record_it: false });
    }

    #[test]
    fn a_vm_on_a_back_end_host_no_node_serves_is_not_defined_here_nor_recorded_there() {
        let compute_9 = ["compute-9".to_owned()];
        let step = start_step(view(OnHost::Absent, Some("host-a"), &compute_9), ours);
        assert_eq!(step, StartStep::LivesElsewhere { node: "compute-9".into(), record_it: false });
    }

    #[test]
    fn a_record_naming_a_host_of_another_process_binds() {
        let step = start_step(view(OnHost::Absent, Some("kvm-9"), &[]), ours);
        assert_eq!(step, StartStep::LivesElsewhere { node: "kvm-9".into(), record_it: false });
    }

    #[test]
    fn a_stopped_vm_recorded_here_is_powered_on_without_a_new_record() {
        assert_eq!(start_step(view(OFF, Some("host-a"), &[]), ours), StartStep::Start { record: false });
    }

    #[test]
    fn a_guest_that_powered_itself_off_is_left_off_under_on_failure_and_started_under_always() {
        let seen = StartView {
            pod_saw_running: true,
            restart_policy: RestartPolicy::OnFailure,
            ..view(powered_off_by(StopReason::GuestShutdown), Some("host-a"), &[])
        };
        assert!(matches!(start_step(seen, ours), StartStep::LeaveOff(Ended { reason: "GuestPoweredOff", .. })));
        let always = StartView { restart_policy: RestartPolicy::Always, ..seen };
        assert_eq!(start_step(always, ours), StartStep::Start { record: false });
    }

    #[test]
    fn a_destroyed_vm_counts_as_a_failure_and_is_started_again_under_on_failure() {
        let seen = StartView {
            pod_saw_running: true,
            restart_policy: RestartPolicy::OnFailure,
            ..view(powered_off_by(StopReason::Destroyed), Some("host-a"), &[])
        };
        assert_eq!(start_step(seen, ours), StartStep::Start { record: false });
        let never = StartView { restart_policy: RestartPolicy::Never, ..seen };
        assert!(matches!(start_step(never, ours), StartStep::LeaveOff(Ended { reason: "Destroyed", .. })));
    }

    #[test]
    fn the_restart_policy_only_speaks_when_the_pod_saw_the_vm_running() {
        let new_pod = StartView {
            restart_policy: RestartPolicy::Never,
            ..view(powered_off_by(StopReason::GuestShutdown), Some("host-a"), &[])
        };
        assert_eq!(start_step(new_pod, ours), StartStep::Start { record: false });
    }

    fn stopping(active: Option<bool>, mode: PowerOffMode, asked_ago: Option<u64>) -> StopView {
        StopView {
            active,
            evicted_and_wanted: false,
            power_off_mode: mode,
            asked_ago: asked_ago.map(Duration::from_secs),
            grace: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_deleted_pod_asks_the_guest_first_and_powers_off_after_the_grace_period() {
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::TrySoft, None)), StopStep::Shutdown);
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::TrySoft, Some(29))), StopStep::Wait);
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::TrySoft, Some(30))), StopStep::Destroy);
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::Hard, None)), StopStep::Destroy);
    }

    #[test]
    fn soft_waits_for_the_guest_however_long_it_takes() {
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::Soft, None)), StopStep::Shutdown);
        assert_eq!(stop_step(stopping(Some(true), PowerOffMode::Soft, Some(86_400))), StopStep::Wait);
    }

    #[test]
    fn a_pod_whose_vm_is_off_or_gone_completes_its_deletion() {
        assert_eq!(stop_step(stopping(Some(false), PowerOffMode::Hard, None)), StopStep::FinishDeletion);
        assert_eq!(stop_step(stopping(None, PowerOffMode::TrySoft, Some(99))), StopStep::FinishDeletion);
    }

    #[test]
    fn an_evicted_vm_that_still_wants_to_run_is_held_whatever_its_power_off_mode() {
        for mode in [PowerOffMode::TrySoft, PowerOffMode::Hard] {
            let held = StopView { evicted_and_wanted: true, ..stopping(Some(true), mode, Some(999)) };
            assert_eq!(stop_step(held), StopStep::Hold);
        }
    }

    #[test]
    fn a_vm_wants_its_pod_only_while_it_names_it_runs_and_is_the_same_object() {
        let vm = VmBuilder::new("web").pod_name("web-x7k2p").build();
        let uid = vm.uid().unwrap();
        let pod = PodBuilder::for_vm(&vm).named("web-x7k2p").build();
        assert_eq!(unwanted(&pod, &uid, &vm), None);
        assert_eq!(unwanted(&pod, "another-uid", &vm), Some("its VirtualMachine was replaced"));
        let stopped = VmBuilder::new("web").pod_name("web-x7k2p").stopped().build();
        assert_eq!(unwanted(&pod, &uid, &stopped), Some("its VirtualMachine was scaled to 0"));
        let other = PodBuilder::for_vm(&vm).named("web-b8r2x").build();
        assert_eq!(unwanted(&other, &uid, &vm), Some("its VirtualMachine has another current pod"));
    }
}
