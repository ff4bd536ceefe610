//! Disks made from backup files with `qemu-img convert` on this machine (a
//! local connection only): a new disk
//! ([`Backup::restore_disk`](vmlet_provider::Backup::restore_disk)), or an
//! inactive VM's disk replaced in place
//! ([`Backup::restore_in_place`](vmlet_provider::Backup::restore_in_place)).
//!
//! Both copy into `<file>.partial`, flush it to stable storage and only then
//! rename it into place, so an interrupted copy is never taken for a finished
//! one (a retry finds no file, or a stale `.partial` that it replaces).
//!
//! In place, each of the VM's disks (the boot disk, then the data disks,
//! each from its own backup file) goes through the steps below; a call cut
//! short between two disks finds the first done and goes on with the next.
//! The steps, and what a call finds when an earlier one was cut
//! short (a crash of vmlet, a timeout) between them:
//!
//! 1. Copy the backup into `<disk>.partial`, in the disk's format (qcow2 for
//!    vmlet's images, raw where `spec.image` is raw), with the disk file's
//!    owner and mode, and flush it. Cut short here, a call starts again.
//! 2. Rename `<disk>` to `<disk>.before-<tag>`. Found: the kept file and the
//!    partial copy, no disk: the call goes on with step 3.
//! 3. Rename `<disk>.partial` to `<disk>` and flush the directory. Found: the
//!    kept file and the disk: the restore is done, and the call answers as
//!    the first did (after step 4).
//! 4. Drop libvirt's record of the internal snapshots that the previous file
//!    held and the new one does not (a copy holds none):
//!    [`Host::forget_snapshots_not_in`]. Their data stays in
//!    `<disk>.before-<tag>`, from which an administrator can still get it
//!    (`qemu-img snapshot -l`); for vmlet they are gone.
//!
//! Nothing here starts, stops or redefines a VM. libvirt gives QEMU the disk
//! at the VM's next start (`dynamic_ownership` relabels it then, as it did
//! the previous file).

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::time::{Duration, Instant};

use virt::connect::Connect;
use virt::sys;
use vmlet_provider::{DataDiskFile, Error, ErrorKind, InPlaceRestore, RestoredDataDisk, Result, VmId};

use crate::backup::check_path;
use crate::backup::disks::pair;
use crate::chains::pinned_disks;
use crate::error::from_libvirt;
use crate::in_flight::Claim;
use crate::provider::{is_active, is_local_uri, Host, LibvirtProvider};
use crate::qemu_img;
use crate::xml::disks;

const OP_RESTORE: &str = "restore disk";
const OP_IN_PLACE: &str = "restore disk in place";

/// How long `qemu-img info` may take.
const INFO_DEADLINE: Duration = Duration::from_secs(60);

/// How long one libvirt call of an in-place restore may take.
const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// The longest tag of an in-place restore, in bytes (vmlet passes a UID, 36).
const TAG_MAX_BYTES: usize = 128;

/// Refuse (`Unsupported`) a connection to another machine, whose files vmlet
/// cannot reach.
pub(crate) fn require_local(operation: &'static str, uri: &str) -> Result<()> {
    if is_local_uri(uri) {
        return Ok(());
    }
    Err(Error::new(
        operation,
        ErrorKind::Unsupported,
        format!(
            "vmlet restores disks with qemu-img where the files are; the connection {uri} reaches another machine, \
             where vmlet cannot run it: run vmlet on that host"
        ),
    ))
}

/// Refuse (`InvalidInput`) a tag that is not 1 to [`TAG_MAX_BYTES`] ASCII
/// letters, digits and `-`: it becomes part of a file name.
fn check_tag(tag: &str) -> Result<()> {
    if tag.is_empty() || tag.len() > TAG_MAX_BYTES || !tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(Error::new(
            OP_IN_PLACE,
            ErrorKind::InvalidInput,
            format!("restore tag {tag:?} must be 1 to {TAG_MAX_BYTES} ASCII letters, digits or '-'"),
        ));
    }
    Ok(())
}

/// The files of an in-place restore of disk file `disk` tagged `tag`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct InPlaceFiles {
    /// The VM's disk file.
    disk: String,
    /// Where its previous content is kept: `<disk>.before-<tag>`.
    kept: String,
    /// The copy being written: `<disk>.partial`.
    partial: String,
}

impl InPlaceFiles {
    fn new(disk: &str, tag: &str) -> InPlaceFiles {
        InPlaceFiles { disk: disk.to_owned(), kept: format!("{disk}.before-{tag}"), partial: format!("{disk}.partial") }
    }
}

/// How far an in-place restore got, from which of its files exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Nothing kept yet: copy, then rename.
    Start,
    /// The disk was renamed to the kept name, the complete copy not yet to
    /// the disk's.
    Renamed,
    /// Both renames happened.
    Done,
    /// The kept file only: neither disk nor copy (removed by hand?).
    CopyLost,
    /// Neither disk nor kept file.
    NoDisk,
}

/// The stage the existence of the disk, the kept file and the partial copy
/// tells.
fn stage_of(disk: bool, kept: bool, partial: bool) -> Stage {
    match (kept, disk, partial) {
        (false, true, _) => Stage::Start,
        (false, false, _) => Stage::NoDisk,
        (true, true, _) => Stage::Done,
        (true, false, true) => Stage::Renamed,
        (true, false, false) => Stage::CopyLost,
    }
}

/// Whether `path` exists (as any kind of file, a dangling link too).
/// Errors: `Permanent` when that cannot be told.
pub(crate) async fn exists(operation: &'static str, path: &str) -> Result<bool> {
    match tokio::fs::symlink_metadata(path).await {
        Ok(_) => Ok(true),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => {
            Err(Error::new(operation, ErrorKind::Permanent, format!("cannot tell whether {path} exists: {err}")))
        }
    }
}

/// Refuse a backup file `source` that is not there (`NotFound`) or no
/// regular file (`InvalidInput`).
async fn check_backup_file(operation: &'static str, source: &str) -> Result<()> {
    match tokio::fs::metadata(source).await {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(_) => {
            Err(Error::new(operation, ErrorKind::InvalidInput, format!("backup file {source} is not a regular file")))
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::new(operation, ErrorKind::NotFound, format!("backup file {source} does not exist")))
        }
        Err(err) => {
            Err(Error::new(operation, ErrorKind::Permanent, format!("cannot read backup file {source}: {err}")))
        }
    }
}

/// Copy the qcow2 backup `source` into a new `output_format` image at
/// `partial` (one left by an earlier call is replaced) and flush it to stable
/// storage; the disk's virtual size in bytes. Errors: those of
/// [`qemu_img::convert`] (the partial file removed), `Permanent` when the
/// flush failed.
async fn copy_into_partial(
    operation: &'static str,
    source: &str,
    partial: &str,
    output_format: &str,
    deadline: Instant,
) -> Result<u64> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let info = qemu_img::info(operation, source, Some("qcow2"), INFO_DEADLINE.min(left())).await?;
    qemu_img::remove_partial(partial);
    qemu_img::convert(operation, source, "qcow2", partial, output_format, left(), &mut |_| {}).await?;
    if let Err(err) = sync(operation, partial).await {
        qemu_img::remove_partial(partial);
        return Err(err);
    }
    Ok(info.virtual_size)
}

/// `fsync` the file or directory at `path`. Errors: `Permanent`.
pub(crate) async fn sync(operation: &'static str, path: &str) -> Result<()> {
    let owned = path.to_owned();
    let synced = tokio::task::spawn_blocking(move || std::fs::File::open(&owned)?.sync_all()).await;
    match synced {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(Error::new(operation, ErrorKind::Permanent, format!("cannot flush {path}: {err}"))),
        Err(err) => {
            Err(Error::new(operation, ErrorKind::Permanent, format!("flushing {path} did not complete: {err}")))
        }
    }
}

/// Rename `from` to `to`. Errors: `Permanent`, with `then` appended (what
/// state that leaves).
pub(crate) async fn rename(operation: &'static str, from: &str, to: &str, then: &str) -> Result<()> {
    tokio::fs::rename(from, to).await.map_err(|err| {
        Error::new(operation, ErrorKind::Permanent, format!("cannot rename {from} to {to}: {err}; {then}"))
    })
}

/// Give `path` the owner, group and mode of `like` (the file it replaces).
/// Errors: `Permanent`.
async fn take_owner_and_mode(operation: &'static str, path: &str, like: &std::fs::Metadata) -> Result<()> {
    let (owned, uid, gid, mode) = (path.to_owned(), like.uid(), like.gid(), like.mode() & 0o7777);
    let done = tokio::task::spawn_blocking(move || {
        std::os::unix::fs::chown(&owned, Some(uid), Some(gid))?;
        std::fs::set_permissions(&owned, std::fs::Permissions::from_mode(mode))
    })
    .await;
    match done {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(Error::new(
            operation,
            ErrorKind::Permanent,
            format!("cannot give {path} the owner {uid}:{gid} and mode {mode:o} of the disk it replaces: {err}"),
        )),
        Err(err) => {
            Err(Error::new(operation, ErrorKind::Permanent, format!("chown of {path} did not complete: {err}")))
        }
    }
}

/// A disk an in-place restore replaces.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DiskFile {
    /// `<target dev>` (`vda`).
    target: String,
    /// Its file.
    file: String,
    /// Its image format (`qcow2`, `raw`).
    format: String,
    /// The data disk's name (`spec.disks[].name`); `None` for the boot disk.
    name: Option<String>,
    /// The backup file it is restored from.
    source: String,
}

impl Host {
    /// The disk files of inactive VM `id` (read-only CD-ROMs such as the
    /// cloud-init seed are no disks), the boot disk first, each paired with
    /// its backup file: `source` for the boot disk, `data_sources` for the
    /// data disks. Errors: `NotFound` for a missing VM; `Conflict` while it
    /// is active; `InvalidInput` when the VM's disks and the backup's do not
    /// match one to one, and for a disk that is no file in a format qemu-img
    /// writes or lies on a backing chain.
    fn inactive_disks(
        &self,
        conn: &Connect,
        id: &VmId,
        source: &str,
        data_sources: &[DataDiskFile],
    ) -> Result<Vec<DiskFile>> {
        let domain = self.require(conn, OP_IN_PLACE, id)?;
        if is_active(&domain, OP_IN_PLACE)? {
            return Err(Error::new(
                OP_IN_PLACE,
                ErrorKind::Conflict,
                format!("VM {id} is active; an in-place restore replaces its disks, so stop the VM first"),
            ));
        }
        let xml = domain.xml_desc(sys::VIR_DOMAIN_XML_INACTIVE).map_err(|e| from_libvirt(OP_IN_PLACE, e))?;
        let pinned = pinned_disks(OP_IN_PLACE, &xml)?;
        let mut files = Vec::new();
        for paired in pair(OP_IN_PLACE, id, disks(&xml), source, data_sources)? {
            let described = paired.describe();
            let disk = paired.disk;
            // The copy stands alone: under a definition that pins a backing
            // chain, QEMU would read the copy's holes from the old base.
            let layered = pinned.iter().any(|pinned| {
                pinned.target == disk.target && pinned.chain.as_ref().is_some_and(|chain| !chain.is_empty())
            });
            if layered {
                return Err(Error::new(
                    OP_IN_PLACE,
                    ErrorKind::InvalidInput,
                    format!(
                        "disk {described} of VM {id} is a qcow2 image on a backing chain, and a restored copy \
                         stands alone; restore the backup into a new VM instead"
                    ),
                ));
            }
            let format = disk.format.clone().unwrap_or_else(|| "raw".to_owned());
            match (disk.kind.as_str(), disk.source, format.as_str()) {
                ("file", Some(file), "qcow2" | "raw") => {
                    files.push(DiskFile { target: disk.target, file, format, name: paired.name, source: paired.file })
                }
                (kind, _, format) => {
                    return Err(Error::new(
                        OP_IN_PLACE,
                        ErrorKind::InvalidInput,
                        format!(
                            "disk {described} of VM {id} is a {kind} disk of format {format}; vmlet restores in place \
                             only a qcow2 or raw file"
                        ),
                    ))
                }
            }
        }
        Ok(files)
    }
}

impl LibvirtProvider {
    /// [`Backup::restore_disk`](vmlet_provider::Backup::restore_disk): see
    /// its documentation in `backup.rs`.
    pub(crate) async fn restore_new_disk(&self, source: &str, target: &str, timeout: Duration) -> Result<u64> {
        require_local(OP_RESTORE, self.uri())?;
        check_path(OP_RESTORE, "backup file", source)?;
        check_path(OP_RESTORE, "restore target", target)?;
        let Some(_claim) = Claim::take(&self.in_flight().targets, &target.to_owned()) else {
            return Err(Error::new(
                OP_RESTORE,
                ErrorKind::Conflict,
                format!("another restore to {target} is running (started by this vmlet); retry once it ended"),
            ));
        };
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        if exists(OP_RESTORE, target).await? {
            let existing = qemu_img::info(OP_RESTORE, target, Some("qcow2"), INFO_DEADLINE.min(left())).await?;
            tracing::info!(bytes = existing.virtual_size, "restore target exists already; left alone");
            return Ok(existing.virtual_size);
        }
        check_backup_file(OP_RESTORE, source).await?;
        let started = Instant::now();
        let partial = format!("{target}.partial");
        let bytes = copy_into_partial(OP_RESTORE, source, &partial, "qcow2", deadline).await?;
        rename(OP_RESTORE, &partial, target, "the copy stays there; a retry makes it again").await?;
        if let Some(dir) = Path::new(target).parent().and_then(Path::to_str) {
            sync(OP_RESTORE, dir).await?;
        }
        tracing::info!(bytes, elapsed = ?started.elapsed(), "disk restored");
        Ok(bytes)
    }

    /// [`Backup::restore_in_place`](vmlet_provider::Backup::restore_in_place):
    /// see the module docs and its documentation in `backup.rs`.
    pub(crate) async fn restore_disk_in_place(
        &self,
        id: &VmId,
        source: &str,
        data_sources: &[DataDiskFile],
        tag: &str,
        timeout: Duration,
    ) -> Result<InPlaceRestore> {
        if !self.domain_kind().is_qemu() {
            return Err(Error::new(
                OP_IN_PLACE,
                ErrorKind::Unsupported,
                "libvirt's test driver has no disks to restore",
            ));
        }
        require_local(OP_IN_PLACE, self.uri())?;
        check_tag(tag)?;
        check_path(OP_IN_PLACE, "backup file", source)?;
        for data in data_sources {
            check_path(OP_IN_PLACE, "data disk backup file", &data.path)?;
        }
        let Some(_claim) = Claim::take(&self.in_flight().vms, id) else {
            return Err(Error::new(
                OP_IN_PLACE,
                ErrorKind::Conflict,
                format!(
                    "VM {id} has a backup, restore or snapshot operation running (started by this vmlet); retry \
                     once it ended"
                ),
            ));
        };
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let (task_id, task_source, task_data) = (id.clone(), source.to_owned(), data_sources.to_vec());
        let disks = self
            .blocking_within(OP_IN_PLACE, CALL_DEADLINE.min(left()), move |host, conn| {
                host.inactive_disks(conn, &task_id, &task_source, &task_data)
            })
            .await?;
        let mut restored = Vec::with_capacity(disks.len());
        for disk in &disks {
            restored.push(self.restore_one_in_place(id, disk, &disks, tag, deadline).await?);
        }
        let mut restored = restored.into_iter();
        let Some((_, boot)) = restored.next() else {
            return Err(Error::new(OP_IN_PLACE, ErrorKind::InvalidInput, format!("VM {id} has no disk to restore")));
        };
        let data_disks = restored
            .map(|(name, done)| RestoredDataDisk {
                name: name.unwrap_or_default(),
                disk: done.disk,
                kept_as: done.kept_as,
                bytes: done.bytes,
            })
            .collect();
        Ok(InPlaceRestore { data_disks, ..boot })
    }

    /// One disk of an in-place restore (`disk`, one of the VM's `all`): the
    /// steps of the module docs, picked up where an earlier call stopped.
    /// Returns the data disk's name and what was done (`data_disks` empty).
    async fn restore_one_in_place(
        &self,
        id: &VmId,
        disk: &DiskFile,
        all: &[DiskFile],
        tag: &str,
        deadline: Instant,
    ) -> Result<(Option<String>, InPlaceRestore)> {
        let left = || deadline.saturating_duration_since(Instant::now());
        let files = InPlaceFiles::new(&disk.file, tag);
        let stage = stage_of(
            exists(OP_IN_PLACE, &files.disk).await?,
            exists(OP_IN_PLACE, &files.kept).await?,
            exists(OP_IN_PLACE, &files.partial).await?,
        );
        tracing::debug!(?stage, disk = %files.disk, "in-place restore");
        match stage {
            Stage::Start => self.copy_and_swap(id, disk, all, &files, deadline).await?,
            Stage::Renamed => {
                rename(OP_IN_PLACE, &files.partial, &files.disk, "the disk's previous content is kept; retry").await?;
                sync_parent(&files.disk).await?;
                tracing::info!(disk = %files.disk, "in-place restore completed after an interruption");
            }
            Stage::Done => tracing::info!(disk = %files.disk, kept_as = %files.kept, "in-place restore done already"),
            Stage::CopyLost => {
                return Err(Error::new(
                    OP_IN_PLACE,
                    ErrorKind::Permanent,
                    format!(
                        "VM {id}'s disk {} is missing, and so is the copy {}; its previous content is in {}: \
                         rename that back to {} and restore again with a new restore",
                        files.disk, files.partial, files.kept, files.disk
                    ),
                ))
            }
            Stage::NoDisk => {
                return Err(Error::new(
                    OP_IN_PLACE,
                    ErrorKind::Permanent,
                    format!(
                        "VM {id}'s disk {} does not exist; an in-place restore keeps the disk it replaces, so it \
                         needs one",
                        files.disk
                    ),
                ))
            }
        }
        let info = qemu_img::info(OP_IN_PLACE, &files.disk, Some(&disk.format), INFO_DEADLINE.min(left())).await?;
        let (task_id, target, held) = (id.clone(), disk.target.clone(), info.snapshots.clone());
        let dropped = self
            .blocking_within(OP_IN_PLACE, CALL_DEADLINE.min(left()), move |host, conn| {
                host.forget_snapshots_not_in(conn, &task_id, &target, &held)
            })
            .await?;
        if !dropped.is_empty() {
            tracing::info!(
                snapshots = ?dropped,
                kept_as = %files.kept,
                "snapshots of the previous disk dropped from libvirt; their data stays in the kept file"
            );
        }
        let done =
            InPlaceRestore { disk: files.disk, kept_as: files.kept, bytes: info.virtual_size, data_disks: Vec::new() };
        Ok((disk.name.clone(), done))
    }

    /// Steps 1 to 3 of the module docs: copy `disk.source` into
    /// `files.partial` (with `disk`'s format, owner and mode), check the VM
    /// is still inactive with the same disks (`all`), then rename the disk
    /// to `files.kept` and the copy to the disk.
    async fn copy_and_swap(
        &self,
        id: &VmId,
        disk: &DiskFile,
        all: &[DiskFile],
        files: &InPlaceFiles,
        deadline: Instant,
    ) -> Result<()> {
        check_backup_file(OP_IN_PLACE, &disk.source).await?;
        let started = Instant::now();
        let old = tokio::fs::metadata(&files.disk).await.map_err(|err| {
            Error::new(OP_IN_PLACE, ErrorKind::Permanent, format!("cannot read VM {id}'s disk {}: {err}", files.disk))
        })?;
        let bytes = copy_into_partial(OP_IN_PLACE, &disk.source, &files.partial, &disk.format, deadline).await?;
        if let Err(err) = take_owner_and_mode(OP_IN_PLACE, &files.partial, &old).await {
            qemu_img::remove_partial(&files.partial);
            return Err(err);
        }
        // Started meanwhile, QEMU would go on with the renamed file.
        let (task_id, boot, data) = (id.clone(), all[0].source.clone(), data_sources_of(all));
        let left = deadline.saturating_duration_since(Instant::now());
        let now = self
            .blocking_within(OP_IN_PLACE, CALL_DEADLINE.min(left), move |host, conn| {
                host.inactive_disks(conn, &task_id, &boot, &data)
            })
            .await;
        match now {
            Ok(now) if now == all => {}
            Ok(now) => {
                qemu_img::remove_partial(&files.partial);
                let now: Vec<&str> = now.iter().map(|disk| disk.file.as_str()).collect();
                return Err(Error::new(
                    OP_IN_PLACE,
                    ErrorKind::Conflict,
                    format!("VM {id}'s disks changed during the restore (now {}); retry", now.join(", ")),
                ));
            }
            Err(err) => {
                qemu_img::remove_partial(&files.partial);
                return Err(err);
            }
        }
        rename(OP_IN_PLACE, &files.disk, &files.kept, "nothing was changed").await?;
        rename(
            OP_IN_PLACE,
            &files.partial,
            &files.disk,
            "the disk's previous content is kept under the other name; a retry completes the restore",
        )
        .await?;
        sync_parent(&files.disk).await?;
        tracing::info!(bytes, elapsed = ?started.elapsed(), disk = %files.disk, kept_as = %files.kept, "disk restored in place");
        Ok(())
    }
}

/// The data disks' backup files of an in-place restore's disks.
fn data_sources_of(disks: &[DiskFile]) -> Vec<DataDiskFile> {
    disks.iter().filter_map(|disk| Some(DataDiskFile { disk: disk.name.clone()?, path: disk.source.clone() })).collect()
}

/// `fsync` the directory holding `path`, so that renames in it last.
async fn sync_parent(path: &str) -> Result<()> {
    match Path::new(path).parent().and_then(Path::to_str) {
        Some(dir) => sync(OP_IN_PLACE, dir).await,
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_of_an_in_place_restore_sit_beside_the_disk() {
        assert_eq!(
            InPlaceFiles::new("/d/vm.qcow2", "u-1"),
            InPlaceFiles {
                disk: "/d/vm.qcow2".into(),
                kept: "/d/vm.qcow2.before-u-1".into(),
                partial: "/d/vm.qcow2.partial".into()
            }
        );
    }

    #[test]
    fn an_interrupted_in_place_restore_is_picked_up_where_it_stopped() {
        // (disk, kept, partial)
        assert_eq!(stage_of(true, false, false), Stage::Start);
        assert_eq!(stage_of(true, false, true), Stage::Start, "a stale copy is made again");
        assert_eq!(stage_of(false, true, true), Stage::Renamed);
        assert_eq!(stage_of(true, true, false), Stage::Done);
        assert_eq!(stage_of(true, true, true), Stage::Done);
        assert_eq!(stage_of(false, true, false), Stage::CopyLost);
        assert_eq!(stage_of(false, false, true), Stage::NoDisk);
    }

    #[test]
    fn a_tag_becomes_part_of_a_file_name_so_it_is_checked() {
        assert!(check_tag("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a").is_ok());
        for bad in ["", "a/b", "..", "a_b", "a b", &"x".repeat(TAG_MAX_BYTES + 1)] {
            assert_eq!(check_tag(bad).unwrap_err().kind, ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn only_local_connections_restore() {
        assert!(require_local(OP_IN_PLACE, "qemu:///system").is_ok());
        assert_eq!(require_local(OP_IN_PLACE, "qemu+ssh://h/system").unwrap_err().kind, ErrorKind::Unsupported);
    }
}
