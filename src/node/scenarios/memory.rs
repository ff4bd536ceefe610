//! An in-memory back end for the scenario suite: a host's VMs in a map, every
//! operation idempotent as the [`Provider`] contract says, with knobs a test
//! turns (the guest powers off, the host stops answering) and, in pushed
//! mode, a note of every VM whose state changed behind vmlet's back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use vmlet_provider::{Error, ErrorKind, HostInfo, PowerState, Provider, Result, StopReason, VmId, VmSpec, VmStatus};

/// One in-memory host.
pub struct MemoryHost {
    name: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    vms: BTreeMap<VmId, VmStatus>,
    next_backend_id: u32,
    answering: bool,
    /// VMs whose state changed by themselves since the last take (pushed mode).
    changed: BTreeSet<VmId>,
    /// Every define and power-on, for the suite's invariants: `(operation, id)`.
    calls: Vec<(&'static str, VmId)>,
}

impl MemoryHost {
    /// An empty, answering host named `name`.
    pub fn new(name: &str) -> Self {
        MemoryHost { name: name.to_owned(), state: Mutex::new(State { answering: true, ..State::default() }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("memory host poisoned")
    }

    fn answer(&self, operation: &'static str) -> Result<std::sync::MutexGuard<'_, State>> {
        let state = self.state();
        if state.answering {
            Ok(state)
        } else {
            Err(Error::new(operation, ErrorKind::Transient, format!("{} does not answer", self.name)))
        }
    }

    /// The VM stops by itself (`reason`), as a guest `poweroff` or a
    /// `virsh destroy` behind vmlet would.
    pub fn vm_stops_by_itself(&self, id: &VmId, reason: StopReason) {
        let mut state = self.state();
        let vm = state.vms.get_mut(id).expect("the VM is defined here");
        vm.power = PowerState::Off;
        vm.stop_reason = Some(reason);
        state.changed.insert(id.clone());
    }

    /// The host stops (`false`) or starts again (`true`) answering.
    pub fn set_answering(&self, answering: bool) {
        self.state().answering = answering;
    }

    /// The VM's state here, without going through the provider API.
    pub fn peek(&self, id: &VmId) -> Option<VmStatus> {
        self.state().vms.get(id).cloned()
    }

    /// VMs that changed by themselves since the last call (what a back end
    /// that pushes events would have sent).
    pub fn take_changes(&self) -> BTreeSet<VmId> {
        std::mem::take(&mut self.state().changed)
    }

    /// How often `operation` (`define`, `start`) was called for `id`.
    pub fn calls(&self, operation: &str, id: &VmId) -> usize {
        self.state().calls.iter().filter(|(op, vm)| *op == operation && vm == id).count()
    }
}

#[async_trait::async_trait]
impl Provider for MemoryHost {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<()> {
        self.answer("ping").map(drop)
    }

    async fn host_info(&self) -> Result<HostInfo> {
        drop(self.answer("host info")?);
        Ok(HostInfo {
            cpus: 8,
            memory_bytes: 16 << 30,
            architecture: "amd64".into(),
            hypervisor: "memory".into(),
            accelerator: None,
            storage_roots: vec![],
        })
    }

    async fn list(&self) -> Result<Vec<VmStatus>> {
        Ok(self.answer("list")?.vms.values().cloned().collect())
    }

    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>> {
        Ok(self.answer("get")?.vms.get(id).cloned())
    }

    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus> {
        let mut state = self.answer("define")?;
        if let Some(existing) = state.vms.get(&spec.id) {
            return Ok(existing.clone());
        }
        state.next_backend_id += 1;
        let status = VmStatus {
            id: spec.id.clone(),
            backend_name: spec.backend_name(),
            backend_id: format!("{}-{}", self.name, state.next_backend_id),
            power: PowerState::Off,
            stop_reason: None,
            fault: None,
            cpus: spec.cpus,
            memory_bytes: spec.memory_bytes,
            max_cpus: spec.cpus,
            max_memory_bytes: spec.memory_bytes,
            next_start: None,
            addresses: vec![],
            network_interfaces: 0,
        };
        state.vms.insert(spec.id.clone(), status.clone());
        state.calls.push(("define", spec.id.clone()));
        Ok(status)
    }

    async fn start(&self, id: &VmId) -> Result<()> {
        let mut state = self.answer("start")?;
        let vm = state.vms.get_mut(id).ok_or_else(|| Error::new("start", ErrorKind::NotFound, "no such VM"))?;
        if vm.power != PowerState::Running {
            vm.power = PowerState::Running;
            vm.stop_reason = None;
            state.calls.push(("start", id.clone()));
        }
        Ok(())
    }

    async fn shutdown(&self, id: &VmId) -> Result<()> {
        // The guest honours ACPI at once.
        let mut state = self.answer("shutdown")?;
        if let Some(vm) = state.vms.get_mut(id).filter(|vm| vm.power.is_active()) {
            vm.power = PowerState::Off;
            vm.stop_reason = Some(StopReason::GuestShutdown);
        }
        Ok(())
    }

    async fn destroy(&self, id: &VmId) -> Result<()> {
        let mut state = self.answer("destroy")?;
        if let Some(vm) = state.vms.get_mut(id).filter(|vm| vm.power.is_active()) {
            vm.power = PowerState::Off;
            vm.stop_reason = Some(StopReason::Destroyed);
        }
        Ok(())
    }

    async fn undefine(&self, id: &VmId) -> Result<()> {
        let mut state = self.answer("undefine")?;
        if state.vms.get(id).is_some_and(|vm| vm.power.is_active()) {
            return Err(Error::new("undefine", ErrorKind::InvalidInput, "the VM is still active"));
        }
        state.vms.remove(id);
        Ok(())
    }
}
