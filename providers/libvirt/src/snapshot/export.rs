//! A new disk from an internal snapshot
//! ([`Snapshots::export_snapshot_disk`](vmlet_provider::Snapshots::export_snapshot_disk)):
//! `qemu-img convert -l snapshot.name=…` of the VM's boot disk, on this
//! machine (a local connection only), into `<target>.partial`, flushed, then
//! renamed to `target`.
//!
//! The VM may run meanwhile: qemu-img reads the image without its lock
//! (`-U`), which is safe for an internal snapshot's clusters (QEMU never
//! writes a cluster a snapshot shares; it copies it first). What could
//! change under the copy is the snapshot table itself, when a snapshot of
//! the VM is taken or deleted: this vmlet's own operations on the VM wait on
//! its job claim, held for the whole copy, and the table is read before and
//! after the copy; a change fails the call `Transient` (the copy removed).

use std::path::Path;
use std::time::{Duration, Instant};

use virt::connect::Connect;
use vmlet_provider::{Error, ErrorKind, Result, VmId};

use super::{check_name, lookup, read, CALL_DEADLINE, INFO_DEADLINE};
use crate::backup::check_path;
use crate::error::from_libvirt;
use crate::provider::{Host, LibvirtProvider};
use crate::qemu_img;
use crate::restore::{exists, rename, require_local, sync};
use crate::xml::disks;

const OP_EXPORT: &str = "export snapshot disk";

impl Host {
    /// The file of VM `id`'s boot disk (its first disk, `spec.image`) when
    /// snapshot `name` holds it inside the image. Errors: `NotFound` for a
    /// missing VM or snapshot; `Unsupported` for an external snapshot;
    /// `InvalidInput` when the boot disk is no qcow2 file the snapshot holds.
    fn snapshot_boot_disk(&self, conn: &Connect, id: &VmId, name: &str) -> Result<String> {
        let domain = self.require(conn, OP_EXPORT, id)?;
        let snapshot = lookup(&domain, name)
            .map_err(|e| from_libvirt(OP_EXPORT, e))?
            .ok_or_else(|| Error::new(OP_EXPORT, ErrorKind::NotFound, format!("VM {id} has no snapshot {name}")))?;
        let taken = read(OP_EXPORT, &snapshot, name)?;
        if taken.is_external() {
            return Err(Error::new(
                OP_EXPORT,
                ErrorKind::Unsupported,
                format!(
                    "snapshot {name} of VM {id} is an external snapshot (taken outside vmlet); vmlet makes disks \
                     from internal snapshots only"
                ),
            ));
        }
        // The live definition while the VM runs: the file QEMU has open.
        let xml = domain.xml_desc(0).map_err(|e| from_libvirt(OP_EXPORT, e))?;
        let boot = disks(&xml).into_iter().next().ok_or_else(|| {
            Error::new(OP_EXPORT, ErrorKind::InvalidInput, format!("VM {id} has no disk to make a new disk from"))
        })?;
        let held = taken.internal_disks().any(|target| target == boot.target);
        match (boot.kind.as_str(), boot.source, boot.format.as_deref()) {
            ("file", Some(file), Some("qcow2")) if held => Ok(file),
            _ => Err(Error::new(
                OP_EXPORT,
                ErrorKind::InvalidInput,
                format!("snapshot {name} of VM {id} does not hold its boot disk {} in a qcow2 file", boot.target),
            )),
        }
    }
}

impl LibvirtProvider {
    /// See the module docs and [`vmlet_provider::Snapshots::export_snapshot_disk`].
    pub(crate) async fn export_disk(&self, id: &VmId, name: &str, target: &str, timeout: Duration) -> Result<u64> {
        check_name(OP_EXPORT, name)?;
        check_path(OP_EXPORT, "new disk", target)?;
        if !self.domain_kind().is_qemu() {
            return Err(Error::new(OP_EXPORT, ErrorKind::Unsupported, "libvirt's test driver has no disks to copy"));
        }
        require_local(OP_EXPORT, self.uri())?;
        let _claim = self.claim(OP_EXPORT, id)?;
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        if exists(OP_EXPORT, target).await? {
            let made = qemu_img::info(OP_EXPORT, target, Some("qcow2"), INFO_DEADLINE.min(left())).await?;
            tracing::info!(disk = %target, bytes = made.virtual_size, "disk from snapshot exists already; left alone");
            return Ok(made.virtual_size);
        }
        let (task_id, task_name) = (id.clone(), name.to_owned());
        let disk = self
            .blocking_within(OP_EXPORT, CALL_DEADLINE.min(left()), move |host, conn| {
                host.snapshot_boot_disk(conn, &task_id, &task_name)
            })
            .await?;
        let before = qemu_img::info(OP_EXPORT, &disk, Some("qcow2"), INFO_DEADLINE.min(left())).await?;
        if !before.snapshots.iter().any(|held| held == name) {
            return Err(Error::new(
                OP_EXPORT,
                ErrorKind::NotFound,
                format!(
                    "disk {disk} of VM {id} does not hold snapshot {name}: the file was replaced since the snapshot \
                     was taken (an in-place restore keeps the previous file as <disk>.before-<tag>)"
                ),
            ));
        }
        let partial = format!("{target}.partial");
        qemu_img::remove_partial(&partial);
        qemu_img::convert_snapshot(OP_EXPORT, &disk, name, &partial, left()).await?;
        let after = qemu_img::info(OP_EXPORT, &disk, Some("qcow2"), INFO_DEADLINE.min(left())).await;
        if after.ok().map(|a| a.snapshots).as_ref() != Some(&before.snapshots) {
            qemu_img::remove_partial(&partial);
            return Err(Error::new(
                OP_EXPORT,
                ErrorKind::Transient,
                format!(
                    "the snapshots of VM {id}'s disk {disk} changed while it was copied (taken or deleted outside \
                     this vmlet); the copy was removed: retry"
                ),
            ));
        }
        if let Err(err) = sync(OP_EXPORT, &partial).await {
            qemu_img::remove_partial(&partial);
            return Err(err);
        }
        rename(OP_EXPORT, &partial, target, "the copy stays there; a retry makes it again").await?;
        if let Some(dir) = Path::new(target).parent().and_then(Path::to_str) {
            sync(OP_EXPORT, dir).await?;
        }
        tracing::info!(disk = %target, bytes = before.virtual_size, "disk made from snapshot");
        Ok(before.virtual_size)
    }
}
