//! The contract between vmlet's core and a hypervisor backend.
//!
//! A [`Provider`] manages the VMs of one hypervisor host (a libvirt connection, a
//! Nova hypervisor, a vSphere HostSystem). vmlet's node agent drives it
//! level-triggered: it reads what the provider reports ([`VmStatus`]), compares it
//! with the pod, and calls the idempotent operations below.
//!
//! Identity: every VM is keyed by [`VmId`], the Kubernetes VirtualMachine object's
//! UID, which the provider records in the backend's own metadata so that vmlet can
//! find its VMs again after a restart without recreating anything.
//!
//! This crate names no backend and no Kubernetes type.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

mod backup;
mod capabilities;
mod error;
mod host_image;
mod migration;
mod resize;
mod snapshot;
mod volume;
pub use backup::{
    Backup, BackupOutcome, BackupProgress, BackupRequest, Consistency, DataDiskCopy, DataDiskFile, InPlaceRestore,
    IncrementalBase, RestoredDataDisk,
};
pub use capabilities::{
    Console, ConsoleChunk, GuestConnection, GuestExec, PortForward, Stats, StreamIo, TermSize, VmStats,
};
pub use error::{Error, ErrorKind, Result};
pub use host_image::{BackingFile, DiskFormat, HostImages, ImageFacts};
pub use migration::{Migration, MigrationMode, MigrationProgress, MigrationTarget};
pub use resize::{Resize, ResizeScope, Resources};
pub use snapshot::{
    is_restored_image_of, restored_image_name, RevertOutcome, SnapshotInfo, SnapshotRequest, Snapshots,
};
pub use volume::{validate_volume_name, Volume, VolumeRequest, VolumeSource, Volumes, MAX_VOLUME_NAME_BYTES};

/// The stable identity of a VM: the UID of its VirtualMachine object
/// (`metadata.uid`, an RFC 4122 UUID string).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VmId(pub String);

impl fmt::Display for VmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the core asks a provider to define: one VM's backend-neutral shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmSpec {
    /// Stable identity, recorded in the backend's metadata.
    pub id: VmId,
    /// Namespace of the VirtualMachine object.
    pub namespace: String,
    /// Name of the VirtualMachine object.
    pub name: String,
    /// Number of virtual CPUs (at least 1).
    pub cpus: u32,
    /// Guest memory in bytes (at least 1 MiB; providers round up to what the
    /// backend allocates, e.g. KiB for libvirt).
    pub memory_bytes: u64,
    /// Hot-plug ceiling for vCPUs, fixed at definition: a live resize may grow
    /// the VM up to it. `None` (or less than `cpus`): `cpus` itself.
    pub max_cpus: Option<u32>,
    /// Hot-plug ceiling for memory in bytes (libvirt: the balloon's maximum),
    /// fixed at definition. `None` (or less than `memory_bytes`): `memory_bytes`.
    pub max_memory_bytes: Option<u64>,
    /// Optional boot disk: a path or volume name the backend resolves on the host.
    /// vmlet's node agent passes only absolute paths under the host's storage
    /// roots ([`HostInfo::storage_roots`] or the host's config). On a host
    /// path its format is [`DiskFormat::of_image_path`]'s.
    pub image: Option<String>,
    /// The boot image's backing chain as vmlet checked it before the define
    /// (each file under the storage roots, each format as the layer above
    /// states it), top's backing file first; empty when the image stands
    /// alone. Back ends that read host files pin it in the definition, so the
    /// hypervisor never follows a header rewritten after the define, and
    /// check it again before every start and migration. `None`: not pinned,
    /// because vmlet cannot read the host's files (a libvirt connection to
    /// another machine) or the image is no host file; the hypervisor reads
    /// the chain from the headers, as it does without vmlet.
    pub image_backing_chain: Option<Vec<BackingFile>>,
    /// Optional direct kernel boot (backends that cannot boot a kernel directly
    /// refuse it with `InvalidInput`).
    pub kernel_boot: Option<KernelBoot>,
    /// Backend-specific settings from the VirtualMachine's
    /// `spec.providerOptions` (e.g. a Nova flavor or networks), keys and values
    /// as the user wrote them. Each provider documents the keys it reads and
    /// refuses any other with `InvalidInput` naming
    /// `spec.providerOptions.<key>`, so a typo never passes silently.
    pub options: BTreeMap<String, String>,
    /// What a cloud-init guest reads at its first boot, delivered the way the
    /// back end does (libvirt: a NoCloud seed image attached read-only);
    /// `None` for none. Back ends that cannot deliver it refuse the VM with
    /// `Unsupported`.
    pub cloud_init: Option<CloudInit>,
    /// Data disks after the boot disk, in order (libvirt: virtio `vdb`,
    /// `vdc`, ...). vmlet's node agent passes only paths under the host's
    /// storage roots (for a qcow2 image, its backing files too). Back ends
    /// without host-file disks refuse a VM with disks (`Unsupported`).
    pub disks: Vec<DataDisk>,
    /// The VM's network interfaces, in order (the guest's first NIC first),
    /// each on a network the host offers by name (`spec.networks`). Empty:
    /// the back end's default for the VM's namespace (libvirt: the first
    /// network the host's config offers it, or no NIC when it offers none).
    /// Providers refuse a name they do not offer the VM's namespace with
    /// `InvalidInput` naming `spec.networks[<i>].name` and the names they
    /// do offer, before anything is created.
    pub networks: Vec<NetworkRequest>,
}

/// One network interface a VM asks for ([`VmSpec::networks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkRequest {
    /// The network's name as the host's administrator offers it (a DNS
    /// label, e.g. `lan`), never a back-end object the tenant names directly.
    pub name: String,
    /// A fixed MAC address, six lower-case hex octets separated by colons
    /// (`52:54:00:12:34:56`), unicast; `None`: the back end picks one when
    /// the VM is defined and keeps it for the VM's life.
    pub mac: Option<String>,
}

/// A data disk: an image file on the VM's host (a PersistentVolumeClaim's
/// `disk.img`, or a host image the VirtualMachine names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataDisk {
    /// Its name in the VirtualMachine (`spec.disks[].name`); the guest sees
    /// it as the disk's serial (`/dev/disk/by-id/virtio-<name>`).
    pub name: String,
    /// Absolute path of the image on the host; on a back end whose disks
    /// are block-storage volumes, the volume's id ([`Volume::path`]).
    pub path: String,
    /// How the hypervisor reads the image: `Raw` for a claim's image (vmlet
    /// makes it raw); for a host image, what [`HostImages::inspect`] read
    /// from the file, never what a VirtualMachine says.
    pub format: DiskFormat,
    /// When the image does not exist yet, make it: a sparse raw image of
    /// this many bytes (a new volume's first use). `None`: it must exist.
    pub create_bytes: Option<u64>,
    /// The image's backing chain as vmlet checked it (see
    /// [`VmSpec::image_backing_chain`]): empty for a raw image and for a
    /// qcow2 image without a backing file.
    pub backing_chain: Vec<BackingFile>,
}

/// cloud-init's NoCloud data for a VM: the files `meta-data`, `user-data`
/// and `network-config` of its seed
/// (<https://cloudinit.readthedocs.io/en/latest/reference/datasources/nocloud.html>).
/// User data may hold secrets: `Debug` shows sizes only, never contents.
#[derive(Clone, PartialEq, Eq)]
pub struct CloudInit {
    /// `meta-data`'s `instance-id`: cloud-init runs its once-per-instance
    /// modules again when it changes (vmlet gives the VM's UID).
    pub instance_id: String,
    /// `meta-data`'s `local-hostname`, the guest's hostname.
    pub hostname: String,
    /// `user-data` as the user wrote it (`#cloud-config` YAML, a `#!` script,
    /// a MIME multipart); passed through unchanged.
    pub user_data: Vec<u8>,
    /// `network-config` (version 1 or 2), if any.
    pub network_config: Option<Vec<u8>>,
}

impl fmt::Debug for CloudInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudInit")
            .field("instance_id", &self.instance_id)
            .field("hostname", &self.hostname)
            .field("user_data_bytes", &self.user_data.len())
            .field("network_config_bytes", &self.network_config.as_ref().map(Vec::len))
            .finish()
    }
}

/// What [`VmSpec::image`] names on a backend ([`Provider::image_reference`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageReference {
    /// A file on the host (libvirt): vmlet allows it only under the host's
    /// storage roots.
    HostPath,
    /// An image in the back end's own catalog, by name or id (Nova's Glance,
    /// a vSphere template): the back end's access rules apply, not storage
    /// roots.
    Catalog,
}

/// Boot a kernel directly instead of from a disk's boot loader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelBoot {
    /// Path of the kernel image on the host.
    pub kernel: String,
    /// Path of the initramfs on the host, if any.
    pub initrd: Option<String>,
    /// Kernel command line, e.g. `console=ttyS0`.
    pub cmdline: Option<String>,
}

impl VmSpec {
    /// The backend name vmlet gives the VM: `<namespace>_<name>`. Unique per host
    /// because neither a namespace nor an object name may contain `_`.
    pub fn backend_name(&self) -> String {
        backend_name(&self.namespace, &self.name)
    }
}

/// The backend name vmlet gives the VM `name` of `namespace`:
/// `<namespace>_<name>` (see [`VmSpec::backend_name`]).
pub fn backend_name(namespace: &str, name: &str) -> String {
    format!("{namespace}_{name}")
}

/// The power state of a VM as the backend reports it, mapped to a few states the
/// core acts on (libvirt's `virDomainState`, Nova's `power_state`, vSphere's
/// `VirtualMachinePowerState` all map onto these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerState {
    /// The guest is running (or blocked, idle, which is still running).
    Running,
    /// Paused by the hypervisor (suspend, migration pause).
    Paused,
    /// A guest shutdown is in progress.
    ShuttingDown,
    /// Powered off; the definition and disks are kept.
    Off,
    /// The guest crashed; the definition is kept.
    Crashed,
    /// The backend reports a state vmlet does not know.
    Unknown,
}

impl PowerState {
    /// True when the guest holds CPU and memory on the host.
    pub fn is_active(self) -> bool {
        matches!(self, PowerState::Running | PowerState::Paused | PowerState::ShuttingDown)
    }
}

/// Why an inactive VM stopped, as far as the back end knows; the core decides
/// from it whether a VM restarts (its restart policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The guest powered itself off (`poweroff`, an ACPI shutdown it honoured).
    GuestShutdown,
    /// Powered off from the host (libvirt `destroy`, a hard stop).
    Destroyed,
    /// The guest or the hypervisor process crashed.
    Crashed,
    /// Never started since defined, or the back end does not say.
    Unknown,
}

/// Why the hypervisor holds an active guest that does not run: it stopped
/// it for an error, not because anyone asked (libvirt: a domain paused for
/// an I/O error, a watchdog, a guest panic, a failed post-copy migration, or
/// by QEMU itself, which libvirt calls `unknown`: a KVM internal error such
/// as "emulation failure"). A pause someone asked for (suspend, a
/// migration's or a snapshot's pause) is no fault. Reported as
/// [`VmStatus::fault`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The back end's state and reason in its words, e.g. `paused (I/O
    /// error)`, with what it usually means.
    pub reason: String,
    /// The hypervisor's own last error line for the VM's current run, when
    /// the provider can read it (libvirt: the QEMU log of a local host,
    /// `/var/log/libvirt/qemu/<domain>.log`), at most 512 bytes.
    pub detail: Option<String>,
    /// Resuming the guest once the cause is fixed continues it where it
    /// stopped (libvirt: an I/O error, e.g. a full disk): vmlet leaves such a
    /// guest paused whatever its restart policy, as a restart would lose
    /// what it has not written out. Other faults count as failures for the
    /// restart policy.
    pub resumable: bool,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.detail {
            Some(detail) => write!(f, "{}; the hypervisor's log says: {detail}", self.reason),
            None => f.write_str(&self.reason),
        }
    }
}

/// What a provider reports about one of vmlet's VMs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmStatus {
    /// The identity recorded in the backend's metadata.
    pub id: VmId,
    /// The backend's own name for the VM (libvirt domain name, Nova server name).
    pub backend_name: String,
    /// The backend's own identifier (libvirt domain UUID, Nova server id, MoRef),
    /// used as the pod's provider ID and to prove "the same VM" across stop/start.
    pub backend_id: String,
    /// Current power state.
    pub power: PowerState,
    /// Why it stopped, for an inactive VM (`None` while active).
    pub stop_reason: Option<StopReason>,
    /// Why an active VM does not run ([`Fault`]); `None` while it runs, for
    /// a pause someone asked for, and for an inactive VM.
    pub fault: Option<Fault>,
    /// Virtual CPUs the VM has now (online vCPUs of a running VM, the
    /// definition's of an inactive one).
    pub cpus: u32,
    /// Memory the VM has now, in bytes: a running VM's current balloon size.
    /// It follows the guest's balloon driver, so it lags behind a new target
    /// while the driver moves there, and a guest that just started has its
    /// memory ceiling until the driver takes it down to its size (without a
    /// driver, it keeps the ceiling).
    pub memory_bytes: u64,
    /// The vCPU ceiling a live resize may grow to (equal to `cpus` when the VM
    /// was defined without one).
    pub max_cpus: u32,
    /// The memory ceiling in bytes a live resize may grow to.
    pub max_memory_bytes: u64,
    /// The size the VM's persistent definition gives it at its next start,
    /// when that differs from what it has now (a resize that waits for a
    /// restart); `None` when they agree. While the balloon moves (see
    /// `memory_bytes`), a running VM's memory differs from its definition's
    /// too; compare again once it settled.
    pub next_start: Option<Resources>,
    /// Guest addresses, as far as the backend knows them (may be empty):
    /// those of the VM's network interfaces, first interface first, without
    /// loopback and link-local addresses. Reported as the pod's `podIPs`.
    pub addresses: Vec<IpAddr>,
    /// How many network interfaces a running VM has (0 for an inactive one:
    /// not looked at). With `addresses` empty, the guest has not taken an
    /// address yet (or the back end cannot see it), so the agent looks again
    /// sooner.
    pub network_interfaces: usize,
}

/// Where a back end holds a VM, as far as one provider can see
/// ([`Provider::locate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// On this provider's host, in this state.
    ThisHost(VmStatus),
    /// On another host of the same back end, named as that host's provider
    /// names itself in [`Provider::backend_host`] (e.g. `<cloud>/<compute
    /// host>` for Nova): back ends that move VMs by themselves see the whole
    /// back end.
    OtherHost(String),
    /// Not on this host; this provider sees no other host (libvirt: one
    /// connection, one host).
    NotOnThisHost,
    /// Nowhere in the back end (a provider that sees the whole back end).
    Nowhere,
}

/// Capacity and identity of the hypervisor host, probed from the backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInfo {
    /// Logical CPUs the host offers to guests.
    pub cpus: u32,
    /// Memory the host offers to guests, in bytes.
    pub memory_bytes: u64,
    /// CPU architecture in Kubernetes' terms (`amd64`, `arm64`, ...).
    pub architecture: String,
    /// Backend and version, e.g. `libvirt 9.0.0 (QEMU)`; shown as the node's
    /// container runtime version.
    pub hypervisor: String,
    /// How guests run on this host, where the backend chooses: `kvm` (hardware
    /// virtualization) or `tcg` (software emulation); `None` when it does not
    /// apply (a simulator) or the backend does not say. Reported as the node
    /// label `vmlet.io/accelerator`.
    pub accelerator: Option<String>,
    /// The backend's default storage roots: absolute directories on the host
    /// where its disk images conventionally live (libvirt: the target path of
    /// the storage pool named `default`, else `/var/lib/libvirt/images`). vmlet
    /// allows a VM's image, kernel, initrd and host-image data disks only
    /// under the host's storage roots; these apply when the host's config
    /// names none. Empty when the
    /// backend has no such place (then only VMs without files can be defined).
    pub storage_roots: Vec<String>,
}

/// A hint from a back end that pushes changes ([`Provider::changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The VM with this identity may have changed: read it again.
    Vm(VmId),
    /// Changes may have been missed (the back end's connection was opened
    /// again): read every VM of the host again.
    All,
}

/// One hypervisor host's VMs. Every operation is idempotent: calling it again
/// after success (or after a crash half-way) converges to the same result and
/// never creates a second VM. Implementations run blocking backend calls off the
/// async workers (`spawn_blocking`).
///
/// Errors carry an [`ErrorKind`] that tells the core whether to retry, report
/// the input as invalid, or answer "not supported".
#[async_trait::async_trait]
pub trait Provider: Send + Sync + 'static {
    /// Short backend name for labels and logs: `libvirt`, `openstack`, `vsphere`.
    fn kind(&self) -> &'static str;

    /// Cheap liveness check of the backend connection. The node agent renews its
    /// Lease only while this succeeds. Errors: `Transient` when unreachable.
    async fn ping(&self) -> Result<()>;

    /// Probe the host's capacity and identity. Errors: `Transient`.
    async fn host_info(&self) -> Result<HostInfo>;

    /// All VMs on this host that carry a vmlet identity; VMs without one are
    /// not vmlet's and are never listed, touched or counted.
    async fn list(&self) -> Result<Vec<VmStatus>>;

    /// The VM with this identity, or `None` when the host has none.
    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>>;

    /// Where the back end holds the VM with this identity: "where is VM X".
    /// `backend_name` is the name vmlet gives the VM ([`VmSpec::backend_name`]),
    /// which a provider may use to answer without listing every VM (a VM
    /// renamed behind vmlet may then be missed; the placement record still
    /// guards it). The default, for providers that see only their own host,
    /// is [`Location::ThisHost`] or [`Location::NotOnThisHost`] from
    /// [`Provider::get`]; back ends that move VMs by themselves (Nova,
    /// vSphere) answer for the whole back end. Errors: `Transient`.
    async fn locate(&self, id: &VmId, backend_name: &str) -> Result<Location> {
        let _ = backend_name;
        Ok(match self.get(id).await? {
            Some(status) => Location::ThisHost(status),
            None => Location::NotOnThisHost,
        })
    }

    /// Define the VM if the host has none with this identity; an existing one is
    /// returned unchanged (no resize, no restart). Errors: `InvalidInput` when the
    /// spec cannot be expressed, `Permanent` when the backend name is taken by a
    /// VM with another identity.
    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus>;

    /// Power on; a running VM is left alone. Errors: `NotFound` when undefined.
    async fn start(&self, id: &VmId) -> Result<()>;

    /// Ask the guest to shut down (ACPI power button or the backend's soft stop)
    /// and return without waiting; an inactive VM is left alone. The caller polls
    /// [`Provider::get`] and calls [`Provider::destroy`] after its grace period.
    async fn shutdown(&self, id: &VmId) -> Result<()>;

    /// Power off at once, keeping the definition and disks; an inactive VM is
    /// left alone.
    async fn destroy(&self, id: &VmId) -> Result<()>;

    /// The back end's own name for this provider's host (a Nova compute
    /// host, a vSphere HostSystem): the name [`Location::OtherHost`] gives
    /// when another provider finds a VM here, so the core can tell which of
    /// its nodes that is. `None` (the default) for back ends that never
    /// answer `OtherHost`.
    fn backend_host(&self) -> Option<String> {
        None
    }

    /// What [`VmSpec::image`] names on this backend; host paths by default.
    fn image_reference(&self) -> ImageReference {
        ImageReference::HostPath
    }

    /// The VMs whose state changed on this host, as the back end pushes them
    /// (power on or off, pause, crash, define, undefine), for a back end that
    /// pushes changes; `None` (the default) for one the core must poll with
    /// [`Provider::get`]. Each call subscribes anew. A receiver that lagged
    /// behind (`RecvError::Lagged`) and [`Change::All`] both mean "changes may
    /// have been missed: look at every VM of the host again". A change is a
    /// hint to read the VM; it carries no state of its own.
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<Change>> {
        None
    }

    /// The serial-console capability, if this backend (and host) has one.
    fn console(&self) -> Option<&dyn Console> {
        None
    }

    /// The guest-command capability, if this backend has one.
    fn guest_exec(&self) -> Option<&dyn GuestExec> {
        None
    }

    /// The capability to connect to TCP ports of a VM's guest (`kubectl
    /// port-forward`), if this backend (and host) has one. Without it the
    /// kubelet API answers port forwarding with 501.
    fn port_forward(&self) -> Option<&dyn PortForward> {
        None
    }

    /// The resource-usage capability, if this backend has one.
    fn stats(&self) -> Option<&dyn Stats> {
        None
    }

    /// The capability to change a VM's vCPUs and memory, if this backend has
    /// one.
    fn resize(&self) -> Option<&dyn Resize> {
        None
    }

    /// The capability to move a VM to another host of the same backend, if
    /// this backend (and host) has one.
    fn migration(&self) -> Option<&dyn Migration> {
        None
    }

    /// The capability to copy a VM's disk to a file on its host and make new
    /// disks from such files, if this backend (and host) has one.
    fn backup(&self) -> Option<&dyn Backup> {
        None
    }

    /// The capability to take, delete and revert to snapshots of a VM, if
    /// this backend (and host) has one.
    fn snapshots(&self) -> Option<&dyn Snapshots> {
        None
    }

    /// The capability to read host image files (a data disk's format and
    /// backing file, see [`HostImages`]), if this backend has one. Without
    /// it, the core refuses VMs whose disks name host images.
    fn host_images(&self) -> Option<&dyn HostImages> {
        None
    }

    /// The capability to make, grow and remove volumes in the host's
    /// storage pools (see [`Volumes`]), if this backend has one. Without
    /// it, the host provisions no volumes dynamically.
    fn volumes(&self) -> Option<&dyn Volumes> {
        None
    }

    /// Remove the definition (and the backend's own metadata) of an inactive VM;
    /// a VM that does not exist is success. Disks named by the user are kept.
    /// Errors: `InvalidInput` when the VM is still active.
    async fn undefine(&self, id: &VmId) -> Result<()>;
}
