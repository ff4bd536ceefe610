//! What the controller does next for a VM, decided from the VM and its current
//! pod alone (pure; the caller reads both and carries the step out).

use crate::node::restart::LEFT_OFF_REASONS;
use crate::node::PLACED_ELSEWHERE;
use crate::v1alpha1::VirtualMachine;
use k8s_openapi::api::core::v1::Pod;

/// The controller's next step for one live (not deleted) VirtualMachine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Name a new pod in `status.podName`, then create it.
    CreatePod,
    /// Delete the current pod, for the reason given (shown in an Event).
    DeletePod(&'static str),
    /// Nothing to change: mirror the current pod into the VM's status.
    Observe,
}

/// The next step for `vm` given its current pod (`None`: it has none, or the
/// pod its `status.podName` names is gone).
///
/// - replicas 1, no pod → [`Step::CreatePod`];
/// - replicas 1, the pod ended (Failed or Succeeded) → delete it, so that the
///   next pass replaces it; unless its VM's restart policy left the VM off
///   (reasons [`LEFT_OFF_REASONS`]): then the VM stays off, with that pod,
///   until a scale to 0 (and back to 1) deletes it;
/// - replicas 1, the pod's agent found the VM lives on another host (waiting
///   reason `PlacedOnAnotherHost`) → delete it; its replacement is pinned to
///   the host of the placement record;
/// - replicas 0, a pod not yet being deleted → delete it (the agent stops the VM);
/// - otherwise (the pod runs, or is already terminating) → [`Step::Observe`]:
///   a terminating pod is never replaced before it is gone, so a VM never
///   gets a second pod while its agent still acts on the first.
pub fn next_step(vm: &VirtualMachine, current: Option<&Pod>) -> Step {
    let deleting = current.is_some_and(|p| p.metadata.deletion_timestamp.is_some());
    let ended = current
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Failed" || phase == "Succeeded");
    let misplaced = current
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .is_some_and(|w| w.reason.as_deref() == Some(PLACED_ELSEWHERE));
    let left_off = current
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.reason.as_deref())
        .is_some_and(|r| LEFT_OFF_REASONS.contains(&r));
    match (vm.spec.replicas, current) {
        (1, None) => Step::CreatePod,
        (1, Some(_)) if ended && left_off => Step::Observe,
        (1, Some(_)) if ended && !deleting => Step::DeletePod("the pod ended; replacing it"),
        (1, Some(_)) if misplaced && !deleting => {
            Step::DeletePod("the VM lives on another host; replacing its pod with one pinned there")
        }
        (0, Some(_)) if !deleting => Step::DeletePod("spec.replicas is 0: stopping the VM"),
        _ => Step::Observe,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    #[test]
    fn a_vm_that_should_run_and_has_no_pod_gets_one() {
        assert_eq!(next_step(&VmBuilder::new("web").build(), None), Step::CreatePod);
    }

    #[test]
    fn a_stopped_vm_without_a_pod_is_left_alone() {
        assert_eq!(next_step(&VmBuilder::new("web").stopped().build(), None), Step::Observe);
    }

    #[test]
    fn a_running_pod_is_observed_and_a_scale_to_zero_deletes_it() {
        let vm = VmBuilder::new("web").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").build();
        assert_eq!(next_step(&vm, Some(&pod)), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(next_step(&stopped, Some(&pod)), Step::DeletePod("spec.replicas is 0: stopping the VM"));
    }

    #[test]
    fn an_ended_pod_is_deleted_before_it_is_replaced() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        pod.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(next_step(&vm, Some(&pod)), Step::DeletePod("the pod ended; replacing it"));
    }

    #[test]
    fn a_pod_bound_to_a_host_that_does_not_hold_the_vm_is_replaced() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-b").build();
        pod.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "vm".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(PLACED_ELSEWHERE.into()),
                    ..ContainerStateWaiting::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]);
        assert!(matches!(next_step(&vm, Some(&pod)), Step::DeletePod(why) if why.contains("another host")));
    }

    #[test]
    fn a_vm_its_restart_policy_left_off_keeps_its_ended_pod_until_scaled_to_zero() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        let status = pod.status.as_mut().unwrap();
        status.phase = Some("Succeeded".into());
        status.reason = Some("GuestPoweredOff".into());
        assert_eq!(next_step(&vm, Some(&pod)), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(next_step(&stopped, Some(&pod)), Step::DeletePod("spec.replicas is 0: stopping the VM"));
    }

    #[test]
    fn a_terminating_pod_is_never_replaced_while_it_terminates() {
        let vm = VmBuilder::new("web").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").deleting().build();
        assert_eq!(next_step(&vm, Some(&pod)), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(next_step(&stopped, Some(&pod)), Step::Observe);
    }
}
