//! Host images: image files that a host's administrators keep under its
//! storage roots and that a VM names as a data disk.
//!
//! The core decides whether a VM may use a file (the host's storage roots);
//! the back end says what the file is, as its hypervisor would read it
//! ([`HostImages::inspect`]), so that a disk's format never comes from the
//! VirtualMachine: a tenant who could say "qcow2" of a raw file, or "raw" of
//! a qcow2 one, could make the hypervisor open files the header names.
//!
//! A qcow2 image may name a backing file, which the hypervisor opens too
//! (read-only). The core follows that chain one image at a time, checking
//! each backing file against the storage roots before it asks the back end
//! to read it, so that nothing outside the roots is ever opened.

use std::fmt;

use crate::Result;

/// How the hypervisor reads a data disk's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskFormat {
    /// The file's bytes are the disk's bytes.
    Raw,
    /// A QEMU copy-on-write image: its header maps the disk onto the file
    /// and may name a backing file.
    Qcow2,
}

impl DiskFormat {
    /// The name QEMU and libvirt use: `raw`, `qcow2`.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }

    /// The format of a boot image (`VmSpec::image`) on a host path, stated
    /// by its name and never read from the file, whose contents its guest
    /// writes: qcow2 when the name ends in `.qcow2`, raw otherwise.
    pub fn of_image_path(path: &str) -> DiskFormat {
        if path.ends_with(".qcow2") {
            DiskFormat::Qcow2
        } else {
            DiskFormat::Raw
        }
    }

    /// The format QEMU names `name`; `None` for any other (`vmdk`, `luks`, ...).
    pub fn from_name(name: &str) -> Option<DiskFormat> {
        match name {
            "raw" => Some(DiskFormat::Raw),
            "qcow2" => Some(DiskFormat::Qcow2),
            _ => None,
        }
    }
}

impl fmt::Display for DiskFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One layer below an image in its backing chain, as vmlet states it to the
/// hypervisor ([`crate::DataDisk::backing_chain`], [`crate::VmSpec::image_backing_chain`]):
/// the file and the format it is read in. The hypervisor opens exactly
/// these files in these formats, whatever the images' headers say later
/// (libvirt: nested `<backingStore>` elements ending in an empty one,
/// <https://libvirt.org/formatdomain.html#hard-drives-floppy-disks-cdroms>).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackingFile {
    /// Absolute path of the file on the host.
    pub path: String,
    /// The format the layer above's header stated for it when vmlet checked
    /// the chain; never probed from the file.
    pub format: DiskFormat,
}

/// What one image file is ([`HostImages::inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageFacts {
    /// Its format, read from its contents.
    pub format: DiskFormat,
    /// The backing file its header names (qcow2 only), as the hypervisor
    /// would open it: a relative name joined to the image's directory; a name
    /// that is no file path (`json:{…}`, `nbd://…`) as written. `None`: it
    /// has none.
    pub backing_file: Option<String>,
    /// The format the header gives the backing file (`raw`, `qcow2`, or any
    /// other name as written), when it gives one.
    pub backing_format: Option<String>,
}

/// Reading host image files where the back end's hypervisor reads them.
#[async_trait::async_trait]
pub trait HostImages: Send + Sync {
    /// What the file at the absolute path `path` is, from its contents.
    /// Only that file is opened: neither a backing file it names nor any
    /// other file. Symbolic links are followed (the caller checked where
    /// they lead).
    ///
    /// Errors: `NotFound` when there is no file at `path`; `InvalidInput`
    /// when it is no regular file, is neither raw nor qcow2 (the message
    /// names the format found), or is a qcow2 image with an external data
    /// file; `Unsupported` when the back end cannot read the host's files
    /// from where vmlet runs (the message says what is needed); `Transient`
    /// when reading did not finish in time; `Permanent` when the file cannot
    /// be read (no permission, a damaged header), with the reason.
    async fn inspect(&self, path: &str) -> Result<ImageFacts>;
}
