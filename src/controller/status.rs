//! VirtualMachine status derived from the VM and its pod (pure functions).

use crate::conditions::set_condition;
use crate::node::resize::RESOURCES_SYNCED;
use crate::v1alpha1::{CurrentResources, MigrationPhase, VirtualMachine, VirtualMachineStatus, VmPhase, VM_LABEL};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;

/// The size the VM runs with (the container status's `resources`, written by
/// its agent) as `status.currentResources`, and the pod's
/// [`RESOURCES_SYNCED`] condition as the VM's `ResourcesSynced`; both kept
/// from the previous status while the agent has not reported them. While the
/// pod does not have the VM's size yet, `ResourcesSynced` is False with reason
/// `Resizing`, or keeps the controller's `Infeasible` (the API server refused
/// the pod's resize).
fn mirror_resize(
    status: &mut VirtualMachineStatus,
    vm: &VirtualMachine,
    pod: Option<&Pod>,
    container: Option<&ContainerStatus>,
    pod_conditions: &[PodCondition],
    generation: Option<i64>,
) {
    let limits = container.and_then(|c| c.resources.as_ref()).and_then(|r| r.limits.as_ref());
    let cpu = limits.and_then(|l| l.get("cpu")).and_then(|q| crate::quantity::parse_millicores(&q.0).ok());
    let memory = limits.and_then(|l| l.get("memory")).and_then(|q| crate::quantity::parse_bytes(&q.0).ok());
    if let (Some(millicores), Some(bytes)) = (cpu, memory) {
        status.current_resources = Some(CurrentResources {
            cpu: i32::try_from(millicores.div_ceil(1000)).unwrap_or(i32::MAX),
            memory: crate::quantity::format_bytes(bytes),
        });
    } else {
        status.current_resources = vm.status.as_ref().and_then(|s| s.current_resources.clone());
    }
    if pod.is_some_and(|p| crate::vmpod::resize_needed(vm, p).is_some_and(|n| n.resources)) {
        // The pod does not have the VM's size yet: the resize was refused
        // (the controller's Infeasible condition stays) or is on its way.
        let refused = status.conditions.iter().any(|c| c.type_ == "ResourcesSynced" && c.reason == "Infeasible");
        if !refused {
            let message = "the VM's pod is being resized to spec.resources";
            set_condition(&mut status.conditions, condition("ResourcesSynced", false, "Resizing", message, generation));
        }
    } else if let Some(synced) = pod_condition(pod_conditions, RESOURCES_SYNCED) {
        set_condition(
            &mut status.conditions,
            condition(
                "ResourcesSynced",
                synced.status == "True",
                synced.reason.as_deref().unwrap_or("Synced"),
                synced.message.as_deref().unwrap_or_default(),
                generation,
            ),
        );
    }
}

/// The `Migrating` condition from `status.migration`: True while the target
/// pod waits or the move runs, False with the reason and message once the
/// last attempt failed (the target agent tries again), succeeded or was
/// cancelled; absent for a VM that never migrated.
fn mirror_migration(status: &mut VirtualMachineStatus, generation: Option<i64>) {
    let Some(migration) = status.migration.clone() else { return };
    let target = migration.target_node.as_deref().unwrap_or("a host the scheduler picks");
    let (active, reason, message) = match migration.phase {
        MigrationPhase::Pending => {
            (true, "WaitingForTarget", format!("pod {} waits for the scheduler", migration.target_pod))
        }
        MigrationPhase::Running => (
            true,
            "Moving",
            format!(
                "moving {} from {} to {target}",
                migration.mode.as_deref().unwrap_or("live"),
                migration.source_node
            ),
        ),
        MigrationPhase::Failed => (false, "MigrationFailed", migration.message.clone().unwrap_or_default()),
        MigrationPhase::Succeeded => (false, "Migrated", format!("moved from {} to {target}", migration.source_node)),
        MigrationPhase::Cancelled => (false, "MigrationCancelled", migration.message.clone().unwrap_or_default()),
    };
    set_condition(&mut status.conditions, condition("Migrating", active, reason, &message, generation));
}

/// `status` with its `Migrating` condition False, reason
/// `TargetUnschedulable` and the scheduler's message, when the VM's
/// migration waits for its target pod `target` and the scheduler marked
/// that pod unschedulable (`PodScheduled=False`); unchanged otherwise.
/// Returns the scheduler's message when it applied.
pub fn mark_unschedulable_target(
    status: &mut VirtualMachineStatus,
    target: Option<&Pod>,
    generation: Option<i64>,
) -> Option<String> {
    let waiting = status.migration.as_ref().is_some_and(|m| m.phase == MigrationPhase::Pending);
    let conditions = target?.status.as_ref()?.conditions.clone().unwrap_or_default();
    let refused = pod_condition(&conditions, "PodScheduled").filter(|c| c.status == "False")?;
    if !waiting {
        return None;
    }
    let target_pod = status.migration.as_ref().map(|m| m.target_pod.clone()).unwrap_or_default();
    let message = format!(
        "target pod {target_pod} has no host: {}; make room on another host, or relax what pins the VM \
         (spec.nodeSelector, affinity, tolerations, the PersistentVolumes' node affinity), or uncordon the \
         drained host to cancel the move",
        refused.message.as_deref().unwrap_or("the scheduler found none")
    );
    set_condition(&mut status.conditions, condition("Migrating", false, "TargetUnschedulable", &message, generation));
    Some(message)
}

/// The status a VM should have given its current pod (`None` when it has none,
/// or it is named but not created yet) and `designated`, the name of that pod
/// (`status.podName`; `None` once a stopped VM's pod is gone).
///
/// Keeps `nodeName` from the previous status while the VM has no pod: a stopped
/// VM's definition stays on that host and its next start goes back there.
pub fn status_from_pod(vm: &VirtualMachine, pod: Option<&Pod>, designated: Option<&str>) -> VirtualMachineStatus {
    let previous = vm.status.clone().unwrap_or_default();
    let generation = vm.metadata.generation;
    let mut status = VirtualMachineStatus {
        observed_generation: generation,
        selector: Some(format!("{VM_LABEL}={}", vm.name_any())),
        node_name: previous.placement.as_ref().map(|p| p.node_name.clone()).or(previous.node_name.clone()),
        provider_id: previous.provider_id.clone(),
        pod_name: designated.map(str::to_owned),
        placement: previous.placement.clone(),
        migration: previous.migration.clone(),
        current_resources: previous.current_resources.clone(),
        conditions: previous.conditions.clone(),
        ..VirtualMachineStatus::default()
    };

    let Some(pod) = pod else {
        status.phase = Some(if vm.spec.replicas == 0 { VmPhase::Stopped } else { VmPhase::Scheduling });
        let (reason, message) = if vm.spec.replicas == 0 {
            ("Stopped", "spec.replicas is 0".to_owned())
        } else {
            ("PodPending", "the VM's pod is being created".to_owned())
        };
        set_condition(&mut status.conditions, condition("Ready", false, reason, &message, generation));
        return status;
    };

    let pod_status = pod.status.clone().unwrap_or_default();
    let pod_conditions = pod_status.conditions.clone().unwrap_or_default();
    // A pod its node rejected (crate::node::admission) never ran the VM
    // there: its node is not the VM's.
    let rejected = matches!(pod_status.reason.as_deref(), Some("NodeAffinity" | "TaintToleration"));
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).filter(|_| !rejected);
    let ready = pod_condition(&pod_conditions, "Ready").is_some_and(|c| c.status == "True");
    let container = pod_status.container_statuses.as_ref().and_then(|c| c.first());

    status.replicas = 1;
    status.ready_replicas = i32::from(ready);
    if node.is_some() {
        status.node_name = node.clone();
    }
    if let Some(id) = container.and_then(|c| c.container_id.clone()) {
        status.provider_id = Some(id);
    }
    status.addresses = pod_status.pod_ips.iter().flatten().map(|ip| ip.ip.clone()).collect();
    mirror_resize(&mut status, vm, Some(pod), container, &pod_conditions, generation);

    let scheduled = pod_condition(&pod_conditions, "PodScheduled");
    let waiting = container.and_then(|c| c.state.as_ref()).and_then(|s| s.waiting.as_ref());
    // An evicted pod of a VM that should still run is held by its agent: the VM
    // keeps running, so say so rather than "Stopping".
    let evicted = pod_condition(&pod_conditions, "DisruptionTarget").is_some_and(|c| c.status == "True");
    let held = evicted && vm.spec.replicas == 1 && vm.metadata.deletion_timestamp.is_none();
    if held {
        set_condition(
            &mut status.conditions,
            condition(
                "EvictionHeld",
                true,
                "EvictionHeld",
                "the VM's pod was evicted (e.g. kubectl drain) and the VM still has replicas 1: it keeps running on \
                 its host until it has moved (status.migration; spec.evictionStrategy); scale it to 0 to stop it",
                generation,
            ),
        );
    } else {
        status.conditions.retain(|c| c.type_ != "EvictionHeld");
    }
    // Left off by its restart policy: stopped, with the reason and how to
    // start it again.
    let left_off = pod_status
        .reason
        .as_deref()
        .filter(|r| crate::node::restart::LEFT_OFF_REASONS.contains(r))
        .filter(|_| matches!(pod_status.phase.as_deref(), Some("Succeeded" | "Failed")));
    let phase = if let Some(reason) = left_off {
        let message = pod_status.message.clone().unwrap_or_default();
        set_condition(&mut status.conditions, condition("Ready", false, reason, &message, generation));
        VmPhase::Stopped
    } else if pod.metadata.deletion_timestamp.is_some() && !held {
        VmPhase::Stopping
    } else if node.is_none() {
        VmPhase::Scheduling
    } else {
        let faulted = waiting.is_some_and(|w| w.reason.as_deref() == Some(crate::node::pod_status::FAULTED));
        match pod_status.phase.as_deref() {
            Some("Running") if ready => VmPhase::Running,
            // Held by the hypervisor for an error: not starting, failed.
            Some("Running") if faulted => VmPhase::Failed,
            Some("Failed") => VmPhase::Failed,
            Some("Unknown") => VmPhase::Unknown,
            _ => VmPhase::Starting,
        }
    };
    let active = status.migration.as_ref().filter(|m| m.is_active()).cloned();
    let phase = if active.is_some() && phase != VmPhase::Stopped { VmPhase::Migrating } else { phase };
    status.phase = Some(phase);
    mirror_migration(&mut status, generation);

    match scheduled {
        Some(c) if c.status == "False" => set_condition(
            &mut status.conditions,
            condition(
                "Scheduled",
                false,
                c.reason.as_deref().unwrap_or("Unschedulable"),
                c.message.as_deref().unwrap_or("the scheduler found no host"),
                generation,
            ),
        ),
        _ if node.is_some() => set_condition(
            &mut status.conditions,
            condition(
                "Scheduled",
                true,
                "Scheduled",
                &format!("bound to host {}", node.as_deref().unwrap_or_default()),
                generation,
            ),
        ),
        _ => {}
    }

    let (reason, message) = match phase {
        VmPhase::Stopped => return status,
        VmPhase::Running => ("Running", "the VM runs and its pod is Ready".to_owned()),
        VmPhase::Stopping => ("Stopping", "the VM is shutting down".to_owned()),
        VmPhase::Scheduling => (
            "Unschedulable",
            scheduled.and_then(|c| c.message.clone()).unwrap_or_else(|| "waiting for the scheduler".into()),
        ),
        _ => match waiting {
            Some(w) => (
                w.reason.as_deref().unwrap_or("Starting"),
                w.message.clone().unwrap_or_else(|| "the VM is starting".into()),
            ),
            None => ("Starting", "the VM is starting".to_owned()),
        },
    };
    set_condition(&mut status.conditions, condition("Ready", ready, reason, &message, generation));
    // The host does not answer: the VM is shown as last known, with why.
    let silent = pod_condition(&pod_conditions, crate::failure::HOST_RESPONDING).filter(|c| c.status == "False");
    set_condition(
        &mut status.conditions,
        match silent {
            Some(c) => condition(
                "HostResponding",
                false,
                "HostNotResponding",
                c.message.as_deref().unwrap_or("the host does not answer"),
                generation,
            ),
            None => condition("HostResponding", true, "HostResponding", "the VM's host answers", generation),
        },
    );
    let provider_failed =
        waiting.filter(|w| matches!(w.reason.as_deref(), Some("ProviderFailed" | crate::node::pod_status::FAULTED)));
    set_condition(
        &mut status.conditions,
        match provider_failed {
            Some(w) => condition(
                "ProviderError",
                true,
                w.reason.as_deref().unwrap_or("ProviderFailed"),
                w.message.as_deref().unwrap_or_default(),
                generation,
            ),
            None => condition("ProviderError", false, "NoError", "the provider reports no error", generation),
        },
    );
    status
}

fn pod_condition<'a>(conditions: &'a [PodCondition], type_: &str) -> Option<&'a PodCondition> {
    conditions.iter().find(|c| c.type_ == type_)
}

fn condition(type_: &str, status: bool, reason: &str, message: &str, generation: Option<i64>) -> Condition {
    crate::conditions::new_condition(type_, status, reason, message, generation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    fn find<'a>(status: &'a VirtualMachineStatus, type_: &str) -> &'a Condition {
        status.conditions.iter().find(|c| c.type_ == type_).unwrap()
    }

    #[test]
    fn stopped_vm_without_pod_is_stopped_and_keeps_its_home_host() {
        let vm = VmBuilder::new("web").stopped().on_host("host-b").build();
        let status = status_from_pod(&vm, None, None);
        assert_eq!(status.phase, Some(VmPhase::Stopped));
        assert_eq!((status.replicas, status.ready_replicas), (0, 0));
        assert_eq!(status.node_name.as_deref(), Some("host-b"));
        assert_eq!(status.selector.as_deref(), Some("vmlet.io/vm=web"));
        assert_eq!(find(&status, "Ready").reason, "Stopped");
    }

    #[test]
    fn a_pod_its_node_rejected_does_not_give_the_vm_that_node() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-b").build();
        let status = pod.status.as_mut().unwrap();
        status.phase = Some("Failed".into());
        status.reason = Some("NodeAffinity".into());
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.node_name, None);
    }

    #[test]
    fn unschedulable_pod_puts_the_schedulers_message_in_the_status() {
        let vm = VmBuilder::new("big").cpu(512).build();
        let msg = "0/3 nodes are available: 3 Insufficient cpu.";
        let pod = PodBuilder::for_vm(&vm).unschedulable(msg).build();
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Scheduling));
        let scheduled = find(&status, "Scheduled");
        assert_eq!((scheduled.status.as_str(), scheduled.reason.as_str()), ("False", "Unschedulable"));
        assert_eq!(scheduled.message, msg);
        assert_eq!(find(&status, "Ready").message, msg);
    }

    #[test]
    fn running_ready_pod_makes_a_running_vm_with_its_node_and_ip() {
        let vm = VmBuilder::new("web").build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.10").build();
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Running));
        assert_eq!((status.replicas, status.ready_replicas), (1, 1));
        assert_eq!(status.node_name.as_deref(), Some("host-a"));
        assert_eq!(status.pod_name.as_deref(), Some("web-x7k2p"));
        assert_eq!(status.addresses, vec!["192.0.2.10".to_owned()]);
        assert_eq!(status.provider_id.as_deref(), Some("libvirt://0b5c3b3e-0000-4000-8000-00000000000a"));
        assert_eq!(find(&status, "Ready").status, "True");
        assert_eq!(status.observed_generation, Some(1));
    }

    #[test]
    fn a_provider_failure_becomes_the_provider_error_condition() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        pod.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "vm".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ProviderFailed".into()),
                    message: Some("define domain: no space left".into()),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]);
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        let error = find(&status, "ProviderError");
        assert_eq!((error.status.as_str(), error.message.as_str()), ("True", "define domain: no space left"));
        assert_eq!(find(&status, "Ready").reason, "ProviderFailed");
        let healthy = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").build();
        assert_eq!(find(&status_from_pod(&vm, Some(&healthy), Some("web-x7k2p")), "ProviderError").status, "False");
    }

    #[test]
    fn a_vm_its_hypervisor_holds_for_an_error_is_failed_not_starting() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.1").build();
        let pod_status = pod.status.as_mut().unwrap();
        pod_status.container_statuses = Some(vec![ContainerStatus {
            name: "vm".into(),
            ready: false,
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("Faulted".into()),
                    message: Some("the hypervisor stopped the guest: paused (watchdog)".into()),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]);
        for condition in pod_status.conditions.iter_mut().flatten().filter(|c| c.type_.ends_with("Ready")) {
            condition.status = "False".into();
        }
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Failed));
        let error = find(&status, "ProviderError");
        assert_eq!(
            (error.status.as_str(), error.reason.as_str(), error.message.as_str()),
            ("True", "Faulted", "the hypervisor stopped the guest: paused (watchdog)")
        );
        assert_eq!(find(&status, "Ready").reason, "Faulted");
    }

    #[test]
    fn an_evicted_pod_of_a_vm_that_should_run_is_held_not_stopping() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.10").deleting().build();
        pod.status.as_mut().unwrap().conditions.as_mut().unwrap().push(PodCondition {
            type_: "DisruptionTarget".into(),
            status: "True".into(),
            reason: Some("EvictionByEvictionAPI".into()),
            ..PodCondition::default()
        });
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Running));
        assert_eq!(find(&status, "EvictionHeld").status, "True");
        let stopped = VmBuilder::new("web").stopped().build();
        let status = status_from_pod(&stopped, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Stopping));
        assert!(!status.conditions.iter().any(|c| c.type_ == "EvictionHeld"));
    }

    #[test]
    fn a_vm_left_off_by_its_restart_policy_is_stopped_with_the_reason() {
        let vm = VmBuilder::new("web").build();
        let mut pod = PodBuilder::for_vm(&vm).on_node("host-a").build();
        let pod_status = pod.status.as_mut().unwrap();
        pod_status.phase = Some("Succeeded".into());
        pod_status.reason = Some("GuestPoweredOff".into());
        pod_status.message = Some("start it again with kubectl scale".into());
        let status = status_from_pod(&vm, Some(&pod), Some("web-x7k2p"));
        assert_eq!(status.phase, Some(VmPhase::Stopped));
        assert_eq!((status.replicas, status.ready_replicas), (1, 0));
        let ready = find(&status, "Ready");
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "GuestPoweredOff"));
        assert!(ready.message.contains("kubectl scale"));
    }

    #[test]
    fn deleting_pod_means_stopping() {
        let vm = VmBuilder::new("web").stopped().build();
        let pod = PodBuilder::for_vm(&vm).on_node("host-a").running("192.0.2.10").deleting().build();
        assert_eq!(status_from_pod(&vm, Some(&pod), Some("web-x7k2p")).phase, Some(VmPhase::Stopping));
    }

    #[test]
    fn an_unschedulable_migration_target_turns_migrating_false_with_the_schedulers_message() {
        use crate::testing::{PodBuilder, VmBuilder};
        let vm = VmBuilder::new("web")
            .pod_name("web-x7k2p")
            .migrating("host-a", "web-x7k2p", "web-2", MigrationPhase::Pending)
            .build();
        let target = PodBuilder::for_vm(&vm)
            .named("web-2")
            .unschedulable("0/1 nodes are available: 1 node(s) were unschedulable.")
            .build();
        let mut status = status_from_pod(&vm, None, Some("web-x7k2p"));
        let message = mark_unschedulable_target(&mut status, Some(&target), Some(1)).expect("marked");
        assert!(message.starts_with("target pod web-2 has no host: 0/1 nodes are available"), "{message}");
        let migrating = status.conditions.iter().find(|c| c.type_ == "Migrating").unwrap();
        assert_eq!((migrating.status.as_str(), migrating.reason.as_str()), ("False", "TargetUnschedulable"));
        let waiting = PodBuilder::for_vm(&vm).named("web-2").build();
        let mut untouched = status_from_pod(&vm, None, Some("web-x7k2p"));
        assert_eq!(mark_unschedulable_target(&mut untouched, Some(&waiting), Some(1)), None, "not tried yet");
        assert_eq!(mark_unschedulable_target(&mut untouched, None, Some(1)), None);
    }
}
