//! Volumes: disks that a back end makes, sizes and removes in its own
//! storage (files in a libvirt storage pool, Cinder volumes of a volume
//! type), for a dynamic volume provisioner to hand to VMs as data disks.
//!
//! A volume lives in a pool of the host, named by the host's administrator
//! (a StorageClass parameter, never a tenant's free text), under a name the
//! caller gives it: the provisioner names a claim's volume
//! `<namespace>_<claim>_<uid>`, which no two claims share. Every operation is
//! idempotent, so a provisioner that crashed half-way calls it again.

use crate::{DiskFormat, Error, ErrorKind, Result};

/// The longest volume name vmlet gives, in bytes.
pub const MAX_VOLUME_NAME_BYTES: usize = 200;

/// A volume to make ([`Volumes::create_volume`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeRequest {
    /// The pool it goes into, by the back end's name for it (libvirt: the
    /// storage pool's name, `virsh pool-list`).
    pub pool: String,
    /// Its name in the pool (see [`validate_volume_name`]); on a file-based
    /// pool, also its file's name in the pool's directory.
    pub name: String,
    /// The disk's size as the guest sees it, in bytes (at least 1). The
    /// back end may round it up (qcow2: to a multiple of 512 bytes).
    pub capacity_bytes: u64,
    /// How the hypervisor reads the file. A new volume takes no space up
    /// front: a raw one is a sparse file, a qcow2 one holds its header only.
    pub format: DiskFormat,
    /// What the new volume holds at first.
    pub source: VolumeSource,
}

/// What a new volume holds at first ([`VolumeRequest::source`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum VolumeSource {
    /// Zeros: a new, empty disk.
    #[default]
    Empty,
    /// A qcow2 overlay on this file, which stays its read-only backing file
    /// in the format stated here (an image of the catalogue): the volume
    /// holds only what the guest writes. Only with [`DiskFormat::Qcow2`].
    Overlay(crate::BackingFile),
    /// A full, independent copy of this file, read in the format stated
    /// here: the volume stands alone (in any format) and the file may
    /// change or go afterwards.
    Copy(crate::BackingFile),
}

impl VolumeSource {
    /// The file the volume is made from, if any.
    pub fn image(&self) -> Option<&crate::BackingFile> {
        match self {
            VolumeSource::Empty => None,
            VolumeSource::Overlay(image) | VolumeSource::Copy(image) => Some(image),
        }
    }

    /// The file the volume stays an overlay on, if any.
    pub fn backing(&self) -> Option<&crate::BackingFile> {
        match self {
            VolumeSource::Overlay(image) => Some(image),
            _ => None,
        }
    }
}

/// A volume as the back end reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    /// The pool that holds it.
    pub pool: String,
    /// Its name in the pool.
    pub name: String,
    /// What the hypervisor opens for it ([`crate::DataDisk::path`]): the
    /// absolute path of its file (libvirt), or the block-storage volume's id
    /// (Nova: a Cinder volume's UUID).
    pub path: String,
    /// The disk's size as the guest sees it, in bytes.
    pub capacity_bytes: u64,
    /// The bytes it takes on the host's storage now (grows as the guest
    /// writes; below `capacity_bytes` for a sparse raw file or a qcow2
    /// image, above it by a qcow2 image's metadata at most).
    pub allocation_bytes: u64,
    /// The format the pool reports for the file; `None` for one other than
    /// raw and qcow2. libvirt's `dir` pools read it from the file's header at
    /// every refresh, so for a volume a guest has written it is whatever the
    /// guest wrote (a qcow2 header in a raw volume makes it "qcow2"): never
    /// open a disk in this format. The provisioner keeps the format it asked
    /// for in the PersistentVolume, and the node agent uses that.
    pub format: Option<DiskFormat>,
}

/// Whether `name` may name a volume: 1 to [`MAX_VOLUME_NAME_BYTES`] bytes of
/// ASCII letters, digits, `.`, `_` and `-`, not starting with `.` (so no
/// `.`, `..` or hidden file, and never a `/` that would leave the pool's
/// directory).
///
/// Errors: `InvalidInput` for `operation`, naming the volume and what is
/// wrong with its name.
pub fn validate_volume_name(operation: &'static str, name: &str) -> Result<()> {
    let problem = if name.is_empty() {
        Some("it is empty".to_owned())
    } else if name.len() > MAX_VOLUME_NAME_BYTES {
        Some(format!("it has {} bytes, more than {MAX_VOLUME_NAME_BYTES}", name.len()))
    } else if name.starts_with('.') {
        Some("it starts with '.'".to_owned())
    } else {
        name.chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
            .map(|c| format!("it holds {c:?}; a volume name holds A-Z, a-z, 0-9, '.', '_' and '-' only"))
    };
    match problem {
        None => Ok(()),
        Some(problem) => {
            Err(Error::new(operation, ErrorKind::InvalidInput, format!("volume name {name:?}: {problem}")))
        }
    }
}

/// Making, reading, growing and removing volumes in a host's storage pools.
///
/// Errors every operation may return: `NotFound` when the host has no pool
/// of that name (the message names it and the pools the host has);
/// `InvalidInput` when the volume's name fails [`validate_volume_name`];
/// `Unsupported` when the pool keeps no files vmlet can attach (the message
/// names the pool's type); `Permanent` when the pool exists but is not
/// running (the message says how to start it); `Transient` when the back
/// end did not answer in time or the connection was lost;
/// `PermissionDenied` when the back end refuses vmlet's credentials.
#[async_trait::async_trait]
pub trait Volumes: Send + Sync {
    /// Make the volume `request` describes, or return the one the pool
    /// already holds under that name when it has `request.format` and at
    /// least `request.capacity_bytes` (unchanged: never grown, never
    /// shrunk), so that calling it again after a success or a crash
    /// converges.
    ///
    /// A volume made from an image ([`VolumeSource::Overlay`],
    /// [`VolumeSource::Copy`]) is at least as large as the image's disk
    /// (a smaller one would cut the guest's disk off); a copy appears under
    /// its name only once it is complete.
    ///
    /// Errors: `Conflict` when the pool holds a volume of that name in
    /// another format or with a smaller capacity (the message names both
    /// the volume's and the request's); `InvalidInput` for a capacity of 0
    /// bytes, one below the image's disk size (the message names both), or
    /// an overlay that is not qcow2; `Unsupported` for a copy the back end
    /// cannot make (libvirt: vmlet is not on the host); `QuotaExceeded` or `Permanent` when the pool has no room (the
    /// back end's message); and those every operation may return.
    async fn create_volume(&self, request: &VolumeRequest) -> Result<Volume>;

    /// The volume named `name` in pool `pool`, or `None` when the pool has
    /// none of that name even after it was refreshed (a pool that several
    /// hosts share holds the volumes each of them made).
    ///
    /// Errors: those every operation may return.
    async fn volume(&self, pool: &str, name: &str) -> Result<Option<Volume>>;

    /// Remove the volume named `name` from pool `pool`, and its file; a
    /// volume that does not exist is success. The caller makes sure that
    /// no VM uses it.
    ///
    /// Errors: those every operation may return.
    async fn delete_volume(&self, pool: &str, name: &str) -> Result<()>;

    /// Grow the volume named `name` in pool `pool`, which was made in
    /// `format`, to `capacity_bytes` (in bytes, as the guest sees it), and
    /// return it; a volume that has exactly that capacity already is
    /// returned unchanged. A running VM of the host that has the volume
    /// attached grows it live through the hypervisor (libvirt:
    /// `virDomainBlockResize`), which reads the file in the format the VM
    /// was given, and its guest sees the new size at once. Otherwise the
    /// back end grows the file, taking no room up front.
    ///
    /// Errors: `NotFound` when the pool has no such volume; `InvalidInput`
    /// when `capacity_bytes` is below the volume's capacity (volumes never
    /// shrink: the guest's data would be cut off) or is 0; `Conflict` when no
    /// VM runs on it and the back end would read the file in another format
    /// than `format` (a guest wrote another format's header into it);
    /// `Unsupported` when the back end cannot grow volumes; and those every
    /// operation may return.
    async fn resize_volume(&self, pool: &str, name: &str, format: DiskFormat, capacity_bytes: u64) -> Result<Volume>;

    /// Whether [`Volumes::resize_volume`] grows a volume of a pool that
    /// several hosts share through any of them, the disk of a running VM on
    /// another host included, because the back end itself tells the
    /// hypervisor that runs the VM (Cinder tells Nova). `false`, the default:
    /// only the host that runs a VM grows its disk live, so vmlet does not
    /// grow volumes of shared pools.
    fn grows_shared_volumes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: &str = "test";

    #[test]
    fn a_provisioners_volume_name_is_valid() {
        for name in ["default_data_0f8e1c2a-7b3d-4e5f-9a6b-1c2d3e4f5a6b", "a", "disk.img", "a-b_c.d", &"x".repeat(200)]
        {
            assert!(validate_volume_name(OP, name).is_ok(), "{name}");
        }
    }

    #[test]
    fn a_name_that_could_leave_the_pool_or_hide_is_refused_naming_why() {
        for (name, why) in [
            ("", "empty"),
            (".", "starts with '.'"),
            ("..", "starts with '.'"),
            (".hidden", "starts with '.'"),
            ("../etc", "starts with '.'"),
            ("a/b", "'/'"),
            ("/abs", "'/'"),
            ("a b", "' '"),
            ("é", "'é'"),
            ("a\0b", "'\\0'"),
            ("a'b", "'\\''"),
        ] {
            let err = validate_volume_name(OP, name).expect_err(name);
            assert_eq!(err.kind, ErrorKind::InvalidInput, "{name}");
            assert!(err.message.contains(why), "{name}: {}", err.message);
        }
    }

    #[test]
    fn a_name_longer_than_200_bytes_is_refused_with_its_length() {
        let err = validate_volume_name(OP, &"x".repeat(201)).expect_err("201 bytes");
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(err.message.contains("201 bytes"), "{}", err.message);
    }
}
