//! Scenario suite: the controller's and the agents' decisions
//! ([`crate::controller::decide::next_step`], [`super::decide::start_step`],
//! [`super::decide::stop_step`]) driving an in-memory back end
//! ([`memory::MemoryHost`]) through whole stories, without a cluster.
//!
//! A tick is one round of what runs concurrently in vmlet: the controller's
//! pass over the VirtualMachine, the scheduler binding new pods (it honours
//! the `kubernetes.io/hostname` pin and otherwise takes hosts in a preference
//! order the scenario sets), then one agent pass per pod that is due. Pods
//! are due after they change (the pod watch), after a failed pass (backoff),
//! and after a change of their VM on the host, which reaches the agent in
//! one of two ways, and every scenario runs under both:
//!
//! - [`Changes::Pushed`]: the back end reports the VMs that changed (as
//!   libvirt's lifecycle events or vSphere's WaitForUpdates would), and only
//!   their pods are due;
//! - [`Changes::Polled`]: nothing is reported (Nova); every pod is due every
//!   [`RESYNC_TICKS`] ticks, as the agent's periodic resync makes it.
//!
//! After every tick the suite checks what must never happen: a VM defined or
//! running on two hosts, two live pods of one VM, a VM defined on a host
//! other than the one its placement record names.
//!
//! What is modelled rather than run: the API server (objects in maps, writes
//! always win), identity (the pods are the VM's own; [`crate::identity`] has
//! its own tests) and the IO around each decision, which mirrors
//! [`super::pods`] step for step.

mod memory;

use super::decide::{start_step, stop_step, unwanted, OnHost, StartStep, StartView, StopStep, StopView};
use super::pod_status::{pod_status, same_pod_status, Observed};
use super::PLACED_ELSEWHERE;
use crate::controller::decide::{next_step, MigrationView, Step};
use crate::controller::status::status_from_pod;
use crate::failure::{self, PodEffect};
use crate::testing::VmBuilder;
use crate::v1alpha1::{Placement, RestartPolicy, VirtualMachine, VirtualMachineStatus};
use crate::vmpod::{new_pod_name, pod_for_vm, vm_from_pod, was_running};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use memory::MemoryHost;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use vmlet_provider::{Location, PowerState, Provider, StopReason, VmId};

/// How changes on a host reach its agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Changes {
    Pushed,
    Polled,
}

/// Ticks between two resyncs of every pod in polled mode.
const RESYNC_TICKS: u32 = 5;
/// A story that has not reached its goal after this many ticks is stuck.
const MAX_TICKS: u32 = 60;

struct World {
    changes: Changes,
    vm: VirtualMachine,
    pods: BTreeMap<String, Pod>,
    hosts: BTreeMap<String, MemoryHost>,
    /// The scheduler's choice among hosts the pod may go to.
    preference: Vec<String>,
    controller_up: bool,
    tick: u32,
    /// Pods due for an agent pass at the next tick.
    due: BTreeSet<String>,
    /// Pods whose guest was asked to shut down, and at which tick.
    shutdown_asked: BTreeMap<String, u32>,
    /// Whether the scenario allows a VM without a placement record on a host
    /// (the record was lost on purpose).
    record_may_be_missing: bool,
    /// What happens in the world while an agent's define runs (a slow back
    /// end), once: the race the agent's guarded placement write and its
    /// fresh reads before the power-on must catch.
    meanwhile: Option<fn(&mut World)>,
}

impl World {
    fn new(changes: Changes, vm: VirtualMachine) -> World {
        let hosts = ["host-a", "host-b", "host-c"].map(|h| (h.to_owned(), MemoryHost::new(h)));
        World {
            changes,
            vm,
            pods: BTreeMap::new(),
            hosts: hosts.into_iter().collect(),
            preference: vec!["host-a".into(), "host-b".into(), "host-c".into()],
            controller_up: true,
            tick: 0,
            due: BTreeSet::new(),
            shutdown_asked: BTreeMap::new(),
            record_may_be_missing: false,
            meanwhile: None,
        }
    }

    fn id(&self) -> VmId {
        VmId(self.vm.uid().expect("the VM has a UID"))
    }

    fn host(&self, name: &str) -> &MemoryHost {
        &self.hosts[name]
    }

    /// The VM's pod that is neither being deleted nor ended, if any.
    fn live_pod(&self) -> Option<&Pod> {
        let live: Vec<&Pod> = self.pods.values().filter(|p| is_live(p)).collect();
        assert!(live.len() <= 1, "tick {}: two live pods of one VM: {:?}", self.tick, names(&live));
        live.first().copied()
    }

    fn record(&self) -> Option<&str> {
        self.vm.status.as_ref().and_then(|s| s.placement.as_ref()).map(|p| p.node_name.as_str())
    }

    /// Hosts that hold the VM, and those where it is active.
    fn holders(&self) -> (Vec<&str>, Vec<&str>) {
        let id = self.id();
        let defined: Vec<&str> =
            self.hosts.iter().filter(|(_, h)| h.peek(&id).is_some()).map(|(n, _)| n.as_str()).collect();
        let active = defined.iter().copied().filter(|n| self.host(n).peek(&id).unwrap().power.is_active()).collect();
        (defined, active)
    }

    fn check_invariants(&self) {
        let (defined, active) = self.holders();
        assert!(defined.len() <= 1, "tick {}: VM defined on {defined:?}", self.tick);
        assert!(active.len() <= 1, "tick {}: VM running on {active:?}", self.tick);
        self.live_pod();
        if let (Some(host), record) = (defined.first(), self.record()) {
            if !(record.is_none() && self.record_may_be_missing) {
                assert_eq!(record, Some(*host), "tick {}: VM on {host} but recorded on {record:?}", self.tick);
            }
        }
    }

    /// Run ticks until `done` holds (checked after each tick); the number of
    /// ticks it took.
    async fn run_until(&mut self, what: &str, done: impl Fn(&World) -> bool) -> u32 {
        let start = self.tick;
        while !done(self) {
            assert!(
                self.tick - start < MAX_TICKS,
                "{:?}: not {what} after {MAX_TICKS} ticks; pods: {:#?}",
                self.changes,
                self.pods
            );
            self.step().await;
            self.check_invariants();
        }
        self.tick - start
    }

    async fn step(&mut self) {
        self.tick += 1;
        if self.controller_up {
            self.controller_pass();
        }
        self.schedule();
        let changed: Vec<VmId> = self.hosts.values().flat_map(|h| h.take_changes()).collect();
        let bound: Vec<String> =
            self.pods.iter().filter(|(_, p)| node_of(p).is_some()).map(|(n, _)| n.clone()).collect();
        match self.changes {
            Changes::Pushed => {
                let id = self.id();
                if changed.contains(&id) {
                    self.due.extend(bound);
                }
            }
            Changes::Polled if self.tick.is_multiple_of(RESYNC_TICKS) => self.due.extend(bound),
            Changes::Polled => {}
        }
        for name in std::mem::take(&mut self.due) {
            self.agent_pass(&name).await;
        }
    }

    /// The controller's pass, carried out as [`crate::controller`] does.
    fn controller_pass(&mut self) {
        let designated = self.vm.status.as_ref().and_then(|s| s.pod_name.clone());
        let current = designated.as_ref().and_then(|n| self.pods.get(n)).cloned();
        match next_step(&self.vm, current.as_ref(), MigrationView::default()) {
            Step::CreatePod => {
                let name = new_pod_name(&self.vm.name_any());
                let status = self.vm.status.get_or_insert_with(VirtualMachineStatus::default);
                let home = status.placement.as_ref().map(|p| p.node_name.clone()).or(status.node_name.clone());
                status.pod_name = Some(name.clone());
                let mut pod = pod_for_vm(&self.vm, &name, "AllNamespaces", home.as_deref()).expect("a valid VM");
                pod.metadata.uid = Some(format!("uid-{name}"));
                self.pods.insert(name, pod);
            }
            Step::DeletePod(_) => {
                let pod = current.expect("deleting means a current pod");
                self.delete_pod(&pod.name_any());
            }
            Step::Observe => {
                let status = status_from_pod(&self.vm, current.as_ref(), designated.as_deref());
                self.vm.status = Some(status);
            }
            other => panic!("step {other:?} is outside these scenarios"),
        }
    }

    /// Bind pods that wait for a node: the pinned host, else the first host
    /// in the preference order.
    fn schedule(&mut self) {
        for (name, pod) in self.pods.iter_mut().filter(|(_, p)| node_of(p).is_none() && is_live(p)) {
            let pinned =
                pod.spec.as_ref().and_then(|s| s.node_selector.as_ref()?.get("kubernetes.io/hostname").cloned());
            let node = pinned.unwrap_or_else(|| self.preference[0].clone());
            pod.spec.as_mut().expect("a pod has a spec").node_name = Some(node);
            self.due.insert(name.clone());
        }
    }

    fn delete_pod(&mut self, name: &str) {
        if let Some(pod) = self.pods.get_mut(name) {
            pod.metadata.deletion_timestamp.get_or_insert_with(|| Time(k8s_openapi::jiff::Timestamp::now()));
            self.due.insert(name.to_owned());
        }
    }

    /// Write `status` to pod `name` unless it shows that already; the change
    /// (through the pod watch) makes the pod due again.
    fn write_pod_status(&mut self, name: &str, derive: impl Fn(&Pod) -> k8s_openapi::api::core::v1::PodStatus) {
        let Some(pod) = self.pods.get_mut(name) else { return };
        let new = derive(pod);
        if !pod.status.as_ref().is_some_and(|old| same_pod_status(old, &new)) {
            pod.status = Some(new);
            self.due.insert(name.to_owned());
        }
    }

    /// One pass of the pod's agent, carried out as [`super::pods`] does.
    async fn agent_pass(&mut self, name: &str) {
        let Some(pod) = self.pods.get(name).cloned() else { return };
        let Some(node) = node_of(&pod) else { return };
        let pod_vm = vm_from_pod(&pod).expect("the controller's pod reads back");
        let id = pod_vm.spec.id.clone();
        let result = if pod.metadata.deletion_timestamp.is_some() {
            self.stop(&pod, &node, &pod_vm).await
        } else if !is_live(&pod) || unwanted(&pod, &id.0, &self.vm).is_some() {
            Ok(()) // an ended pod waits for a change; an unwanted one is abandoned
        } else {
            self.start(&pod, &node, &pod_vm).await
        };
        if let Err(e) = result {
            let handling = failure::handling(e.kind);
            let message = e.to_string();
            let reason = handling.reason.as_str();
            match handling.pod {
                PodEffect::Waiting => self.write_pod_status(name, |p| {
                    pod_status(p, "10.0.0.1", &Observed::Waiting { reason, message: &message }, false)
                }),
                PodEffect::KeepLastKnown => self.write_pod_status(name, |p| {
                    pod_status(p, "10.0.0.1", &Observed::HostNotResponding { message: &message }, false)
                }),
                PodEffect::Unchanged => {}
            }
            self.due.insert(name.to_owned()); // backoff: due again later
        }
    }

    async fn start(&mut self, pod: &Pod, node: &str, pod_vm: &crate::vmpod::PodVm) -> vmlet_provider::Result<()> {
        let name = pod.name_any();
        let id = pod_vm.spec.id.clone();
        let host = self.host(node);
        let on_host = host.get(&id).await?;
        let mut elsewhere = Vec::new();
        for (other, h) in self.hosts.iter().filter(|(n, _)| n.as_str() != node) {
            if let Ok(Location::ThisHost(_)) = h.locate(&id, &pod_vm.spec.backend_name()).await {
                elsewhere.push(other.clone());
            }
        }
        let record = self.record().map(str::to_owned);
        let saw_running = was_running(pod);
        let view = StartView {
            here: node,
            on_host: on_host.as_ref().map_or(OnHost::Absent, |s| OnHost::Defined(s.power, s.stop_reason)),
            record: record.as_deref(),
            held_elsewhere: &elsewhere,
            pod_saw_running: saw_running,
            restart_policy: pod_vm.restart_policy,
        };
        let step = start_step(view, |n| self.hosts.contains_key(n));
        let observed_status = match step {
            StartStep::LivesElsewhere { node: there, record_it } => {
                if record_it {
                    self.set_record(&there);
                }
                let message = format!("lives on {there}");
                self.write_pod_status(&name, |p| {
                    pod_status(p, "10.0.0.1", &Observed::Waiting { reason: PLACED_ELSEWHERE, message: &message }, false)
                });
                return Ok(());
            }
            StartStep::LeaveOff(ended) => {
                self.write_pod_status(&name, |p| {
                    pod_status(p, "10.0.0.1", &Observed::Ended { ended, message: "left off" }, false)
                });
                return Ok(());
            }
            StartStep::Running { record } => {
                if record {
                    self.set_record(node);
                }
                on_host.expect("running here")
            }
            StartStep::Start { record: write_record } | StartStep::DefineAndStart { record: write_record } => {
                let host = self.host(node);
                let (status, defined_now) = match on_host {
                    Some(status) => (status, false),
                    None => (host.ensure_defined(&pod_vm.spec).await?, true),
                };
                if let Some(meanwhile) = self.meanwhile.take() {
                    meanwhile(self);
                }
                // As super::pods::start_vm: the guarded placement write (or a
                // fresh read) proves the VM still wants this pod, then the
                // pod watch that the pod is not going away; else a
                // definition this pass made is removed and nothing starts.
                let still_wanted =
                    if write_record { self.record_here(pod, node, record.as_deref()) } else { self.wanted(pod) };
                let still_wanted = still_wanted.and_then(|()| match self.pods.get(&name) {
                    Some(now) if now.uid() == pod.uid() && now.metadata.deletion_timestamp.is_none() => Ok(()),
                    _ => Err("the pod is being deleted"),
                });
                if still_wanted.is_err() {
                    if defined_now {
                        self.host(node).undefine(&id).await?;
                    }
                    self.due.insert(name); // requeued, as an abandoned pass is
                    return Ok(());
                }
                let host = self.host(node);
                host.start(&id).await?;
                host.get(&id).await?.unwrap_or(status)
            }
        };
        let restarted = saw_running && !matches!(step, StartStep::Running { .. });
        self.write_pod_status(&name, |p| {
            pod_status(p, "10.0.0.1", &Observed::Vm { status: &observed_status, provider: "memory" }, restarted)
        });
        Ok(())
    }

    async fn stop(&mut self, pod: &Pod, node: &str, pod_vm: &crate::vmpod::PodVm) -> vmlet_provider::Result<()> {
        let name = pod.name_any();
        let host = self.host(node);
        let status = host.get(&pod_vm.spec.id).await?;
        let view = StopView {
            active: status.as_ref().map(|s| s.power.is_active()),
            evicted_and_wanted: false,
            power_off_mode: pod_vm.power_off_mode,
            asked_ago: self.shutdown_asked.get(&name).map(|at| Duration::from_secs(u64::from(self.tick - at))),
            grace: Duration::from_secs(3),
        };
        match stop_step(view) {
            StopStep::FinishDeletion => {
                self.pods.remove(&name);
                return Ok(());
            }
            StopStep::Shutdown => {
                host.shutdown(&pod_vm.spec.id).await?;
                self.shutdown_asked.insert(name.clone(), self.tick);
            }
            StopStep::Destroy => host.destroy(&pod_vm.spec.id).await?,
            StopStep::Hold | StopStep::Wait => {}
        }
        self.due.insert(name); // the agent looks again soon (TRANSITION)
        Ok(())
    }

    /// The placement write of [`super::pods`] (`record_here`): guarded by
    /// the VirtualMachine's resourceVersion, so it is decided on the VM as
    /// it is now (a stale copy costs the agent a conflict and a fresh read).
    /// Refused when the VM no longer wants `pod` or the record no longer
    /// names `expected`.
    fn record_here(&mut self, pod: &Pod, node: &str, expected: Option<&str>) -> Result<(), &'static str> {
        self.wanted(pod)?;
        if self.record() != expected {
            return Err("the placement record changed meanwhile");
        }
        self.set_record(node);
        Ok(())
    }

    /// The fresh read of [`super::pods`] (`wanted`): whether the
    /// VirtualMachine as it is now still wants to run through `pod`.
    fn wanted(&self, pod: &Pod) -> Result<(), &'static str> {
        unwanted(pod, &self.id().0, &self.vm).map_or(Ok(()), Err)
    }

    fn set_record(&mut self, node: &str) {
        let status = self.vm.status.get_or_insert_with(VirtualMachineStatus::default);
        status.placement = Some(Placement { node_name: node.to_owned(), backend_id: None });
    }

    /// Run ticks until nothing is due and a resync just ran: the quiet
    /// moment right after a poll, the worst moment for a change to happen
    /// to a polled back end.
    async fn settle(&mut self) {
        self.run_until("quiet after a resync", |w| w.due.is_empty() && w.tick % RESYNC_TICKS == 0).await;
    }

    // What a user (or the world) does between ticks.

    fn scale(&mut self, replicas: i32) {
        self.vm.spec.replicas = replicas;
    }

    fn running_on(&self, node: &str) -> bool {
        let running = self.host(node).peek(&self.id()).is_some_and(|s| s.power == PowerState::Running);
        let pod_running = self.live_pod().is_some_and(|p| {
            node_of(p).as_deref() == Some(node) && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        });
        running && pod_running
    }
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

fn is_live(pod: &Pod) -> bool {
    let ended = matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
    pod.metadata.deletion_timestamp.is_none() && !ended
}

fn names(pods: &[&Pod]) -> Vec<String> {
    pods.iter().map(|p| p.name_any()).collect()
}

fn pod_phase(world: &World) -> Option<String> {
    world.live_pod().or_else(|| world.pods.values().next()).and_then(|p| p.status.as_ref()?.phase.clone())
}

/// A world with one running VM (restart policy `policy`) on host-a; both
/// modes, for the scenario to go on from.
async fn running_vm(changes: Changes, policy: RestartPolicy) -> World {
    let mut vm = VmBuilder::new("web").build();
    vm.spec.restart_policy = policy;
    let mut world = World::new(changes, vm);
    world.run_until("running on host-a", |w| w.running_on("host-a")).await;
    world
}

const BOTH: [Changes; 2] = [Changes::Pushed, Changes::Polled];

#[tokio::test]
async fn a_new_vm_is_defined_on_the_host_its_pod_was_scheduled_to_and_recorded_there() {
    for changes in BOTH {
        let mut vm = VmBuilder::new("web").build();
        vm.spec.restart_policy = RestartPolicy::Always;
        let mut world = World::new(changes, vm);
        world.preference = vec!["host-b".into(), "host-a".into()];
        let ticks = world.run_until("running on host-b", |w| w.running_on("host-b")).await;
        assert_eq!(world.record(), Some("host-b"), "{changes:?}");
        assert_eq!(world.host("host-b").calls("define", &world.id()), 1, "{changes:?}");
        assert_eq!(world.holders().0, ["host-b"], "{changes:?}");
        assert!(ticks <= 4, "{changes:?}: pod changes are always pushed; took {ticks} ticks");
    }
}

#[tokio::test]
async fn a_guest_that_powers_off_under_always_is_started_again_in_place() {
    let mut took = BTreeMap::new();
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::Always).await;
        let backend_id = world.host("host-a").peek(&world.id()).unwrap().backend_id;
        world.settle().await;
        world.host("host-a").vm_stops_by_itself(&world.id(), StopReason::GuestShutdown);
        let ticks = world.run_until("started again", |w| w.host("host-a").calls("start", &w.id()) == 2).await;
        world.run_until("running again", |w| w.running_on("host-a")).await;
        assert_eq!(world.host("host-a").peek(&world.id()).unwrap().backend_id, backend_id, "{changes:?}: same VM");
        let restarts =
            world.live_pod().unwrap().status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0].restart_count;
        assert_eq!(restarts, 1, "{changes:?}");
        took.insert(format!("{changes:?}"), ticks);
    }
    assert!(took["Pushed"] < took["Polled"], "a pushed change is acted on before the next resync: {took:?}");
}

#[tokio::test]
async fn under_on_failure_a_clean_power_off_leaves_the_vm_off_until_scaled_to_zero_and_back() {
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::OnFailure).await;
        let id = world.id();
        world.host("host-a").vm_stops_by_itself(&id, StopReason::GuestShutdown);
        world.run_until("the pod ended", |w| pod_phase(w).as_deref() == Some("Succeeded")).await;
        for _ in 0..2 * RESYNC_TICKS {
            world.step().await;
            world.check_invariants();
        }
        assert_eq!(world.host("host-a").calls("start", &id), 1, "{changes:?}: left off");
        assert_eq!(world.vm.spec.replicas, 1, "{changes:?}: the spec is the user's");
        let status = world.vm.status.as_ref().unwrap();
        assert_eq!(status.ready_replicas, 0, "{changes:?}");

        world.scale(0);
        world.run_until("its pod is gone", |w| w.pods.is_empty()).await;
        world.scale(1);
        world.run_until("running again", |w| w.running_on("host-a")).await;
        assert_eq!(world.host("host-a").calls("define", &id), 1, "{changes:?}: the same definition");
    }
}

#[tokio::test]
async fn under_on_failure_a_destroy_behind_vmlet_counts_as_a_failure_and_restarts() {
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::OnFailure).await;
        world.host("host-a").vm_stops_by_itself(&world.id(), StopReason::Destroyed);
        world.run_until("started again", |w| w.host("host-a").calls("start", &w.id()) == 2).await;
        world.run_until("running again", |w| w.running_on("host-a")).await;
    }
}

#[tokio::test]
async fn a_pod_deleted_while_the_controller_is_down_comes_back_on_the_recorded_host() {
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::Always).await;
        world.controller_up = false;
        let pod = world.live_pod().unwrap().name_any();
        world.delete_pod(&pod);
        world.run_until("the pod is gone", |w| w.pods.is_empty()).await;
        world.preference = vec!["host-b".into(), "host-c".into()];
        world.controller_up = true;
        world.run_until("running on host-a again", |w| w.running_on("host-a")).await;
        for other in ["host-b", "host-c"] {
            assert_eq!(world.host(other).calls("define", &world.id()), 0, "{changes:?}: nothing on {other}");
        }
    }
}

#[tokio::test]
async fn a_vm_whose_record_was_lost_is_found_where_it_is_and_never_defined_twice() {
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::Always).await;
        let id = world.id();
        let backend_id = world.host("host-a").peek(&id).unwrap().backend_id;
        let pod = world.live_pod().unwrap().name_any();
        world.delete_pod(&pod);
        world.run_until("the pod is gone", |w| w.pods.is_empty()).await;
        // A status write lost, or an older vmlet: nothing says where it is.
        world.record_may_be_missing = true;
        world.controller_up = false;
        let status = world.vm.status.as_mut().unwrap();
        (status.placement, status.node_name) = (None, None);
        world.controller_up = true;
        world.preference = vec!["host-b".into()];
        world.run_until("running on host-a", |w| w.running_on("host-a")).await;
        assert_eq!(world.record(), Some("host-a"), "{changes:?}: the record was written back");
        assert_eq!(world.host("host-b").calls("define", &id), 0, "{changes:?}: host-b never defined it");
        assert_eq!(world.host("host-a").peek(&id).unwrap().backend_id, backend_id, "{changes:?}");
    }
}

#[tokio::test]
async fn a_host_that_stops_answering_keeps_its_pod_running_and_restarts_nothing() {
    for changes in BOTH {
        let mut world = running_vm(changes, RestartPolicy::Always).await;
        let id = world.id();
        world.host("host-a").set_answering(false);
        let silent = |w: &World| {
            w.live_pod()
                .and_then(|p| p.status.as_ref()?.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == failure::HOST_RESPONDING && c.status == "False"))
        };
        // A pass must run to notice: a resync (polled) or a retry after the
        // pod's own change; force one as the periodic resync would.
        let pod = world.live_pod().unwrap().name_any();
        world.due.insert(pod);
        world.run_until("the pod says the host does not answer", silent).await;
        for _ in 0..2 * RESYNC_TICKS {
            world.step().await;
            world.check_invariants();
            assert_eq!(pod_phase(&world).as_deref(), Some("Running"), "{changes:?}: still Running");
        }
        world.host("host-a").set_answering(true);
        world.run_until("the condition cleared", |w| !silent(w)).await;
        assert!(world.running_on("host-a"), "{changes:?}");
        assert_eq!(world.host("host-a").calls("start", &id), 1, "{changes:?}: nothing was restarted");
    }
}

/// A slow define on host-a, during which `meanwhile` happens: run until the
/// agent's pass has ended and nothing is due, for each mode.
async fn raced(changes: Changes, meanwhile: fn(&mut World)) -> World {
    let mut world = World::new(changes, VmBuilder::new("web").build());
    world.meanwhile = Some(meanwhile);
    world.run_until("the raced pass to be over and nothing due", |w| w.meanwhile.is_none() && w.due.is_empty()).await;
    world
}

#[tokio::test]
async fn a_vm_scaled_to_zero_while_it_is_defined_is_undefined_again_and_never_powered_on() {
    for changes in BOTH {
        let mut world = raced(changes, |w| w.scale(0)).await;
        let id = world.id();
        assert_eq!(world.host("host-a").calls("define", &id), 1, "{changes:?}: the raced define ran");
        assert_eq!(world.host("host-a").calls("start", &id), 0, "{changes:?}: powered on after the scale to 0");
        assert!(world.holders().0.is_empty(), "{changes:?}: the late definition was left on {:?}", world.holders().0);
        assert_eq!(world.record(), None, "{changes:?}: a VM that never ran is recorded somewhere");
        world.run_until("the pod gone", |w| w.pods.is_empty()).await;

        world.scale(1);
        world.run_until("running on host-a after the scale to 1", |w| w.running_on("host-a")).await;
        assert_eq!(world.host("host-a").calls("start", &id), 1, "{changes:?}");
        assert_eq!(world.holders().0, ["host-a"], "{changes:?}");
    }
}

#[tokio::test]
async fn a_vm_deleted_while_it_is_defined_is_undefined_again_and_never_powered_on() {
    for changes in BOTH {
        let world = raced(changes, |w| {
            w.vm.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        })
        .await;
        let id = world.id();
        assert_eq!(world.host("host-a").calls("define", &id), 1, "{changes:?}: the raced define ran");
        assert_eq!(world.host("host-a").calls("start", &id), 0, "{changes:?}: a VM being deleted was powered on");
        assert!(world.holders().0.is_empty(), "{changes:?}: the late definition was left on {:?}", world.holders().0);
        assert_eq!(world.record(), None, "{changes:?}");
    }
}

#[tokio::test]
async fn a_pod_deleted_while_its_vm_is_defined_starts_nothing_and_its_replacement_runs_the_vm_once() {
    for changes in BOTH {
        let mut world = raced(changes, |w| {
            let first = w.live_pod().expect("the pod being synced").name_any();
            w.delete_pod(&first);
        })
        .await;
        let id = world.id();
        assert_eq!(world.host("host-a").calls("start", &id), 0, "{changes:?}: powered on for a pod being deleted");
        assert!(world.holders().0.is_empty(), "{changes:?}: the late definition was left on {:?}", world.holders().0);
        // The placement write came before the pod's deletion was seen, so
        // the record names host-a: the replacement pod is pinned there.
        world.run_until("running on host-a through a new pod", |w| w.running_on("host-a")).await;
        assert_eq!(world.host("host-a").calls("define", &id), 2, "{changes:?}: the raced define and the real one");
        assert_eq!(world.host("host-a").calls("start", &id), 1, "{changes:?}: powered on once");
        assert_eq!(world.pods.len(), 1, "{changes:?}: the first pod's deletion finished: {:?}", world.pods.keys());
    }
}
