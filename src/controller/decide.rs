//! What the controller does next for a VM, decided from the VM and its current
//! pod alone (pure; the caller reads both and carries the step out).

use crate::node::restart::LEFT_OFF_REASONS;
use crate::node::PLACED_ELSEWHERE;
use crate::v1alpha1::{EvictionStrategy, MigrationPhase, VirtualMachine};
use crate::vmpod::{resize_needed, ResizeNeeded};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// The controller's next step for one live (not deleted) VirtualMachine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Name a new pod in `status.podName`, then create it.
    CreatePod,
    /// Delete the current pod, for the reason given (shown in an Event).
    DeletePod(&'static str),
    /// Resize the current pod in place to the VM's size (`pods/resize`),
    /// and/or bring its ceiling and resize-policy annotations up to date.
    ResizePod(ResizeNeeded),
    /// The current pod was evicted and the VM moves: name a target pod in
    /// `status.migration`, then create it (kept off the source host).
    StartMigration,
    /// End the active migration before it moved anything, for the reason
    /// given: delete its target pod, record it as Cancelled.
    CancelMigration(&'static str),
    /// Nothing to change: mirror the current pod into the VM's status.
    Observe,
}

/// What the controller knows of a VM's active migration beside the VM.
#[derive(Debug, Clone, Copy, Default)]
pub struct MigrationView<'a> {
    /// The target pod `status.migration.targetPod` names, if it exists.
    pub target: Option<&'a Pod>,
    /// Whether the source host's Node is schedulable again (not cordoned);
    /// `None` when not read (only needed while the target pod waits).
    pub source_schedulable: Option<bool>,
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
/// - replicas 1, a live pod whose size, ceilings or resize policy differ
///   from the VM's → [`Step::ResizePod`] (its agent applies the new size);
/// - replicas 0, a pod not yet being deleted → delete it (the agent stops the VM);
/// - otherwise (the pod runs, or is already terminating) → [`Step::Observe`]:
///   a terminating pod is never replaced before it is gone, so a VM never
///   gets a second pod while its agent still acts on the first.
pub fn next_step(vm: &VirtualMachine, current: Option<&Pod>, migration: MigrationView<'_>) -> Step {
    if let Some(step) = migration_step(vm, current, migration) {
        return step;
    }
    let deleting = current.is_some_and(|p| p.metadata.deletion_timestamp.is_some());
    let ended = current
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Failed" || phase == "Succeeded");
    let misplaced =
        current.and_then(crate::vmpod::waiting_reason).is_some_and(|(reason, _)| reason == PLACED_ELSEWHERE);
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
        (1, Some(pod)) if !deleting && !ended => match resize_needed(vm, pod) {
            Some(needed) => Step::ResizePod(needed),
            None => Step::Observe,
        },
        (0, Some(_)) if !deleting => Step::DeletePod("spec.replicas is 0: stopping the VM"),
        _ => Step::Observe,
    }
}

/// The step a migration asks for, if any: migration through scheduling
/// (see ARCHITECTURE.md, Migration).
///
/// - The current pod was evicted (DisruptionTarget) and is terminating, the
///   VM still wants to run and may migrate (`evictionStrategy` not `None`),
///   and no migration is under way → [`Step::StartMigration`]; unless the
///   last migration away from this very pod was cancelled (its host became
///   schedulable again): then the pod is replaced by one on the same host
///   ([`Step::CreatePod`], pinned by the placement record), which takes the
///   running VM over, and the evicted pod's deletion completes.
/// - A migration is under way and its target pod is gone or ended → start
///   again (the pod still needs to go) or cancel (it no longer does).
/// - Its target pod still waits for the scheduler and the source host is
///   schedulable again (`kubectl uncordon`) → cancel.
/// - The VM was scaled to 0 meanwhile → cancel (its pod's agent then stops it).
fn migration_step(vm: &VirtualMachine, current: Option<&Pod>, view: MigrationView<'_>) -> Option<Step> {
    let last = vm.status.as_ref().and_then(|s| s.migration.as_ref());
    let evicted_held = vm.spec.replicas == 1
        && vm.spec.eviction_strategy != EvictionStrategy::None
        && current.is_some_and(|p| p.metadata.deletion_timestamp.is_some() && was_evicted(p));
    match last.filter(|m| m.is_active()) {
        Some(active) => {
            let target_live = view.target.is_some_and(|p| {
                let ended = matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
                p.metadata.deletion_timestamp.is_none() && !ended
            });
            let unbound = view.target.is_some_and(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none());
            if vm.spec.replicas == 0 {
                Some(Step::CancelMigration("spec.replicas is 0: the VM stops where it is"))
            } else if !target_live && evicted_held {
                Some(Step::StartMigration)
            } else if !target_live {
                Some(Step::CancelMigration("its target pod is gone and its evicted pod no longer needs to go"))
            } else if active.phase == MigrationPhase::Pending && unbound && view.source_schedulable == Some(true) {
                Some(Step::CancelMigration("the source host is schedulable again (uncordoned) before the move started"))
            } else {
                Some(Step::Observe)
            }
        }
        None if evicted_held => {
            let cancelled_here = last.is_some_and(|m| {
                m.phase == MigrationPhase::Cancelled && current.is_some_and(|p| p.name_any() == m.source_pod)
            });
            Some(if cancelled_here { Step::CreatePod } else { Step::StartMigration })
        }
        None => None,
    }
}

/// The pod carries the DisruptionTarget condition (an eviction, or the
/// taint manager) with status True.
pub fn was_evicted(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "DisruptionTarget" && c.status == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    fn view<'a>(target: Option<&'a Pod>, source_schedulable: Option<bool>) -> MigrationView<'a> {
        MigrationView { target, source_schedulable }
    }

    #[test]
    fn an_evicted_pod_of_a_vm_that_still_runs_starts_a_migration() {
        let vm = VmBuilder::new("web").pod_name("web-aaaaa").build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        assert_eq!(next_step(&vm, Some(&evicted), view(None, None)), Step::StartMigration);
    }

    #[test]
    fn an_evicted_pod_of_a_vm_that_may_not_migrate_is_only_observed_while_its_agent_stops_the_vm() {
        let vm = VmBuilder::new("web").pod_name("web-aaaaa").eviction_strategy(EvictionStrategy::None).build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        assert_eq!(next_step(&vm, Some(&evicted), view(None, None)), Step::Observe);
    }

    #[test]
    fn a_migration_under_way_keeps_the_evicted_pod_beside_its_target_pod() {
        let vm = VmBuilder::new("web")
            .pod_name("web-aaaaa")
            .migrating("host-a", "web-aaaaa", "web-bbbbb", MigrationPhase::Running)
            .build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        let target = PodBuilder::for_vm(&vm).named("web-bbbbb").on_node("host-b").build();
        assert_eq!(next_step(&vm, Some(&evicted), view(Some(&target), Some(true))), Step::Observe);
    }

    #[test]
    fn uncordoning_the_source_before_the_target_pod_is_placed_cancels_the_migration() {
        let vm = VmBuilder::new("web")
            .pod_name("web-aaaaa")
            .migrating("host-a", "web-aaaaa", "web-bbbbb", MigrationPhase::Pending)
            .build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        let waiting = PodBuilder::for_vm(&vm).named("web-bbbbb").unschedulable("0/2 nodes are available").build();
        assert_eq!(next_step(&vm, Some(&evicted), view(Some(&waiting), Some(false))), Step::Observe);
        assert!(matches!(next_step(&vm, Some(&evicted), view(Some(&waiting), Some(true))), Step::CancelMigration(_)));
        // Once placed, uncordoning no longer stops it.
        let placed = PodBuilder::for_vm(&vm).named("web-bbbbb").on_node("host-b").build();
        assert_eq!(next_step(&vm, Some(&evicted), view(Some(&placed), Some(true))), Step::Observe);
    }

    #[test]
    fn after_a_cancelled_migration_the_evicted_pod_is_replaced_on_its_own_host() {
        let vm = VmBuilder::new("web")
            .pod_name("web-aaaaa")
            .migrating("host-a", "web-aaaaa", "web-bbbbb", MigrationPhase::Cancelled)
            .build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        assert_eq!(next_step(&vm, Some(&evicted), view(None, None)), Step::CreatePod);
    }

    #[test]
    fn a_lost_target_pod_is_made_again_and_a_scale_to_zero_cancels() {
        let vm = VmBuilder::new("web")
            .pod_name("web-aaaaa")
            .migrating("host-a", "web-aaaaa", "web-bbbbb", MigrationPhase::Failed)
            .build();
        let evicted = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").evicted().build();
        assert_eq!(next_step(&vm, Some(&evicted), view(None, None)), Step::StartMigration);
        let mut stopped = vm.clone();
        stopped.spec.replicas = 0;
        let target = PodBuilder::for_vm(&vm).named("web-bbbbb").on_node("host-b").build();
        assert!(matches!(next_step(&stopped, Some(&evicted), view(Some(&target), None)), Step::CancelMigration(_)));
    }

    #[test]
    fn a_vm_whose_size_changed_has_its_running_pod_resized_not_replaced() {
        let vm = VmBuilder::new("web").cpu(1).memory("256Mi").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").build();
        assert_eq!(next_step(&vm, Some(&pod), MigrationView::default()), Step::Observe);
        let mut bigger = vm.clone();
        bigger.spec.resources.cpu = 2;
        assert_eq!(
            next_step(&bigger, Some(&pod), MigrationView::default()),
            Step::ResizePod(ResizeNeeded { resources: true, annotations: false })
        );
        let mut ceiling = vm.clone();
        ceiling.spec.resources.max_cpu = Some(4);
        assert_eq!(
            next_step(&ceiling, Some(&pod), MigrationView::default()),
            Step::ResizePod(ResizeNeeded { resources: false, annotations: true })
        );
    }

    #[test]
    fn the_same_size_written_another_way_is_no_resize() {
        let vm = VmBuilder::new("web").cpu(1).memory("1Gi").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").build();
        let limits = pod.spec.as_mut().unwrap().containers[0].resources.as_mut().unwrap().limits.as_mut().unwrap();
        limits.insert("cpu".into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("1000m".into()));
        limits.insert("memory".into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("1024Mi".into()));
        assert_eq!(next_step(&vm, Some(&pod), MigrationView::default()), Step::Observe);
    }

    #[test]
    fn a_terminating_pod_is_not_resized() {
        let vm = VmBuilder::new("web").cpu(1).build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.7").deleting().build();
        let mut bigger = vm.clone();
        bigger.spec.resources.cpu = 2;
        assert_eq!(next_step(&bigger, Some(&pod), MigrationView::default()), Step::Observe);
    }

    #[test]
    fn a_vm_that_should_run_and_has_no_pod_gets_one() {
        assert_eq!(next_step(&VmBuilder::new("web").build(), None, MigrationView::default()), Step::CreatePod);
    }

    #[test]
    fn a_stopped_vm_without_a_pod_is_left_alone() {
        assert_eq!(next_step(&VmBuilder::new("web").stopped().build(), None, MigrationView::default()), Step::Observe);
    }

    #[test]
    fn a_running_pod_is_observed_and_a_scale_to_zero_deletes_it() {
        let vm = VmBuilder::new("web").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").build();
        assert_eq!(next_step(&vm, Some(&pod), MigrationView::default()), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(
            next_step(&stopped, Some(&pod), MigrationView::default()),
            Step::DeletePod("spec.replicas is 0: stopping the VM")
        );
    }

    #[test]
    fn an_ended_pod_is_deleted_before_it_is_replaced() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        pod.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(
            next_step(&vm, Some(&pod), MigrationView::default()),
            Step::DeletePod("the pod ended; replacing it")
        );
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
        assert!(
            matches!(next_step(&vm, Some(&pod), MigrationView::default()), Step::DeletePod(why) if why.contains("another host"))
        );
    }

    #[test]
    fn a_vm_its_restart_policy_left_off_keeps_its_ended_pod_until_scaled_to_zero() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        let status = pod.status.as_mut().unwrap();
        status.phase = Some("Succeeded".into());
        status.reason = Some("GuestPoweredOff".into());
        assert_eq!(next_step(&vm, Some(&pod), MigrationView::default()), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(
            next_step(&stopped, Some(&pod), MigrationView::default()),
            Step::DeletePod("spec.replicas is 0: stopping the VM")
        );
    }

    #[test]
    fn a_terminating_pod_is_never_replaced_while_it_terminates() {
        let vm = VmBuilder::new("web").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").deleting().build();
        assert_eq!(next_step(&vm, Some(&pod), MigrationView::default()), Step::Observe);
        let stopped = VmBuilder::new("web").stopped().build();
        assert_eq!(next_step(&stopped, Some(&pod), MigrationView::default()), Step::Observe);
    }
}
