//! Data disks from host images (`spec.disks[].hostImage.path`): image files
//! that already exist on the VM's host, under its storage roots.
//!
//! The image's path was checked against the roots with the VM's other files
//! ([`crate::storage::StorageRoots::check_on_host`]). Here the back end reads
//! what the file is ([`vmlet_provider::HostImages::inspect`]): its format,
//! which the disk is attached in (never a format the VirtualMachine states),
//! and for qcow2 the backing file its header names. Each backing file is
//! checked against the roots before the back end is asked to read it, so
//! nothing outside them is opened, down to the end of the chain. vmlet never
//! makes, changes or deletes a host image.

use crate::storage::{StorageField, StorageRefusal, StorageRoots};
use crate::v1alpha1::VmDisk;
use std::time::Duration;
use vmlet_provider::{DataDisk, DiskFormat, ErrorKind, Provider};

/// The most backing files a host image may have: a longer chain (or a loop)
/// is refused.
pub const MAX_BACKING_FILES: usize = 16;

/// Why a host image cannot be attached (yet): the pod's waiting reason and
/// message, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// There is no file at the path (it may be made later): wait.
    #[error(
        "spec.disks[{disk}].hostImage.path: there is no file {path:?} on host {host}; vmlet never makes host \
         images: make it there (e.g. qemu-img create -f qcow2 {path} 10G), or fix the path"
    )]
    NotFound {
        /// The disk's name.
        disk: String,
        /// The path as the VM gives it.
        path: String,
        /// The host (node name).
        host: String,
    },
    /// The file (or a backing file) cannot be a disk, or this back end cannot
    /// read host images: the message says why and what to do.
    #[error("spec.disks[{disk}].hostImage.path {path:?}: {why}")]
    Unusable {
        /// The disk's name.
        disk: String,
        /// The path as the VM gives it.
        path: String,
        /// Why, and the fix.
        why: String,
    },
}

impl NotReady {
    /// The pod's waiting reason.
    pub fn reason(&self) -> &'static str {
        match self {
            NotReady::NotFound { .. } => "HostImageNotFound",
            NotReady::Unusable { .. } => "HostImageNotUsable",
        }
    }

    /// When to look again: soon for a file that may appear, rarely for one
    /// that only its administrator can change.
    pub fn recheck(&self) -> Duration {
        match self {
            NotReady::NotFound { .. } => Duration::from_secs(15),
            NotReady::Unusable { .. } => Duration::from_secs(60),
        }
    }
}

/// Why a host image gives no disk ([`host_image_disk`]).
#[derive(Debug)]
pub enum Unavailable {
    /// The image waits or is unusable.
    NotReady(NotReady),
    /// A backing file lies outside the storage roots: a refusal like an
    /// image outside them.
    Refused(Box<StorageRefusal>),
    /// The back end did not answer in time: retry with backoff.
    Provider(vmlet_provider::Error),
}

/// Refuse the host images among `disks` (a VirtualMachine's) when
/// `provider`'s back end cannot attach any, before their paths are checked
/// against roots that such a back end has no use for. Errors: the first
/// host-image disk, naming its field and the back end.
pub fn check_supported(provider: &dyn Provider, disks: &[VmDisk]) -> Result<(), NotReady> {
    if provider.host_images().is_some() {
        return Ok(());
    }
    match disks.iter().find_map(|disk| Some((disk, disk.host_image_path()?))) {
        Some((disk, path)) => Err(NotReady::Unusable {
            disk: disk.name.clone(),
            path: path.to_owned(),
            why: unsupported(provider.kind()),
        }),
        None => Ok(()),
    }
}

/// The data disk `disk` from the host image at `path` (allowed by `roots`
/// already), as `provider` reads it: its format, every backing file checked
/// against `roots`. Errors: [`Unavailable`].
pub async fn host_image_disk(
    provider: &dyn Provider,
    roots: &StorageRoots,
    host: &str,
    disk: &str,
    path: &str,
) -> Result<DataDisk, Unavailable> {
    let unusable =
        |why: String| Unavailable::NotReady(NotReady::Unusable { disk: disk.into(), path: path.into(), why });
    let Some(images) = provider.host_images() else {
        return Err(unusable(unsupported(provider.kind())));
    };
    let field = StorageField::HostImage { disk: disk.to_owned() };
    let facts = match images.inspect(path).await {
        Ok(facts) => facts,
        Err(e) if e.kind == ErrorKind::NotFound => {
            return Err(Unavailable::NotReady(NotReady::NotFound {
                disk: disk.into(),
                path: path.into(),
                host: host.into(),
            }))
        }
        Err(e) => return Err(not_readable(e, &unusable)),
    };
    let mut next = facts.backing_file.clone().map(|file| (file, facts.backing_format.clone()));
    let mut seen = 0;
    while let Some((file, stated_format)) = next {
        seen += 1;
        if seen > MAX_BACKING_FILES {
            return Err(unusable(format!(
                "its backing chain is longer than {MAX_BACKING_FILES} files (or a loop); flatten it \
                 (qemu-img convert -O qcow2)"
            )));
        }
        roots.check_backing_on_host(&field, path, &file).await.map_err(Unavailable::Refused)?;
        if let Some(format) = stated_format.as_deref().filter(|f| DiskFormat::from_name(f).is_none()) {
            return Err(unusable(format!(
                "its backing file {file:?} is a {format} image; vmlet attaches raw and qcow2 images only"
            )));
        }
        let backing = match images.inspect(&file).await {
            Ok(backing) => backing,
            Err(e) if e.kind == ErrorKind::NotFound => {
                return Err(unusable(format!("its backing file {file:?} does not exist")));
            }
            Err(e) => return Err(not_readable(e, &unusable)),
        };
        next = backing.backing_file.map(|file| (file, backing.backing_format));
    }
    Ok(DataDisk { name: disk.to_owned(), path: path.to_owned(), format: facts.format, create_bytes: None })
}

/// What a back end without [`vmlet_provider::HostImages`] says of a host image.
fn unsupported(kind: &str) -> String {
    format!(
        "the {kind} back end cannot attach host images (they are files on a libvirt host); remove the disk, or \
         run the VM on a libvirt host"
    )
}

/// A failed read of an image: a timeout is retried with backoff; anything
/// else leaves the image unusable with the back end's message.
fn not_readable(e: vmlet_provider::Error, unusable: &impl Fn(String) -> Unavailable) -> Unavailable {
    match e.kind {
        ErrorKind::Transient => Unavailable::Provider(e),
        _ => unusable(e.message),
    }
}
