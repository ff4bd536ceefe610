//! Named points in time of a VM kept by the back end beside its disk
//! (snapshots), and going back to one (revert).
//!
//! A snapshot is the back end's own: libvirt's internal snapshots live inside
//! the VM's qcow2 disk (and, taken of a running VM, hold its memory too:
//! QEMU's `savevm`, which pauses the guest while the memory is written). vmlet
//! names each snapshot; a name is unique per VM.
//!
//! A revert writes over what the VM's disk holds, so it is refused while the
//! VM is active: the caller stops the VM first.

use std::time::Duration;

use crate::{Result, VmId};

/// What to take ([`Snapshots::create_snapshot`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRequest {
    /// The snapshot's name on the back end, unique per VM: letters, digits,
    /// `-`, `_` and `.`, at most 200 bytes (vmlet uses `<namespace>_<name>_<uid>`).
    pub name: String,
    /// Whether to save the VM's memory too. `None`: what the back end does for
    /// the VM's state (libvirt: with memory when running, disk only when
    /// stopped). `Some(true)` of a stopped VM and `Some(false)` of a running
    /// one where the back end cannot do it are refused `InvalidInput`, with a
    /// message naming the fix.
    pub memory: Option<bool>,
    /// Freeze the guest's filesystems (guest agent) while a disk-only
    /// snapshot of a running VM is taken; a snapshot with memory needs no
    /// freeze (the memory holds what was not written out).
    pub quiesce: bool,
    /// How long taking it may take; then the call fails `Transient` (the
    /// back end may still finish it: a retry with the same name finds it).
    pub timeout: Duration,
}

/// A snapshot the back end holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its name ([`SnapshotRequest::name`]).
    pub name: String,
    /// Whether it holds the VM's memory (a revert then resumes the guest
    /// where it was, where the back end can).
    pub memory: bool,
    /// Whether the VM was running when it was taken.
    pub vm_was_running: bool,
    /// When it was taken, seconds since the Unix epoch (the back end's clock).
    pub created_unix_seconds: i64,
}

/// What a revert did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RevertOutcome {
    /// Whether the snapshot's memory was put back. Reverting a stopped VM to
    /// a snapshot with memory puts back its disks only (the VM stays
    /// stopped): they then hold what the guest had written out when the
    /// snapshot was taken, as after a power cut.
    pub memory_restored: bool,
}

/// The snapshot capability ([`crate::Provider::snapshots`]). Called on the
/// provider of the host that holds the VM.
#[async_trait::async_trait]
pub trait Snapshots: Send + Sync {
    /// Take snapshot `request.name` of VM `id`. Idempotent: a snapshot of that
    /// name that exists already is returned as it is (a retried call).
    /// Errors: `NotFound` when this host has no such VM; `InvalidInput` for a
    /// request the back end cannot do (see [`SnapshotRequest::memory`]; a disk
    /// that cannot hold snapshots, e.g. a raw data disk: the message names
    /// it); `Conflict` while the VM has another job running (a backup, a
    /// migration); `Transient` after `request.timeout`.
    async fn create_snapshot(&self, id: &VmId, request: &SnapshotRequest) -> Result<SnapshotInfo>;

    /// The snapshot `name` of VM `id`, if the back end holds it.
    /// Errors: `NotFound` when this host has no such VM.
    async fn snapshot(&self, id: &VmId, name: &str) -> Result<Option<SnapshotInfo>>;

    /// Delete snapshot `name` of VM `id` (its data is dropped from the disk;
    /// the VM's current state is untouched). A snapshot that does not exist,
    /// or a VM this host does not have, is success.
    /// Errors: `Conflict` while the VM has another job running.
    async fn delete_snapshot(&self, id: &VmId, name: &str) -> Result<()>;

    /// Put VM `id`'s disks back as they were at snapshot `name` (see
    /// [`RevertOutcome`]); everything written since is lost, so the VM must be
    /// stopped. The snapshot itself is kept.
    /// Errors: `NotFound` when the VM or the snapshot does not exist;
    /// `Conflict` while the VM is active or has a job running.
    async fn revert_to_snapshot(&self, id: &VmId, name: &str) -> Result<RevertOutcome>;

    /// Make a new, independent qcow2 image at the absolute path `target`
    /// holding what VM `id`'s boot disk held at snapshot `name`, for a new VM
    /// (a clone). Only the disk is copied: a VM started from it boots as
    /// after a power cut at the moment the snapshot was taken. VM `id` may be
    /// running or stopped and is not touched; the snapshot is kept.
    /// Idempotent: a `target` that exists is taken as made by an earlier
    /// call (the copy is written beside it and renamed into place only once
    /// complete) and its size returned. Returns the image's virtual size, in
    /// bytes.
    ///
    /// Errors: `NotFound` when the VM or the snapshot does not exist;
    /// `InvalidInput` for a relative `target`; `Conflict` while the VM has
    /// another operation running that could change its snapshots;
    /// `Unsupported` where the back end cannot read a snapshot's disk;
    /// `Transient` after `timeout` (the partial copy removed); `Permanent`
    /// when the copy failed (no room left: the message says so).
    async fn export_snapshot_disk(&self, id: &VmId, name: &str, target: &str, timeout: Duration) -> Result<u64>;

    /// On a back end whose images are its own catalog's
    /// ([`crate::ImageReference::Catalog`]: a vSphere template), make a new
    /// image named `image` in that catalog holding what VM `id`'s disks held
    /// at snapshot `name`, for a new VM whose `image` then names it (a clone;
    /// the counterpart of [`Snapshots::export_snapshot_disk`], which writes a
    /// host file). `image` is vmlet's name for it ([`restored_image_name`]);
    /// the back end lets only VMs of that namespace boot it (see
    /// [`is_restored_image_of`]). VM `id` may be running or stopped and is
    /// not touched; the snapshot is kept. Idempotent: an image of that name
    /// made by an earlier call is taken as made. The image stays when the new
    /// VM is deleted (the back end's administrator removes it).
    ///
    /// Errors: `NotFound` when the VM or the snapshot does not exist;
    /// `InvalidInput` for a name the back end cannot hold (too long: the
    /// message says which part to shorten); `Conflict` when something else
    /// of that name exists; `Transient` after `timeout` (the back end may
    /// still finish it: a retry finds it); `Unsupported` (the default) where
    /// the back end keeps no image catalog.
    async fn export_snapshot_image(&self, id: &VmId, name: &str, image: &str, timeout: Duration) -> Result<()> {
        let _ = (id, name, image, timeout);
        Err(crate::Error::new(
            "make an image from a snapshot",
            crate::ErrorKind::Unsupported,
            "this back end has no image catalog to make a snapshot's image in; its snapshots are exported as host \
             disk files",
        ))
    }
}

/// vmlet's name for the image (a back end's catalog entry, or a host file
/// without its `.qcow2` suffix) that restore `restore_uid` makes for new VM
/// `vm` of `namespace`: `<namespace>_<vm>_restored_<restore uid>`. Namespace
/// and VM names hold no `_`, so the namespace is the part before the first
/// `_` ([`is_restored_image_of`]).
pub fn restored_image_name(namespace: &str, vm: &str, restore_uid: &str) -> String {
    format!("{namespace}_{vm}_restored_{restore_uid}")
}

/// Whether `image` is a name [`restored_image_name`] gives for a VM of
/// `namespace`: `<namespace>_<vm>_restored_<uid>` with a non-empty VM name
/// and a UID of hex digits and `-` (36 characters), neither holding `_`. A
/// back end boots such an image only for a VM of that namespace, so one
/// tenant cannot boot another's restored disk by naming it.
pub fn is_restored_image_of(namespace: &str, image: &str) -> bool {
    let Some(rest) = image.strip_prefix(namespace).and_then(|r| r.strip_prefix('_')) else { return false };
    let Some((vm, uid)) = rest.split_once("_restored_") else { return false };
    !namespace.is_empty()
        && !namespace.contains('_')
        && !vm.is_empty()
        && !vm.contains('_')
        && uid.len() == 36
        && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a";

    #[test]
    fn a_restored_image_belongs_to_the_namespace_its_name_begins_with_only() {
        let image = restored_image_name("tenant-a", "web2", UID);
        assert_eq!(image, format!("tenant-a_web2_restored_{UID}"));
        assert!(is_restored_image_of("tenant-a", &image));
        assert!(!is_restored_image_of("tenant", &image), "a namespace that is a prefix of another");
        assert!(!is_restored_image_of("tenant-b", &image));
        assert!(!is_restored_image_of("tenant-a", "tenant-a_web"), "a VM's own vSphere name");
        assert!(!is_restored_image_of("tenant-a", &format!("tenant-a__restored_{UID}")));
        assert!(!is_restored_image_of("tenant-a", &format!("tenant-a_x_y_restored_{UID}")));
        assert!(!is_restored_image_of("tenant-a", "tenant-a_web_restored_template-c0"));
        assert!(!is_restored_image_of("", &format!("_web_restored_{UID}")));
    }
}
