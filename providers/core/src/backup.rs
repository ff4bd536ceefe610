//! Copying a VM's disks to files on its host while it runs (a backup), and
//! making new disks from such files (a restore).
//!
//! A backup copies every disk of the VM at one point in time: the boot disk
//! into [`BackupRequest::target`] and each data disk (a disk the
//! VirtualMachine names in `spec.disks`) into the file
//! [`BackupRequest::data_disks`] gives for it, one file per disk.
//!
//! The copy is a point-in-time image of the disk: for a running VM the back
//! end copies the blocks as they were when the backup began while the guest
//! goes on writing (libvirt's push-mode `virDomainBackupBegin`); an inactive
//! VM's disk is copied as it is. A backup never pauses or stops the VM beyond
//! the moment its guest's filesystems are frozen (when asked and possible).
//!
//! Incremental backups: a backup may leave a *checkpoint* on the VM
//! ([`BackupRequest::checkpoint`]), from which the back end tracks the blocks
//! the guest writes; a later backup based on it
//! ([`BackupRequest::incremental`]) copies only those blocks into a file whose
//! backing file is the previous backup's, so the chain (full backup, then each
//! incremental one) reads as the whole disk at the newest backup's point in
//! time. A VM carries at most one checkpoint of vmlet's: a backup that
//! creates one deletes the VM's older ones once it completed, so an
//! incremental backup is always based on the newest backup of the chain.

use std::time::Duration;

use crate::{Result, VmId};

/// What to back up and where ([`Backup::backup`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupRequest {
    /// Absolute path on the VM's host of the qcow2 file to write. The caller
    /// checked it lies under the host's backup roots, and its directory
    /// exists. The name is the caller's alone (unique per backup): a file of
    /// this name is an earlier attempt of this same backup, which the
    /// provider adopts or replaces ([`Backup::backup`]). The provider never
    /// writes elsewhere.
    pub target: String,
    /// One file per data disk of the VM (`spec.disks[].name`), under the same
    /// rules as `target` (absolute, checked by the caller, the caller's own
    /// name). The list must name every data disk the VM has and no other
    /// (else `InvalidInput`, naming the disk): a backup is all of the VM's
    /// disks at one point in time, never some of them. Empty for a VM with
    /// its boot disk only.
    pub data_disks: Vec<DataDiskFile>,
    /// Freeze the guest's filesystems (through its guest agent) for the moment
    /// the backup begins, so the copy is what the guest had written out. When
    /// the guest has no agent (or it does not answer), the backup goes on
    /// crash-consistent and [`BackupOutcome::consistency`] says why.
    pub quiesce: bool,
    /// How long the whole backup may take; then it is aborted (the VM runs on)
    /// and the call fails `Transient`.
    pub timeout: Duration,
    /// Create a checkpoint of this name on the VM at the backup's point in
    /// time, atomically with it, so a later backup can copy only what changed
    /// since ([`BackupRequest::incremental`]). 1 to 128 ASCII letters, digits,
    /// `-`, `_` and `.` (else `InvalidInput`). Once the backup completed, the
    /// provider deletes the VM's other checkpoints that vmlet created (a VM
    /// carries at most one); a backup that fails deletes the checkpoint it
    /// created, and leaves the older ones. A checkpoint of vmlet's that has
    /// this name already (an earlier, interrupted attempt of the same backup)
    /// is replaced; one that vmlet did not create fails `InvalidInput`.
    /// `None`: no checkpoint is created, and the VM's checkpoints are left
    /// as they are. An inactive VM's backup (a plain copy of its disk)
    /// creates none either (libvirt creates checkpoints of running VMs only)
    /// and leaves the VM's checkpoints alone: [`BackupOutcome::checkpoint`]
    /// is then `None`, and the next backup must be a full one.
    pub checkpoint: Option<String>,
    /// Copy only the blocks written since checkpoint
    /// [`IncrementalBase::checkpoint`] into [`BackupRequest::target`], which
    /// the provider creates as a qcow2 whose backing file is
    /// [`IncrementalBase::backing_file`]. `None`: a full backup.
    pub incremental: Option<IncrementalBase>,
}

/// What an incremental backup builds on ([`BackupRequest::incremental`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IncrementalBase {
    /// The VM's checkpoint that the backup in `backing_file` created (same
    /// name rules as [`BackupRequest::checkpoint`]). Errors: `NotFound` when
    /// the VM has no such checkpoint (deleted by a newer backup, by a revert,
    /// or never made): the message says to take a full backup.
    pub checkpoint: String,
    /// Absolute path on the VM's host of the backup file (qcow2) written by
    /// the backup that created `checkpoint`: the newest file of the chain. The
    /// new file names it as its backing file (format qcow2), so it must stay
    /// where it is while the chain is used (a restore reads the whole chain).
    /// Errors: `NotFound` when it does not exist; `InvalidInput` when it is no
    /// qcow2 image. The caller checked it lies under the host's backup roots.
    pub backing_file: String,
    /// For each data disk, the file the base backup wrote for it: the new
    /// data disk file's backing file (same rules as `backing_file`). The
    /// disks must be those of [`BackupRequest::data_disks`] (else
    /// `InvalidInput`: a disk added since the base needs a full backup).
    pub data_backing_files: Vec<DataDiskFile>,
}

/// A file on the VM's host that holds (or will hold) one data disk's copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataDiskFile {
    /// The data disk's name in the VirtualMachine (`spec.disks[].name`).
    pub disk: String,
    /// Absolute path of the file on the VM's host.
    pub path: String,
}

/// One data disk's copy in a finished backup ([`BackupOutcome::data_disks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataDiskCopy {
    /// The data disk's name in the VirtualMachine (`spec.disks[].name`).
    pub disk: String,
    /// The file written (from [`BackupRequest::data_disks`]).
    pub path: String,
    /// The disk's virtual size in bytes (0 where the back end cannot tell).
    pub virtual_bytes: u64,
    /// Size in bytes of the file written (0 where vmlet cannot see it).
    pub file_bytes: u64,
}

/// How far a backup got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackupProgress {
    /// Bytes of the disk copied so far.
    pub processed_bytes: u64,
    /// Bytes of the disk in all (its virtual size, as the back end counts it;
    /// 0 while unknown).
    pub total_bytes: u64,
}

/// How consistent a finished backup is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Consistency {
    /// The guest's filesystems were frozen when the copy's point in time was
    /// taken (`count` of them): what the guest had written is in the copy.
    Quiesced {
        /// Filesystems the guest agent froze.
        filesystems: u32,
    },
    /// Like a power cut: blocks the guest had not yet flushed may be missing.
    /// `reason` says why (no quiesce asked, no guest agent, an inactive VM is
    /// always consistent and reports [`Consistency::Offline`] instead).
    CrashConsistent {
        /// Why the filesystems were not frozen.
        reason: String,
    },
    /// The VM was not running: its disk was copied as it is on the host.
    Offline,
}

/// A finished backup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupOutcome {
    /// The boot disk's file ([`BackupRequest::target`]).
    pub path: String,
    /// The data disks' files, in the order of [`BackupRequest::data_disks`].
    pub data_disks: Vec<DataDiskCopy>,
    /// Bytes of disk data copied, all disks together: their virtual sizes for a full backup,
    /// the bytes written since the base checkpoint for an incremental one
    /// (in the back end's granularity, 64 KiB clusters for QEMU).
    pub bytes: u64,
    /// Size in bytes of the boot disk's file (zero blocks are not stored).
    pub file_bytes: u64,
    /// How consistent the copy is.
    pub consistency: Consistency,
    /// The checkpoint created with the backup ([`BackupRequest::checkpoint`]),
    /// on which the next incremental backup can be based; `None` when none
    /// was asked or the VM was not running ([`Consistency::Offline`]).
    pub checkpoint: Option<String>,
}

/// The backup capability ([`crate::Provider::backup`]). Called on the provider
/// of the host that holds the VM; both operations write only the path they are
/// given.
#[async_trait::async_trait]
pub trait Backup: Send + Sync {
    /// Copy the VM's disks to `request.target` and `request.data_disks`
    /// (qcow2 files) at one point in time and wait until the copy completed,
    /// calling `progress` about once a second with all disks' bytes together
    /// (for an incremental backup, `total_bytes` counts the changed bytes to
    /// copy). A VM without a boot disk, or whose data disks are not exactly
    /// those the request names, is refused `InvalidInput` naming the disk.
    ///
    /// An incremental backup ([`BackupRequest::incremental`]) needs a running
    /// VM: an inactive one is refused `InvalidInput` (take a full backup),
    /// and so is a request whose new checkpoint has the base's name.
    ///
    /// Idempotent across restarts of the caller: a call for a target that an
    /// earlier call (of an earlier process) began writing picks up where that
    /// one is:
    /// (What follows speaks of `request.target`; the data disks' files go
    /// with it: they are written, adopted and removed together.)
    /// - the VM's backup job writes exactly `request.target`: the call follows
    ///   it to its end instead of starting another (progress, outcome and
    ///   errors as for a fresh one; [`BackupOutcome::checkpoint`] is the
    ///   checkpoint that job creates, `request.checkpoint` when it does);
    /// - no job runs, but the back end's record of the VM's last completed job
    ///   is a backup that completed into `request.target` (and created
    ///   `request.checkpoint`, when one is named), and the file exists: the
    ///   call returns that backup's outcome;
    /// - the file exists and nothing writes or completed into it: it is the
    ///   leftover of an interrupted attempt (the name is the caller's alone),
    ///   which the provider removes before it starts afresh.
    ///
    /// How consistent an adopted backup is may not be known: unless the back
    /// end can tell, a followed job reports [`Consistency::CrashConsistent`]
    /// with the reason "followed after a restart of vmlet: whether the
    /// guest's filesystems were frozen is not known".
    ///
    /// A second call while one runs in this process for the same VM fails
    /// `Conflict` and does not disturb the first.
    /// Errors: `NotFound` when this host has no such VM; `Conflict` when the
    /// VM has another job running (a migration, a backup to another target);
    /// `Permanent` with
    /// the back end's message when the copy failed (e.g. no room left on the
    /// target: the message says so), in which case the partial file is
    /// removed and the VM runs on; `Transient` after `request.timeout`.
    async fn backup(
        &self,
        id: &VmId,
        request: &BackupRequest,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<BackupOutcome>;

    /// Abort VM `id`'s backup to `target` (a boot disk's file), if one runs:
    /// the back end's job that writes exactly `target` is cancelled, the call
    /// waits (within a deadline of its own) until the job ended, removes the
    /// partial files (`target` and the data disks' files of the same job) and
    /// returns true; the VM runs on. A [`Backup::backup`] call following that
    /// job fails `Transient` ("cancelled"). Returns false when no backup to
    /// `target` runs (none at all, one to another target, or another job such
    /// as a migration, which are all left alone; or this host has no such
    /// VM), so a repeated call is harmless.
    /// Errors: `Transient` when the
    /// back end does not answer, or the job has not ended, in time (the call
    /// can be repeated).
    async fn abort_backup(&self, id: &VmId, target: &str) -> Result<bool>;

    /// Write a new, independent qcow2 disk at `target` holding what the backup
    /// file `source` holds, read through its backing chain for an incremental
    /// backup (a full copy without a backing file: deleting the backups later
    /// does not harm the disk). Both are absolute paths on this host that the caller
    /// checked. The copy is written to `<target>.partial` and renamed to
    /// `target` once complete, so an interrupted restore is never taken for a
    /// finished one; a `target` that exists already is left alone and its
    /// size returned (a retried restore). Returns the bytes of disk data
    /// copied.
    /// Errors: `NotFound` when `source` does not exist; `Permanent` when the
    /// copy failed (the partial target is removed).
    async fn restore_disk(&self, source: &str, target: &str, timeout: Duration) -> Result<u64>;

    /// Put the disks of stopped VM `id` back as the backup files hold them:
    /// the boot disk from `source`, each data disk from the file
    /// `data_sources` names for it (absolute paths on this host the caller
    /// checked), each read through its backing chain for an incremental
    /// backup; the disks get no backing file. `data_sources` must name
    /// exactly the VM's data disks (else `InvalidInput` naming the disk: a
    /// backup of other disks cannot be put back in place). Per disk, nothing is
    /// lost: the VM's current disk file is renamed to `<disk>.before-<tag>`
    /// (`tag`: letters, digits and `-`; vmlet passes the restore's UID) and
    /// the copy, written first as `<disk>.partial`, takes the disk's place.
    /// Idempotent: a call that finds the renamed old disk and the disk both
    /// present has been done and returns as the first did; one that finds the
    /// renamed old disk but no disk completes the rename.
    /// Errors: `NotFound` when the VM or `source` does not exist; `Conflict`
    /// while the VM is active or has a job running; `InvalidInput` for a VM
    /// whose data disks differ from `data_sources`, or a bad `tag`; `Unsupported` where vmlet
    /// cannot reach the files (a remote connection); `Permanent` when the
    /// copy failed (the partial file is removed and the VM's disk is
    /// untouched); `Transient` after `timeout`.
    async fn restore_in_place(
        &self,
        id: &VmId,
        source: &str,
        data_sources: &[DataDiskFile],
        tag: &str,
        timeout: Duration,
    ) -> Result<InPlaceRestore>;
}

/// What an in-place restore did ([`Backup::restore_in_place`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InPlaceRestore {
    /// The VM's boot disk, now holding the backup's data.
    pub disk: String,
    /// Where the disk's previous content was kept (`<disk>.before-<tag>`).
    pub kept_as: String,
    /// Bytes of disk data copied (the boot disk's virtual size).
    pub bytes: u64,
    /// The data disks put back, in the order of `data_sources`.
    pub data_disks: Vec<RestoredDataDisk>,
}

/// One data disk put back by [`Backup::restore_in_place`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoredDataDisk {
    /// The data disk's name in the VirtualMachine (`spec.disks[].name`).
    pub name: String,
    /// Its file, now holding the backup's data.
    pub disk: String,
    /// Where its previous content was kept (`<disk>.before-<tag>`).
    pub kept_as: String,
    /// Bytes of disk data copied (its virtual size).
    pub bytes: u64,
}
