//! [`VsphereProvider`]: the [`Provider`] operations for one ESXi host
//! (`HostSystem`) of a [`VCenter`], as the OpenStack provider serves one
//! nova-compute host of a cloud.
//!
//! Split by concern: [`vcenter`] (the options and the shared session),
//! [`spec`] (what a tenant may ask for), [`clone`] (making a VM),
//! [`resize`], [`migration`] and [`snapshots`] (the capabilities); the
//! [`Provider`] operations stay here.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;
use tracing::instrument;
use vmlet_provider::{
    Error as ProviderError, ErrorKind, HostInfo, ImageReference, Location, Migration, MigrationMode, MigrationProgress,
    MigrationTarget, PowerState as VmPower, Provider, Resize, ResizeScope, Resources, Result, StopReason, VmId, VmSpec,
    VmStatus,
};

use crate::hosts::{list_hosts, ConnectionState, Host};
use crate::lifecycle::{
    clone_vm, destroy_vm, list_templates, reconfigure_hardware, reconfigure_live, record_next_start, relocate_vm,
    shutdown_guest, CloneRequest, Hardware, NicBacking, NicNetwork,
};
use crate::placement::{read_datacenter, read_portgroup, read_template};
use crate::session::{Session, SessionConfig};
use crate::vms::{power_off, power_on, PowerState, Vm, UID_KEY};
use crate::Error;

mod clone;
mod library;
mod migration;
mod resize;
mod snapshots;
mod spec;
#[cfg(test)]
mod tests;
mod vcenter;

pub use vcenter::{NetworkOffer, VCenter, VCenterOptions, DATASTORE_OPTION, MAX_VM_NAME_CHARS};

/// The provider error of a vSphere failure in `operation`: its kind and
/// vSphere's message, the failure as source.
fn provider_error(operation: &'static str) -> impl Fn(Error) -> ProviderError {
    move |e| ProviderError::new(operation, e.kind(), e.to_string()).with_source(e)
}

/// The VMs vmlet manages on one ESXi host of a [`VCenter`].
///
/// - Identity: a VM is vmlet's when its `config.extraConfig` has
///   `vmlet.io.uid` ([`UID_KEY`]); it is named [`VmSpec::backend_name`].
///   Two VMs carrying one UID (a copy made outside vmlet) stop vmlet from
///   acting on either (`Permanent`, naming both) and are not listed.
/// - `list`/`get` read the vCenter's VMs (`runtime.host` tells the host);
///   `locate` answers for the whole vCenter, naming hosts `<vcenter>/<host>`.
/// - Every operation acts only on a VM on this host; one on another host
///   gets `NotFound` (`Conflict` for `ensure_defined` and `undefine`, which
///   must not make a twin or report a VM elsewhere as gone).
/// - Capabilities: resize, migration and snapshots (`provider/snapshots.rs`:
///   vSphere snapshots, revert, a new VM from one through a template); no
///   console, guest commands, stats or backup: the core answers those with
///   501 or a reason saying vSphere lacks it.
///
/// Cloning is cheap and shares the session.
#[derive(Clone, Debug)]
pub struct VsphereProvider {
    vcenter: Arc<VCenter>,
    host: String,
    /// The host's node name in vmlet (what [`Migration::target`] gives).
    node_name: String,
    /// The host's static facts (reference, pool, datacenter), read once.
    resolved: Arc<OnceCell<Host>>,
}

impl VsphereProvider {
    /// The provider of the ESXi host named `host` (its inventory `name`, as
    /// [`list_hosts`] gives it) of `vcenter`; its node name is `host` until
    /// [`VsphereProvider::with_node_name`] says otherwise.
    pub fn new(vcenter: Arc<VCenter>, host: impl Into<String>) -> VsphereProvider {
        let host = host.into();
        VsphereProvider { vcenter, node_name: host.clone(), host, resolved: Arc::new(OnceCell::new()) }
    }

    /// The same provider, its host known in vmlet as node `name`.
    #[must_use]
    pub fn with_node_name(mut self, name: impl Into<String>) -> Self {
        self.node_name = name.into();
        self
    }

    /// The host's inventory name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The shared vCenter.
    pub fn vcenter(&self) -> &Arc<VCenter> {
        &self.vcenter
    }

    /// This host as vSphere lists it now. Errors: `NotFound` when the
    /// vCenter (its datacenter) has no host of that name.
    async fn host_now(&self, operation: &'static str) -> Result<Host> {
        let hosts = self.vcenter.hosts().await.map_err(provider_error(operation))?;
        hosts.into_iter().find(|h| h.name == self.host).ok_or_else(|| self.no_such_host(operation))
    }

    fn no_such_host(&self, operation: &'static str) -> ProviderError {
        let datacenter =
            self.vcenter.options.datacenter.as_deref().map(|d| format!(" datacenter {d} of")).unwrap_or_default();
        ProviderError::new(
            operation,
            ErrorKind::NotFound,
            format!("the{datacenter} vCenter {} has no ESXi host named {}", self.vcenter.name, self.host),
        )
    }

    /// The host's reference, pool and datacenter (read once; they last the
    /// host's life in the inventory).
    async fn resolved(&self, operation: &'static str) -> Result<&Host> {
        self.resolved.get_or_try_init(|| self.host_now(operation)).await
    }

    async fn session(&self, operation: &'static str) -> Result<&Session> {
        self.vcenter.session().await.map_err(provider_error(operation))
    }

    /// Every VM of the vCenter carrying a vmlet UID (from the push cache
    /// when it is current, else read directly: [`crate::updates::owned_vms`]),
    /// with the UIDs that more than one carries.
    async fn owned_vms(&self, operation: &'static str) -> Result<(Vec<Vm>, HashMap<String, usize>)> {
        let vms = crate::updates::owned_vms(&self.vcenter).await.map_err(provider_error(operation))?;
        let mut counts: HashMap<String, usize> = HashMap::new();
        for vm in &vms {
            *counts.entry(vm.uid.clone()).or_default() += 1;
        }
        Ok((vms, counts))
    }

    /// vmlet's VM with this UID anywhere in the vCenter. Errors: `Permanent`
    /// when two VMs carry it (vmlet acts on neither until one is removed).
    async fn find_anywhere(&self, operation: &'static str, id: &VmId) -> Result<Option<Vm>> {
        let (vms, _) = self.owned_vms(operation).await?;
        let mut carrying = vms.into_iter().filter(|vm| vm.uid == id.0);
        let Some(first) = carrying.next() else { return Ok(None) };
        if let Some(second) = carrying.next() {
            return Err(ProviderError::new(
                operation,
                ErrorKind::Permanent,
                format!(
                    "VMs {} ({}) and {} ({}) both carry {UID_KEY} {id}; vmlet acts on neither until an administrator \
                     removes the one that is not this VM's",
                    first.name, first.moref.value, second.name, second.moref.value
                ),
            ));
        }
        Ok(Some(first))
    }

    /// vmlet's VM with this UID on this host. Errors: `NotFound` when there
    /// is none here (the message names the host it is on, if any).
    async fn find_here(&self, operation: &'static str, id: &VmId) -> Result<Vm> {
        let host = self.resolved(operation).await?;
        let not_found = |why: String| ProviderError::new(operation, ErrorKind::NotFound, why);
        let Some(vm) = self.find_anywhere(operation, id).await? else {
            return Err(not_found(format!("no VM with {UID_KEY} {id} in vCenter {}", self.vcenter.name)));
        };
        if vm.host.as_ref() != Some(&host.moref) {
            let on = self.host_name_of(vm.host.as_ref()).await.unwrap_or_else(|| "no host".into());
            return Err(not_found(format!("VM {} ({id}) is on {on}, not on {}", vm.name, self.host)));
        }
        Ok(vm)
    }

    /// The inventory name of `host`, when vSphere lists it.
    async fn host_name_of(&self, host: Option<&crate::MoRef>) -> Option<String> {
        let host = host?;
        let hosts = list_hosts(self.vcenter.session().await.ok()?).await.ok()?;
        hosts.into_iter().find(|h| h.moref == *host).map(|h| h.name)
    }
}

/// The provider's view of a VM.
fn status_of(vm: &Vm) -> VmStatus {
    let power = match vm.power_state {
        PowerState::PoweredOn => VmPower::Running,
        PowerState::PoweredOff => VmPower::Off,
        PowerState::Suspended => VmPower::Paused,
        PowerState::Other(_) => VmPower::Unknown,
    };
    let cpus = vm.cpus.unwrap_or(0);
    let memory_bytes = vm.memory_bytes.unwrap_or(0);
    // The ceilings of a live resize: those recorded at the clone, where
    // hot-add is on; otherwise the size (a running VM cannot grow).
    let max_cpus = if vm.sizing.cpu_hot_add { vm.sizing.max_cpus.unwrap_or(cpus).max(cpus) } else { cpus };
    let max_memory_bytes = if vm.sizing.memory_hot_add {
        vm.sizing.max_memory_bytes.unwrap_or(memory_bytes).max(memory_bytes)
    } else {
        memory_bytes
    };
    let addresses: Vec<IpAddr> = vm
        .ip_address
        .filter(|ip| !ip.is_loopback() && !is_link_local(ip) && !ip.is_unspecified())
        .into_iter()
        .collect();
    VmStatus {
        id: VmId(vm.uid.clone()),
        backend_name: vm.name.clone(),
        backend_id: vm.moref.value.clone(),
        power,
        stop_reason: (!power.is_active()).then_some(StopReason::Unknown),
        fault: None,
        cpus,
        memory_bytes,
        max_cpus,
        max_memory_bytes,
        next_start: match (vm.sizing.next_cpus, vm.sizing.next_memory_bytes) {
            (Some(cpus_next), Some(memory_next)) if (cpus_next, memory_next) != (cpus, memory_bytes) => {
                Some(Resources { cpus: cpus_next, memory_bytes: memory_next })
            }
            _ => None,
        },
        network_interfaces: addresses.len(),
        addresses,
    }
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// Why `host` cannot run VMs now, for its node's NotReady condition:
/// disconnected, not responding, in maintenance mode; `None` when it can.
fn not_ready_reason(host: &Host) -> Option<String> {
    let why = match (&host.connection_state, host.in_maintenance_mode) {
        (ConnectionState::Connected, false) => return None,
        (ConnectionState::Connected, true) => "is in maintenance mode".to_owned(),
        (ConnectionState::Disconnected, _) => "is disconnected from vCenter".to_owned(),
        (ConnectionState::NotResponding, _) => "is not responding to vCenter".to_owned(),
        (ConnectionState::Other(state), _) => format!("has connection state {state}"),
    };
    Some(format!("ESXi host {} {why}", host.name))
}

/// The memory vSphere gives a VM asked for `bytes`, in MiB: rounded up to
/// whole MiB and to a multiple of 4 MiB, which vSphere requires of
/// `memoryMB`.
fn memory_mib_of(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20).div_ceil(4) * 4
}

/// `<vcenter>/<host>`, as [`Provider::backend_host`] and [`Location::OtherHost`] name a host.
fn qualified(vcenter: &VCenter, host: &str) -> String {
    format!("{}/{host}", vcenter.name)
}

#[async_trait::async_trait]
impl Provider for VsphereProvider {
    fn kind(&self) -> &'static str {
        "vsphere"
    }

    /// Reads the host's `runtime.connectionState` and
    /// `runtime.inMaintenanceMode`. Errors: `Transient` when the vCenter is
    /// unreachable, or the host is disconnected, not responding or in
    /// maintenance mode (the message says which, so the node's NotReady
    /// condition does); `PermissionDenied` for refused credentials;
    /// `NotFound` when the vCenter has no such host.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host))]
    async fn ping(&self) -> Result<()> {
        const OP: &str = "ping";
        let host = self.host_now(OP).await?;
        match not_ready_reason(&host) {
            None => Ok(()),
            Some(why) => Err(ProviderError::new(OP, ErrorKind::Transient, why)),
        }
    }

    /// The host's physical cores (`summary.hardware.numCpuCores`) and
    /// memory (`summary.hardware.memorySize`, bytes), architecture `amd64`
    /// (ESXi runs on x86-64), hypervisor = the server's `about.fullName`.
    /// Errors: `NotFound`; `Transient` when vSphere reports no hardware (a
    /// host never connected) or is unreachable.
    async fn host_info(&self) -> Result<HostInfo> {
        const OP: &str = "probe host";
        let host = self.host_now(OP).await?;
        let (Some(cpus), Some(memory_bytes)) = (host.cpu_cores, host.memory_bytes) else {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Transient,
                format!("vSphere reports no hardware for ESXi host {} (never connected?)", self.host),
            ));
        };
        let session = self.session(OP).await?;
        Ok(HostInfo {
            cpus,
            memory_bytes,
            architecture: "amd64".into(),
            hypervisor: session.service_content().full_name.clone(),
            accelerator: None,
            storage_roots: Vec::new(),
        })
    }

    async fn list(&self) -> Result<Vec<VmStatus>> {
        const OP: &str = "list VMs";
        let host = self.resolved(OP).await?.moref.clone();
        let (vms, counts) = self.owned_vms(OP).await?;
        let mut out = Vec::new();
        for vm in vms.iter().filter(|vm| vm.host.as_ref() == Some(&host)) {
            if counts[&vm.uid] > 1 {
                tracing::warn!(vm.uid = %vm.uid, vm.name = %vm.name, "more than one VM carries this UID; not listed");
                continue;
            }
            out.push(status_of(vm));
        }
        Ok(out)
    }

    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>> {
        const OP: &str = "get VM";
        let host = self.resolved(OP).await?.moref.clone();
        Ok(self.find_anywhere(OP, id).await?.filter(|vm| vm.host.as_ref() == Some(&host)).as_ref().map(status_of))
    }

    /// `<vcenter>/<host name>`: the vCenter's name keeps two vCenters'
    /// hosts of the same name apart.
    fn backend_host(&self) -> Option<String> {
        Some(qualified(&self.vcenter, &self.host))
    }

    /// Live within the hot-add ceilings, else for the next start
    /// ([`Resize` for `VsphereProvider`]).
    fn resize(&self) -> Option<&dyn Resize> {
        Some(self)
    }

    /// vMotion and cold relocation to another host of the same vCenter
    /// ([`Migration` for `VsphereProvider`]).
    fn migration(&self) -> Option<&dyn Migration> {
        Some(self)
    }

    /// vSphere's snapshots of a VM of this host, and new VMs from one
    /// through a template (`provider/snapshots.rs`).
    fn snapshots(&self) -> Option<&dyn vmlet_provider::Snapshots> {
        Some(self)
    }

    /// Where the vCenter holds the VM with this UID: `ThisHost`,
    /// `OtherHost(<vcenter>/<host>)`, or `Nowhere`.
    async fn locate(&self, id: &VmId, _backend_name: &str) -> Result<Location> {
        const OP: &str = "locate VM";
        let host = self.resolved(OP).await?.moref.clone();
        Ok(match self.find_anywhere(OP, id).await? {
            None => Location::Nowhere,
            Some(vm) if vm.host.as_ref() == Some(&host) => Location::ThisHost(status_of(&vm)),
            Some(vm) => match self.host_name_of(vm.host.as_ref()).await {
                Some(name) => Location::OtherHost(qualified(&self.vcenter, &name)),
                None => Location::Nowhere,
            },
        })
    }

    /// Clones the template `spec.image` (one of `vcenters[].templates`, or
    /// the template deployed from one of `vcenters[].libraryItems`:
    /// `provider/library.rs`) onto this host, powered off, with `vmlet.io.uid`, the spec's size and
    /// hot-add ceilings, in the configured folder, pool and datastore, its
    /// network cards on `spec.networks`, linked to the template's current
    /// snapshot if it has one (see `placement`), unless the
    /// vCenter has a VM with this UID (then that one is returned unchanged:
    /// no second clone, no resize).
    ///
    /// Errors: `InvalidInput` naming the field for a template, datastore or
    /// network not allowed (with the allowed names), a template not in the
    /// datacenter, another provider option, kernel boot, a MAC address, more
    /// networks than the template has cards, a name over 80 characters;
    /// `Unsupported` for cloud-init data and data disks; `Conflict` when the
    /// VM is on another host; `Permanent` when two VMs carry the UID, the
    /// name is taken by a VM without it, or a configured folder, pool,
    /// datastore or network is not in the datacenter (naming the field);
    /// `Transient` when the clone outlives its deadline (the next call finds
    /// it by its UID).
    #[instrument(skip(self, spec), fields(provider = "vsphere", host = %self.host, vm.uid = %spec.id, vm.name = %spec.backend_name()))]
    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus> {
        const OP: &str = "define VM";
        let template = self.check_spec(spec)?;
        let host = self.resolved(OP).await?.moref.clone();
        if let Some(vm) = self.find_anywhere(OP, &spec.id).await? {
            if vm.host.as_ref() == Some(&host) {
                return Ok(status_of(&vm));
            }
            let on = self.host_name_of(vm.host.as_ref()).await.unwrap_or_else(|| "no host".into());
            return Err(ProviderError::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "VM {} with this VM's UID exists on {on}; vmlet does not make a second one on {}",
                    vm.name, self.host
                ),
            ));
        }
        if self.vcenter.options.library_items.iter().any(|item| item == template) {
            let deployed = self.library_template(template).await?;
            self.clone_here(spec, &deployed).await?;
        } else {
            self.clone_here(spec, template).await?;
        }
        Ok(status_of(&self.find_here(OP, &spec.id).await?))
    }

    /// `PowerOnVM_Task`, waited for ([`VCenterOptions::task_timeout`]); a
    /// running VM is left alone. Errors: `NotFound` when this host has no
    /// such VM.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn start(&self, id: &VmId) -> Result<()> {
        const OP: &str = "start VM";
        let vm = self.find_here(OP, id).await?;
        if vm.power_state == PowerState::PoweredOn {
            return Ok(());
        }
        let session = self.session(OP).await?;
        power_on(session, &vm.moref, self.vcenter.options.task_timeout).await.map_err(provider_error(OP))
    }

    /// `ShutdownGuest`: VMware Tools in the guest shut it down; returns at
    /// once. An inactive VM is left alone. A guest without running Tools
    /// (`ToolsUnavailable`) cannot be asked: that is logged and answered
    /// with success, as a guest that ignores an ACPI button press, so the
    /// node agent powers it off ([`Provider::destroy`]) after the grace
    /// period.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn shutdown(&self, id: &VmId) -> Result<()> {
        const OP: &str = "shut down VM";
        let vm = self.find_here(OP, id).await?;
        if vm.power_state != PowerState::PoweredOn {
            return Ok(());
        }
        let session = self.session(OP).await?;
        match shutdown_guest(session, &vm.moref).await {
            Err(e) if matches!(e.fault(), Some("ToolsUnavailable" | "ToolsNotRunning")) => {
                tracing::warn!(vm.name = %vm.name, error = %e, "no VMware Tools in the guest to shut it down; it is powered off after the grace period");
                Ok(())
            }
            Err(e) if e.fault() == Some("InvalidPowerState") => Ok(()),
            other => other.map_err(provider_error(OP)),
        }
    }

    /// `PowerOffVM_Task` (no guest shutdown), waited for
    /// ([`VCenterOptions::task_timeout`]); an inactive VM is left alone.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn destroy(&self, id: &VmId) -> Result<()> {
        const OP: &str = "power off VM";
        let vm = self.find_here(OP, id).await?;
        if vm.power_state == PowerState::PoweredOff {
            return Ok(());
        }
        let session = self.session(OP).await?;
        power_off(session, &vm.moref, self.vcenter.options.task_timeout).await.map_err(provider_error(OP))
    }

    /// Templates from the vCenter's inventory, not host paths.
    fn image_reference(&self) -> ImageReference {
        ImageReference::Catalog
    }

    /// `Destroy_Task` of a powered-off VM (its disks go with it: they were
    /// cloned for it), waited for. No VM with this UID is success.
    /// Errors: `InvalidInput` while it is on or suspended; `Conflict` when
    /// it is on another host.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn undefine(&self, id: &VmId) -> Result<()> {
        const OP: &str = "delete VM";
        let host = self.resolved(OP).await?.moref.clone();
        let Some(vm) = self.find_anywhere(OP, id).await? else { return Ok(()) };
        if vm.host.as_ref() != Some(&host) {
            let on = self.host_name_of(vm.host.as_ref()).await.unwrap_or_else(|| "no host".into());
            return Err(ProviderError::new(
                OP,
                ErrorKind::Conflict,
                format!("VM {} ({id}) is on {on}, not on {}; delete it there", vm.name, self.host),
            ));
        }
        if vm.power_state != PowerState::PoweredOff {
            return Err(ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!("VM {} is {:?}; power it off before deleting it", vm.name, vm.power_state),
            ));
        }
        let session = self.session(OP).await?;
        match destroy_vm(session, &vm.moref, self.vcenter.options.task_timeout).await {
            Err(e) if e.fault() == Some("ManagedObjectNotFound") => Ok(()),
            other => other.map_err(provider_error(OP)),
        }?;
        tracing::info!(vm.name = %vm.name, vm.moref = %vm.moref.value, "VM destroyed");
        Ok(())
    }
}
