//! The VMs vmlet owns, and their power operations.
//!
//! A VM is vmlet's when its `config.extraConfig` carries [`UID_KEY`] (the
//! VirtualMachine's UID); no other VM is listed. Power operations follow
//! vim25's `PowerOnVM_Task` and `PowerOffVM_Task`: each returns a `Task`
//! whose `info.state` is read until `success` or `error` (then
//! `info.error` is the fault) or until the caller's deadline.

use std::time::Duration;

use tokio::time::Instant;

use crate::properties::{self, datacenter_walk, object_set, prop_set, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::Error;

/// The `config.extraConfig` key holding the UID of the VirtualMachine a VM
/// belongs to.
pub const UID_KEY: &str = "vmlet.io.uid";

/// A VM that carries [`UID_KEY`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vm {
    /// The value of `config.extraConfig["vmlet.io.uid"]`. Two VMs may carry
    /// one UID (a copy made outside vmlet); callers decide what that means.
    pub uid: String,
    /// `name`.
    pub name: String,
    /// Its `VirtualMachine` reference, e.g. `vm-71`.
    pub moref: MoRef,
    /// `runtime.host`: the `HostSystem` it runs or is registered on; `None`
    /// when vSphere reports none.
    pub host: Option<MoRef>,
    /// `runtime.powerState`.
    pub power_state: PowerState,
    /// `config.hardware.numCPU`: virtual CPUs; `None` when vSphere reports none.
    pub cpus: Option<u32>,
    /// `config.hardware.memoryMB` in bytes (MiB × 2²⁰); `None` when vSphere
    /// reports none.
    pub memory_bytes: Option<u64>,
    /// `guest.ipAddress`: the guest's primary address as VMware Tools
    /// report it; `None` without Tools, before the guest has one, or when
    /// it is no IP address.
    pub ip_address: Option<std::net::IpAddr>,
    /// CPU and memory hot-add, the ceilings vmlet recorded at the clone,
    /// and a size waiting for the next start.
    pub sizing: Sizing,
}

/// The `config.extraConfig` key of the vCPU ceiling of a live resize
/// (vSphere has no such setting: vmlet records the VM's `maxCpu`).
pub const MAX_CPUS_KEY: &str = "vmlet.io.maxCpus";

/// The `config.extraConfig` key of the memory ceiling of a live resize, in
/// MiB (the VM's `maxMemory`).
pub const MAX_MEMORY_KEY: &str = "vmlet.io.maxMemoryMiB";

/// The `config.extraConfig` key of the vCPUs a running VM gets at its next
/// start (a resize it could not take live; vSphere holds one configuration).
pub const NEXT_CPUS_KEY: &str = "vmlet.io.nextCpus";

/// The `config.extraConfig` key of the memory, in MiB, a running VM gets at
/// its next start.
pub const NEXT_MEMORY_KEY: &str = "vmlet.io.nextMemoryMiB";

/// Whether a running VM can grow, how far, and what it gets at its next
/// start: `config.cpuHotAddEnabled`, `config.memoryHotAddEnabled`, the
/// ceilings in [`MAX_CPUS_KEY`] and [`MAX_MEMORY_KEY`], the size in
/// [`NEXT_CPUS_KEY`] and [`NEXT_MEMORY_KEY`]. A value that is absent, empty
/// or not a number is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sizing {
    /// `config.cpuHotAddEnabled`.
    pub cpu_hot_add: bool,
    /// `config.memoryHotAddEnabled`.
    pub memory_hot_add: bool,
    /// [`MAX_CPUS_KEY`].
    pub max_cpus: Option<u32>,
    /// [`MAX_MEMORY_KEY`] in bytes (MiB × 2²⁰).
    pub max_memory_bytes: Option<u64>,
    /// [`NEXT_CPUS_KEY`].
    pub next_cpus: Option<u32>,
    /// [`NEXT_MEMORY_KEY`] in bytes (MiB × 2²⁰).
    pub next_memory_bytes: Option<u64>,
}

/// vim25 `VirtualMachinePowerState`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PowerState {
    /// `poweredOn`.
    PoweredOn,
    /// `poweredOff`.
    PoweredOff,
    /// `suspended`.
    Suspended,
    /// A value this crate does not know, as vSphere wrote it.
    Other(String),
}

impl PowerState {
    /// The state vSphere writes as `value` (`VirtualMachinePowerState`).
    pub(crate) fn parse(value: &str) -> PowerState {
        match value {
            "poweredOn" => PowerState::PoweredOn,
            "poweredOff" => PowerState::PoweredOff,
            "suspended" => PowerState::Suspended,
            other => PowerState::Other(other.to_owned()),
        }
    }
}

const UID_PATH: &str = r#"config.extraConfig["vmlet.io.uid"]"#;

const MAX_CPUS_PATH: &str = r#"config.extraConfig["vmlet.io.maxCpus"]"#;
const MAX_MEMORY_PATH: &str = r#"config.extraConfig["vmlet.io.maxMemoryMiB"]"#;
const NEXT_CPUS_PATH: &str = r#"config.extraConfig["vmlet.io.nextCpus"]"#;
const NEXT_MEMORY_PATH: &str = r#"config.extraConfig["vmlet.io.nextMemoryMiB"]"#;

/// The properties read of every VM.
pub(crate) const VM_PATHS: [&str; 13] = [
    "name",
    "runtime.host",
    "runtime.powerState",
    "config.hardware.numCPU",
    "config.hardware.memoryMB",
    "guest.ipAddress",
    UID_PATH,
    "config.cpuHotAddEnabled",
    "config.memoryHotAddEnabled",
    MAX_CPUS_PATH,
    MAX_MEMORY_PATH,
    NEXT_CPUS_PATH,
    NEXT_MEMORY_PATH,
];

/// The `specSet` content that walks datacenters' VM folders to their VMs
/// (VMs inside vApps are not reached).
fn vms_spec(root: &MoRef) -> String {
    let props = prop_set("VirtualMachine", &VM_PATHS);
    props + &object_set(root, &datacenter_walk("vmFolder", &[]))
}

/// Every VM carrying [`UID_KEY`], sorted by name. Templates carry none
/// unless someone made one from a vmlet VM; they are listed then too.
///
/// Errors: those of [`Session`] calls (one `RetrievePropertiesEx`, plus
/// `ContinueRetrievePropertiesEx` for a large inventory).
pub async fn list_vms(session: &Session) -> Result<Vec<Vm>, Error> {
    let spec = vms_spec(&session.service_content().root_folder);
    Ok(vms_from_objects(&properties::retrieve(session, &spec).await?))
}

pub(crate) fn vms_from_objects(objects: &[ObjectContent]) -> Vec<Vm> {
    let mut vms: Vec<Vm> = objects
        .iter()
        .filter(|o| o.obj.kind == "VirtualMachine")
        .filter_map(|vm| {
            // The value is an OptionValue: <key>vmlet.io.uid</key><value>…</value>.
            // An empty value is none (vSphere removes a key set to ""; a
            // template made from a snapshot clears it so).
            let uid = vm.get(UID_PATH)?.child_text("value")?.trim().to_owned();
            if uid.is_empty() {
                return None;
            }
            Some(Vm {
                uid,
                name: vm.text("name").unwrap_or_default().to_owned(),
                moref: vm.obj.clone(),
                host: vm.moref("runtime.host"),
                power_state: PowerState::parse(vm.text("runtime.powerState").unwrap_or_default()),
                cpus: vm.text("config.hardware.numCPU").and_then(|v| v.parse().ok()),
                memory_bytes: vm
                    .text("config.hardware.memoryMB")
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(|mib| mib << 20),
                ip_address: vm.text("guest.ipAddress").and_then(|v| v.parse().ok()),
                sizing: sizing_of(vm),
            })
        })
        .collect();
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    vms
}

/// The hot-add settings, recorded ceilings and next-start size of one VM's
/// properties.
fn sizing_of(vm: &ObjectContent) -> Sizing {
    let option = |path: &str| vm.get(path).and_then(|v| v.child_text("value")).map(|v| v.trim().to_owned());
    let mib = |path: &str| option(path).and_then(|v| v.parse::<u64>().ok()).and_then(|mib| mib.checked_mul(1 << 20));
    Sizing {
        cpu_hot_add: vm.text("config.cpuHotAddEnabled") == Some("true"),
        memory_hot_add: vm.text("config.memoryHotAddEnabled") == Some("true"),
        max_cpus: option(MAX_CPUS_PATH).and_then(|v| v.parse().ok()),
        max_memory_bytes: mib(MAX_MEMORY_PATH),
        next_cpus: option(NEXT_CPUS_PATH).and_then(|v| v.parse().ok()),
        next_memory_bytes: mib(NEXT_MEMORY_PATH),
    }
}

/// Powers `vm` on (`PowerOnVM_Task`) and waits for the task, at most
/// `deadline`. A VM already on is success.
///
/// Errors: [`Error::Fault`] with the task's or the call's fault
/// (`ManagedObjectNotFound` → NotFound, `InvalidState` → Conflict, ...);
/// [`Error::TaskTimeout`] after `deadline` (the task may still finish).
pub async fn power_on(session: &Session, vm: &MoRef, deadline: Duration) -> Result<(), Error> {
    power(session, vm, "PowerOnVM_Task", PowerState::PoweredOn, deadline).await
}

/// Powers `vm` off (`PowerOffVM_Task`: a hard power-off, no guest shutdown)
/// and waits for the task, at most `deadline`. A VM already off is success.
///
/// Errors: as [`power_on`].
pub async fn power_off(session: &Session, vm: &MoRef, deadline: Duration) -> Result<(), Error> {
    power(session, vm, "PowerOffVM_Task", PowerState::PoweredOff, deadline).await
}

async fn power(
    session: &Session,
    vm: &MoRef,
    method: &'static str,
    wanted: PowerState,
    deadline: Duration,
) -> Result<(), Error> {
    let started = Instant::now();
    let result = match session.call(method, vm, "").await {
        Ok(response) => match response.child("returnval").and_then(MoRef::from_element) {
            Some(task) => wait_for_task(session, method, &task, started, deadline).await.map(|_| ()),
            None => Err(Error::Response { operation: method, status: 200, reason: "no Task in the answer".into() }),
        },
        Err(error) => Err(error),
    };
    match result {
        // vSphere refuses to power on a VM that is on (InvalidPowerState); the
        // state the caller wants is reached all the same.
        Err(error) if error.fault() == Some("InvalidPowerState") && power_state(session, vm).await? == wanted => Ok(()),
        result => result,
    }
}

/// `runtime.powerState` of `vm`.
pub(crate) async fn power_state(session: &Session, vm: &MoRef) -> Result<PowerState, Error> {
    let spec = prop_set("VirtualMachine", &["runtime.powerState"]) + &object_set(vm, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    let state = objects.first().and_then(|o| o.text("runtime.powerState"));
    Ok(PowerState::parse(state.unwrap_or_default()))
}

/// Reads the task's `info.state` (100 ms apart, growing to 1 s) until it
/// ends or `deadline` after `started` passes; on success returns
/// `info.result` (e.g. the new VM of a `CloneVM_Task`), if the task has one.
pub(crate) async fn wait_for_task(
    session: &Session,
    operation: &'static str,
    task: &MoRef,
    started: Instant,
    deadline: Duration,
) -> Result<Option<crate::xml::Element>, Error> {
    // Counted when this returns or is dropped: the task may have changed
    // the VM either way (the update cache catches up on it).
    let _ended = session.task_guard();
    let until = started + deadline;
    let spec = prop_set("Task", &["info.state", "info.error", "info.result"]) + &object_set(task, &[]);
    let mut pause = Duration::from_millis(100);
    loop {
        let objects = properties::retrieve(session, &spec).await?;
        let info = objects.first();
        let state = info.and_then(|o| o.text("info.state")).unwrap_or_default().to_owned();
        match state.as_str() {
            "success" => return Ok(info.and_then(|o| o.get("info.result")).cloned()),
            "error" => return Err(task_fault(operation, info)),
            _ => {}
        }
        let now = Instant::now();
        if now >= until {
            let waited = now - started;
            return Err(Error::TaskTimeout { operation, task: task.value.clone(), state, waited });
        }
        tokio::time::sleep(pause.min(until - now)).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// The fault of a task in state `error`: `info.error.fault`'s type and
/// `info.error.localizedMessage`.
pub(crate) fn task_fault(operation: &'static str, info: Option<&ObjectContent>) -> Error {
    let error = info.and_then(|o| o.get("info.error"));
    let fault = error.and_then(|e| e.child("fault")).map(crate::soap::fault_type).unwrap_or_default();
    let message = error.and_then(|e| e.child_text("localizedMessage")).unwrap_or_default().trim().to_owned();
    Error::Fault { operation, fault, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::properties::objects_of;
    use crate::soap::parse_response;
    use vmlet_provider::ErrorKind;

    fn recorded(bytes: &[u8]) -> Vec<ObjectContent> {
        objects_of(&parse_response(bytes).unwrap().unwrap())
    }

    #[test]
    fn only_the_vm_carrying_a_uid_is_listed() {
        let vms = vms_from_objects(&recorded(include_bytes!("../tests/fixtures/vms.xml")));
        assert_eq!(vms.len(), 1, "{vms:?}");
        let vm = &vms[0];
        assert_eq!((vm.uid.as_str(), vm.name.as_str()), ("00000000-0000-4000-8000-000000000001", "DC0_C0_RP0_VM1"));
        assert_eq!(vm.moref.kind, "VirtualMachine");
        assert_eq!(vm.host.as_ref().map(|h| h.kind.as_str()), Some("HostSystem"));
        assert_eq!(vm.power_state, PowerState::PoweredOn);
    }

    #[test]
    fn a_failed_task_is_its_fault_with_vsphere_s_message() {
        let objects = recorded(include_bytes!("../tests/fixtures/task_invalid_power_state.xml"));
        assert_eq!(objects[0].text("info.state"), Some("error"));
        let error = task_fault("PowerOnVM_Task", objects.first());
        assert_eq!(error.fault(), Some("InvalidPowerState"));
        assert_eq!(error.kind(), ErrorKind::Conflict);
        assert_eq!(error.to_string(), "PowerOnVM_Task: InvalidPowerState: *types.InvalidPowerState");
    }

    #[test]
    fn the_uid_is_asked_for_by_its_extra_config_key_only() {
        let spec = vms_spec(&MoRef::new("Folder", "group-d1"));
        assert!(spec.contains("<pathSet>config.extraConfig[&quot;vmlet.io.uid&quot;]</pathSet>"), "{spec}");
        assert!(!spec.contains("<pathSet>config.extraConfig</pathSet>"), "{spec}");
    }
}
