//! Resize: the VM follows its pod's size.
//!
//! The controller resizes a VM's pod in place (`pods/resize`) when
//! `spec.resources` changes; the pod's container limits are then the size the
//! VM should have, and the agent, as the kubelet of the virtual node, applies
//! it: live (vCPU hot-plug, memory balloon) where the VM's resize policy and
//! its ceilings allow, else in the definition for the next start
//! (`ResourcesSynced=False`, reason `RestartRequired`). What it decided shows
//! on the pod the way Kubernetes shows a container resize: the conditions
//! `PodResizePending` (reasons `Infeasible`, `Deferred`) and
//! `PodResizeInProgress` (reason `Error`), and the container status's
//! `resources` and `allocatedResources` (the size the VM runs with), plus
//! vmlet's condition [`RESOURCES_SYNCED`], which the controller mirrors into
//! the VirtualMachine. See KEP-1287 (in-place pod resize).

use crate::quantity::{format_bytes, format_millicores};
use crate::v1alpha1::ResizePolicy;
use k8s_openapi::api::core::v1::{PodCondition, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;
use vmlet_provider::{Resources, VmStatus};

/// Pod condition: whether the VM runs with the size its pod asks for.
pub const RESOURCES_SYNCED: &str = "vmlet.io/ResourcesSynced";
/// Kubernetes' pod condition for a resize the kubelet has not started.
pub const POD_RESIZE_PENDING: &str = "PodResizePending";
/// Kubernetes' pod condition for a resize being applied (or failed, reason
/// `Error`).
pub const POD_RESIZE_IN_PROGRESS: &str = "PodResizeInProgress";

/// Whether the host has room for a VM to grow, as the kubelet decides for a
/// pod resize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// The growth fits what the node has free (or it is no growth).
    Fits,
    /// The node has room in all but not now: other pods use it (reason
    /// `Deferred`; retried as pods come and go).
    Deferred(String),
    /// More than the node has at all (reason `Infeasible`).
    Infeasible(String),
}

/// What to do about a VM's size ([`plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The VM has the wanted size now and at its next start.
    InSync,
    /// Hot-plug now (and in the definition).
    Live,
    /// Change the definition only; `restart_required` when the running VM
    /// keeps another size until its next start.
    NextStart {
        /// The running VM differs from the wanted size.
        restart_required: bool,
    },
    /// Not now: `(reason, message)`, reason `Infeasible` or `Deferred`.
    Pending(&'static str, String),
}

/// What to do so that a running VM reported as `status` gets `wanted` (its
/// pod's size), given its resize policy, whether the provider can resize live
/// at all, and whether the node fits the growth.
///
/// - The VM has `wanted` now and at its next start → [`Plan::InSync`].
/// - It has `wanted` now but its definition says otherwise (an earlier resize
///   waiting for a restart, undone) → the definition is put back, no restart.
/// - The growth does not fit the node → [`Plan::Pending`], as Kubernetes does.
/// - `Restart` → the definition, restart required.
/// - Within the ceilings the VM was defined with, and the provider resizes
///   live → [`Plan::Live`].
/// - Beyond them: `Live` → infeasible (the message says how to get there);
///   `LiveOrRestart` → the definition, restart required.
pub fn plan(wanted: Resources, policy: ResizePolicy, can_live: bool, status: &VmStatus, fit: Fit) -> Plan {
    let now = Resources { cpus: status.cpus, memory_bytes: status.memory_bytes };
    let next = status.next_start.unwrap_or(now);
    if now == wanted {
        return if next == wanted { Plan::InSync } else { Plan::NextStart { restart_required: false } };
    }
    match fit {
        Fit::Fits => {}
        Fit::Deferred(message) => return Plan::Pending("Deferred", message),
        Fit::Infeasible(message) => return Plan::Pending("Infeasible", message),
    }
    let within = wanted.cpus <= status.max_cpus && wanted.memory_bytes <= status.max_memory_bytes;
    match policy {
        ResizePolicy::Restart => Plan::NextStart { restart_required: true },
        _ if within && can_live => Plan::Live,
        ResizePolicy::Live => Plan::Pending(
            "Infeasible",
            if can_live {
                format!(
                    "{} vCPUs and {} exceed the ceilings the VM was defined with ({} vCPUs, {}); resizePolicy Live \
                     cannot apply it: raise spec.resources.maxCpu/maxMemory and restart the VM, or use resizePolicy \
                     LiveOrRestart",
                    wanted.cpus,
                    format_bytes(wanted.memory_bytes),
                    status.max_cpus,
                    format_bytes(status.max_memory_bytes)
                )
            } else {
                "this backend cannot resize a running VM; use resizePolicy LiveOrRestart or Restart".to_owned()
            },
        ),
        ResizePolicy::LiveOrRestart => Plan::NextStart { restart_required: true },
    }
}

/// Whether a VM growing from `now` to `wanted` fits a node that can allocate
/// `allocatable` and whose other pods request `others` in all (cpu in
/// millicores, memory in bytes).
pub fn fit(now: Resources, wanted: Resources, allocatable: (u64, u64), others: (u64, u64)) -> Fit {
    let (cpu_total, memory_total) = allocatable;
    let (cpu_used, memory_used) = others;
    let wanted_milli = u64::from(wanted.cpus) * 1000;
    if wanted_milli > cpu_total || wanted.memory_bytes > memory_total {
        return Fit::Infeasible(format!(
            "{} vCPUs and {} exceed what the node can allocate at all ({} CPU, {})",
            wanted.cpus,
            format_bytes(wanted.memory_bytes),
            format_millicores(cpu_total),
            format_bytes(memory_total)
        ));
    }
    let grows = wanted.cpus > now.cpus || wanted.memory_bytes > now.memory_bytes;
    if grows && (cpu_used + wanted_milli > cpu_total || memory_used + wanted.memory_bytes > memory_total) {
        return Fit::Deferred(format!(
            "the node has {} CPU and {} free beside its other pods; the VM needs {} vCPUs and {}",
            format_millicores(cpu_total.saturating_sub(cpu_used)),
            format_bytes(memory_total.saturating_sub(memory_used)),
            wanted.cpus,
            format_bytes(wanted.memory_bytes)
        ));
    }
    Fit::Fits
}

/// What the pod shows about its resize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shown {
    /// The VM has its pod's size.
    Synced,
    /// The definition has it; the running VM gets it at its next start.
    RestartRequired(String),
    /// Not applied (`PodResizePending` with the reason).
    Pending(&'static str, String),
    /// Applying failed (`PodResizeInProgress`, reason `Error`).
    Failed(String),
}

/// `status` with the resize shown: the container's `resources` and
/// `allocatedResources` from what the VM runs with (`running`), and the
/// conditions [`RESOURCES_SYNCED`], [`POD_RESIZE_PENDING`] and
/// [`POD_RESIZE_IN_PROGRESS`] as `shown` says (the latter two removed when
/// they no longer apply, as the kubelet does).
pub fn show(mut status: PodStatus, running: Resources, shown: &Shown) -> PodStatus {
    let amounts = BTreeMap::from([
        ("cpu".to_owned(), Quantity(format_millicores(u64::from(running.cpus) * 1000))),
        ("memory".to_owned(), Quantity(format_bytes(running.memory_bytes))),
    ]);
    for container in status.container_statuses.iter_mut().flatten() {
        container.allocated_resources = Some(amounts.clone());
        container.resources = Some(ResourceRequirements {
            requests: Some(amounts.clone()),
            limits: Some(amounts.clone()),
            ..ResourceRequirements::default()
        });
    }
    let conditions = status.conditions.get_or_insert_with(Vec::new);
    conditions.retain(|c| c.type_ != POD_RESIZE_PENDING && c.type_ != POD_RESIZE_IN_PROGRESS);
    let (synced, reason, message) = match shown {
        Shown::Synced => (true, "Synced", "the VM runs with the size its pod asks for".to_owned()),
        Shown::RestartRequired(message) => (false, "RestartRequired", message.clone()),
        Shown::Pending(reason, message) => {
            conditions.push(condition(POD_RESIZE_PENDING, true, reason, message));
            (false, *reason, message.clone())
        }
        Shown::Failed(message) => {
            conditions.push(condition(POD_RESIZE_IN_PROGRESS, true, "Error", message));
            (false, "ResizeFailed", message.clone())
        }
    };
    let new = condition(RESOURCES_SYNCED, synced, reason, &message);
    match conditions.iter_mut().find(|c| c.type_ == RESOURCES_SYNCED) {
        Some(old) if old.status == new.status && old.reason == new.reason && old.message == new.message => {}
        Some(old) => *old = new,
        None => conditions.push(new),
    }
    status
}

fn condition(type_: &str, status: bool, reason: &str, message: &str) -> PodCondition {
    PodCondition {
        type_: type_.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_transition_time: Some(Time(Timestamp::now())),
        ..PodCondition::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::{PowerState, VmId};

    const MIB: u64 = 1024 * 1024;

    fn size(cpus: u32, mib: u64) -> Resources {
        Resources { cpus, memory_bytes: mib * MIB }
    }

    /// A running VM of `now`, defined with ceilings `max`.
    fn running(now: Resources, max: Resources) -> VmStatus {
        VmStatus {
            id: VmId("u1".into()),
            backend_name: "default_web".into(),
            backend_id: "b1".into(),
            power: PowerState::Running,
            stop_reason: None,
            fault: None,
            cpus: now.cpus,
            memory_bytes: now.memory_bytes,
            max_cpus: max.cpus,
            max_memory_bytes: max.memory_bytes,
            next_start: None,
            addresses: vec![],
            network_interfaces: 0,
        }
    }

    #[test]
    fn a_vm_of_its_pods_size_is_in_sync() {
        let vm = running(size(1, 256), size(2, 512));
        assert_eq!(plan(size(1, 256), ResizePolicy::LiveOrRestart, true, &vm, Fit::Fits), Plan::InSync);
    }

    #[test]
    fn growth_within_the_ceilings_is_hot_plugged() {
        let vm = running(size(1, 256), size(2, 512));
        assert_eq!(plan(size(2, 384), ResizePolicy::LiveOrRestart, true, &vm, Fit::Fits), Plan::Live);
        assert_eq!(plan(size(2, 384), ResizePolicy::Live, true, &vm, Fit::Fits), Plan::Live);
    }

    #[test]
    fn growth_beyond_the_ceilings_waits_for_a_restart_or_is_infeasible_under_live() {
        let vm = running(size(1, 256), size(2, 512));
        assert_eq!(
            plan(size(3, 256), ResizePolicy::LiveOrRestart, true, &vm, Fit::Fits),
            Plan::NextStart { restart_required: true }
        );
        let Plan::Pending(reason, message) = plan(size(3, 256), ResizePolicy::Live, true, &vm, Fit::Fits) else {
            panic!("Live beyond the ceilings must not apply");
        };
        assert_eq!(reason, "Infeasible");
        assert!(message.contains("maxCpu"), "{message}");
    }

    #[test]
    fn the_restart_policy_never_hot_plugs() {
        let vm = running(size(1, 256), size(2, 512));
        assert_eq!(
            plan(size(2, 256), ResizePolicy::Restart, true, &vm, Fit::Fits),
            Plan::NextStart { restart_required: true }
        );
    }

    #[test]
    fn a_backend_that_cannot_resize_live_defers_to_the_next_start() {
        let vm = running(size(1, 256), size(2, 512));
        assert_eq!(
            plan(size(2, 256), ResizePolicy::LiveOrRestart, false, &vm, Fit::Fits),
            Plan::NextStart { restart_required: true }
        );
    }

    #[test]
    fn a_resize_undone_before_the_restart_puts_the_definition_back_without_one() {
        let mut vm = running(size(1, 256), size(1, 256));
        vm.next_start = Some(size(4, 256));
        assert_eq!(
            plan(size(1, 256), ResizePolicy::LiveOrRestart, true, &vm, Fit::Fits),
            Plan::NextStart { restart_required: false }
        );
    }

    #[test]
    fn growth_the_node_cannot_hold_is_pending_as_kubernetes_reports_it() {
        let vm = running(size(1, 256), size(8, 4096));
        let too_big = fit(size(1, 256), size(8, 256), (4000, 8192 * MIB), (0, 0));
        assert!(matches!(too_big, Fit::Infeasible(_)), "{too_big:?}");
        let busy = fit(size(1, 256), size(3, 256), (4000, 8192 * MIB), (2000, 0));
        let Fit::Deferred(message) = busy.clone() else { panic!("3 vCPUs beside 2 used of 4 must wait: {busy:?}") };
        assert!(message.contains("2 CPU"), "{message}");
        assert_eq!(
            plan(size(3, 256), ResizePolicy::LiveOrRestart, true, &vm, busy),
            Plan::Pending("Deferred", message)
        );
        assert_eq!(fit(size(2, 512), size(1, 256), (4000, 8192 * MIB), (3500, 0)), Fit::Fits, "shrinking always fits");
    }

    #[test]
    fn the_pod_shows_the_running_size_and_one_condition_per_state() {
        let base = PodStatus { container_statuses: Some(vec![Default::default()]), ..PodStatus::default() };
        let pending = show(base.clone(), size(1, 256), &Shown::Pending("Infeasible", "too big".into()));
        let conditions = pending.conditions.as_ref().unwrap();
        let types: Vec<(&str, &str)> = conditions.iter().map(|c| (c.type_.as_str(), c.status.as_str())).collect();
        assert_eq!(types, [(POD_RESIZE_PENDING, "True"), (RESOURCES_SYNCED, "False")]);
        let container = &pending.container_statuses.as_ref().unwrap()[0];
        assert_eq!(container.resources.as_ref().unwrap().limits.as_ref().unwrap()["memory"].0, "256Mi");
        assert_eq!(container.allocated_resources.as_ref().unwrap()["cpu"].0, "1");

        let synced = show(pending, size(2, 384), &Shown::Synced);
        let types: Vec<(&str, &str)> =
            synced.conditions.as_ref().unwrap().iter().map(|c| (c.type_.as_str(), c.status.as_str())).collect();
        assert_eq!(types, [(RESOURCES_SYNCED, "True")], "the pending condition is gone");
        let container = &synced.container_statuses.as_ref().unwrap()[0];
        assert_eq!(container.allocated_resources.as_ref().unwrap()["cpu"].0, "2");
    }
}
