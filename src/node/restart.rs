//! What a VM's restart policy says when its VM is found off although its pod
//! saw it running (pure).

use crate::v1alpha1::RestartPolicy;
use vmlet_provider::StopReason;

/// The pod's end when a VM is left off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// The pod phase: `Succeeded` after a clean guest power-off, else `Failed`.
    pub phase: &'static str,
    /// Pod and VM reason: `GuestPoweredOff`, `Crashed` or `Destroyed`.
    pub reason: &'static str,
}

/// The reasons of [`Ended`]: a pod that ended with one of these was left off
/// by its restart policy, and is not replaced ([`crate::controller::decide`]).
pub const LEFT_OFF_REASONS: [&str; 3] = ["GuestPoweredOff", "Crashed", "Destroyed"];

/// Start the VM again, or leave it off and end the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterStop {
    /// Power it on again.
    StartAgain,
    /// Leave it off; the pod ends so.
    LeaveOff(Ended),
}

/// What `policy` says about a VM that stopped for `reason`, as the kubelet's
/// restartPolicy does for a container: `Always` starts it again; `OnFailure`
/// only after a failure (a crash, a power-off from the host, an unknown
/// cause), not after the guest powered itself off; `Never` never.
pub fn after_stop(policy: RestartPolicy, reason: Option<StopReason>) -> AfterStop {
    let ended = match reason {
        Some(StopReason::GuestShutdown) => Ended { phase: "Succeeded", reason: "GuestPoweredOff" },
        Some(StopReason::Destroyed) => Ended { phase: "Failed", reason: "Destroyed" },
        Some(StopReason::Crashed | StopReason::Unknown) | None => Ended { phase: "Failed", reason: "Crashed" },
    };
    match policy {
        RestartPolicy::Always => AfterStop::StartAgain,
        RestartPolicy::OnFailure if ended.phase == "Failed" => AfterStop::StartAgain,
        RestartPolicy::OnFailure | RestartPolicy::Never => AfterStop::LeaveOff(ended),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POWERED_OFF: Ended = Ended { phase: "Succeeded", reason: "GuestPoweredOff" };

    #[test]
    fn always_starts_the_vm_again_whatever_stopped_it() {
        for reason in [StopReason::GuestShutdown, StopReason::Destroyed, StopReason::Crashed, StopReason::Unknown] {
            assert_eq!(after_stop(RestartPolicy::Always, Some(reason)), AfterStop::StartAgain);
        }
    }

    #[test]
    fn on_failure_leaves_a_guest_that_powered_itself_off_off_and_restarts_a_destroyed_or_crashed_one() {
        assert_eq!(
            after_stop(RestartPolicy::OnFailure, Some(StopReason::GuestShutdown)),
            AfterStop::LeaveOff(POWERED_OFF)
        );
        assert_eq!(after_stop(RestartPolicy::OnFailure, Some(StopReason::Destroyed)), AfterStop::StartAgain);
        assert_eq!(after_stop(RestartPolicy::OnFailure, Some(StopReason::Crashed)), AfterStop::StartAgain);
        assert_eq!(after_stop(RestartPolicy::OnFailure, None), AfterStop::StartAgain);
    }

    #[test]
    fn never_leaves_it_off_and_says_why() {
        assert_eq!(after_stop(RestartPolicy::Never, Some(StopReason::GuestShutdown)), AfterStop::LeaveOff(POWERED_OFF));
        assert_eq!(
            after_stop(RestartPolicy::Never, Some(StopReason::Destroyed)),
            AfterStop::LeaveOff(Ended { phase: "Failed", reason: "Destroyed" })
        );
        assert_eq!(
            after_stop(RestartPolicy::Never, Some(StopReason::Crashed)),
            AfterStop::LeaveOff(Ended { phase: "Failed", reason: "Crashed" })
        );
    }

    #[test]
    fn every_end_reason_is_one_the_controller_leaves_alone() {
        for reason in [StopReason::GuestShutdown, StopReason::Destroyed, StopReason::Crashed] {
            let AfterStop::LeaveOff(ended) = after_stop(RestartPolicy::Never, Some(reason)) else { panic!() };
            assert!(LEFT_OFF_REASONS.contains(&ended.reason));
        }
    }
}
