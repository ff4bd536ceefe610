//! [`Snapshots`] for [`VsphereProvider`]: vSphere's own snapshots of a VM of
//! this host ([`crate::snapshots`]), named by vmlet, and new VMs made from
//! one through a template.
//!
//! - Take: `CreateSnapshot_Task`. `memory` unset: with memory when the VM
//!   runs, disk only when it is off; `memory: false` of a running VM is a
//!   disk-only snapshot, quiesced through VMware Tools when asked (vSphere
//!   fails it without Tools: take it with memory instead); `memory:
//!   true` of a VM that is off is refused. The snapshot's description says
//!   whether the VM ran (vSphere records a disk-only snapshot as
//!   `poweredOff`).
//! - Revert: `RevertToSnapshot_Task` with `suppressPowerOn`, only while the
//!   VM is powered off. Where vSphere leaves the VM suspended (a real
//!   vCenter may, after a revert to a snapshot with memory; the simulator
//!   leaves it off), that is reported as
//!   [`RevertOutcome::memory_restored`]; otherwise the VM boots from the
//!   disks as they were.
//! - A new VM from a snapshot ([`Snapshots::export_snapshot_image`]):
//!   `CloneVM_Task` of the snapshot into a template of vmlet's name
//!   (`<namespace>_<vm>_restored_<restore uid>`) in the VM's folder, on this
//!   host, without the VM's `vmlet.io.uid`; the new VM is a clone of that
//!   template, which only VMs of that namespace may name
//!   ([`VsphereProvider::check_spec`]). The template stays when the VM is
//!   deleted.
//! - There are no host files: [`Snapshots::export_snapshot_disk`] is
//!   `Unsupported`.

use std::time::Duration;

use tracing::instrument;
use vmlet_provider::{
    Error as ProviderError, ErrorKind, Result, RevertOutcome, SnapshotInfo, SnapshotRequest, Snapshots, VmId,
};

use super::{provider_error, VsphereProvider, MAX_VM_NAME_CHARS};
use crate::snapshots::{
    clone_snapshot_to_template, create_snapshot, folder_of, remove_snapshot, revert_to_snapshot, snapshots_of,
    vms_named, CreateSnapshot, Snapshot, SnapshotClone,
};
use crate::vms::{power_state, PowerState, Vm};

/// The description of a snapshot taken of a running VM.
const TAKEN_RUNNING: &str = "taken by vmlet; VM poweredOn";
/// The description of a snapshot taken of a VM that was off.
const TAKEN_STOPPED: &str = "taken by vmlet; VM poweredOff";

/// What vmlet reports of `snapshot`.
fn info_of(snapshot: &Snapshot) -> SnapshotInfo {
    let memory = snapshot.state == PowerState::PoweredOn;
    SnapshotInfo {
        name: snapshot.name.clone(),
        memory,
        vm_was_running: memory || snapshot.description == TAKEN_RUNNING,
        created_unix_seconds: snapshot.created_unix_seconds.unwrap_or(0),
    }
}

/// Whether to save memory and quiesce, for a VM in `power` asked for
/// `memory` (see the module docs): `(memory, quiesce)`, or why not.
fn plan(
    vm: &str,
    power: &PowerState,
    memory: Option<bool>,
    quiesce: bool,
) -> std::result::Result<(bool, bool), String> {
    let running = match power {
        PowerState::PoweredOn => true,
        PowerState::PoweredOff => false,
        other => return Err(format!("VM {vm} is {other:?}; power it on or off before taking a snapshot")),
    };
    let memory = match (memory, running) {
        (Some(true), false) => {
            return Err(format!(
                "spec.memory: VM {vm} is powered off and has no memory to save; leave memory unset or false"
            ))
        }
        (Some(memory), true) => memory,
        (None, running) => running,
        (Some(false), false) => false,
    };
    Ok((memory, quiesce && running && !memory))
}

impl VsphereProvider {
    /// The one snapshot named `name` of `vm`, if any. Errors: `Permanent`
    /// when two carry the name (vmlet acts on neither).
    async fn snapshot_named(&self, operation: &'static str, vm: &Vm, name: &str) -> Result<Option<Snapshot>> {
        let session = self.session(operation).await?;
        let all = snapshots_of(session, &vm.moref).await.map_err(provider_error(operation))?;
        let mut named = all.into_iter().filter(|s| s.name == name);
        let first = named.next();
        if let (Some(first), Some(second)) = (&first, named.next()) {
            return Err(ProviderError::new(
                operation,
                ErrorKind::Permanent,
                format!(
                    "VM {} has two snapshots named {name} ({} and {}); vmlet acts on neither until an administrator \
                     removes one",
                    vm.name, first.moref.value, second.moref.value
                ),
            ));
        }
        Ok(first)
    }
}

#[async_trait::async_trait]
impl Snapshots for VsphereProvider {
    /// See the module docs. Errors as [`Snapshots::create_snapshot`]
    /// documents; `InvalidInput` also for a suspended VM; `Transient` when
    /// the task outlives `request.timeout` (vSphere may still finish it; a
    /// retry finds it by name); the task's fault by its kind.
    #[instrument(skip(self, request), fields(provider = "vsphere", host = %self.host, vm.uid = %id, snapshot.name = %request.name))]
    async fn create_snapshot(&self, id: &VmId, request: &SnapshotRequest) -> Result<SnapshotInfo> {
        const OP: &str = "take snapshot";
        let vm = self.find_here(OP, id).await?;
        if let Some(existing) = self.snapshot_named(OP, &vm, &request.name).await? {
            return Ok(info_of(&existing));
        }
        let (memory, quiesce) = plan(&vm.name, &vm.power_state, request.memory, request.quiesce)
            .map_err(|why| ProviderError::new(OP, ErrorKind::InvalidInput, why))?;
        let running = vm.power_state == PowerState::PoweredOn;
        let description = if running { TAKEN_RUNNING } else { TAKEN_STOPPED };
        let session = self.session(OP).await?;
        tracing::info!(vm.name = %vm.name, memory, quiesce, "taking snapshot");
        let create = CreateSnapshot { name: &request.name, description, memory, quiesce };
        create_snapshot(session, &vm.moref, &create, request.timeout).await.map_err(|e| {
            let mut error = provider_error(OP)(e);
            if error.kind == ErrorKind::Transient {
                error.message =
                    format!("{}; vSphere may still take snapshot {}: a retry finds it", error.message, request.name);
            }
            error
        })?;
        match self.snapshot_named(OP, &vm, &request.name).await? {
            Some(taken) => Ok(info_of(&taken)),
            None => Err(ProviderError::new(
                OP,
                ErrorKind::Transient,
                format!("vSphere took snapshot {} of VM {} but does not list it yet", request.name, vm.name),
            )),
        }
    }

    /// `snapshot.rootSnapshotList` of the VM. Errors: `NotFound` when this
    /// host has no such VM; `Permanent` when two snapshots carry the name.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, snapshot.name = %name))]
    async fn snapshot(&self, id: &VmId, name: &str) -> Result<Option<SnapshotInfo>> {
        const OP: &str = "read snapshot";
        let vm = self.find_here(OP, id).await?;
        Ok(self.snapshot_named(OP, &vm, name).await?.as_ref().map(info_of))
    }

    /// `RemoveSnapshot_Task` (`removeChildren` false), waited for
    /// ([`super::VCenterOptions::task_timeout`]). No such VM on this host,
    /// or no such snapshot, is success. Errors: `Conflict` while the VM has
    /// another task (`TaskInProgress`); `Transient` after the deadline.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, snapshot.name = %name))]
    async fn delete_snapshot(&self, id: &VmId, name: &str) -> Result<()> {
        const OP: &str = "delete snapshot";
        let vm = match self.find_here(OP, id).await {
            Err(e) if e.kind == ErrorKind::NotFound => return Ok(()),
            other => other?,
        };
        let Some(snapshot) = self.snapshot_named(OP, &vm, name).await? else { return Ok(()) };
        let session = self.session(OP).await?;
        match remove_snapshot(session, &snapshot.moref, self.vcenter.options.task_timeout).await {
            Err(e) if e.fault() == Some("ManagedObjectNotFound") => Ok(()),
            other => other.map_err(provider_error(OP)),
        }?;
        tracing::info!(vm.name = %vm.name, snapshot.moref = %snapshot.moref.value, "snapshot removed");
        Ok(())
    }

    /// `RevertToSnapshot_Task` with `suppressPowerOn`, waited for
    /// ([`super::VCenterOptions::task_timeout`]), of a powered-off VM. Errors:
    /// `NotFound` when this host has no such VM or it has no such snapshot;
    /// `Conflict` while the VM is not powered off; the task's fault by its
    /// kind.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, snapshot.name = %name))]
    async fn revert_to_snapshot(&self, id: &VmId, name: &str) -> Result<RevertOutcome> {
        const OP: &str = "revert to snapshot";
        let vm = self.find_here(OP, id).await?;
        if vm.power_state != PowerState::PoweredOff {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Conflict,
                format!("VM {} is {:?}; it is reverted only while powered off", vm.name, vm.power_state),
            ));
        }
        let Some(snapshot) = self.snapshot_named(OP, &vm, name).await? else {
            return Err(ProviderError::new(
                OP,
                ErrorKind::NotFound,
                format!("VM {} has no snapshot named {name}", vm.name),
            ));
        };
        let session = self.session(OP).await?;
        revert_to_snapshot(session, &snapshot.moref, self.vcenter.options.task_timeout)
            .await
            .map_err(provider_error(OP))?;
        let after = power_state(session, &vm.moref).await.map_err(provider_error(OP))?;
        tracing::info!(vm.name = %vm.name, snapshot.moref = %snapshot.moref.value, power = ?after, "reverted to snapshot");
        Ok(RevertOutcome { memory_restored: after == PowerState::Suspended })
    }

    /// vSphere keeps disks on its datastores, not in host files: a new VM is
    /// made from a snapshot through a template instead
    /// ([`Snapshots::export_snapshot_image`]). Errors: always `Unsupported`.
    async fn export_snapshot_disk(&self, _id: &VmId, _name: &str, _target: &str, _timeout: Duration) -> Result<u64> {
        Err(ProviderError::new(
            "export snapshot disk",
            ErrorKind::Unsupported,
            "vSphere keeps a VM's disks on its datastores, not in host files; a new VM is made from a snapshot \
             through a template",
        ))
    }

    /// See the module docs: `CloneVM_Task` of the snapshot into template
    /// `image` in the VM's folder, on this host and its pool. A template of
    /// that name in that folder is taken as made by an earlier call.
    /// Errors as [`Snapshots::export_snapshot_image`] documents:
    /// `InvalidInput` for a name over vSphere's 80 characters; `Conflict`
    /// when a VM of that name that is no template is in the folder (a clone
    /// still running, or another VM); `NotFound` for no such VM on this
    /// host or no such snapshot.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, snapshot.name = %name, image = %image))]
    async fn export_snapshot_image(&self, id: &VmId, name: &str, image: &str, timeout: Duration) -> Result<()> {
        const OP: &str = "make a template from a snapshot";
        if image.chars().count() > MAX_VM_NAME_CHARS || image.is_empty() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "the template's name {image:?} (<namespace>_<new VM>_restored_<restore UID>) is longer than \
                     vSphere's {MAX_VM_NAME_CHARS} characters; give the new VM a shorter name"
                ),
            ));
        }
        let vm = self.find_here(OP, id).await?;
        let Some(snapshot) = self.snapshot_named(OP, &vm, name).await? else {
            return Err(ProviderError::new(
                OP,
                ErrorKind::NotFound,
                format!("VM {} has no snapshot named {name}", vm.name),
            ));
        };
        let host = self.resolved(OP).await?;
        let session = self.session(OP).await?;
        let permanent = |why: String| ProviderError::new(OP, ErrorKind::Permanent, why);
        let folder = folder_of(session, &vm.moref)
            .await
            .map_err(provider_error(OP))?
            .ok_or_else(|| permanent(format!("vSphere reports no folder of VM {}", vm.name)))?;
        let pool = host
            .resource_pool
            .as_ref()
            .ok_or_else(|| permanent(format!("vSphere reports no resource pool for host {}", self.host)))?;
        let existing = vms_named(session, &folder, image).await.map_err(provider_error(OP))?;
        if existing.iter().any(|named| named.template) {
            return Ok(());
        }
        if let Some(other) = existing.first() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "VM {} ({image}) is in VM {}'s folder and is no template (a clone still running?)",
                    other.moref.value, vm.name
                ),
            ));
        }
        tracing::info!(vm.name = %vm.name, snapshot.moref = %snapshot.moref.value, "cloning snapshot into a template");
        let request = SnapshotClone {
            vm: &vm.moref,
            snapshot: &snapshot.moref,
            folder: &folder,
            name: image,
            host: &host.moref,
            pool,
        };
        let template = clone_snapshot_to_template(session, &request, timeout).await.map_err(|e| {
            let mut error = provider_error(OP)(e);
            if error.kind == ErrorKind::Transient {
                error.message = format!("{}; vSphere may still make template {image}: a retry finds it", error.message);
            }
            error
        })?;
        tracing::info!(template.moref = %template.value, "template made from the snapshot");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soap::MoRef;

    #[test]
    fn memory_follows_the_power_state_unless_asked_and_a_stopped_vm_has_none_to_save() {
        let (on, off) = (PowerState::PoweredOn, PowerState::PoweredOff);
        assert_eq!(plan("ns_web", &on, None, true), Ok((true, false)), "a running VM: with memory, no freeze");
        assert_eq!(plan("ns_web", &on, Some(false), true), Ok((false, true)), "disk only: quiesced");
        assert_eq!(plan("ns_web", &on, Some(false), false), Ok((false, false)));
        assert_eq!(plan("ns_web", &off, None, true), Ok((false, false)), "a stopped VM: disk only");
        let refused = plan("ns_web", &off, Some(true), true).unwrap_err();
        assert!(refused.starts_with("spec.memory: VM ns_web is powered off"), "{refused}");
        assert!(plan("ns_web", &PowerState::Suspended, None, true).unwrap_err().contains("Suspended"));
    }

    #[test]
    fn a_disk_only_snapshot_of_a_running_vm_says_the_vm_ran() {
        let snapshot = |state: PowerState, description: &str| Snapshot {
            moref: MoRef::new("VirtualMachineSnapshot", "snapshot-1"),
            name: "ns_s_u".into(),
            description: description.into(),
            created_unix_seconds: Some(1_796_537_400),
            state,
            quiesced: false,
        };
        let with_memory = info_of(&snapshot(PowerState::PoweredOn, TAKEN_RUNNING));
        assert_eq!((with_memory.memory, with_memory.vm_was_running), (true, true));
        let disk_only = info_of(&snapshot(PowerState::PoweredOff, TAKEN_RUNNING));
        assert_eq!((disk_only.memory, disk_only.vm_was_running), (false, true));
        let stopped = info_of(&snapshot(PowerState::PoweredOff, TAKEN_STOPPED));
        assert_eq!(
            (stopped.memory, stopped.vm_was_running, stopped.created_unix_seconds),
            (false, false, 1_796_537_400)
        );
    }
}
