//! [`Snapshots`]: libvirt's internal snapshots of a VM, kept inside its qcow2
//! disk, and going back to one.
//!
//! - **Taking one** (`virDomainSnapshotCreateXML`): of a running (or paused)
//!   VM with its memory (`<memory snapshot='internal'/>`: QEMU's `savevm`
//!   pauses the guest while its memory and disk state are written into the
//!   disk image, then the guest runs on); of an inactive VM, its disk only
//!   (libvirt runs `qemu-img snapshot -c`). libvirt 9 takes an internal
//!   snapshot of a running VM only with its memory, so a disk-only snapshot of
//!   a running VM is refused (`InvalidInput`: take it with memory, or stop the
//!   VM first). [`SnapshotRequest::quiesce`] is not used: a snapshot with
//!   memory holds what the guest had not written out, so it needs no freeze
//!   (libvirt refuses to freeze for anything but a disk-only snapshot), and an
//!   inactive VM has no guest to freeze.
//! - **Which disks**: every disk of the VM must be a qcow2 file, the only
//!   format that holds internal snapshots. A data disk
//!   ([`vmlet_provider::VmSpec::disks`]) on a qcow2 volume is snapshotted
//!   with the boot disk; a VM with a raw data disk (or a raw boot disk) is
//!   refused `InvalidInput` naming the disk. The
//!   read-only cloud-init seed CD-ROM is left out (libvirt's default for
//!   read-only disks, `snapshot='no'`), so a seeded VM can be snapshotted.
//! - **Reverting** (only an inactive VM, only its disks): vmlet runs
//!   `qemu-img snapshot -a` on each disk file the snapshot is in, rather than
//!   `virDomainRevertToSnapshot`, for two reasons. libvirt's revert of a
//!   snapshot with memory starts the VM (with `REVERT_PAUSED`, paused): QEMU
//!   would take the VM's memory on the host, virtlogd would start a new
//!   console log over the last boot's, and the VM would end with stop reason
//!   `Destroyed` once stopped again, which a restart policy reads as a power
//!   cut. And libvirt's revert of any snapshot also puts back the domain
//!   definition the VM had when it was taken (an older size), where vmlet
//!   keeps the definition as the VirtualMachine says. Both disk paths leave
//!   the disk as the snapshot had it. vmlet then makes the snapshot libvirt's
//!   current one by redefining its metadata
//!   (`VIR_DOMAIN_SNAPSHOT_CREATE_REDEFINE|CURRENT`, no disk is touched), as
//!   libvirt's own revert would, so the next snapshot's parent is right. Before
//!   any disk is touched, each is checked to hold the snapshot (`qemu-img
//!   info`): a disk replaced since (see below) fails the revert `Permanent`
//!   and nothing changes. qemu-img runs where the disk is, so reverting needs
//!   a local connection.
//! - **Deleting** (`virDomainSnapshotDelete`, no flags): the snapshot's data
//!   leaves the disk; its children, if any, become its parent's.
//! - **The test driver** keeps snapshots in memory and has no disks: taking,
//!   reading and deleting them work as on QEMU, and a revert only makes the
//!   snapshot the current one.
//!
//! Each call takes the VM's in-process job claim ([`crate::in_flight`]): a
//! snapshot operation while this vmlet backs up or restores the VM (or works
//! on another of its snapshots) fails `Conflict` at once, as does one while
//! libvirt runs a job on a running VM (a migration, a backup).
//!
//! Checkpoints (incremental backups' bases, `checkpoint.rs`) and snapshots,
//! as libvirt 9.0 and QEMU 7.2 have them: a running VM with a checkpoint
//! takes a snapshot with memory; a stopped one takes none (libvirt: "cannot
//! perform block operations while checkpoint exists") and its disk reverts
//! to none (qemu-img: "Device has active dirty bitmaps"): both are refused
//! `InvalidInput` saying so.
//!
//! A VM undefined by vmlet takes libvirt's snapshot metadata with it
//! (`VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA`); the snapshots' data stays in
//! the disk file, which vmlet never deletes (`qemu-img snapshot -l` lists it).
//! An in-place restore ([`vmlet_provider::Backup::restore_in_place`]) puts a
//! new file in the disk's place that holds none of the old one's snapshots:
//! it drops libvirt's record of them ([`Host::forget_snapshots_not_in`]), so
//! they are gone for vmlet (reading one answers `None`, a revert `NotFound`),
//! and their data stays in the old file, `<disk>.before-<tag>`.

mod export;

use std::time::Duration;

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::domain_snapshot::DomainSnapshot;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::sys;
use vmlet_provider::{Error, ErrorKind, Result, RevertOutcome, SnapshotInfo, SnapshotRequest, Snapshots, VmId};

use crate::domains::find;
use crate::error::{from_libvirt, is_operation_invalid};
use crate::in_flight::Claim;
use crate::jobs::{job_stats, operation_name};
use crate::provider::{is_active, is_local_uri, Host, LibvirtProvider};
use crate::qemu_img;
use crate::xml::{attributes, disks, element, escape, start_of, Disk};

const OP_CREATE: &str = "create snapshot";
const OP_READ: &str = "read snapshot";
const OP_DELETE: &str = "delete snapshot";
const OP_REVERT: &str = "revert to snapshot";
const OP_FORGET: &str = "forget snapshots";

/// The longest snapshot name, in bytes ([`SnapshotRequest::name`]).
const NAME_MAX_BYTES: usize = 200;

/// How long reading a snapshot, or one of a revert's libvirt calls, may take.
const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// How long a deletion may take: QEMU (or qemu-img, for an inactive VM)
/// frees the snapshot's clusters in the disk image.
const DELETE_DEADLINE: Duration = Duration::from_secs(300);

/// How long `qemu-img info` on a disk may take during a revert.
const INFO_DEADLINE: Duration = Duration::from_secs(60);

/// How long `qemu-img snapshot -a` on one disk may take.
const APPLY_DEADLINE: Duration = Duration::from_secs(300);

/// What vmlet reads of a snapshot's XML (`virDomainSnapshotGetXMLDesc`): its
/// own elements, not those of the domain definition it embeds.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SnapshotXml {
    /// `<state>`: the domain's state when it was taken (`running`, `paused`,
    /// `shutoff`, `disk-snapshot`, …).
    state: String,
    /// `<memory snapshot='…'>`: `internal`, `external` or `no` (also when
    /// absent).
    memory: String,
    /// `<creationTime>`, seconds since the Unix epoch.
    created: i64,
    /// `<disks><disk name='…' snapshot='…'>`: each disk's target and how the
    /// snapshot holds it (`internal`, `external`, `no`).
    disks: Vec<(String, String)>,
}

impl SnapshotXml {
    /// Parse a snapshot's XML; `None` when `<state>` or `<creationTime>` is
    /// missing or unreadable.
    fn parse(xml: &str) -> Option<SnapshotXml> {
        // libvirt writes the snapshot's own elements before the definitions
        // (and the migration cookie) it embeds, whose <memory> and <disk>
        // elements are others.
        let end = ["domain", "inactiveDomain", "cookie"]
            .iter()
            .filter_map(|name| start_of(xml, name))
            .min()
            .unwrap_or(xml.len());
        let own = &xml[..end];
        let state = element(own, "state")?.1.trim().to_owned();
        let created = element(own, "creationTime")?.1.trim().parse().ok()?;
        let attribute =
            |attrs: &[(String, String)], key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let memory = start_of(own, "memory")
            .and_then(|at| attributes(&own[at..]))
            .and_then(|attrs| attribute(&attrs, "snapshot"))
            .unwrap_or_else(|| "no".to_owned());
        let mut disks = Vec::new();
        if let Some(list) = start_of(own, "disks") {
            let mut rest = &own[list..];
            while let Some(at) = start_of(rest, "disk") {
                if let Some(attrs) = attributes(&rest[at..]) {
                    if let Some(name) = attribute(&attrs, "name") {
                        disks.push((name, attribute(&attrs, "snapshot").unwrap_or_else(|| "internal".to_owned())));
                    }
                }
                rest = &rest[at + "<disk".len()..];
            }
        }
        Some(SnapshotXml { state, memory, created, disks })
    }

    /// The provider's view of snapshot `name` with this XML.
    fn info(&self, name: &str) -> SnapshotInfo {
        SnapshotInfo {
            name: name.to_owned(),
            memory: self.memory != "no",
            vm_was_running: !matches!(self.state.as_str(), "shutoff" | "crashed"),
            created_unix_seconds: self.created,
        }
    }

    /// True when some part of it lives outside the disk images (an external
    /// snapshot, taken outside vmlet), which vmlet does not revert.
    fn is_external(&self) -> bool {
        self.memory == "external" || self.disks.iter().any(|(_, how)| how == "external")
    }

    /// The targets of the disks the snapshot holds inside their images.
    fn internal_disks(&self) -> impl Iterator<Item = &str> {
        self.disks.iter().filter(|(_, how)| how == "internal").map(|(target, _)| target.as_str())
    }
}

/// Refuse (`InvalidInput`) a snapshot name outside what
/// [`SnapshotRequest::name`] allows.
fn check_name(operation: &'static str, name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > NAME_MAX_BYTES || !name.chars().all(allowed) {
        return Err(Error::new(
            operation,
            ErrorKind::InvalidInput,
            format!("snapshot name {name:?} must be 1 to {NAME_MAX_BYTES} letters, digits, '-', '_' or '.' (ASCII)"),
        ));
    }
    Ok(())
}

/// Whether a snapshot of VM `id` (`running` or not) takes its memory, from
/// what was asked ([`SnapshotRequest::memory`]). Errors: `InvalidInput`
/// naming the fix for a disk-only snapshot of a running VM (libvirt 9 cannot
/// take one internally) and for memory of a VM that is not running.
fn with_memory(id: &VmId, running: bool, asked: Option<bool>) -> Result<bool> {
    match (running, asked) {
        (true, None | Some(true)) => Ok(true),
        (false, None | Some(false)) => Ok(false),
        (true, Some(false)) => Err(Error::new(
            OP_CREATE,
            ErrorKind::InvalidInput,
            format!(
                "VM {id} is running, and libvirt takes an internal snapshot of a running VM only with its memory: \
                 set memory to true (or leave it unset), or stop the VM first for a disk-only snapshot"
            ),
        )),
        (false, Some(true)) => Err(Error::new(
            OP_CREATE,
            ErrorKind::InvalidInput,
            format!(
                "VM {id} is not running, so it has no memory to save: set memory to false (or leave it unset), or \
                 start the VM first"
            ),
        )),
    }
}

/// Refuse (`InvalidInput`) a QEMU VM whose disks cannot all hold internal
/// snapshots: each must be a qcow2 file, and there must be one (read-only
/// CD-ROMs are no disks here: libvirt leaves them out).
fn check_disks(id: &VmId, found: &[Disk]) -> Result<()> {
    if found.is_empty() {
        return Err(Error::new(
            OP_CREATE,
            ErrorKind::InvalidInput,
            format!(
                "VM {id} has no disk to hold a snapshot (internal snapshots live in a qcow2 disk): give it one \
                 with spec.image (a name ending in .qcow2)"
            ),
        ));
    }
    for disk in found {
        let format = disk.format.as_deref().unwrap_or("raw");
        if disk.kind == "file" && format == "qcow2" {
            continue;
        }
        let (what, fix) = match &disk.serial {
            Some(name) => (
                format!("spec.disks[{name}]"),
                "give the disk a qcow2 volume (a StorageClass with parameters.format: qcow2) to snapshot the VM, or back the \
                 VM up instead (a backup copies raw disks too)",
            ),
            None => ("spec.image".to_owned(), "use a qcow2 image for spec.image (a name ending in .qcow2)"),
        };
        let source = disk.source.as_deref().unwrap_or("no file");
        let is = if disk.kind == "file" { format!("a {format} image") } else { format!("a {} disk", disk.kind) };
        return Err(Error::new(
            OP_CREATE,
            ErrorKind::InvalidInput,
            format!(
                "disk {} of VM {id} ({what}, {source}) is {is}, which cannot hold internal snapshots (only qcow2 \
                 files can); {fix}",
                disk.target
            ),
        ));
    }
    Ok(())
}

/// The snapshot `name` of `domain`, if it has one.
fn lookup(domain: &Domain, name: &str) -> Result<Option<DomainSnapshot>, VirtError> {
    match Domain::lookup_snapshot_by_name(domain, name, 0) {
        Ok(snapshot) => Ok(Some(snapshot)),
        Err(err) if is_no_snapshot(&err) => Ok(None),
        Err(err) => Err(err),
    }
}

/// The parsed XML of `snapshot` (named `name`). Errors (for `operation`):
/// libvirt's, and `Permanent` for XML vmlet cannot read.
fn read(operation: &'static str, snapshot: &DomainSnapshot, name: &str) -> Result<SnapshotXml> {
    let xml = snapshot.xml_desc(0).map_err(|e| from_libvirt(operation, e))?;
    SnapshotXml::parse(&xml).ok_or_else(|| {
        Error::new(operation, ErrorKind::Permanent, format!("libvirt's XML of snapshot {name} has no state or time"))
    })
}

/// True when `err` says the domain has no snapshot of the asked name.
fn is_no_snapshot(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::NoDomainSnapshot)
}

/// True when `err` says the VM or its disk is busy: another job holds the
/// domain (`OPERATION_INVALID`, libvirt's state change lock not acquired in
/// time) or another process holds the image's lock.
fn is_busy(err: &VirtError) -> bool {
    // " lock", not "lock": "block" is in many messages.
    let message = err.message();
    is_operation_invalid(err)
        || err.code().is(ErrorNumber::OperationTimeout)
        || message.contains(" lock")
        || message.contains("another job")
}

/// The provider error for `operation` on snapshot `name` of VM `id` that
/// libvirt refused with `err`: `Conflict` when the VM or its disk is busy
/// ([`is_busy`]), else the libvirt error's kind.
fn refused(operation: &'static str, id: &VmId, name: &str, err: VirtError) -> Error {
    if err.message().contains("checkpoint exists") {
        return Error::new(
            operation,
            ErrorKind::InvalidInput,
            format!(
                "VM {id} has a checkpoint for incremental backups, and libvirt takes no snapshot of a stopped VM \
                 with one ({}); snapshot {name} can be taken while the VM runs (with its memory)",
                err.message()
            ),
        )
        .with_source(err);
    }
    if is_busy(&err) {
        return Error::new(
            operation,
            ErrorKind::Conflict,
            format!(
                "VM {id} or its disk is busy ({}); snapshot {name} can be worked on once that ended",
                err.message()
            ),
        )
        .with_source(err);
    }
    let mut error = from_libvirt(operation, err);
    error.message = format!("snapshot {name} of VM {id}: {}", error.message);
    error
}

/// Refuse (`Conflict`) while running `domain` has a libvirt job (a
/// migration, a backup, another snapshot).
fn refuse_jobs(operation: &'static str, domain: &Domain, id: &VmId) -> Result<()> {
    let job = match job_stats(domain, 0) {
        Ok(job) => job,
        // Stopped meanwhile: no job runs; a driver without jobs (the test
        // driver) runs none.
        Err(err) if is_operation_invalid(&err) || err.code().is(ErrorNumber::NoSupport) => return Ok(()),
        Err(err) => return Err(from_libvirt(operation, err)),
    };
    if job.is_running() {
        return Err(Error::new(
            operation,
            ErrorKind::Conflict,
            format!(
                "VM {id} is busy with {} (a libvirt job, `virsh domjobinfo`); retry once it ended",
                operation_name(job.operation)
            ),
        ));
    }
    Ok(())
}

/// The `<domainsnapshot>` vmlet asks libvirt for: name `name`, with the
/// memory or without; each disk as libvirt's default has it (qcow2 disks
/// internal, read-only ones left out).
fn snapshot_xml(name: &str, memory: bool) -> String {
    let memory = if memory { "internal" } else { "no" };
    format!("<domainsnapshot><name>{}</name><memory snapshot='{memory}'/></domainsnapshot>", escape(name))
}

/// A disk a revert puts back: its target and file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RevertDisk {
    target: String,
    file: String,
}

impl Host {
    /// Take snapshot `request.name` of VM `id`, or return the one of that
    /// name.
    fn create_snapshot(&self, conn: &Connect, id: &VmId, request: &SnapshotRequest) -> Result<SnapshotInfo> {
        let name = &request.name;
        let domain = self.require(conn, OP_CREATE, id)?;
        if let Some(existing) = lookup(&domain, name).map_err(|e| from_libvirt(OP_CREATE, e))? {
            tracing::info!(vm.uid = %id, snapshot.name = %name, "snapshot exists already");
            return Ok(read(OP_CREATE, &existing, name)?.info(name));
        }
        let running = is_active(&domain, OP_CREATE)?;
        let memory = with_memory(id, running, request.memory)?;
        if request.quiesce {
            tracing::debug!(vm.uid = %id, memory, "quiesce not needed: a snapshot with memory, or of a stopped VM");
        }
        if running {
            refuse_jobs(OP_CREATE, &domain, id)?;
        }
        if self.kind.is_qemu() {
            let xml = domain.xml_desc(0).map_err(|e| from_libvirt(OP_CREATE, e))?;
            check_disks(id, &disks(&xml))?;
        }
        match domain.create_snapshot_xml(&snapshot_xml(name, memory), 0) {
            Ok(snapshot) => {
                let info = read(OP_CREATE, &snapshot, name)?.info(name);
                tracing::info!(vm.uid = %id, snapshot.name = %name, snapshot.memory = info.memory, "snapshot taken");
                Ok(info)
            }
            Err(err) => {
                // Taken meanwhile by another call, or the VM started or
                // stopped since it was looked at.
                if let Ok(Some(existing)) = lookup(&domain, name) {
                    return Ok(read(OP_CREATE, &existing, name)?.info(name));
                }
                if is_active(&domain, OP_CREATE)? != running {
                    return Err(Error::new(
                        OP_CREATE,
                        ErrorKind::Conflict,
                        format!(
                            "VM {id} {} while snapshot {name} was being taken ({}); retry",
                            if running { "stopped" } else { "started" },
                            err.message()
                        ),
                    )
                    .with_source(err));
                }
                Err(refused(OP_CREATE, id, name, err))
            }
        }
    }

    /// Snapshot `name` of VM `id`, if it has one.
    fn snapshot(&self, conn: &Connect, id: &VmId, name: &str) -> Result<Option<SnapshotInfo>> {
        let domain = self.require(conn, OP_READ, id)?;
        match lookup(&domain, name).map_err(|e| from_libvirt(OP_READ, e))? {
            Some(snapshot) => Ok(Some(read(OP_READ, &snapshot, name)?.info(name))),
            None => Ok(None),
        }
    }

    /// Delete snapshot `name` of VM `id`; a missing VM or snapshot is success.
    fn delete_snapshot(&self, conn: &Connect, id: &VmId, name: &str) -> Result<()> {
        let Some(domain) = find(conn, &self.uuids, id)? else {
            return Ok(());
        };
        let Some(snapshot) = lookup(&domain, name).map_err(|e| from_libvirt(OP_DELETE, e))? else {
            return Ok(());
        };
        if is_active(&domain, OP_DELETE)? {
            refuse_jobs(OP_DELETE, &domain, id)?;
        }
        match snapshot.delete(0) {
            Ok(()) => {
                tracing::info!(vm.uid = %id, snapshot.name = %name, "snapshot deleted");
                Ok(())
            }
            Err(err) if is_no_snapshot(&err) => Ok(()),
            Err(err) => Err(refused(OP_DELETE, id, name, err)),
        }
    }

    /// What a revert of inactive VM `id` to snapshot `name` puts back: the
    /// files of the disks the snapshot holds. Errors: `NotFound` for a
    /// missing VM or snapshot; `Conflict` while the VM is active;
    /// `Unsupported` for an external snapshot; `Permanent` when a disk the
    /// snapshot holds is no qcow2 file of the VM any more.
    fn plan_revert(&self, conn: &Connect, id: &VmId, name: &str) -> Result<Vec<RevertDisk>> {
        let domain = self.require(conn, OP_REVERT, id)?;
        if is_active(&domain, OP_REVERT)? {
            return Err(Error::new(
                OP_REVERT,
                ErrorKind::Conflict,
                format!(
                    "VM {id} is active; a revert writes over its disk, so it needs a stopped VM: stop the VM first"
                ),
            ));
        }
        let snapshot = lookup(&domain, name)
            .map_err(|e| from_libvirt(OP_REVERT, e))?
            .ok_or_else(|| Error::new(OP_REVERT, ErrorKind::NotFound, format!("VM {id} has no snapshot {name}")))?;
        let taken = read(OP_REVERT, &snapshot, name)?;
        if taken.is_external() {
            return Err(Error::new(
                OP_REVERT,
                ErrorKind::Unsupported,
                format!(
                    "snapshot {name} of VM {id} is an external snapshot (its data in files beside the disk, taken \
                     outside vmlet); vmlet reverts internal snapshots only"
                ),
            ));
        }
        let xml = domain.xml_desc(sys::VIR_DOMAIN_XML_INACTIVE).map_err(|e| from_libvirt(OP_REVERT, e))?;
        let current = disks(&xml);
        taken
            .internal_disks()
            .map(|target| {
                let disk = current.iter().find(|disk| disk.target == target);
                match disk {
                    Some(Disk { kind, source: Some(file), format: Some(format), .. })
                        if kind == "file" && format == "qcow2" =>
                    {
                        Ok(RevertDisk { target: target.to_owned(), file: file.clone() })
                    }
                    _ => Err(Error::new(
                        OP_REVERT,
                        ErrorKind::Permanent,
                        format!(
                            "snapshot {name} of VM {id} holds disk {target}, which is no qcow2 file of the VM any \
                             more; nothing was changed"
                        ),
                    )),
                }
            })
            .collect()
    }

    /// Make snapshot `name` VM `id`'s current one in libvirt's metadata
    /// (redefined as it is, with `CURRENT`): what libvirt's own revert
    /// records. A failure is logged: the disks were put back already.
    fn mark_current(&self, conn: &Connect, id: &VmId, name: &str) -> Result<()> {
        let marked = self.require(conn, OP_REVERT, id).and_then(|domain| {
            let snapshot = lookup(&domain, name)
                .map_err(|e| from_libvirt(OP_REVERT, e))?
                .ok_or_else(|| Error::new(OP_REVERT, ErrorKind::NotFound, format!("snapshot {name} is gone")))?;
            let xml = snapshot.xml_desc(sys::VIR_DOMAIN_SNAPSHOT_XML_SECURE).map_err(|e| from_libvirt(OP_REVERT, e))?;
            let flags = sys::VIR_DOMAIN_SNAPSHOT_CREATE_REDEFINE | sys::VIR_DOMAIN_SNAPSHOT_CREATE_CURRENT;
            domain.create_snapshot_xml(&xml, flags).map(drop).map_err(|e| from_libvirt(OP_REVERT, e))
        });
        if let Err(err) = marked {
            tracing::warn!(vm.uid = %id, snapshot.name = %name, error = %err, "reverted, but not made libvirt's current snapshot");
        }
        Ok(())
    }

    /// Drop libvirt's record (its metadata only: no disk is touched) of VM
    /// `id`'s snapshots held inside disk `target` whose file no longer holds
    /// them (`held`: the snapshot names the file holds now, from `qemu-img
    /// info`), as after the file was replaced by an in-place restore. Returns
    /// the names dropped.
    /// Errors: `NotFound` when the VM is gone; libvirt's.
    pub(crate) fn forget_snapshots_not_in(
        &self,
        conn: &Connect,
        id: &VmId,
        target: &str,
        held: &[String],
    ) -> Result<Vec<String>> {
        let domain = self.require(conn, OP_FORGET, id)?;
        let mut dropped = Vec::new();
        for snapshot in domain.list_all_snapshots(0).map_err(|e| from_libvirt(OP_FORGET, e))? {
            let name = snapshot.name().map_err(|e| from_libvirt(OP_FORGET, e))?;
            let taken = read(OP_FORGET, &snapshot, &name)?;
            if held.contains(&name) || !taken.internal_disks().any(|disk| disk == target) {
                continue;
            }
            match snapshot.delete(sys::VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY) {
                Ok(()) => dropped.push(name),
                Err(err) if is_no_snapshot(&err) => {}
                Err(err) => return Err(from_libvirt(OP_FORGET, err)),
            }
        }
        Ok(dropped)
    }
}

impl LibvirtProvider {
    /// This process's job claim on VM `id`, or `Conflict` for `operation`
    /// while another backup, restore or snapshot operation holds it.
    fn claim(&self, operation: &'static str, id: &VmId) -> Result<Claim<'_, VmId>> {
        Claim::take(&self.in_flight().vms, id).ok_or_else(|| {
            Error::new(
                operation,
                ErrorKind::Conflict,
                format!(
                    "VM {id} has a backup, restore or snapshot operation running (started by this vmlet); retry \
                     once it ended"
                ),
            )
        })
    }

    /// Put each of `disks` back to its internal snapshot `name` with
    /// qemu-img, once each was seen to hold it.
    async fn revert_disks(&self, id: &VmId, name: &str, disks: &[RevertDisk]) -> Result<()> {
        for disk in disks {
            let info = qemu_img::info(OP_REVERT, &disk.file, Some("qcow2"), INFO_DEADLINE).await?;
            if !info.snapshots.iter().any(|held| held == name) {
                return Err(Error::new(
                    OP_REVERT,
                    ErrorKind::Permanent,
                    format!(
                        "disk {} of VM {id} ({}) does not hold snapshot {name}: the file was replaced since the \
                         snapshot was taken (an in-place restore keeps the previous file as <disk>.before-<tag>); \
                         nothing was changed; delete the snapshot",
                        disk.target, disk.file
                    ),
                ));
            }
        }
        for disk in disks {
            qemu_img::apply_snapshot(OP_REVERT, &disk.file, name, APPLY_DEADLINE).await.map_err(|mut err| {
                if err.kind == ErrorKind::Permanent && err.message.contains("dirty bitmaps") {
                    err.kind = ErrorKind::InvalidInput;
                    err.message = format!(
                        "disk {} of VM {id} carries a checkpoint for incremental backups (a dirty bitmap), and \
                         qemu-img reverts no snapshot of a disk with one; nothing was changed: delete the VM's \
                         checkpoints (`virsh checkpoint-delete`) to revert, then take a full backup ({})",
                        disk.target, err.message
                    );
                } else if err.kind == ErrorKind::Permanent && err.message.contains(" lock") {
                    err.kind = ErrorKind::Conflict;
                    err.message =
                        format!("the disk of VM {id} is in use (was the VM started meanwhile?): {}", err.message);
                }
                err
            })?;
            tracing::info!(vm.uid = %id, snapshot.name = %name, disk = %disk.target, file = %disk.file, "disk reverted");
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Snapshots for LibvirtProvider {
    /// See the module docs. `request.quiesce` is not used (a snapshot with
    /// memory needs no freeze; libvirt cannot take one without memory of a
    /// running VM). A running VM pauses while its memory is written into its
    /// disk (about as long as writing its memory size to the disk takes).
    ///
    /// Errors as [`Snapshots::create_snapshot`] documents: `InvalidInput` also
    /// for a bad name and for a VM whose disks are not all qcow2 files (a
    /// raw boot disk, data disks: the message names the disk) or that has
    /// none; `Conflict` also while this vmlet backs up, restores or works on
    /// the VM's snapshots, when the VM started or stopped during the call,
    /// and while another process holds the disk's lock.
    #[instrument(
        skip(self, request),
        fields(provider = "libvirt", vm.uid = %id, snapshot.name = %request.name, snapshot.memory = ?request.memory)
    )]
    async fn create_snapshot(&self, id: &VmId, request: &SnapshotRequest) -> Result<SnapshotInfo> {
        check_name(OP_CREATE, &request.name)?;
        let _claim = self.claim(OP_CREATE, id)?;
        let (task_id, task_request) = (id.clone(), request.clone());
        let created = self
            .blocking_within(OP_CREATE, request.timeout, move |host, conn| {
                host.create_snapshot(conn, &task_id, &task_request)
            })
            .await;
        created.map_err(|mut err| {
            if err.kind == ErrorKind::Transient && err.source.is_none() {
                err.message = format!(
                    "{}; libvirt may still finish snapshot {} of VM {id}: a retry with the same name finds it",
                    err.message, request.name
                );
            }
            err
        })
    }

    /// `virDomainSnapshotLookupByName` and its XML. Errors as
    /// [`Snapshots::snapshot`] documents; `InvalidInput` for a bad name;
    /// `Transient` when libvirt does not answer within a minute.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, snapshot.name = %name))]
    async fn snapshot(&self, id: &VmId, name: &str) -> Result<Option<SnapshotInfo>> {
        check_name(OP_READ, name)?;
        let (id, name) = (id.clone(), name.to_owned());
        self.blocking_within(OP_READ, CALL_DEADLINE, move |host, conn| host.snapshot(conn, &id, &name)).await
    }

    /// `virDomainSnapshotDelete` (its children, if any, become its parent's).
    /// Errors as [`Snapshots::delete_snapshot`] documents; `InvalidInput` for
    /// a bad name; `Conflict` also while this vmlet backs up, restores or
    /// works on the VM's snapshots; `Transient` when libvirt does not answer
    /// within five minutes.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, snapshot.name = %name))]
    async fn delete_snapshot(&self, id: &VmId, name: &str) -> Result<()> {
        check_name(OP_DELETE, name)?;
        let _claim = self.claim(OP_DELETE, id)?;
        let (id, name) = (id.clone(), name.to_owned());
        self.blocking_within(OP_DELETE, DELETE_DEADLINE, move |host, conn| host.delete_snapshot(conn, &id, &name)).await
    }

    /// See the module docs: `qemu-img snapshot -a` on each disk the snapshot
    /// holds (QEMU), then the snapshot made libvirt's current one. The VM
    /// stays stopped and keeps its definition; `memory_restored` is always
    /// false (a stopped VM gets its disks back only).
    ///
    /// Errors as [`Snapshots::revert_to_snapshot`] documents; `InvalidInput`
    /// for a bad name; `Unsupported` on a remote QEMU connection (qemu-img
    /// runs where the disk is) and for an external snapshot; `Conflict` also
    /// while this vmlet backs up, restores or works on the VM's snapshots,
    /// and when the VM started during the call (its disk locked); `Permanent`
    /// when a disk no longer holds the snapshot (nothing is changed);
    /// `Transient` when qemu-img or libvirt does not finish in time.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, snapshot.name = %name))]
    async fn revert_to_snapshot(&self, id: &VmId, name: &str) -> Result<RevertOutcome> {
        check_name(OP_REVERT, name)?;
        if self.domain_kind().is_qemu() && !is_local_uri(self.uri()) {
            return Err(Error::new(
                OP_REVERT,
                ErrorKind::Unsupported,
                format!(
                    "vmlet reverts a VM's disk with qemu-img where the disk is; the connection {} reaches another \
                     machine, where vmlet cannot run it: run vmlet on that host",
                    self.uri()
                ),
            ));
        }
        let _claim = self.claim(OP_REVERT, id)?;
        let (task_id, task_name) = (id.clone(), name.to_owned());
        let disks = self
            .blocking_within(OP_REVERT, CALL_DEADLINE, move |host, conn| host.plan_revert(conn, &task_id, &task_name))
            .await?;
        self.revert_disks(id, name, &disks).await?;
        let (task_id, task_name) = (id.clone(), name.to_owned());
        self.blocking_within(OP_REVERT, CALL_DEADLINE, move |host, conn| host.mark_current(conn, &task_id, &task_name))
            .await
            .unwrap_or_else(|err| tracing::warn!(error = %err, "reverted, but not made libvirt's current snapshot"));
        tracing::info!(disks = disks.len(), "reverted to snapshot");
        Ok(RevertOutcome { memory_restored: false })
    }

    /// `qemu-img convert -U -l snapshot.name=<name>` of the boot disk into a
    /// new qcow2 file (`export.rs`), the VM running or not. Errors as
    /// [`Snapshots::export_snapshot_disk`] documents; `InvalidInput` also for
    /// a bad name and when the snapshot does not hold the boot disk in a
    /// qcow2 file; `Unsupported` on the test driver, on a remote connection
    /// and for an external snapshot; `NotFound` also when the disk file was
    /// replaced since the snapshot was taken.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, snapshot.name = %name, disk = %target))]
    async fn export_snapshot_disk(&self, id: &VmId, name: &str, target: &str, timeout: Duration) -> Result<u64> {
        self.export_disk(id, name, target, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> VmId {
        VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into())
    }

    /// As libvirt 9 formats a running VM's snapshot (abridged): the embedded
    /// domain has a <memory> and <disk> elements of its own.
    const RUNNING: &str = "<domainsnapshot>\n  <name>s-run</name>\n  <state>running</state>\n  <parent>\n    \
                           <name>s-off</name>\n  </parent>\n  <creationTime>1796205741</creationTime>\n  \
                           <memory snapshot='internal'/>\n  <disks>\n    <disk name='vda' snapshot='internal'/>\n    \
                           <disk name='hdc' snapshot='no'/>\n  </disks>\n  <domain type='qemu'>\n    \
                           <memory unit='KiB'>262144</memory>\n    <devices>\n      \
                           <disk type='file' device='disk'>\n        <target dev='vdz'/>\n      </disk>\n    \
                           </devices>\n  </domain>\n</domainsnapshot>\n";

    #[test]
    fn a_snapshot_is_read_from_its_own_elements_not_its_domains() {
        let parsed = SnapshotXml::parse(RUNNING).expect("parsed");
        assert_eq!(
            parsed,
            SnapshotXml {
                state: "running".into(),
                memory: "internal".into(),
                created: 1_796_205_741,
                disks: vec![("vda".into(), "internal".into()), ("hdc".into(), "no".into())],
            }
        );
        assert_eq!(
            parsed.info("s-run"),
            SnapshotInfo {
                name: "s-run".into(),
                memory: true,
                vm_was_running: true,
                created_unix_seconds: 1_796_205_741
            }
        );
        assert_eq!(parsed.internal_disks().collect::<Vec<_>>(), ["vda"]);
        assert!(!parsed.is_external());
    }

    #[test]
    fn a_stopped_vms_snapshot_has_no_memory_and_the_test_drivers_no_disks() {
        let xml = "<domainsnapshot><name>s</name><state>shutoff</state><creationTime>5</creationTime>\
                   <memory snapshot='no'/><disks>\n  </disks><domain type='test'><memory>1</memory></domain>\
                   </domainsnapshot>";
        let parsed = SnapshotXml::parse(xml).expect("parsed");
        assert_eq!(parsed.disks, vec![]);
        assert_eq!(
            parsed.info("s"),
            SnapshotInfo { name: "s".into(), memory: false, vm_was_running: false, created_unix_seconds: 5 }
        );
        let external = RUNNING.replace("<memory snapshot='internal'/>", "<memory snapshot='external' file='/m'/>");
        assert!(SnapshotXml::parse(&external).expect("parsed").is_external());
        assert_eq!(SnapshotXml::parse("<domainsnapshot><name>s</name></domainsnapshot>"), None);
    }

    #[test]
    fn memory_follows_the_vms_state_and_a_mismatch_names_the_fix() {
        assert!(with_memory(&id(), true, None).unwrap());
        assert!(with_memory(&id(), true, Some(true)).unwrap());
        assert!(!with_memory(&id(), false, None).unwrap());
        assert!(!with_memory(&id(), false, Some(false)).unwrap());
        let running = with_memory(&id(), true, Some(false)).unwrap_err();
        assert_eq!(running.kind, ErrorKind::InvalidInput);
        assert!(running.message.contains("stop the VM first"), "{running}");
        let stopped = with_memory(&id(), false, Some(true)).unwrap_err();
        assert_eq!(stopped.kind, ErrorKind::InvalidInput);
        assert!(stopped.message.contains("start the VM first"), "{stopped}");
    }

    fn disk(target: &str, format: &str, serial: Option<&str>) -> Disk {
        Disk {
            target: target.into(),
            kind: "file".into(),
            source: Some(format!("/d/{target}.img")),
            format: Some(format.into()),
            serial: serial.map(str::to_owned),
        }
    }

    #[test]
    fn only_qcow2_disks_hold_snapshots_and_a_raw_one_is_named() {
        assert!(check_disks(&id(), &[disk("vda", "qcow2", None)]).is_ok());
        let data = check_disks(&id(), &[disk("vda", "qcow2", None), disk("vdb", "raw", Some("data"))]).unwrap_err();
        assert_eq!(data.kind, ErrorKind::InvalidInput);
        assert!(data.message.contains("disk vdb") && data.message.contains("spec.disks[data]"), "{data}");
        assert!(data.message.contains("format: qcow2"), "{data}");
        let qcow2_data = [disk("vda", "qcow2", None), disk("vdb", "qcow2", Some("data"))];
        assert!(check_disks(&id(), &qcow2_data).is_ok(), "a qcow2 data disk holds snapshots");
        let boot = check_disks(&id(), &[disk("vda", "raw", None)]).unwrap_err();
        assert!(boot.message.contains("spec.image"), "{boot}");
        let none = check_disks(&id(), &[]).unwrap_err();
        assert_eq!(none.kind, ErrorKind::InvalidInput);
        assert!(none.message.contains("no disk"), "{none}");
    }

    #[test]
    fn names_are_checked_before_they_reach_xml_or_a_command_line() {
        for good in ["default_web_6c8f1f4e-2b0a", "a", "v1.2", &"x".repeat(NAME_MAX_BYTES)] {
            assert!(check_name(OP_CREATE, good).is_ok(), "{good}");
        }
        for bad in ["", "a b", "a/b", "<x>", "é", &"x".repeat(NAME_MAX_BYTES + 1)] {
            assert_eq!(check_name(OP_CREATE, bad).unwrap_err().kind, ErrorKind::InvalidInput, "{bad:?}");
        }
        assert_eq!(
            snapshot_xml("s.1", true),
            "<domainsnapshot><name>s.1</name><memory snapshot='internal'/></domainsnapshot>"
        );
        assert_eq!(snapshot_xml("s", false), "<domainsnapshot><name>s</name><memory snapshot='no'/></domainsnapshot>");
    }

    /// A provider on libvirt's test driver, in-process, from `test-vms/hosts/host-a.xml`.
    async fn test_host() -> LibvirtProvider {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../test-vms/hosts/host-a.xml");
        let path = path.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        LibvirtProvider::connect(&format!("test://{}", path.display())).await.expect("open test driver")
    }

    fn request(name: &str, memory: Option<bool>) -> SnapshotRequest {
        SnapshotRequest { name: name.into(), memory, quiesce: true, timeout: Duration::from_secs(60) }
    }

    #[tokio::test]
    async fn the_test_driver_takes_reverts_and_deletes_snapshots_in_memory() {
        use vmlet_provider::{PowerState, Provider, VmSpec};
        let provider = test_host().await;
        let snapshots = provider.snapshots().expect("the test driver has snapshots");
        let spec = VmSpec {
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: vec![],
            id: id(),
            namespace: "team-a".into(),
            name: "snap".into(),
            cpus: 1,
            memory_bytes: 256 << 20,
            max_cpus: None,
            max_memory_bytes: None,
            image: None,
            image_backing_chain: None,
            kernel_boot: None,
        };
        provider.ensure_defined(&spec).await.expect("define");
        provider.start(&id()).await.expect("start");

        let running = snapshots.create_snapshot(&id(), &request("on", None)).await.expect("snapshot a running VM");
        assert!(running.memory && running.vm_was_running, "{running:?}");
        let again = snapshots.create_snapshot(&id(), &request("on", Some(false))).await.expect("the same name again");
        assert_eq!(again, running, "returned as it is");
        let err = snapshots.create_snapshot(&id(), &request("disk-only", Some(false))).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        let err = snapshots.revert_to_snapshot(&id(), "on").await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
        assert_eq!(provider.get(&id()).await.unwrap().unwrap().power, PowerState::Running);

        provider.destroy(&id()).await.expect("destroy");
        let err = snapshots.create_snapshot(&id(), &request("memory", Some(true))).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        let off = snapshots.create_snapshot(&id(), &request("off", None)).await.expect("snapshot a stopped VM");
        assert!(!off.memory && !off.vm_was_running, "{off:?}");
        let reverted = snapshots.revert_to_snapshot(&id(), "on").await.expect("revert");
        assert_eq!(reverted, RevertOutcome { memory_restored: false });
        assert_eq!(provider.get(&id()).await.unwrap().unwrap().power, PowerState::Off, "stays stopped");
        let err = snapshots.revert_to_snapshot(&id(), "none").await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

        assert_eq!(snapshots.snapshot(&id(), "on").await.expect("read"), Some(running));
        snapshots.delete_snapshot(&id(), "on").await.expect("delete");
        snapshots.delete_snapshot(&id(), "on").await.expect("delete again");
        assert_eq!(snapshots.snapshot(&id(), "on").await.expect("read"), None);
        let other = VmId("00000000-0000-4000-8000-00000000beef".into());
        snapshots.delete_snapshot(&other, "on").await.expect("a VM this host does not have");
        assert_eq!(snapshots.snapshot(&other, "on").await.unwrap_err().kind, ErrorKind::NotFound);

        provider.undefine(&id()).await.expect("undefine with a snapshot left");
        assert!(provider.get(&id()).await.unwrap().is_none());
    }
}
