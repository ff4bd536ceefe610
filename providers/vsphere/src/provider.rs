//! [`VsphereProvider`]: the [`Provider`] operations for one ESXi host
//! (`HostSystem`) of a [`VCenter`], as the OpenStack provider serves one
//! nova-compute host of a cloud.

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
    clone_vm, destroy_vm, list_templates, reconfigure_size, relocate_vm, shutdown_guest, CloneRequest,
};
use crate::session::{Session, SessionConfig};
use crate::vms::{list_vms, power_off, power_on, PowerState, Vm, UID_KEY};
use crate::Error;

/// vSphere's limit on a VM's name, in characters.
pub const MAX_VM_NAME_CHARS: usize = 80;

/// What vmlet's administrator allows and how long vmlet waits, for one vCenter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VCenterOptions {
    /// The datacenter whose hosts and templates are used; `None`: any
    /// (then a template is looked up in the datacenter of the VM's host).
    pub datacenter: Option<String>,
    /// The template names `spec.image` may name: a security boundary (vmlet's
    /// user may clone any VM of the vCenter; a tenant only these). Empty:
    /// no VM can be defined.
    pub templates: Vec<String>,
    /// Deadline of a `CloneVM_Task` (default 10 min).
    pub clone_timeout: Duration,
    /// Deadline of every other task: power on and off, reconfigure,
    /// destroy (default 2 min).
    pub task_timeout: Duration,
}

impl Default for VCenterOptions {
    fn default() -> Self {
        VCenterOptions {
            datacenter: None,
            templates: Vec::new(),
            clone_timeout: Duration::from_secs(600),
            task_timeout: Duration::from_secs(120),
        }
    }
}

/// One vCenter (or standalone ESXi) shared by the providers of its hosts:
/// its name in vmlet's config, one [`Session`] opened at the first call
/// (and again at the next call after a failed connect, so a vCenter that is
/// down when vmlet starts is NotReady, not fatal), and the options.
pub struct VCenter {
    name: String,
    config: SessionConfig,
    session: OnceCell<Session>,
    options: VCenterOptions,
}

impl std::fmt::Debug for VCenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VCenter").field("name", &self.name).field("url", &self.config.url).finish_non_exhaustive()
    }
}

impl VCenter {
    /// A vCenter named `name` (config `vcenters[].name`, used in
    /// [`Provider::backend_host`]) reached with `config`; nothing is
    /// connected yet.
    pub fn new(name: impl Into<String>, config: SessionConfig, options: VCenterOptions) -> VCenter {
        VCenter { name: name.into(), config, session: OnceCell::new(), options }
    }

    /// Its name in vmlet's config.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The options.
    pub fn options(&self) -> &VCenterOptions {
        &self.options
    }

    /// The logged-in session, connecting on the first call.
    ///
    /// Errors: those of [`Session::connect`].
    pub async fn session(&self) -> std::result::Result<&Session, Error> {
        self.session.get_or_try_init(|| Session::connect(self.config.clone())).await
    }

    /// The hosts of the configured datacenter (all hosts without one).
    ///
    /// Errors: those of [`Session::connect`] and [`list_hosts`].
    pub async fn hosts(&self) -> std::result::Result<Vec<Host>, Error> {
        let hosts = list_hosts(self.session().await?).await?;
        Ok(hosts
            .into_iter()
            .filter(|h| self.options.datacenter.as_ref().is_none_or(|dc| *dc == h.datacenter))
            .collect())
    }
}

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
/// - Capabilities: none in this slice (no console, guest commands, stats,
///   resize, migration, backup, snapshots): the core answers those with
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

    /// Every VM of the vCenter carrying a vmlet UID, with the UIDs that
    /// more than one carries.
    async fn owned_vms(&self, operation: &'static str) -> Result<(Vec<Vm>, HashMap<String, usize>)> {
        let vms = list_vms(self.session(operation).await?).await.map_err(provider_error(operation))?;
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

    /// `spec` as this slice can make it, or `InvalidInput`/`Unsupported`
    /// naming the field; returns the template name.
    fn check_spec<'s>(&self, spec: &'s VmSpec) -> Result<&'s str> {
        const OP: &str = "define VM";
        let invalid = |message: String| ProviderError::new(OP, ErrorKind::InvalidInput, message);
        if let Some(key) = spec.options.keys().next() {
            return Err(invalid(format!(
                "spec.providerOptions.{key}: the vSphere provider reads no provider options; remove it"
            )));
        }
        if spec.kernel_boot.is_some() {
            return Err(invalid(
                "spec.kernel: vSphere cannot boot a kernel directly; boot from a template (spec.image)".into(),
            ));
        }
        if spec.cloud_init.is_some() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                "spec.cloudInit: the vSphere provider does not deliver cloud-init data yet; remove it",
            ));
        }
        if let Some(disk) = spec.disks.first() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                format!("spec.disks[{}]: the vSphere provider attaches no data disks yet; remove it", disk.name),
            ));
        }
        if let Some(network) = spec.networks.first() {
            return Err(invalid(format!(
                "spec.networks[0].name: {:?} is not offered: this vSphere host offers no networks by name (allowed: \
                 []); remove spec.networks, the VM keeps its template's networks",
                network.name
            )));
        }
        let allowed = &self.vcenter.options.templates;
        let template = spec.image.as_deref().filter(|i| !i.is_empty()).ok_or_else(|| {
            invalid(format!("spec.image: name the template to clone, one of [{}]", allowed.join(", ")))
        })?;
        if !allowed.iter().any(|t| t == template) {
            return Err(invalid(format!(
                "spec.image: template {template:?} is not one this vCenter allows (allowed: [{}]); use one of them, or \
                 ask vmlet's administrator to add it to vcenters[].templates",
                allowed.join(", ")
            )));
        }
        let name = spec.backend_name();
        if name.chars().count() > MAX_VM_NAME_CHARS {
            return Err(invalid(format!(
                "metadata.name: the VM's vSphere name {name:?} (<namespace>_<name>) is longer than vSphere's \
                 {MAX_VM_NAME_CHARS} characters; use a shorter name"
            )));
        }
        Ok(template)
    }

    /// Clone `template` onto this host as `spec`'s VM, then make sure it
    /// has `spec`'s size (`ReconfigVM_Task` when the clone did not apply
    /// the clone spec's `numCPUs`/`memoryMB`, as govmomi's simulator).
    async fn clone_here(&self, spec: &VmSpec, template_name: &str) -> Result<()> {
        const OP: &str = "define VM";
        let host = self.resolved(OP).await?;
        let session = self.session(OP).await?;
        let datacenter = self.vcenter.options.datacenter.as_deref().unwrap_or(&host.datacenter);
        let templates = list_templates(session).await.map_err(provider_error(OP))?;
        let mut matching = templates.iter().filter(|t| t.name == template_name && t.datacenter == datacenter);
        let template = matching.next().ok_or_else(|| {
            ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!("spec.image: datacenter {datacenter} has no template named {template_name:?}"),
            )
        })?;
        if matching.next().is_some() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!(
                    "spec.image: datacenter {datacenter} has two templates named {template_name:?}; vmlet clones \
                     neither until an administrator renames one"
                ),
            ));
        }
        let (Some(folder), Some(pool)) = (template.folder.as_ref(), host.resource_pool.as_ref()) else {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!("template {template_name} has no folder or host {} no resource pool in vSphere", self.host),
            ));
        };
        let memory_mib = memory_mib_of(spec.memory_bytes);
        let name = spec.backend_name();
        let request = CloneRequest {
            template: &template.moref,
            folder,
            name: &name,
            host: &host.moref,
            pool,
            uid: &spec.id.0,
            cpus: spec.cpus,
            memory_mib,
        };
        tracing::info!(template = %template_name, vm.backend_name = %name, "cloning template");
        let vm = clone_vm(session, &request, self.vcenter.options.clone_timeout).await.map_err(|e| {
            if e.fault() == Some("DuplicateName") {
                ProviderError::new(
                    OP,
                    ErrorKind::Permanent,
                    format!("a VM named {name} that does not carry this VM's {UID_KEY} exists in vSphere: {e}"),
                )
                .with_source(e)
            } else {
                provider_error(OP)(e)
            }
        })?;
        tracing::info!(vm.moref = %vm.value, "VM cloned");
        let made = self.find_here(OP, &spec.id).await?;
        if made.cpus != Some(spec.cpus) || made.memory_bytes != Some(memory_mib << 20) {
            reconfigure_size(session, &vm, spec.cpus, memory_mib, self.vcenter.options.task_timeout)
                .await
                .map_err(provider_error(OP))?;
        }
        Ok(())
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
        max_cpus: cpus,
        max_memory_bytes: memory_bytes,
        next_start: None,
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

    /// Resize of a powered-off VM ([`Resize` for `VsphereProvider`]).
    fn resize(&self) -> Option<&dyn Resize> {
        Some(self)
    }

    /// vMotion and cold relocation to another host of the same vCenter
    /// ([`Migration` for `VsphereProvider`]).
    fn migration(&self) -> Option<&dyn Migration> {
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

    /// Clones the template `spec.image` (one of `vcenters[].templates`) onto
    /// this host, powered off, with `vmlet.io.uid` and the spec's size,
    /// unless the vCenter has a VM with this UID (then that one is returned
    /// unchanged: no second clone, no resize).
    ///
    /// Errors: `InvalidInput` naming the field for a template not allowed or
    /// not in the datacenter, a provider option, kernel boot, a network,
    /// a name over 80 characters; `Unsupported` for cloud-init data and data
    /// disks; `Conflict` when the VM is on another host; `Permanent` when two
    /// VMs carry the UID or the name is taken by a VM without it;
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
        self.clone_here(spec, template).await?;
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

/// Resize: `ReconfigVM_Task` of a powered-off VM (`numCPUs`, one core per
/// socket, `memoryMB` rounded up to a multiple of 4 MiB). vmlet's clones have
/// no CPU or memory hot-add, so a VM's ceilings are its size and a running
/// VM keeps its size: the node agent gives it the new one before its next
/// power-on (as it does on every back end after a next-start resize).
#[async_trait::async_trait]
impl Resize for VsphereProvider {
    /// Errors: `Unsupported` for [`ResizeScope::Live`] and for a VM that is
    /// not powered off (the message says the size applies at the next
    /// start); `InvalidInput` for no vCPU or no memory; `NotFound` when this
    /// host has no such VM; a task's fault by its kind ([`provider_error`]).
    /// Idempotent: a VM of that size is left alone, powered on or not.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn resize(&self, id: &VmId, to: Resources, _ceilings: Resources, scope: ResizeScope) -> Result<()> {
        const OP: &str = "resize VM";
        if to.cpus == 0 || to.memory_bytes == 0 {
            return Err(ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.resources: {} vCPUs and {} bytes of memory; both must be at least 1",
                    to.cpus, to.memory_bytes
                ),
            ));
        }
        let vm = self.find_here(OP, id).await?;
        let memory_mib = memory_mib_of(to.memory_bytes);
        if vm.cpus == Some(to.cpus) && vm.memory_bytes == Some(memory_mib << 20) {
            return Ok(());
        }
        if scope == ResizeScope::Live {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "VM {} has no CPU or memory hot-add on vSphere; the new size applies at its next start",
                    vm.name
                ),
            ));
        }
        if vm.power_state != PowerState::PoweredOff {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "vSphere resizes VM {} only while it is powered off; the new size applies at its next start",
                    vm.name
                ),
            ));
        }
        let session = self.session(OP).await?;
        reconfigure_size(session, &vm.moref, to.cpus, memory_mib, self.vcenter.options.task_timeout)
            .await
            .map_err(provider_error(OP))
    }
}

/// Migration: `RelocateVM_Task` to another ESXi host of the same vCenter and
/// that host's root pool, disks left on their datastore (shared within a
/// cluster): vMotion of a running VM, a cold relocation of one that is off.
/// A target is named `<vcenter>/<host name>` ([`qualified`]).
#[async_trait::async_trait]
impl Migration for VsphereProvider {
    fn target(&self) -> MigrationTarget {
        MigrationTarget { host: self.node_name.clone(), address: qualified(&self.vcenter, &self.host) }
    }

    /// Errors: `NotFound` when this host has no such VM (it may have moved
    /// already); `InvalidInput` for a target of another vCenter, one the
    /// vCenter does not have, this host itself, or a power state that does
    /// not fit the mode (live: powered on; cold: powered off); the task's
    /// fault by its kind ([`provider_error`]); `Transient` when the task
    /// outlives `timeout` (the move may still finish: the VM is then found
    /// on the target).
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, target = %to.host))]
    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()> {
        const OP: &str = "migrate VM";
        let invalid = |message: String| ProviderError::new(OP, ErrorKind::InvalidInput, message);
        let Some((vcenter, host_name)) = to.address.split_once('/') else {
            return Err(invalid(format!(
                "target {} has no vSphere address (<vcenter>/<host>): {:?}",
                to.host, to.address
            )));
        };
        if vcenter != self.vcenter.name {
            return Err(invalid(format!(
                "target {} is on vCenter {vcenter}, this VM on {}: vmlet moves VMs within one vCenter",
                to.host, self.vcenter.name
            )));
        }
        if host_name == self.host {
            return Err(invalid(format!("target {} is the VM's own host {}", to.host, self.host)));
        }
        let vm = self.find_here(OP, id).await?;
        let wanted = match mode {
            MigrationMode::Live => PowerState::PoweredOn,
            MigrationMode::Cold => PowerState::PoweredOff,
        };
        if vm.power_state != wanted {
            return Err(invalid(format!(
                "VM {} is {:?}; a {mode:?} migration moves a VM that is {wanted:?}",
                vm.name, vm.power_state
            )));
        }
        let hosts = self.vcenter.hosts().await.map_err(provider_error(OP))?;
        let target = hosts
            .iter()
            .find(|h| h.name == host_name)
            .ok_or_else(|| invalid(format!("vCenter {vcenter} has no host {host_name} (target {})", to.host)))?;
        let pool = target.resource_pool.as_ref().ok_or_else(|| {
            ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!("vSphere reports no resource pool for host {host_name}"),
            )
        })?;
        let session = self.session(OP).await?;
        tracing::info!(vm.name = %vm.name, to = %host_name, ?mode, "relocating VM");
        relocate_vm(session, &vm.moref, &target.moref, pool, timeout).await.map_err(provider_error(OP))
    }

    /// vmlet does not read a relocation task's progress: `None`.
    async fn progress(&self, _id: &VmId) -> Result<Option<MigrationProgress>> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soap::MoRef;

    fn vm(power_state: PowerState, ip: Option<&str>) -> Vm {
        Vm {
            uid: "u-1".into(),
            name: "ns_web".into(),
            moref: MoRef::new("VirtualMachine", "vm-42"),
            host: Some(MoRef::new("HostSystem", "host-21")),
            power_state,
            cpus: Some(2),
            memory_bytes: Some(512 << 20),
            ip_address: ip.map(|i| i.parse().unwrap()),
        }
    }

    #[test]
    fn a_running_vm_reports_its_size_moref_and_routable_address() {
        let status = status_of(&vm(PowerState::PoweredOn, Some("10.0.0.7")));
        assert_eq!((status.power, status.stop_reason), (VmPower::Running, None));
        assert_eq!((status.backend_id.as_str(), status.backend_name.as_str()), ("vm-42", "ns_web"));
        assert_eq!((status.cpus, status.memory_bytes, status.max_cpus), (2, 512 << 20, 2));
        assert_eq!(status.addresses, vec!["10.0.0.7".parse::<IpAddr>().unwrap()]);
        let link_local = status_of(&vm(PowerState::PoweredOn, Some("169.254.1.1")));
        assert!(link_local.addresses.is_empty());
    }

    #[test]
    fn a_powered_off_vm_is_off_for_an_unknown_reason_and_suspended_is_paused() {
        let off = status_of(&vm(PowerState::PoweredOff, None));
        assert_eq!((off.power, off.stop_reason), (VmPower::Off, Some(StopReason::Unknown)));
        assert_eq!(status_of(&vm(PowerState::Suspended, None)).power, VmPower::Paused);
    }

    fn provider(templates: &[&str]) -> VsphereProvider {
        let config = SessionConfig::new(
            "https://127.0.0.1:1/sdk",
            crate::Trust::Thumbprint("00".repeat(32).parse().unwrap()),
            "u",
            crate::Secret::new("p"),
        );
        let options =
            VCenterOptions { templates: templates.iter().map(|t| (*t).to_owned()).collect(), ..Default::default() };
        VsphereProvider::new(Arc::new(VCenter::new("vc1", config, options)), "DC0_C0_H0")
    }

    fn spec(image: &str) -> VmSpec {
        VmSpec {
            id: VmId("u-1".into()),
            namespace: "tenant".into(),
            name: "web".into(),
            cpus: 1,
            memory_bytes: 256 << 20,
            max_cpus: None,
            max_memory_bytes: None,
            image: Some(image.into()),
            image_backing_chain: None,
            kernel_boot: None,
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: vec![],
        }
    }

    #[test]
    fn a_template_the_config_does_not_allow_is_refused_naming_the_field_and_the_allowed_ones() {
        let p = provider(&["template-c0", "template-h0"]);
        assert_eq!(p.check_spec(&spec("template-c0")).unwrap(), "template-c0");
        let error = p.check_spec(&spec("DC0_C0_RP0_VM1")).unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidInput);
        assert_eq!(
            error.message,
            "spec.image: template \"DC0_C0_RP0_VM1\" is not one this vCenter allows (allowed: [template-c0, \
             template-h0]); use one of them, or ask vmlet's administrator to add it to vcenters[].templates"
        );
    }

    #[test]
    fn options_networks_and_long_names_are_refused_before_anything_is_cloned() {
        let p = provider(&["t"]);
        let mut with_option = spec("t");
        with_option.options.insert("folder".into(), "x".into());
        let error = p.check_spec(&with_option).unwrap_err();
        assert!(error.message.starts_with("spec.providerOptions.folder:"), "{}", error.message);
        let mut with_network = spec("t");
        with_network.networks.push(vmlet_provider::NetworkRequest { name: "lan".into(), mac: None });
        assert!(p.check_spec(&with_network).unwrap_err().message.starts_with("spec.networks[0].name:"));
        let mut long = spec("t");
        long.name = "n".repeat(80);
        assert!(p.check_spec(&long).unwrap_err().message.starts_with("metadata.name:"));
        assert!(p.check_spec(&spec("")).unwrap_err().message.starts_with("spec.image:"));
    }

    #[test]
    fn memory_is_rounded_up_to_the_4_mib_multiple_vsphere_requires() {
        assert_eq!(memory_mib_of(256 << 20), 256);
        assert_eq!(memory_mib_of((257 << 20) - 1), 260);
        assert_eq!(memory_mib_of(1), 4);
    }

    #[test]
    fn a_host_disconnected_not_responding_or_in_maintenance_is_not_ready_saying_which() {
        let host = |state: ConnectionState, maintenance: bool| Host {
            name: "esx-1".into(),
            moref: MoRef::new("HostSystem", "host-1"),
            cluster: None,
            datacenter: "DC0".into(),
            cpu_cores: Some(8),
            memory_bytes: Some(1 << 35),
            connection_state: state,
            in_maintenance_mode: maintenance,
            resource_pool: None,
        };
        assert_eq!(not_ready_reason(&host(ConnectionState::Connected, false)), None);
        assert_eq!(
            not_ready_reason(&host(ConnectionState::Connected, true)).as_deref(),
            Some("ESXi host esx-1 is in maintenance mode")
        );
        assert_eq!(
            not_ready_reason(&host(ConnectionState::Disconnected, false)).as_deref(),
            Some("ESXi host esx-1 is disconnected from vCenter")
        );
        assert_eq!(
            not_ready_reason(&host(ConnectionState::NotResponding, true)).as_deref(),
            Some("ESXi host esx-1 is not responding to vCenter")
        );
    }

    #[test]
    fn a_host_is_named_with_its_vcenter() {
        assert_eq!(provider(&[]).backend_host().as_deref(), Some("vc1/DC0_C0_H0"));
    }
}
