//! [`Backup`]: a VM's disks copied to qcow2 files on its host, one file per
//! disk, at one point in time, and new disks made from such files.
//!
//! Which disk goes to which file is `backup/disks.rs`'s: the boot disk to the
//! request's target, each data disk (its `<serial>` is its name in
//! `spec.disks`) to the file the request names for it. Every step below
//! covers all of them: one backup job (one `virDomainBackupBegin` with all
//! disks, so one point in time), one checkpoint with a bitmap per disk, and
//! one `qemu-img convert` per disk for an inactive VM.
//!
//! - A running VM: libvirt's push-mode backup (`virDomainBackupBegin` with
//!   `<domainbackup mode='push'>`). QEMU copies the disk as it was when the
//!   backup began while the guest goes on writing (copy-before-write), so the
//!   VM is never paused. Asked to quiesce, vmlet freezes the guest's file
//!   systems through its agent (`virDomainFSFreeze`) just before the backup
//!   begins and thaws them (`virDomainFSThaw`) as soon as `virDomainBackupBegin`
//!   returned, whether it succeeded or not: the freeze lasts one libvirt call.
//!   vmlet then reads the job's progress once a second
//!   (`virDomainGetJobStats`) and, once the job is gone, how it ended (the
//!   completed job's statistics, kept for other readers).
//! - An inactive VM: its disk file copied with `qemu-img convert` on this
//!   machine, so only on a local connection (`qemu:///system`).
//! - A restore: `qemu-img convert` of the backup file into a new qcow2 disk,
//!   or into the place of an inactive VM's disk, on this machine too (see
//!   `restore.rs`).
//!
//! - Checkpoints and incremental backups (see `checkpoint.rs`): a backup
//!   asked to leave a checkpoint passes checkpoint XML to
//!   `virDomainBackupBegin`, which creates it atomically with the backup's
//!   point in time. An incremental backup first creates its target with
//!   `qemu-img create -b <previous backup> -F qcow2`, then begins with
//!   `<incremental>base</incremental>` and `VIR_DOMAIN_BACKUP_BEGIN_REUSE_EXTERNAL`:
//!   QEMU writes only the blocks the base checkpoint's bitmap marks, and the
//!   new file reads the others through its backing file. Once a backup that
//!   created a checkpoint completed, vmlet deletes the VM's other checkpoints
//!   that carry vmlet's mark; one that failed deletes the checkpoint it
//!   created. An inactive VM gets no checkpoint (libvirt 9 creates them only
//!   for running VMs), and an incremental backup of it is refused.
//!
//! Each VM has one backup at a time: a second call while one runs (in this
//! process, or a job libvirt reports: a backup to another target, a
//! migration, a block copy), or while this process restores the VM's disk or
//! works on its snapshots, fails `Conflict` at once and leaves the first
//! alone.
//!
//! A backup outlives the vmlet that began it (libvirt's job runs in libvirtd
//! and QEMU): a call for the target that a running job writes follows that
//! job, and one for a target a completed job wrote answers from libvirt's
//! record of it (see `backup/adopt.rs`). `abort_backup` cancels the job that
//! writes a given target and nothing else (`backup/abort.rs`).
//!
//! Where a copy fails, times out or is cancelled, its partial file is removed
//! (by libvirt itself for a running VM's backup, and by vmlet as well where
//! the file is on this machine). Nothing here stops, pauses or redefines a VM.
//!
//! Caveat: QEMU runs in its own mount namespace (libvirt's default), which is
//! a copy of the host's taken when the VM started: on a host whose mounts do
//! not propagate (no shared mount propagation), a file system mounted after
//! the VM started is invisible to QEMU, and a backup onto it fails ("Could not
//! open …"; the message says so).

mod abort;
mod adopt;
pub(crate) mod disks;

use std::time::{Duration, Instant};

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::sys;
use vmlet_provider::{
    Backup, BackupOutcome, BackupProgress, BackupRequest, Consistency, DataDiskCopy, DataDiskFile, Error, ErrorKind,
    InPlaceRestore, IncrementalBase, Result, VmId,
};

use crate::checkpoint::{self, check_name, checkpoint_xml};
use crate::error::{from_libvirt, is_operation_invalid};
use crate::in_flight::Claim;
use crate::jobs::{abort_job, block_job, block_job_name, job_stats, operation_name, JobStats};
use crate::provider::{is_active, is_local_uri, Host, LibvirtProvider};
use crate::qemu_img;
use crate::xml::{disks, escape};
use disks::{pair, Paired};

const OP: &str = "back up disk";
const OP_PROGRESS: &str = "read backup progress";
const OP_ABORT: &str = "abort backup";
const OP_CHECKPOINTS: &str = "delete backup checkpoints";

/// How often a running backup's progress is read.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How long the start of a backup may take: the guest agent's freeze, and
/// libvirt creating the target and starting QEMU's job (which waits up to
/// 30 s for another job on the domain to end). At most the backup's timeout.
const BEGIN_DEADLINE: Duration = Duration::from_secs(120);

/// How long one progress read may take.
const POLL_DEADLINE: Duration = Duration::from_secs(30);

/// How long `virDomainAbortJob` may take.
const ABORT_DEADLINE: Duration = Duration::from_secs(30);

/// How long QEMU gets to end an aborted backup before vmlet stops waiting
/// (and leaves the partial file to libvirt, which removes it when the job
/// ends).
const ABORT_GRACE: Duration = Duration::from_secs(60);

/// How long `qemu-img info` may take.
const INFO_DEADLINE: Duration = Duration::from_secs(60);

/// How long deleting a VM's checkpoints may take.
const CHECKPOINTS_DEADLINE: Duration = Duration::from_secs(60);

/// How a backup began ([`Host::begin_backup`]).
enum Started {
    /// The VM is not running: vmlet copies its disks itself, in this order
    /// (the boot disk first).
    Offline(Vec<OfflineCopy>),
    /// libvirt runs the backup job, which will be this consistent.
    Job { consistency: Consistency },
}

/// One disk of an inactive VM and the file it is copied to.
#[derive(Debug)]
struct OfflineCopy {
    /// The disk's file or block device.
    source: String,
    /// Its image format (`qcow2`, `raw`).
    format: String,
    /// The backup file.
    target: String,
    /// The data disk's name (`spec.disks[].name`); `None` for the boot disk.
    name: Option<String>,
}

/// What one look at a running backup found ([`Host::backup_progress`]).
enum Poll {
    /// The job still copies.
    Running(BackupProgress),
    /// The job is gone; how it ended as libvirt recorded it (type NONE, or
    /// another operation, when libvirt kept no record of it).
    Ended(JobStats),
}

impl Host {
    /// Start backing up VM `id` to `target`: for a running VM, libvirt's
    /// backup job of all its disks (frozen file systems around its start when
    /// `request.quiesce`), creating `plan.create` with it and copying only what
    /// changed since `plan.base` (whose targets exist already) when asked; for
    /// an inactive one, nothing yet but the disks to copy (an incremental one
    /// is refused).
    fn begin_backup(&self, conn: &Connect, id: &VmId, request: &BackupRequest, plan: &Checkpoints) -> Result<Started> {
        let domain = self.require(conn, OP, id)?;
        let xml = domain.xml_desc(0).map_err(|e| from_libvirt(OP, e))?;
        let paired = pair(OP, id, disks(&xml), &request.target, &request.data_disks)?;
        if !is_active(&domain, OP)? {
            if plan.base.is_some() {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "VM {id} is not running: an incremental backup copies what a running VM wrote since its \
                         checkpoint, and libvirt tracks that only while it runs; take a full backup"
                    ),
                ));
            }
            return paired.into_iter().map(|disk| offline_copy(id, disk)).collect::<Result<_>>().map(Started::Offline);
        }
        if plan.create.is_some() || plan.base.is_some() {
            refuse_without_bitmaps(id, &paired)?;
        }
        if let Some(base) = &plan.base {
            if checkpoint::lookup(&domain, base).map_err(|e| from_libvirt(OP, e))?.is_none() {
                return Err(Error::new(
                    OP,
                    ErrorKind::NotFound,
                    format!(
                        "VM {id} has no checkpoint {base} to base an incremental backup on (a newer backup or a \
                         revert removed it, or it was never made): take a full backup"
                    ),
                ));
            }
        }
        if let Some(name) = &plan.create {
            replace_stale_checkpoint(&domain, id, name)?;
        }
        refuse_other_jobs(&domain, id, &paired, &request.target)?;
        let consistency = if request.quiesce {
            freeze(&domain, id)
        } else {
            Consistency::CrashConsistent { reason: "quiesce was not asked".to_owned() }
        };
        let targets: Vec<&str> = paired.iter().map(|disk| disk.disk.target.as_str()).collect();
        let checkpoint = plan.create.as_deref().map(|name| checkpoint_xml(name, &targets));
        let backup = backup_xml(&paired, plan.base.as_deref());
        let begun = backup_begin(&domain, &backup, checkpoint.as_deref(), plan.base.is_some());
        if request.quiesce {
            thaw(&domain, id, matches!(consistency, Consistency::Quiesced { .. }));
        }
        begun.map_err(|e| begin_error(id, &request.target, e))?;
        tracing::info!(vm.uid = %id, disks = ?targets, backup.target = %request.target, ?consistency, "backup job started");
        Ok(Started::Job { consistency })
    }

    /// The progress of VM `id`'s backup job, or how it ended.
    fn backup_progress(&self, conn: &Connect, id: &VmId) -> Result<Poll> {
        let domain = self.require(conn, OP_PROGRESS, id)?;
        match job_stats(&domain, 0) {
            Ok(job) if job.is_running() && job.is_backup() => return Ok(Poll::Running(progress_of(&job))),
            Ok(_) => {}
            // Stopped meanwhile, which ended the job: its record says so.
            Err(err) if is_operation_invalid(&err) => {}
            Err(err) => return Err(from_libvirt(OP_PROGRESS, err)),
        }
        // Kept for other readers (`virsh domjobinfo --completed`).
        let flags = sys::VIR_DOMAIN_JOB_STATS_COMPLETED | sys::VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED;
        job_stats(&domain, flags).map(Poll::Ended).map_err(|e| from_libvirt(OP_PROGRESS, e))
    }

    /// Delete VM `id`'s checkpoints that vmlet created, except `keep`; the
    /// names of those left (that could not be deleted).
    fn delete_checkpoints(&self, conn: &Connect, id: &VmId, keep: Option<&str>) -> Result<Vec<String>> {
        let domain = self.require(conn, OP_CHECKPOINTS, id)?;
        checkpoint::delete_vmlets_except(&domain, keep).map_err(|e| from_libvirt(OP_CHECKPOINTS, e))
    }

    /// Delete VM `id`'s checkpoint `name`, if it has one.
    fn delete_checkpoint(&self, conn: &Connect, id: &VmId, name: &str) -> Result<()> {
        let domain = self.require(conn, OP_CHECKPOINTS, id)?;
        match checkpoint::lookup(&domain, name).map_err(|e| from_libvirt(OP_CHECKPOINTS, e))? {
            Some(found) => found.delete().map_err(|e| from_libvirt(OP_CHECKPOINTS, e)),
            None => Ok(()),
        }
    }

    /// `virDomainAbortJob` on VM `id` while its current job is a backup; any
    /// other job is left alone.
    fn abort_backup(&self, conn: &Connect, id: &VmId) -> Result<()> {
        let domain = self.require(conn, OP_ABORT, id)?;
        match job_stats(&domain, 0) {
            Ok(job) if job.is_running() && job.is_backup() => {}
            _ => return Ok(()),
        }
        abort_job(&domain).map_err(|e| from_libvirt(OP_ABORT, e))
    }
}

/// The checkpoints of one backup: the one it creates, the one it is based on.
#[derive(Clone, Debug, Default)]
struct Checkpoints {
    create: Option<String>,
    base: Option<String>,
}

/// Delete checkpoint `name` of `domain` when vmlet created it (an earlier,
/// interrupted attempt of the same backup): the backup creates it anew.
/// Errors: `InvalidInput` when a checkpoint of that name is not vmlet's.
fn replace_stale_checkpoint(domain: &Domain, id: &VmId, name: &str) -> Result<()> {
    let Some(existing) = checkpoint::lookup(domain, name).map_err(|e| from_libvirt(OP, e))? else {
        return Ok(());
    };
    if !existing.is_vmlets().map_err(|e| from_libvirt(OP, e))? {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "VM {id} has a checkpoint {name} that vmlet did not create; name the backup's checkpoint otherwise"
            ),
        ));
    }
    tracing::info!(vm.uid = %id, checkpoint.name = %name, "replacing a checkpoint an interrupted backup left");
    existing.delete().map_err(|e| from_libvirt(OP, e))
}

/// The copy of inactive VM `id`'s `disk`. Errors: `Unsupported` for a disk
/// that is no file or block device (a network disk, a pool volume).
fn offline_copy(id: &VmId, disk: Paired) -> Result<OfflineCopy> {
    let described = disk.describe();
    let Paired { disk, name, file } = disk;
    match (disk.kind.as_str(), disk.source) {
        ("file" | "block", Some(source)) => Ok(OfflineCopy {
            source,
            // What libvirt assumes of a disk without a stated format.
            format: disk.format.unwrap_or_else(|| "raw".to_owned()),
            target: file,
            name,
        }),
        (kind, _) => Err(Error::new(
            OP,
            ErrorKind::Unsupported,
            format!(
                "disk {described} of VM {id} is a {kind} disk without a file vmlet could copy while the VM is not \
                 running; start the VM to back it up through libvirt"
            ),
        )),
    }
}

/// Refuse (`InvalidInput`, naming the disk and the fix) a checkpoint of a
/// VM one of whose disks is no qcow2 image: a checkpoint is a dirty bitmap
/// kept in each disk's image, which only qcow2 holds.
fn refuse_without_bitmaps(id: &VmId, paired: &[Paired]) -> Result<()> {
    let Some(disk) = paired.iter().find(|disk| disk.disk.format.as_deref() != Some("qcow2")) else {
        return Ok(());
    };
    Err(Error::new(
        OP,
        ErrorKind::InvalidInput,
        format!(
            "disk {} of VM {id} is a {} image, and a checkpoint (spec.checkpoint, or an incremental backup) keeps a \
             dirty bitmap in every disk's image, which only qcow2 images hold: give the disk a qcow2 volume (a \
             StorageClass with parameters.format: qcow2) or take full backups without a checkpoint",
            disk.describe(),
            disk.disk.format.as_deref().unwrap_or("raw")
        ),
    ))
}

/// Refuse (`Conflict`) when the domain has a job running (a migration,
/// another backup) or one of its disks a block job (a copy, a commit):
/// libvirt would make the backup wait up to 30 s for the one, and refuse it
/// for the other.
fn refuse_other_jobs(domain: &Domain, id: &VmId, disks: &[Paired], target: &str) -> Result<()> {
    let job = job_stats(domain, 0).map_err(|e| begin_error(id, target, e))?;
    if job.is_running() {
        return Err(Error::new(
            OP,
            ErrorKind::Conflict,
            format!(
                "VM {id} is busy with {} (a libvirt job, `virsh domjobinfo`); a backup can begin once it ended",
                operation_name(job.operation)
            ),
        ));
    }
    for disk in disks {
        if let Some(kind) = block_job(domain, &disk.disk.target).map_err(|e| begin_error(id, target, e))? {
            return Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "disk {} of VM {id} is busy with {} (`virsh blockjob`); a backup can begin once it ended",
                    disk.describe(),
                    block_job_name(kind)
                ),
            ));
        }
    }
    Ok(())
}

/// Freeze the guest's file systems through its agent (`virDomainFSFreeze`);
/// the consistency that gives the backup.
fn freeze(domain: &Domain, id: &VmId) -> Consistency {
    // SAFETY: `domain` holds a valid virDomainPtr for the call; a null list of
    // 0 mount points means all of them; libvirt keeps no pointer.
    let frozen = unsafe { sys::virDomainFSFreeze(domain.as_ptr(), std::ptr::null_mut(), 0, 0) };
    match u32::try_from(frozen) {
        Ok(filesystems) => Consistency::Quiesced { filesystems },
        Err(_) => {
            let err = VirtError::last_error();
            tracing::info!(vm.uid = %id, reason = %err.message(), "guest file systems not frozen; the backup is crash-consistent");
            Consistency::CrashConsistent {
                reason: format!("the guest agent did not freeze the file systems: {}", err.message()),
            }
        }
    }
}

/// Thaw the guest's file systems (`virDomainFSThaw`), trying three times
/// when they were `frozen`; a failure is logged (loudly when they were).
fn thaw(domain: &Domain, id: &VmId, frozen: bool) {
    for attempt in 1..=3 {
        // SAFETY: as in `freeze`.
        if unsafe { sys::virDomainFSThaw(domain.as_ptr(), std::ptr::null_mut(), 0, 0) } >= 0 {
            return;
        }
        let err = VirtError::last_error();
        if !frozen {
            tracing::debug!(vm.uid = %id, reason = %err.message(), "thaw after a failed freeze failed too");
            return;
        }
        if attempt == 3 {
            tracing::error!(
                vm.uid = %id,
                reason = %err.message(),
                "the guest's file systems may still be frozen; thaw them with `virsh domfsthaw`"
            );
        }
    }
}

/// `virDomainBackupBegin` with `xml` and `checkpoint` XML (none when
/// `None`): libvirt creates the target file itself and refuses one that
/// exists, unless `reuse_target` (an incremental backup's target, created by
/// vmlet with its backing file).
fn backup_begin(domain: &Domain, xml: &str, checkpoint: Option<&str>, reuse_target: bool) -> Result<(), VirtError> {
    // vmlet builds both from paths and names without NUL bytes (checked on
    // entry).
    let xml = std::ffi::CString::new(xml).unwrap_or_default();
    let checkpoint = checkpoint.map(|c| std::ffi::CString::new(c).unwrap_or_default());
    let checkpoint_ptr = checkpoint.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    let flags = if reuse_target { sys::VIR_DOMAIN_BACKUP_BEGIN_REUSE_EXTERNAL } else { 0 };
    // SAFETY: `domain` holds a valid virDomainPtr and both strings are
    // NUL-terminated (or null: no checkpoint) for the call; libvirt keeps
    // neither.
    let ret = unsafe { sys::virDomainBackupBegin(domain.as_ptr(), xml.as_ptr(), checkpoint_ptr, flags) };
    if ret < 0 {
        return Err(VirtError::last_error());
    }
    Ok(())
}

/// The push-mode backup of each of `disks` into a new qcow2 at its file:
/// all of it, or what changed since checkpoint `incremental`.
fn backup_xml(disks: &[Paired], incremental: Option<&str>) -> String {
    let incremental =
        incremental.map(|base| format!("<incremental>{}</incremental>", escape(base))).unwrap_or_default();
    let disks: String = disks
        .iter()
        .map(|disk| {
            format!(
                "<disk name='{}' backup='yes' type='file'><driver type='qcow2'/><target file='{}'/></disk>",
                escape(&disk.disk.target),
                escape(&disk.file)
            )
        })
        .collect();
    format!("<domainbackup mode='push'>{incremental}<disks>{disks}</disks></domainbackup>")
}

/// The provider error for a backup of VM `id` to `target` that could not
/// begin.
///
/// - another job on the domain or its disk (`OPERATION_INVALID`, "another
///   backup job is already running", "disk 'vda' has a blockjob assigned",
///   libvirt's job lock not acquired in time) or a domain that stopped
///   meanwhile → `Conflict`;
/// - a target QEMU cannot open → `Permanent`, naming the mount namespace;
/// - otherwise the libvirt error's kind.
fn begin_error(id: &VmId, target: &str, err: VirtError) -> Error {
    let message = err.message().to_owned();
    let busy = is_operation_invalid(&err)
        || (err.code().is(ErrorNumber::OperationTimeout) && message.contains("state change lock"))
        || message.contains("blockjob")
        || message.contains("block job")
        || (message.contains("another") && message.contains("job"));
    let (kind, message) = if busy {
        (
            ErrorKind::Conflict,
            format!(
                "the backup of VM {id} cannot begin now ({message}): another job runs on it or its state changed; \
                 retry once it settled"
            ),
        )
    } else if message.contains("Could not open") {
        (
            ErrorKind::Permanent,
            format!(
                "QEMU cannot open the backup target {target} ({message}); QEMU sees the host's mounts as they were \
                 when the VM started, so a file system mounted since is invisible to it: back up to a directory \
                 that existed then, or restart the VM"
            ),
        )
    } else {
        let mut error = from_libvirt(OP, err);
        error.message = format!("the backup of VM {id} to {target} could not begin: {}", error.message);
        return error;
    };
    Error::new(OP, kind, message).with_source(err)
}

/// A running backup job's progress.
fn progress_of(job: &JobStats) -> BackupProgress {
    BackupProgress { processed_bytes: job.processed_bytes.unwrap_or(0), total_bytes: job.total_bytes.unwrap_or(0) }
}

/// Refuse (`InvalidInput`) a `path` that is not absolute or holds a NUL byte.
pub(crate) fn check_path(operation: &'static str, what: &str, path: &str) -> Result<()> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(Error::new(
            operation,
            ErrorKind::InvalidInput,
            format!("{what} {path:?} must be an absolute path on the libvirt host"),
        ));
    }
    Ok(())
}

impl LibvirtProvider {
    /// Follow VM `id`'s backup job until it ended or `deadline` passed.
    async fn follow_backup(
        &self,
        id: &VmId,
        request: &BackupRequest,
        consistency: Consistency,
        deadline: Instant,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome> {
        loop {
            match self.poll_backup(id).await {
                Ok(Poll::Running(now)) => progress(now),
                Ok(Poll::Ended(job)) => return self.backup_ended(id, request, job, consistency, progress).await,
                Err(err) if err.is_transient() => {
                    tracing::warn!(vm.uid = %id, error = %err, "cannot read the backup's progress; trying again");
                }
                Err(err) if err.kind == ErrorKind::NotFound => {
                    let partial = self.discard_partials(files(request));
                    return Err(Error::new(
                        OP,
                        ErrorKind::Permanent,
                        format!("VM {id} was undefined during its backup to {}; {partial}", request.target),
                    ));
                }
                Err(err) => return Err(err),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return self.abort_after_timeout(id, request, consistency, progress).await;
            }
            tokio::time::sleep(POLL_INTERVAL.min(left)).await;
        }
    }

    /// One look at VM `id`'s backup job.
    async fn poll_backup(&self, id: &VmId) -> Result<Poll> {
        let id = id.clone();
        self.blocking_within(OP_PROGRESS, POLL_DEADLINE, move |host, conn| host.backup_progress(conn, &id)).await
    }

    /// The outcome of a backup job that ended as `job` says.
    async fn backup_ended(
        &self,
        id: &VmId,
        request: &BackupRequest,
        job: JobStats,
        consistency: Consistency,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome> {
        let target = &request.target;
        if job.is_backup() && job.job_type == sys::VIR_DOMAIN_JOB_COMPLETED {
            let total = job.total_bytes.or(job.processed_bytes).unwrap_or(0);
            let processed = job.processed_bytes.unwrap_or(total);
            progress(BackupProgress { processed_bytes: processed, total_bytes: total });
            let file_bytes = self.file_size(target).await;
            let data_disks = self.data_copies(request).await;
            tracing::info!(vm.uid = %id, backup.target = %target, data_disks = data_disks.len(), bytes = processed, file_bytes, ?consistency, "backup completed");
            let checkpoint = request.checkpoint.clone();
            return Ok(BackupOutcome {
                path: target.clone(),
                data_disks,
                bytes: processed,
                file_bytes,
                consistency,
                checkpoint,
            });
        }
        let partial = self.discard_partials(files(request));
        let (kind, message) = if !job.is_backup() {
            (
                ErrorKind::Permanent,
                format!(
                    "libvirt kept no record of how the backup of VM {id} to {target} ended (was libvirtd restarted \
                     during it?); {partial}; back it up again"
                ),
            )
        } else if job.job_type == sys::VIR_DOMAIN_JOB_CANCELLED {
            (
                ErrorKind::Transient,
                format!(
                    "the backup of VM {id} to {target} was cancelled (`virsh domjobabort`, or the VM stopped); \
                     {partial}"
                ),
            )
        } else {
            let reason = job.error.as_deref().unwrap_or("libvirt recorded no reason; see libvirtd's log");
            (
                ErrorKind::Permanent,
                format!("the backup of VM {id} to {target} failed: {reason}; {partial}; the VM was left as it was"),
            )
        };
        tracing::warn!(vm.uid = %id, backup.target = %target, job.type = job.job_type, reason = ?job.error, "backup did not complete");
        Err(Error::new(OP, kind, message))
    }

    /// Abort VM `id`'s backup job after its timeout and wait for it to end.
    /// A job that completed meanwhile is a finished backup.
    async fn abort_after_timeout(
        &self,
        id: &VmId,
        request: &BackupRequest,
        consistency: Consistency,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome> {
        tracing::warn!(vm.uid = %id, timeout = ?request.timeout, "backup did not finish in time; aborting it");
        let abort_id = id.clone();
        let aborted =
            self.blocking_within(OP_ABORT, ABORT_DEADLINE, move |host, conn| host.abort_backup(conn, &abort_id));
        if let Err(err) = aborted.await {
            tracing::warn!(vm.uid = %id, error = %err, "virDomainAbortJob failed");
        }
        let until = Instant::now() + ABORT_GRACE;
        let ended = loop {
            match self.poll_backup(id).await {
                Ok(Poll::Ended(job)) if job.is_backup() && job.job_type == sys::VIR_DOMAIN_JOB_COMPLETED => {
                    return self.backup_ended(id, request, job, consistency, progress).await;
                }
                Ok(Poll::Ended(_)) => break true,
                Err(err) if err.kind == ErrorKind::NotFound => break true,
                _ if Instant::now() >= until => break false,
                _ => tokio::time::sleep(POLL_INTERVAL).await,
            }
        };
        let partial = if ended {
            self.discard_partials(files(request))
        } else {
            "QEMU had not ended the copy a minute later; libvirt removes the partial file when it does"
        };
        Err(Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "the backup of VM {id} to {} did not finish within {}s and was aborted; {partial}; the VM runs on",
                request.target,
                request.timeout.as_secs_f32()
            ),
        ))
    }

    /// Copy inactive VM `id`'s disks with qemu-img, one after the other;
    /// progress counts all disks' virtual sizes together. A copy that failed
    /// removes what the earlier ones wrote.
    async fn offline_backup(
        &self,
        id: &VmId,
        request: &BackupRequest,
        copies: &[OfflineCopy],
        deadline: Instant,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome> {
        if !is_local_uri(self.uri()) {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "VM {id} is not running, and vmlet copies an inactive VM's disks with qemu-img where the files \
                     are; the connection {} reaches another machine, where vmlet cannot run it: start the VM to back \
                     it up through libvirt, or run vmlet on that host",
                    self.uri()
                ),
            ));
        }
        let left = || deadline.saturating_duration_since(Instant::now());
        let mut sizes = Vec::with_capacity(copies.len());
        for copy in copies {
            sizes.push(
                qemu_img::info(OP, &copy.source, Some(&copy.format), INFO_DEADLINE.min(left())).await?.virtual_size,
            );
        }
        let total: u64 = sizes.iter().sum();
        progress(BackupProgress { processed_bytes: 0, total_bytes: total });
        let mut copied = 0;
        for (at, (copy, &size)) in copies.iter().zip(&sizes).enumerate() {
            let mut report = |percent: f64| {
                let processed_bytes = copied + (size as f64 * percent / 100.0) as u64;
                progress(BackupProgress { processed_bytes, total_bytes: total });
            };
            let converted =
                qemu_img::convert(OP, &copy.source, &copy.format, &copy.target, "qcow2", left(), &mut report);
            if let Err(mut err) = converted.await {
                if err.kind == ErrorKind::Permanent && err.message.contains("lock") {
                    err.kind = ErrorKind::Conflict;
                    err.message =
                        format!("the disks of VM {id} are in use (was the VM started meanwhile?): {}", err.message);
                }
                self.discard_partials(copies[..at].iter().map(|done| done.target.as_str()));
                return Err(err);
            }
            copied += size;
        }
        progress(BackupProgress { processed_bytes: total, total_bytes: total });
        let file_bytes = self.file_size(&request.target).await;
        let mut data_disks = Vec::new();
        for (copy, &virtual_bytes) in copies.iter().zip(&sizes) {
            if let Some(disk) = &copy.name {
                let file_bytes = self.file_size(&copy.target).await;
                data_disks.push(DataDiskCopy {
                    disk: disk.clone(),
                    path: copy.target.clone(),
                    virtual_bytes,
                    file_bytes,
                });
            }
        }
        tracing::info!(vm.uid = %id, backup.target = %request.target, data_disks = data_disks.len(), bytes = total, file_bytes, "offline backup completed");
        let consistency = Consistency::Offline;
        Ok(BackupOutcome {
            path: request.target.clone(),
            data_disks,
            bytes: total,
            file_bytes,
            consistency,
            checkpoint: None,
        })
    }

    /// The data disks' files of a completed backup job, with their sizes
    /// (0 where vmlet cannot read them: a remote connection).
    async fn data_copies(&self, request: &BackupRequest) -> Vec<DataDiskCopy> {
        let mut copies = Vec::with_capacity(request.data_disks.len());
        for DataDiskFile { disk, path } in &request.data_disks {
            let virtual_bytes = if is_local_uri(self.uri()) {
                match qemu_img::info(OP, path, Some("qcow2"), INFO_DEADLINE).await {
                    Ok(info) => info.virtual_size,
                    Err(err) => {
                        tracing::warn!(path, error = %err, "cannot read the data disk backup's size");
                        0
                    }
                }
            } else {
                0
            };
            let file_bytes = self.file_size(path).await;
            copies.push(DataDiskCopy { disk: disk.clone(), path: path.clone(), virtual_bytes, file_bytes });
        }
        copies
    }

    /// The size of the file at `path` when it is on this machine; 0 for a
    /// remote connection's (or an unreadable) file.
    async fn file_size(&self, path: &str) -> u64 {
        if !is_local_uri(self.uri()) {
            return 0;
        }
        match tokio::fs::metadata(path).await {
            Ok(meta) => meta.len(),
            Err(err) => {
                tracing::warn!(path, error = %err, "cannot read the backup file's size");
                0
            }
        }
    }

    /// Check `request`'s checkpoint names and, for an incremental backup,
    /// its backing files, and create its targets (the boot disk's and each
    /// data disk's) on top of them.
    ///
    /// Errors: `InvalidInput` for a bad name, a new checkpoint named as the
    /// base, a relative or non-qcow2 backing file, data disks' backing files
    /// that are not those of `request.data_disks`, or a target that exists;
    /// `NotFound` when a backing file does not exist; `Unsupported` on a
    /// remote connection (qemu-img creates the targets where they are).
    async fn plan_checkpoints(&self, id: &VmId, request: &BackupRequest) -> Result<Checkpoints> {
        if let Some(name) = &request.checkpoint {
            check_name(OP, "checkpoint", name)?;
        }
        let Some(base) = &request.incremental else {
            return Ok(Checkpoints { create: request.checkpoint.clone(), base: None });
        };
        check_name(OP, "base checkpoint", &base.checkpoint)?;
        if request.checkpoint.as_ref() == Some(&base.checkpoint) {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("the backup's new checkpoint must not have its base's name ({})", base.checkpoint),
            ));
        }
        if !is_local_uri(self.uri()) {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "vmlet creates an incremental backup's files (on top of the previous backup) with qemu-img where \
                     the files are; the connection {} reaches another machine: run vmlet on that host",
                    self.uri()
                ),
            ));
        }
        let layers = incremental_layers(request, base)?;
        for (_, backing_file) in &layers {
            check_backing_file(id, backing_file).await?;
        }
        for (at, (target, backing_file)) in layers.iter().enumerate() {
            if let Err(err) = qemu_img::create_with_backing(OP, target, backing_file, INFO_DEADLINE).await {
                self.discard_partials(layers[..at].iter().map(|(created, _)| *created));
                return Err(err);
            }
        }
        Ok(Checkpoints { create: request.checkpoint.clone(), base: Some(base.checkpoint.clone()) })
    }

    /// After a backup job that created checkpoint `created`: when it
    /// `succeeded`, delete the VM's other vmlet checkpoints (a VM carries at
    /// most one); when not, delete `created`. Failures are logged: the
    /// backup's outcome stands.
    async fn tidy_checkpoints(&self, id: &VmId, created: Option<&str>, succeeded: bool) {
        let Some(created) = created.map(str::to_owned) else {
            return;
        };
        let task_id = id.clone();
        let result = if succeeded {
            self.blocking_within(OP_CHECKPOINTS, CHECKPOINTS_DEADLINE, move |host, conn| {
                host.delete_checkpoints(conn, &task_id, Some(&created))
            })
            .await
        } else {
            self.blocking_within(OP_CHECKPOINTS, CHECKPOINTS_DEADLINE, move |host, conn| {
                host.delete_checkpoint(conn, &task_id, &created).map(|()| vec![created.clone()])
            })
            .await
        };
        match result {
            Ok(left) if succeeded && !left.is_empty() => {
                tracing::warn!(vm.uid = %id, checkpoints = ?left, "older checkpoints left; `virsh checkpoint-delete` them");
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(vm.uid = %id, error = %err, "cannot tidy the VM's backup checkpoints"),
        }
    }

    /// Remove a failed backup's partial `files` where vmlet can (a local
    /// connection; libvirt removes them too) and say what became of them.
    fn discard_partials<'a>(&self, files: impl IntoIterator<Item = &'a str>) -> &'static str {
        if is_local_uri(self.uri()) {
            files.into_iter().for_each(|file| {
                qemu_img::remove_partial(file);
            });
            "the partial files were removed"
        } else {
            "libvirt removes the partial files on its host"
        }
    }
}

/// Refuse (`InvalidInput`) a request whose files are not absolute paths or
/// not distinct: two disks copied into one file would overwrite each other.
fn check_files(request: &BackupRequest) -> Result<()> {
    check_path(OP, "backup target", &request.target)?;
    for data in &request.data_disks {
        check_path(OP, "data disk backup target", &data.path)?;
    }
    let all: Vec<&str> = files(request).collect();
    if let Some((at, file)) = all.iter().enumerate().find(|(at, file)| all[..*at].contains(file)) {
        let disk = request.data_disks.get(at - 1).map_or("?", |data| data.disk.as_str());
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "backup file {file} is named for two disks (the second: data disk {disk}); each disk needs its own"
            ),
        ));
    }
    Ok(())
}

/// Every file `request` writes: the boot disk's target, then the data disks'.
fn files(request: &BackupRequest) -> impl Iterator<Item = &str> {
    std::iter::once(request.target.as_str()).chain(request.data_disks.iter().map(|data| data.path.as_str()))
}

/// Each file of an incremental backup and the earlier backup's file it is
/// created on: the boot disk's target on `base.backing_file`, each data
/// disk's on the base's file for the same disk. Errors (`InvalidInput`):
/// a relative backing file; a data disk the base has no file for (added
/// since: take a full backup) or a base file for a disk the request does
/// not name.
fn incremental_layers<'a>(request: &'a BackupRequest, base: &'a IncrementalBase) -> Result<Vec<(&'a str, &'a str)>> {
    check_path(OP, "backing file", &base.backing_file)?;
    let mut layers = vec![(request.target.as_str(), base.backing_file.as_str())];
    for data in &request.data_disks {
        let Some(backing) = base.data_backing_files.iter().find(|backing| backing.disk == data.disk) else {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "the base backup holds no copy of data disk {} (spec.disks[{}]), which was added since: take a \
                     full backup",
                    data.disk, data.disk
                ),
            ));
        };
        check_path(OP, "backing file", &backing.path)?;
        layers.push((data.path.as_str(), backing.path.as_str()));
    }
    if let Some(extra) =
        base.data_backing_files.iter().find(|backing| !request.data_disks.iter().any(|data| data.disk == backing.disk))
    {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "the base backup holds data disk {} that this backup names no file for; an incremental backup \
                 copies the same disks as its base",
                extra.disk
            ),
        ));
    }
    Ok(layers)
}

/// Check that `backing_file`, a previous backup an incremental one of VM
/// `id` builds on, is a qcow2 file. Errors: `NotFound` when it does not
/// exist; `InvalidInput` when it is no file or no qcow2 image; `Permanent`
/// when it cannot be read.
async fn check_backing_file(id: &VmId, backing_file: &str) -> Result<()> {
    match tokio::fs::metadata(backing_file).await {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("backing file {backing_file} is no file")))
        }
        Err(err) => {
            return Err(Error::new(
                OP,
                if err.kind() == std::io::ErrorKind::NotFound { ErrorKind::NotFound } else { ErrorKind::Permanent },
                format!(
                    "the previous backup {backing_file}, on which the incremental backup of VM {id} builds, cannot \
                     be read ({err}): take a full backup"
                ),
            ))
        }
    }
    let info = qemu_img::info(OP, backing_file, None, INFO_DEADLINE).await?;
    if info.format != "qcow2" {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!("backing file {backing_file} is a {} image; a backup chain is qcow2 files", info.format),
        ));
    }
    Ok(())
}

#[async_trait::async_trait]
impl Backup for LibvirtProvider {
    /// See the module docs. Returns at most about a minute and a half after
    /// `request.timeout` (the abort, then the wait for QEMU to end the copy).
    /// Progress counts bytes of the disk (libvirt's `disk_processed` and
    /// `disk_total`; for an inactive VM qemu-img's percentage of the virtual
    /// size): as soon as the copy runs, about once a second, and once more at
    /// the end (a copy that took less than a second reports only then).
    ///
    /// `BackupOutcome::bytes` is the disk data copied (its virtual size for
    /// these full backups), `file_bytes` the size of the file written (0 on a
    /// remote connection, whose files vmlet cannot see).
    ///
    /// While an inactive VM's disk is being copied, qemu-img holds its lock:
    /// starting the VM fails until the copy finished.
    ///
    /// Errors as [`Backup::backup`] documents; `InvalidInput` for a relative
    /// target; `Unsupported` on the test driver, and for an inactive VM on a
    /// remote connection (its file is on another machine) or whose disk is no
    /// file; `Conflict` also when the VM started while its disk was copied.
    #[instrument(
        skip(self, request, progress),
        fields(provider = "libvirt", vm.uid = %id, backup.target = %request.target, backup.quiesce = request.quiesce)
    )]
    async fn backup(
        &self,
        id: &VmId,
        request: &BackupRequest,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome> {
        if !self.domain_kind().is_qemu() {
            return Err(Error::new(OP, ErrorKind::Unsupported, "libvirt's test driver has no disks to back up"));
        }
        check_files(request)?;
        let Some(_claim) = Claim::take(&self.in_flight().vms, id) else {
            return Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "VM {id} has a backup, restore or snapshot operation running (started by this vmlet); wait \
                     until it ended"
                ),
            ));
        };
        if let Some(outcome) = self.resume_earlier(id, request, progress).await? {
            return Ok(outcome);
        }
        let plan = self.plan_checkpoints(id, request).await?;
        let deadline = Instant::now() + request.timeout;
        // The freeze is a guest-agent call: it waits its turn with the others.
        let agent = if request.quiesce { Some(self.agent_turn(OP, id).await?) } else { None };
        let (task_id, task_request, task_plan) = (id.clone(), request.clone(), plan.clone());
        let started = self
            .blocking_within(OP, BEGIN_DEADLINE.min(request.timeout), move |host, conn| {
                host.begin_backup(conn, &task_id, &task_request, &task_plan)
            })
            .await;
        drop(agent);
        let started = match started {
            Ok(started) => started,
            Err(err) => {
                if plan.base.is_some() {
                    // vmlet created these targets (libvirt did not begin).
                    self.discard_partials(files(request));
                }
                return Err(err);
            }
        };
        match started {
            Started::Offline(copies) => self.offline_backup(id, request, &copies, deadline, progress).await,
            Started::Job { consistency } => {
                let ended = self.follow_backup(id, request, consistency, deadline, progress).await;
                self.tidy_checkpoints(id, plan.create.as_deref(), ended.is_ok()).await;
                ended
            }
        }
    }

    /// Only a job whose backup XML names `target` as a disk's push target is
    /// aborted; libvirt removes the partial file of a full backup itself,
    /// and vmlet removes it too where it is on this machine (a local
    /// connection).
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, backup.target = %target))]
    async fn abort_backup(&self, id: &VmId, target: &str) -> Result<bool> {
        self.abort_backup_job(id, target).await
    }

    /// `qemu-img convert -f qcow2 -O qcow2` on this machine (a local
    /// connection only) into `<target>.partial`, flushed to stable storage,
    /// then renamed to `target`; the bytes returned are the disk's virtual
    /// size (see `restore.rs`). A `target` that exists is left alone (it must
    /// be a qcow2 image) and its virtual size returned.
    ///
    /// Errors as [`Backup::restore_disk`] documents; `Transient` after
    /// `timeout` (qemu-img killed, the partial target removed); `InvalidInput`
    /// for relative paths or a `source` that is no file; `Unsupported` on a
    /// remote connection (the files are on another machine); `Conflict` while
    /// another restore to `target` runs in this process.
    #[instrument(skip(self), fields(provider = "libvirt", restore.source = %source, restore.target = %target))]
    async fn restore_disk(&self, source: &str, target: &str, timeout: Duration) -> Result<u64> {
        self.restore_new_disk(source, target, timeout).await
    }

    /// The VM's disk replaced by a copy of `source` in the disk's own format
    /// (`qemu-img convert` on this machine, a local connection only), its
    /// previous file kept as `<disk>.before-<tag>` with the old file's owner
    /// and mode given to the new one; libvirt's record of the internal
    /// snapshots that only the previous file holds is dropped (see
    /// `restore.rs`). `bytes` is the disk's virtual size.
    ///
    /// The caller keeps the VM stopped during the call: vmlet checks that it
    /// is inactive before the copy and again just before the renames, but
    /// cannot lock out a start in between.
    ///
    /// Errors as [`Backup::restore_in_place`] documents; `InvalidInput` also
    /// for a relative `source` and for a disk that is no file;
    /// `Unsupported` also on the test driver; `Permanent` when the disk file
    /// and its kept copy are both missing, or a rename failed (the message
    /// says what is where; a retry completes it).
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, restore.source = %source, restore.tag = %tag))]
    async fn restore_in_place(
        &self,
        id: &VmId,
        source: &str,
        data_sources: &[DataDiskFile],
        tag: &str,
        timeout: Duration,
    ) -> Result<InPlaceRestore> {
        self.restore_disk_in_place(id, source, data_sources, tag, timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xml::Disk;

    fn id() -> VmId {
        VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into())
    }

    fn disk(target: &str, format: Option<&str>) -> Disk {
        Disk {
            target: target.into(),
            kind: "file".into(),
            source: Some(format!("/d/{target}.img")),
            format: format.map(str::to_owned),
            serial: None,
        }
    }

    fn paired(target: &str, name: Option<&str>, file: &str) -> Paired {
        Paired { disk: disk(target, Some("qcow2")), name: name.map(str::to_owned), file: file.into() }
    }

    fn request(data: &[(&str, &str)]) -> BackupRequest {
        BackupRequest {
            target: "/b/vm.qcow2".into(),
            data_disks: data
                .iter()
                .map(|(disk, path)| DataDiskFile { disk: (*disk).into(), path: (*path).into() })
                .collect(),
            quiesce: false,
            timeout: Duration::from_secs(60),
            checkpoint: None,
            incremental: None,
        }
    }

    #[test]
    fn the_backup_xml_pushes_each_disk_into_its_own_new_qcow2() {
        assert_eq!(
            backup_xml(&[paired("vda", None, "/backups/it's.qcow2")], None),
            "<domainbackup mode='push'><disks><disk name='vda' backup='yes' type='file'><driver type='qcow2'/>\
             <target file='/backups/it&apos;s.qcow2'/></disk></disks></domainbackup>"
        );
        assert_eq!(
            backup_xml(&[paired("vda", None, "/b/1.qcow2"), paired("vdb", Some("data"), "/b/1.data.qcow2")], None),
            "<domainbackup mode='push'><disks><disk name='vda' backup='yes' type='file'><driver type='qcow2'/>\
             <target file='/b/1.qcow2'/></disk><disk name='vdb' backup='yes' type='file'><driver type='qcow2'/>\
             <target file='/b/1.data.qcow2'/></disk></disks></domainbackup>"
        );
    }

    #[test]
    fn an_incremental_backup_xml_names_its_base_checkpoint() {
        assert_eq!(
            backup_xml(&[paired("vda", None, "/b/2.qcow2")], Some("b-1")),
            "<domainbackup mode='push'><incremental>b-1</incremental><disks><disk name='vda' backup='yes' \
             type='file'><driver type='qcow2'/><target file='/b/2.qcow2'/></disk></disks></domainbackup>"
        );
    }

    #[test]
    fn a_checkpoint_needs_every_disk_in_qcow2_and_names_the_one_that_is_not() {
        let qcow2 = [paired("vda", None, "/b/1"), paired("vdb", Some("data"), "/b/2")];
        assert!(refuse_without_bitmaps(&id(), &qcow2).is_ok());
        let raw = Paired { disk: disk("vdb", Some("raw")), ..qcow2[1].clone() };
        let unstated = Paired { disk: disk("vdb", None), ..qcow2[1].clone() };
        for data in [raw, unstated] {
            let err = refuse_without_bitmaps(&id(), &[qcow2[0].clone(), data]).expect_err("raw");
            assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
            assert!(err.message.contains("disk vdb (spec.disks[data]) of VM"), "{err}");
            assert!(err.message.contains("is a raw image"), "{err}");
            assert!(err.message.contains("format: qcow2"), "{err}");
        }
    }

    #[test]
    fn an_inactive_vms_disks_are_copied_from_their_files_in_their_format_raw_by_default() {
        let boot = Paired { disk: disk("vda", None), name: None, file: "/b/1.qcow2".into() };
        let copy = offline_copy(&id(), boot).expect("a file disk is copied");
        assert_eq!(
            (copy.source.as_str(), copy.format.as_str(), copy.target.as_str(), copy.name),
            ("/d/vda.img", "raw", "/b/1.qcow2", None)
        );
        let data = paired("vdb", Some("data"), "/b/1.data.qcow2");
        assert_eq!(offline_copy(&id(), data).expect("data disk").name.as_deref(), Some("data"));
        let network = Paired {
            disk: Disk { kind: "network".into(), source: None, ..disk("vdb", None) },
            ..paired("vdb", Some("data"), "/b/x")
        };
        let err = offline_copy(&id(), network).expect_err("a network disk is not");
        assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
        assert!(err.message.contains("vdb (spec.disks[data])"), "{err}");
    }

    #[test]
    fn relative_paths_are_refused() {
        assert!(check_path(OP, "backup target", "/b/x.qcow2").is_ok());
        for path in ["b/x.qcow2", "", "/b/x\0.qcow2"] {
            assert_eq!(check_path(OP, "backup target", path).expect_err(path).kind, ErrorKind::InvalidInput);
        }
    }

    #[test]
    fn every_file_of_a_request_is_absolute_and_its_own() {
        assert!(check_files(&request(&[("data", "/b/vm.data.qcow2"), ("logs", "/b/vm.logs.qcow2")])).is_ok());
        let err = check_files(&request(&[("data", "b/vm.data.qcow2")])).expect_err("relative");
        assert!(err.message.contains("data disk backup target"), "{err}");
        let err = check_files(&request(&[("data", "/b/vm.qcow2")])).expect_err("the boot disk's file");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(
            err.message.contains("backup file /b/vm.qcow2 is named for two disks (the second: data disk data)"),
            "{err}"
        );
        let err = check_files(&request(&[("data", "/b/d"), ("logs", "/b/d")])).expect_err("twice");
        assert!(err.message.contains("(the second: data disk logs)"), "{err}");
        let one = request(&[("data", "/b/d")]);
        let all: Vec<&str> = files(&one).collect();
        assert_eq!(all, ["/b/vm.qcow2", "/b/d"]);
    }

    #[test]
    fn an_incremental_backup_layers_each_disk_on_the_bases_copy_of_the_same_disk() {
        let data = |disk: &str, path: &str| DataDiskFile { disk: disk.into(), path: path.into() };
        let base = |files: Vec<DataDiskFile>| IncrementalBase {
            checkpoint: "c-1".into(),
            backing_file: "/b/0.qcow2".into(),
            data_backing_files: files,
        };
        let request = request(&[("data", "/b/1.data"), ("logs", "/b/1.logs")]);
        let both = base(vec![data("logs", "/b/0.logs"), data("data", "/b/0.data")]);
        let layers = incremental_layers(&request, &both);
        assert_eq!(
            layers.expect("layers"),
            [("/b/vm.qcow2", "/b/0.qcow2"), ("/b/1.data", "/b/0.data"), ("/b/1.logs", "/b/0.logs")]
        );
        let err = incremental_layers(&request, &base(vec![data("data", "/b/0.data")])).expect_err("logs added since");
        assert!(
            err.message.contains("holds no copy of data disk logs (spec.disks[logs]), which was added since"),
            "{err}"
        );
        let extra = base(vec![data("data", "/b/0.d"), data("logs", "/b/0.l"), data("gone", "/b/0.g")]);
        let err = incremental_layers(&request, &extra).expect_err("a disk removed since");
        assert!(err.message.contains("holds data disk gone that this backup names no file for"), "{err}");
        let err = incremental_layers(&request, &base(vec![data("data", "0.d"), data("logs", "/b/0.l")]))
            .expect_err("relative");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    }
}
