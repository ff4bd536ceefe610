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
use vmlet_provider::{BackingFile, DataDisk, DiskFormat, ErrorKind, HostImages, ImageFacts, Provider};

/// The most backing files a host image may have: a longer chain (or a loop)
/// is refused.
pub const MAX_BACKING_FILES: usize = 16;

/// Why a host image cannot be attached (yet): the pod's waiting reason and
/// message, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// There is no file at the path (it may be made later): wait.
    #[error(
        "{field}: there is no file {path:?} on host {host}; vmlet never makes host images: make it there \
         (e.g. qemu-img create -f qcow2 {path} 10G), or fix the path"
    )]
    NotFound {
        /// The field that names the image.
        field: StorageField,
        /// The path as the VM gives it.
        path: String,
        /// The host (node name).
        host: String,
    },
    /// The file (or a backing file) cannot be a disk, or this back end cannot
    /// read host images: the message says why and what to do.
    #[error("{field} {path:?}: {why}")]
    Unusable {
        /// The field that names the image.
        field: StorageField,
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

/// Why a host image gives no disk ([`host_image_disk`], [`boot_image_chain`]).
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
            field: StorageField::HostImage { disk: disk.name.clone() },
            path: path.to_owned(),
            why: unsupported(provider.kind()),
        }),
        None => Ok(()),
    }
}

/// The data disk `disk` from the host image at `path` (allowed by `roots`
/// already), as `provider` reads it: its format, and its backing chain
/// ([`backing_chain`]) with every file checked against `roots`. Errors:
/// [`Unavailable`].
pub async fn host_image_disk(
    provider: &dyn Provider,
    roots: &StorageRoots,
    host: &str,
    disk: &str,
    path: &str,
) -> Result<DataDisk, Unavailable> {
    let field = StorageField::HostImage { disk: disk.to_owned() };
    let Some(images) = provider.host_images() else {
        return Err(unusable(&field, path, unsupported(provider.kind())));
    };
    let facts = inspect_top(images, &field, host, path).await?;
    let backing_chain = backing_chain(images, roots, &field, path, &facts).await?;
    Ok(DataDisk {
        name: disk.to_owned(),
        path: path.to_owned(),
        format: facts.format,
        create_bytes: None,
        backing_chain,
    })
}

/// The backing chain of the image at `path` that `field` names (the boot
/// image `spec.image`, or a claim's catalogue base; allowed by `roots`
/// already) on a back end whose images are host files. Its format
/// is its name's ([`DiskFormat::of_image_path`]): a raw image has no chain
/// and is not read; a qcow2 one is read as qcow2 and its chain followed as
/// [`backing_chain`] does. `None` when the back end cannot read the host's
/// files (a connection to another machine): nothing is pinned there.
/// Errors: [`Unavailable`]; `Unusable` when a `.qcow2` file holds no qcow2
/// image.
pub async fn boot_image_chain(
    provider: &dyn Provider,
    roots: &StorageRoots,
    host: &str,
    field: StorageField,
    path: &str,
) -> Result<Option<Vec<BackingFile>>, Unavailable> {
    if DiskFormat::of_image_path(path) == DiskFormat::Raw {
        return Ok(Some(Vec::new()));
    }
    let Some(images) = provider.host_images() else { return Ok(None) };
    let facts = match images.inspect(path).await {
        Err(e) if e.kind == ErrorKind::Unsupported => return Ok(None),
        Err(e) if e.kind == ErrorKind::NotFound => {
            return Err(Unavailable::NotReady(NotReady::NotFound { field, path: path.into(), host: host.into() }))
        }
        Err(e) => return Err(not_readable(e, &field, path)),
        Ok(facts) => facts,
    };
    if facts.format != DiskFormat::Qcow2 {
        return Err(unusable(
            &field,
            path,
            format!(
                "its name ends in .qcow2, which makes it a qcow2 disk, but the file holds no qcow2 image: convert \
                 it (qemu-img convert -f raw -O qcow2 {path} <new>.qcow2), or name a raw image without .qcow2"
            ),
        ));
    }
    backing_chain(images, roots, &field, path, &facts).await.map(Some)
}

/// What the image at `path` (named by `field`) is. Errors: `NotFound` when
/// it does not exist; the back end's refusal as `Unusable`.
async fn inspect_top(
    images: &dyn HostImages,
    field: &StorageField,
    host: &str,
    path: &str,
) -> Result<ImageFacts, Unavailable> {
    match images.inspect(path).await {
        Ok(facts) => Ok(facts),
        Err(e) if e.kind == ErrorKind::NotFound => Err(Unavailable::NotReady(NotReady::NotFound {
            field: field.clone(),
            path: path.into(),
            host: host.into(),
        })),
        Err(e) => Err(not_readable(e, field, path)),
    }
}

/// The backing chain below the image at `path` (named by `field`), whose
/// own header `top` was read already: each backing file in turn, top's
/// first, checked against `roots` before anything reads it, in the format
/// the layer above states. A raw layer ends the chain unread (QEMU reads
/// its bytes as the disk's); a qcow2 layer is read for the next one. The
/// back end pins exactly this chain in the definition.
///
/// Errors: `Refused` for a backing file outside the roots; `Unusable` for a
/// backing file whose format the header does not state (vmlet never probes
/// one: QEMU would read a guest-written header as the format), a format
/// other than raw and qcow2, a layer stated qcow2 that holds no qcow2
/// image, a missing file, or more than [`MAX_BACKING_FILES`] layers.
pub async fn backing_chain(
    images: &dyn HostImages,
    roots: &StorageRoots,
    field: &StorageField,
    path: &str,
    top: &ImageFacts,
) -> Result<Vec<BackingFile>, Unavailable> {
    let mut chain: Vec<BackingFile> = Vec::new();
    let (mut layer, mut above) = (path.to_owned(), top.clone());
    while let Some(file) = above.backing_file.take() {
        if chain.len() == MAX_BACKING_FILES {
            return Err(unusable(
                field,
                path,
                format!(
                    "its backing chain is longer than {MAX_BACKING_FILES} files (or a loop); flatten it \
                     (qemu-img convert -O qcow2)"
                ),
            ));
        }
        roots.check_backing_on_host(field, path, &file).await.map_err(Unavailable::Refused)?;
        let format = match above.backing_format.as_deref() {
            None => {
                return Err(unusable(
                    field,
                    path,
                    format!(
                        "{layer:?} names its backing file {file:?} without its format, and vmlet never guesses one \
                         from a file's contents: state it (qemu-img rebase -u -b {file} -F raw {layer}, or -F qcow2)"
                    ),
                ))
            }
            Some(name) => DiskFormat::from_name(name).ok_or_else(|| {
                unusable(
                    field,
                    path,
                    format!("its backing file {file:?} is a {name} image; vmlet attaches raw and qcow2 images only"),
                )
            })?,
        };
        let facts = match images.inspect(&file).await {
            Ok(facts) => facts,
            Err(e) if e.kind == ErrorKind::NotFound => {
                return Err(unusable(field, path, format!("its backing file {file:?} does not exist")));
            }
            Err(e) => return Err(not_readable(e, field, path)),
        };
        chain.push(BackingFile { path: file.clone(), format });
        match format {
            DiskFormat::Raw => break,
            DiskFormat::Qcow2 if facts.format != DiskFormat::Qcow2 => {
                return Err(unusable(
                    field,
                    path,
                    format!("{layer:?} states its backing file {file:?} is qcow2, but that file holds no qcow2 image"),
                ));
            }
            DiskFormat::Qcow2 => (layer, above) = (file, facts),
        }
    }
    Ok(chain)
}

fn unusable(field: &StorageField, path: &str, why: String) -> Unavailable {
    Unavailable::NotReady(NotReady::Unusable { field: field.clone(), path: path.into(), why })
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
fn not_readable(e: vmlet_provider::Error, field: &StorageField, path: &str) -> Unavailable {
    match e.kind {
        ErrorKind::Transient => Unavailable::Provider(e),
        _ => unusable(field, path, e.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HostConfig;
    use vmlet_provider::HostInfo;

    /// Roots `/img` on a host reached over ssh (paths only, no links).
    fn roots() -> StorageRoots {
        let host: HostConfig = serde_json::from_value(serde_json::json!({
            "name": "host-a", "provider": "libvirt", "uri": "qemu+ssh://root@kvm-1/system", "storageRoots": ["/img"]
        }))
        .unwrap();
        let info = HostInfo {
            cpus: 2,
            memory_bytes: 1 << 30,
            architecture: "amd64".into(),
            hypervisor: "libvirt 9.0.0 (QEMU)".into(),
            accelerator: None,
            storage_roots: vec![],
        };
        StorageRoots::for_host(&host, &info)
    }

    /// Image headers by file, as a back end reads them; reads are recorded.
    #[derive(Default)]
    struct Files {
        headers: Vec<(&'static str, ImageFacts)>,
        read: std::sync::Mutex<Vec<String>>,
    }

    #[async_trait::async_trait]
    impl HostImages for Files {
        async fn inspect(&self, path: &str) -> vmlet_provider::Result<ImageFacts> {
            self.read.lock().unwrap().push(path.to_owned());
            let found = self.headers.iter().find(|(p, _)| *p == path).map(|(_, facts)| facts.clone());
            found.ok_or_else(|| vmlet_provider::Error::new("inspect", ErrorKind::NotFound, format!("no {path}")))
        }
    }

    fn image(format: DiskFormat, backing: Option<(&str, Option<&str>)>) -> ImageFacts {
        ImageFacts {
            format,
            backing_file: backing.map(|(file, _)| file.to_owned()),
            backing_format: backing.and_then(|(_, format)| format.map(str::to_owned)),
        }
    }

    const QCOW2: DiskFormat = DiskFormat::Qcow2;
    const RAW: DiskFormat = DiskFormat::Raw;

    async fn chain_of(files: &Files, top: &ImageFacts) -> Result<Vec<BackingFile>, Unavailable> {
        let field = StorageField::HostImage { disk: "data".into() };
        backing_chain(files, &roots(), &field, "/img/top.qcow2", top).await
    }

    fn why(unavailable: Unavailable) -> String {
        match unavailable {
            Unavailable::NotReady(not_ready) => not_ready.to_string(),
            Unavailable::Refused(refusal) => refusal.to_string(),
            Unavailable::Provider(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn the_chain_is_every_layer_in_its_stated_format_and_a_raw_layer_ends_it() {
        let files = Files {
            headers: vec![
                ("/img/mid.qcow2", image(QCOW2, Some(("/img/base.raw", Some("raw"))))),
                // A raw layer's own header (a guest may have written one) is
                // never followed: QEMU reads its bytes.
                ("/img/base.raw", image(QCOW2, Some(("/etc/passwd", Some("raw"))))),
            ],
            ..Files::default()
        };
        let top = image(QCOW2, Some(("/img/mid.qcow2", Some("qcow2"))));
        let chain = chain_of(&files, &top).await.unwrap();
        assert_eq!(
            chain,
            [
                BackingFile { path: "/img/mid.qcow2".into(), format: QCOW2 },
                BackingFile { path: "/img/base.raw".into(), format: RAW },
            ]
        );
        assert_eq!(*files.read.lock().unwrap(), ["/img/mid.qcow2", "/img/base.raw"]);
        assert_eq!(chain_of(&files, &image(QCOW2, None)).await.unwrap(), []);
    }

    #[tokio::test]
    async fn a_backing_file_without_a_stated_format_is_refused_and_never_read() {
        let files = Files { headers: vec![("/img/base.raw", image(QCOW2, None))], ..Files::default() };
        let top = image(QCOW2, Some(("/img/base.raw", None)));
        let message = why(chain_of(&files, &top).await.unwrap_err());
        assert_eq!(
            message,
            "spec.disks[data].hostImage.path \"/img/top.qcow2\": \"/img/top.qcow2\" names its backing file \
             \"/img/base.raw\" without its format, and vmlet never guesses one from a file's contents: state it \
             (qemu-img rebase -u -b /img/base.raw -F raw /img/top.qcow2, or -F qcow2)"
        );
        assert!(files.read.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_layer_stated_qcow2_that_is_raw_and_a_backing_file_outside_the_roots_are_refused() {
        let files = Files { headers: vec![("/img/base.img", image(RAW, None))], ..Files::default() };
        let stated_qcow2 = image(QCOW2, Some(("/img/base.img", Some("qcow2"))));
        let message = why(chain_of(&files, &stated_qcow2).await.unwrap_err());
        assert!(
            message.ends_with("states its backing file \"/img/base.img\" is qcow2, but that file holds no qcow2 image"),
            "{message}"
        );
        let outside = image(QCOW2, Some(("/etc/passwd", Some("raw"))));
        assert!(matches!(chain_of(&files, &outside).await.unwrap_err(), Unavailable::Refused(_)));
        assert_eq!(*files.read.lock().unwrap(), ["/img/base.img"], "nothing outside the roots is read");
    }

    #[tokio::test]
    async fn a_loop_is_cut_after_the_longest_chain_allowed() {
        let files = Files {
            headers: vec![("/img/loop.qcow2", image(QCOW2, Some(("/img/loop.qcow2", Some("qcow2")))))],
            ..Files::default()
        };
        let top = image(QCOW2, Some(("/img/loop.qcow2", Some("qcow2"))));
        let message = why(chain_of(&files, &top).await.unwrap_err());
        assert!(message.contains(&format!("longer than {MAX_BACKING_FILES} files")), "{message}");
        assert_eq!(files.read.lock().unwrap().len(), MAX_BACKING_FILES);
    }
}
