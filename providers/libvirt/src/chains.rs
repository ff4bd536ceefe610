//! Backing chains pinned in the definition, and checked again before a start
//! or a migration.
//!
//! A qcow2 image's header names its backing file and that file's format.
//! Left to itself, libvirt reads those names again at every start and QEMU
//! opens whatever they say, so a header rewritten after the define (e.g.
//! `qemu-img rebase -u -b /etc/passwd -F raw`, which anyone who can write
//! the file as raw can do) would hand another file to the guest. So:
//!
//! - **Pinned.** Each file disk vmlet defines carries its chain as vmlet
//!   checked it ([`vmlet_provider::DataDisk::backing_chain`],
//!   [`vmlet_provider::VmSpec::image_backing_chain`]): nested
//!   `<backingStore>` elements, each with its format and file, ending in an
//!   empty `<backingStore/>`. libvirt (≥ 5.10, domain capability
//!   `backingStoreInput`) then gives QEMU exactly that chain and reads no
//!   header for it
//!   (<https://libvirt.org/formatdomain.html#hard-drives-floppy-disks-cdroms>).
//! - **Checked.** Before a start and before a migration, every qcow2 layer
//!   of every disk is read again (`qemu-img info -f qcow2`, which opens that
//!   file alone) and must still name the next pinned layer in its format, or
//!   none at the end. A mismatch refuses the operation with `InvalidInput`
//!   naming the VirtualMachine's field, and nothing is opened. A raw layer
//!   is never read: its bytes are the guest's. A qcow2 disk whose definition
//!   pins no chain (defined by an older vmlet) may start only while its
//!   header names no backing file.

use std::fmt::Write as _;

use vmlet_provider::{BackingFile, DiskFormat, Error, ErrorKind, HostImages, Result, VmId};

use crate::error::from_libvirt;
use crate::provider::{is_local_uri, LibvirtProvider};
use crate::xml::escape;

/// The `<backingStore>` elements that pin `chain` below a disk's `<source>`,
/// indented for a `<disk>` at four spaces: one per layer, nested, ending in
/// an empty `<backingStore/>` (the chain ends here; nothing is probed).
pub(crate) fn backing_store_xml(chain: &[BackingFile]) -> String {
    let mut xml = String::new();
    for (depth, layer) in chain.iter().enumerate() {
        let pad = "  ".repeat(3 + depth);
        // Writing into a String cannot fail.
        let _ = write!(
            xml,
            "{pad}<backingStore type='file'>\n{pad}  <format type='{}'/>\n{pad}  <source file='{}'/>\n",
            layer.format.as_str(),
            escape(&layer.path),
        );
    }
    let _ = writeln!(xml, "{}<backingStore/>", "  ".repeat(3 + chain.len()));
    for depth in (0..chain.len()).rev() {
        let _ = writeln!(xml, "{}</backingStore>", "  ".repeat(3 + depth));
    }
    xml
}

/// The first child element of `node` named `name`.
fn child<'a, 'input>(node: roxmltree::Node<'a, 'input>, name: &str) -> Option<roxmltree::Node<'a, 'input>> {
    node.children().find(|c| c.has_tag_name(name))
}

/// A file disk of a domain definition with the chain it pins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PinnedDisk {
    /// `<target dev>`: `vda` is the boot disk.
    pub(crate) target: String,
    /// `<serial>`: a data disk's name in the VirtualMachine.
    pub(crate) serial: Option<String>,
    /// The image file.
    pub(crate) source: String,
    /// `<driver type>`; `None` when the definition states none.
    pub(crate) format: Option<String>,
    /// The pinned chain, top's backing file first; `None` when the
    /// definition has no `<backingStore>` (libvirt reads the header).
    pub(crate) chain: Option<Vec<PinnedLayer>>,
}

/// One pinned layer: its file and format as the definition states them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PinnedLayer {
    /// The file; `None` for a layer that is no file (network, block).
    pub(crate) path: Option<String>,
    /// `<format type>`, when stated.
    pub(crate) format: Option<String>,
}

/// The file disks (`<disk type='file' device='disk'>`) of the domain XML
/// `xml` with their pinned chains, in document order. Errors: `Permanent`
/// when the XML does not parse.
pub(crate) fn pinned_disks(operation: &'static str, xml: &str) -> Result<Vec<PinnedDisk>> {
    let document = roxmltree::Document::parse(xml).map_err(|e| {
        Error::new(operation, ErrorKind::Permanent, format!("libvirt's domain XML does not parse: {e}"))
    })?;
    let devices = document.root_element().children().filter(|c| c.has_tag_name("devices"));
    let mut disks = Vec::new();
    for disk in devices.flat_map(|d| d.children()).filter(|c| c.has_tag_name("disk")) {
        if disk.attribute("type").unwrap_or("file") != "file" || disk.attribute("device").unwrap_or("disk") != "disk" {
            continue;
        }
        let (Some(target), Some(source)) = (
            child(disk, "target").and_then(|t| t.attribute("dev")),
            child(disk, "source").and_then(|s| s.attribute("file")),
        ) else {
            continue;
        };
        let chain = child(disk, "backingStore").map(|mut store| {
            let mut layers = Vec::new();
            // An empty <backingStore/> ends the chain.
            while store.has_children() || store.attribute("type").is_some() {
                layers.push(PinnedLayer {
                    path: child(store, "source").and_then(|s| s.attribute("file")).map(str::to_owned),
                    format: child(store, "format").and_then(|f| f.attribute("type")).map(str::to_owned),
                });
                match child(store, "backingStore") {
                    Some(next) => store = next,
                    None => break,
                }
            }
            layers
        });
        disks.push(PinnedDisk {
            target: target.to_owned(),
            serial: child(disk, "serial").and_then(|s| s.text()).map(|s| s.trim().to_owned()),
            source: source.to_owned(),
            format: child(disk, "driver").and_then(|d| d.attribute("type")).map(str::to_owned),
            chain,
        });
    }
    Ok(disks)
}

impl PinnedDisk {
    /// The VirtualMachine field that names this disk's image.
    fn field(&self) -> String {
        match (&self.serial, self.target.as_str()) {
            (_, "vda") => "spec.image".to_owned(),
            (Some(name), _) => format!("spec.disks[{name}].hostImage.path"),
            (None, target) => format!("disk {target}"),
        }
    }
}

/// Check every disk of `disks` against its images' headers as the module
/// documentation says, reading each qcow2 layer through `images`. Errors:
/// `InvalidInput` naming the field, the file, what its header names and what
/// the definition pins; the errors of [`HostImages::inspect`] otherwise.
pub(crate) async fn verify(operation: &'static str, images: &dyn HostImages, disks: &[PinnedDisk]) -> Result<()> {
    for disk in disks {
        if disk.format.as_deref() != Some("qcow2") {
            continue;
        }
        let refuse = |why: String| {
            Error::new(
                operation,
                ErrorKind::InvalidInput,
                format!(
                    "{} {}: {why}; the image changed after vmlet defined the VM, and vmlet opens nothing on it. \
                     An administrator puts the header back (qemu-img rebase -u), or deletes the VM and makes it \
                     again",
                    disk.field(),
                    disk.source
                ),
            )
        };
        let Some(chain) = &disk.chain else {
            if let Some(file) = images.inspect(&disk.source).await?.backing_file {
                return Err(refuse(format!(
                    "its definition pins no backing chain (an older vmlet defined it), and its header names the \
                     backing file {file:?}"
                )));
            }
            continue;
        };
        // The qcow2 layers in turn: the image, then each pinned qcow2 layer.
        let mut layer = disk.source.clone();
        for depth in 0..=chain.len() {
            let facts = images.inspect(&layer).await?;
            if facts.format != DiskFormat::Qcow2 {
                return Err(refuse(format!("{layer:?} is pinned as qcow2 but holds no qcow2 image any more")));
            }
            let named = facts.backing_file.as_deref().map(|file| (file, facts.backing_format.as_deref()));
            let pinned = chain.get(depth).map(|l| (l.path.as_deref().unwrap_or(""), l.format.as_deref()));
            if named != pinned {
                return Err(refuse(format!(
                    "the header of {layer:?} names {}, but the definition pins {}",
                    describe(named),
                    describe(pinned)
                )));
            }
            match chain.get(depth) {
                Some(PinnedLayer { path: Some(path), format: Some(format) }) if format == "qcow2" => {
                    layer = path.clone();
                }
                _ => break,
            }
        }
    }
    Ok(())
}

impl LibvirtProvider {
    /// Before `operation` (a start, a migration) of VM `id` on a local QEMU
    /// host: [`verify`] the disks of its definition (`live`: the running
    /// domain's, else the persistent one). Nothing to check on the test
    /// driver (its domains have no disks) or on a connection to another
    /// machine, whose files vmlet cannot read (the pinned chain alone holds
    /// there). Errors: [`verify`]'s; `NotFound` for a missing VM.
    pub(crate) async fn verify_chains(&self, operation: &'static str, id: &VmId, live: bool) -> Result<()> {
        if !self.domain_kind().is_qemu() || !is_local_uri(self.uri()) {
            return Ok(());
        }
        let flags = if live { 0 } else { virt::sys::VIR_DOMAIN_XML_INACTIVE };
        let task_id = id.clone();
        let xml = self
            .blocking(operation, move |host, conn| {
                host.require(conn, operation, &task_id)?.xml_desc(flags).map_err(|e| from_libvirt(operation, e))
            })
            .await?;
        verify(operation, self, &pinned_disks(operation, &xml)?).await
    }
}

/// "the backing file \"/a\" (raw)", or "no backing file".
fn describe(layer: Option<(&str, Option<&str>)>) -> String {
    match layer {
        None => "no backing file".to_owned(),
        Some((file, format)) => format!("the backing file {file:?} ({})", format.unwrap_or("no format")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::ImageFacts;

    fn layer(path: &str, format: DiskFormat) -> BackingFile {
        BackingFile { path: path.into(), format }
    }

    fn disk_xml(backing: &str) -> String {
        format!(
            "<domain><devices>\n    <disk type='file' device='disk'>\n      <driver name='qemu' type='qcow2'/>\n      \
             <source file='/img/top.qcow2'/>\n{backing}      <target dev='vdb' bus='virtio'/>\n      \
             <serial>data</serial>\n    </disk>\n</devices></domain>"
        )
    }

    #[test]
    fn a_chain_is_pinned_as_nested_backing_stores_that_end_in_an_empty_one() {
        let chain = [layer("/img/mid.qcow2", DiskFormat::Qcow2), layer("/img/b&se.raw", DiskFormat::Raw)];
        assert_eq!(
            backing_store_xml(&chain),
            concat!(
                "      <backingStore type='file'>\n",
                "        <format type='qcow2'/>\n",
                "        <source file='/img/mid.qcow2'/>\n",
                "        <backingStore type='file'>\n",
                "          <format type='raw'/>\n",
                "          <source file='/img/b&amp;se.raw'/>\n",
                "          <backingStore/>\n",
                "        </backingStore>\n",
                "      </backingStore>\n",
            )
        );
        assert_eq!(backing_store_xml(&[]), "      <backingStore/>\n", "a disk that stands alone says so");
    }

    #[test]
    fn pinned_chains_round_trip_through_the_xml() {
        let chain = [layer("/img/mid.qcow2", DiskFormat::Qcow2), layer("/img/base.raw", DiskFormat::Raw)];
        let disks = pinned_disks("test", &disk_xml(&backing_store_xml(&chain))).unwrap();
        let pinned = |path: &str, format: &str| PinnedLayer { path: Some(path.into()), format: Some(format.into()) };
        assert_eq!(
            disks,
            [PinnedDisk {
                target: "vdb".into(),
                serial: Some("data".into()),
                source: "/img/top.qcow2".into(),
                format: Some("qcow2".into()),
                chain: Some(vec![pinned("/img/mid.qcow2", "qcow2"), pinned("/img/base.raw", "raw")]),
            }]
        );
        let alone = pinned_disks("test", &disk_xml(&backing_store_xml(&[]))).unwrap();
        assert_eq!(alone[0].chain, Some(vec![]));
        assert_eq!(pinned_disks("test", &disk_xml("")).unwrap()[0].chain, None, "nothing pinned");
    }

    #[test]
    fn cdroms_and_non_file_disks_are_not_pinned_disks() {
        let xml = "<domain><devices><disk type='file' device='cdrom'><source file='/seed.iso'/>\
                   <target dev='hdc'/></disk><disk type='network' device='disk'><target dev='vdc'/></disk>\
                   </devices></domain>";
        assert_eq!(pinned_disks("test", xml).unwrap(), []);
    }

    /// Headers by file, as [`HostImages::inspect`] would read them.
    struct Headers(Vec<(&'static str, ImageFacts)>);

    #[async_trait::async_trait]
    impl HostImages for Headers {
        async fn inspect(&self, path: &str) -> Result<ImageFacts> {
            let found = self.0.iter().find(|(p, _)| *p == path).map(|(_, facts)| facts.clone());
            found.ok_or_else(|| Error::new("inspect", ErrorKind::NotFound, format!("no {path}")))
        }
    }

    fn qcow2(backing: Option<(&str, &str)>) -> ImageFacts {
        ImageFacts {
            format: DiskFormat::Qcow2,
            backing_file: backing.map(|(file, _)| file.to_owned()),
            backing_format: backing.map(|(_, format)| format.to_owned()),
        }
    }

    fn verified(headers: Vec<(&'static str, ImageFacts)>, chain: &[BackingFile]) -> Result<()> {
        let disks = pinned_disks("start domain", &disk_xml(&backing_store_xml(chain))).unwrap();
        block_on(verify("start domain", &Headers(headers), &disks))
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(future)
    }

    #[test]
    fn headers_that_still_name_the_pinned_chain_pass_and_raw_layers_are_never_read() {
        let chain = [layer("/img/mid.qcow2", DiskFormat::Qcow2), layer("/img/base.raw", DiskFormat::Raw)];
        let headers = vec![
            ("/img/top.qcow2", qcow2(Some(("/img/mid.qcow2", "qcow2")))),
            ("/img/mid.qcow2", qcow2(Some(("/img/base.raw", "raw")))),
        ];
        verified(headers, &chain).unwrap();
        verified(vec![("/img/top.qcow2", qcow2(None))], &[]).unwrap();
    }

    #[test]
    fn a_header_rewritten_after_the_define_refuses_naming_the_field_both_files_and_the_fix() {
        let chain = [layer("/img/base.raw", DiskFormat::Raw)];
        let err = verified(vec![("/img/top.qcow2", qcow2(Some(("/etc/passwd", "raw"))))], &chain).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert_eq!(
            err.message,
            "spec.disks[data].hostImage.path /img/top.qcow2: the header of \"/img/top.qcow2\" names the backing \
             file \"/etc/passwd\" (raw), but the definition pins the backing file \"/img/base.raw\" (raw); the \
             image changed after vmlet defined the VM, and vmlet opens nothing on it. An administrator puts the \
             header back (qemu-img rebase -u), or deletes the VM and makes it again"
        );
        // A format changed alone, a backing file added under a lone image, a
        // deeper layer rewritten: each is a mismatch.
        let format_only = verified(vec![("/img/top.qcow2", qcow2(Some(("/img/base.raw", "qcow2"))))], &chain);
        assert!(format_only.unwrap_err().message.contains("(qcow2), but the definition pins"));
        let added = verified(vec![("/img/top.qcow2", qcow2(Some(("/img/base.raw", "raw"))))], &[]);
        assert!(added.unwrap_err().message.contains("but the definition pins no backing file"));
        let deep = [layer("/img/mid.qcow2", DiskFormat::Qcow2), layer("/img/base.raw", DiskFormat::Raw)];
        let headers = vec![
            ("/img/top.qcow2", qcow2(Some(("/img/mid.qcow2", "qcow2")))),
            ("/img/mid.qcow2", qcow2(Some(("/etc/shadow", "raw")))),
        ];
        assert!(verified(headers, &deep).unwrap_err().message.contains("the header of \"/img/mid.qcow2\""));
    }

    #[test]
    fn a_disk_defined_without_a_pinned_chain_starts_only_while_its_header_names_no_backing_file() {
        let disks = pinned_disks("start domain", &disk_xml("")).unwrap();
        let run =
            |facts: ImageFacts| block_on(verify("start domain", &Headers(vec![("/img/top.qcow2", facts)]), &disks));
        run(qcow2(None)).unwrap();
        let err = run(qcow2(Some(("/img/base.raw", "raw")))).unwrap_err();
        assert!(err.message.contains("pins no backing chain"), "{}", err.message);
    }
}
