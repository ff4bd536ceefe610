//! Host images ([`HostImages`]): what an image file on this host is, read
//! where libvirt's QEMU reads it (a local connection only).
//!
//! The format comes from the file's first bytes, never from a VM: the qcow2
//! magic (`QFI\xfb`, version 2 or 3) makes it qcow2; the magic of another
//! format QEMU reads (qcow version 1, vmdk, vdi, vhdx, vpc, qed, luks,
//! parallels, bochs) is refused, naming it; anything else is raw, as QEMU
//! reads a file in which it finds no format. A qcow2 image whose header sets
//! the external data file bit is refused before anything reads it further.
//! Only then does `qemu-img info -f qcow2` (never probing a format) read the
//! backing file the header names, joined to the image's directory when
//! relative, as QEMU opens it. qemu-img opens the image alone (it follows no
//! backing file unless asked to), so nothing but the file itself is opened:
//! the caller checks each backing file before it asks about it.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use tokio::process::Command;
use tracing::instrument;
use vmlet_provider::{DiskFormat, Error, ErrorKind, HostImages, ImageFacts, Result};

use crate::provider::{is_local_uri, LibvirtProvider};

const OP: &str = "inspect host image";
/// How long `qemu-img info` may take.
const INFO_DEADLINE: Duration = Duration::from_secs(30);
/// The bytes of a file's start that [`sniff`] reads.
const HEADER_BYTES: usize = 512;

#[async_trait::async_trait]
impl HostImages for LibvirtProvider {
    /// See the module's documentation. Errors as [`HostImages::inspect`]
    /// says; `Unsupported` on a connection to another machine (vmlet reads
    /// the file itself) and when `qemu-img` is not installed.
    #[instrument(skip(self), fields(provider = "libvirt"))]
    async fn inspect(&self, path: &str) -> Result<ImageFacts> {
        if !is_local_uri(self.uri()) {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "vmlet reads a host image's format and backing file where the files are, and the connection \
                     {} reaches another machine: run vmlet on that host to use host images there",
                    self.uri()
                ),
            ));
        }
        if !Path::new(path).is_absolute() {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("{path:?} is not an absolute path")));
        }
        let owned = path.to_owned();
        let header = tokio::task::spawn_blocking(move || read_header(&owned))
            .await
            .map_err(|e| Error::new(OP, ErrorKind::Transient, format!("reading {path} did not complete: {e}")))??;
        match sniff(&header) {
            Sniffed::Raw => Ok(ImageFacts { format: DiskFormat::Raw, backing_file: None, backing_format: None }),
            Sniffed::Other(format) => Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "{path} is a {format} image; vmlet attaches raw and qcow2 images only: convert it \
                     (qemu-img convert -O qcow2 {path} <new path>)"
                ),
            )),
            Sniffed::Qcow2 { external_data_file: true } => Err(data_file_refused(path)),
            Sniffed::Qcow2 { external_data_file: false } => qcow2_facts(path).await,
        }
    }
}

/// The first [`HEADER_BYTES`] of the regular file at `path` (fewer when it is
/// shorter). Errors: `NotFound`, `InvalidInput` for no regular file,
/// `Permanent` when it cannot be read.
fn read_header(path: &str) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| {
        let kind = if e.kind() == std::io::ErrorKind::NotFound { ErrorKind::NotFound } else { ErrorKind::Permanent };
        Error::new(OP, kind, format!("cannot read {path}: {e}")).with_source(e)
    };
    let file = std::fs::File::open(path).map_err(io)?;
    if !file.metadata().map_err(io)?.is_file() {
        return Err(Error::new(OP, ErrorKind::InvalidInput, format!("{path} is not a regular file")));
    }
    let mut header = Vec::with_capacity(HEADER_BYTES);
    file.take(HEADER_BYTES as u64).read_to_end(&mut header).map_err(io)?;
    Ok(header)
}

/// What a file's first bytes say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sniffed {
    /// No format QEMU knows: raw.
    Raw,
    /// qcow2 (version 2 or 3), and whether its header says its data lives
    /// in an external data file (incompatible feature bit 2).
    Qcow2 { external_data_file: bool },
    /// Another format QEMU reads, by name.
    Other(&'static str),
}

/// The format `header` (a file's first bytes) is in, by the magic QEMU's
/// own probes look for.
fn sniff(header: &[u8]) -> Sniffed {
    let be32 = |at: usize| header.get(at..at + 4).map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")));
    if header.starts_with(b"QFI\xfb") {
        return match be32(4) {
            Some(2) => Sniffed::Qcow2 { external_data_file: false },
            Some(3) => {
                let features = header.get(72..80).map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
                // A version 3 header too short to hold its feature bits is
                // no image QEMU opens; refuse it as holding a data file.
                Sniffed::Qcow2 { external_data_file: features.is_none_or(|f| f & 0b100 != 0) }
            }
            _ => Sniffed::Other("qcow (version 1, or an unknown version)"),
        };
    }
    const MAGICS: [(&[u8], &str); 10] = [
        (b"KDMV", "vmdk"),
        (b"COWD", "vmdk"),
        (b"# Disk DescriptorFile", "vmdk"),
        (b"vhdxfile", "vhdx"),
        (b"conectix", "vpc"),
        (b"QED\0", "qed"),
        (b"LUKS\xba\xbe", "luks"),
        (b"WithoutFreeSpace", "parallels"),
        (b"WithouFreSpacExt", "parallels"),
        (b"Bochs Virtual HD Image", "bochs"),
    ];
    if let Some((_, format)) = MAGICS.iter().find(|(magic, _)| header.starts_with(magic)) {
        return Sniffed::Other(format);
    }
    if header.get(64..68) == Some(&0xbeda_107f_u32.to_le_bytes()[..]) {
        return Sniffed::Other("vdi");
    }
    Sniffed::Raw
}

fn data_file_refused(path: &str) -> Error {
    Error::new(
        OP,
        ErrorKind::InvalidInput,
        format!(
            "{path} is a qcow2 image with an external data file, which QEMU would open too; vmlet attaches qcow2 \
             images without one: convert it (qemu-img convert -O qcow2 {path} <new path>)"
        ),
    )
}

/// `qemu-img info -U --output=json -f qcow2 <path>`: the backing file and
/// its stated format.
async fn qcow2_facts(path: &str) -> Result<ImageFacts> {
    let mut command = Command::new("qemu-img");
    command.args(["info", "-U", "--output=json", "-f", "qcow2", path]).kill_on_drop(true);
    let output = match tokio::time::timeout(INFO_DEADLINE, command.output()).await {
        Err(_) => {
            return Err(Error::new(
                OP,
                ErrorKind::Transient,
                format!("qemu-img info {path} did not finish within {}s", INFO_DEADLINE.as_secs()),
            ))
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                "qemu-img is not installed; install it on the libvirt host (Debian: qemu-utils) to use qcow2 host \
                 images",
            ))
        }
        Ok(Err(e)) => return Err(Error::new(OP, ErrorKind::Permanent, format!("cannot run qemu-img: {e}"))),
        Ok(Ok(output)) => output,
    };
    if !output.status.success() {
        let message = String::from_utf8_lossy(&output.stderr);
        return Err(Error::new(OP, ErrorKind::Permanent, format!("qemu-img info {path}: {}", message.trim())));
    }
    parse_qcow2_info(&output.stdout).map_err(|why| match why {
        Qcow2Info::DataFile => data_file_refused(path),
        Qcow2Info::Unreadable => Error::new(
            OP,
            ErrorKind::Permanent,
            format!("qemu-img info {path} printed what vmlet cannot read: {}", String::from_utf8_lossy(&output.stdout)),
        ),
    })
}

/// Why [`parse_qcow2_info`] gives no facts.
#[derive(Debug, PartialEq, Eq)]
enum Qcow2Info {
    /// The image has an external data file.
    DataFile,
    /// The answer is no qcow2 image's.
    Unreadable,
}

/// The facts in `qemu-img info --output=json -f qcow2`'s answer: the backing
/// file as QEMU opens it (`full-backing-filename`, else `backing-filename`)
/// and `backing-filename-format`.
fn parse_qcow2_info(json: &[u8]) -> std::result::Result<ImageFacts, Qcow2Info> {
    let info: serde_json::Value = serde_json::from_slice(json).map_err(|_| Qcow2Info::Unreadable)?;
    if info["format"].as_str() != Some("qcow2") {
        return Err(Qcow2Info::Unreadable);
    }
    if !info["format-specific"]["data"]["data-file"].is_null() {
        return Err(Qcow2Info::DataFile);
    }
    let text = |key: &str| info[key].as_str().filter(|s| !s.is_empty()).map(str::to_owned);
    Ok(ImageFacts {
        format: DiskFormat::Qcow2,
        backing_file: text("full-backing-filename").or_else(|| text("backing-filename")),
        backing_format: text("backing-filename-format"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A qcow2 header's first 80 bytes: `version`, and the incompatible
    /// features at offset 72.
    fn qcow2_header(version: u32, incompatible: u64) -> Vec<u8> {
        let mut header = b"QFI\xfb".to_vec();
        header.extend_from_slice(&version.to_be_bytes());
        header.resize(72, 0);
        header.extend_from_slice(&incompatible.to_be_bytes());
        header
    }

    #[test]
    fn the_format_comes_from_the_files_magic_and_anything_unknown_is_raw() {
        assert_eq!(sniff(&qcow2_header(3, 0)), Sniffed::Qcow2 { external_data_file: false });
        assert_eq!(sniff(&qcow2_header(2, 0)[..72]), Sniffed::Qcow2 { external_data_file: false });
        assert_eq!(sniff(b"KDMV\x01\0\0\0"), Sniffed::Other("vmdk"));
        assert_eq!(sniff(b"# Disk DescriptorFile\nversion=1\n"), Sniffed::Other("vmdk"));
        assert_eq!(sniff(b"LUKS\xba\xbe\0\x01"), Sniffed::Other("luks"));
        assert!(matches!(sniff(b"QFI\xfb\0\0\0\x01"), Sniffed::Other(_)), "qcow version 1");
        let mut vdi = vec![0u8; 68];
        vdi[64..68].copy_from_slice(&0xbeda_107f_u32.to_le_bytes());
        assert_eq!(sniff(&vdi), Sniffed::Other("vdi"));
        for raw in [&b""[..], &[0u8; 512][..], b"\xeb\x63\x90 boot sector", b"QFI"] {
            assert_eq!(sniff(raw), Sniffed::Raw, "{raw:?}");
        }
    }

    #[test]
    fn a_qcow2_header_with_an_external_data_file_is_seen_before_qemu_img_runs() {
        assert_eq!(sniff(&qcow2_header(3, 0b100)), Sniffed::Qcow2 { external_data_file: true });
        assert_eq!(sniff(&qcow2_header(3, 0b11)), Sniffed::Qcow2 { external_data_file: false }, "dirty, corrupt");
        assert_eq!(sniff(&qcow2_header(3, 0)[..40]), Sniffed::Qcow2 { external_data_file: true }, "cut short");
    }

    #[test]
    fn the_backing_file_is_read_as_qemu_opens_it() {
        let json = br#"{"format": "qcow2", "filename": "/img/top.qcow2", "backing-filename": "base.raw",
            "full-backing-filename": "/img/base.raw", "backing-filename-format": "raw",
            "format-specific": {"type": "qcow2", "data": {"compat": "1.1"}}}"#;
        let facts = parse_qcow2_info(json).unwrap();
        assert_eq!(facts.backing_file.as_deref(), Some("/img/base.raw"));
        assert_eq!(facts.backing_format.as_deref(), Some("raw"));
        let json_name = br#"{"format": "qcow2", "backing-filename": "json:{\"driver\": \"nbd\"}"}"#;
        assert_eq!(parse_qcow2_info(json_name).unwrap().backing_file.as_deref(), Some("json:{\"driver\": \"nbd\"}"));
        let alone = parse_qcow2_info(br#"{"format": "qcow2", "virtual-size": 1048576}"#).unwrap();
        assert_eq!((alone.backing_file, alone.backing_format), (None, None));
    }

    #[test]
    fn a_data_file_in_qemu_imgs_answer_is_refused_too() {
        let json =
            br#"{"format": "qcow2", "format-specific": {"type": "qcow2", "data": {"data-file": "/etc/shadow"}}}"#;
        assert_eq!(parse_qcow2_info(json), Err(Qcow2Info::DataFile));
        assert_eq!(parse_qcow2_info(br#"{"format": "raw"}"#), Err(Qcow2Info::Unreadable));
        assert_eq!(parse_qcow2_info(b"qemu-img: Could not open"), Err(Qcow2Info::Unreadable));
    }

    #[tokio::test]
    async fn real_images_are_read_by_qemu_img_without_opening_their_backing_files() {
        let dir = std::env::temp_dir().join(format!("vmlet-host-images-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = |name: &str| dir.join(name).display().to_string();
        let qemu_img = |args: &[&str]| std::process::Command::new("qemu-img").args(args).status();
        if !qemu_img(&["create", "-q", "-f", "raw", &path("base.raw"), "1M"]).is_ok_and(|s| s.success()) {
            eprintln!("qemu-img is not installed; skipping");
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        // The backing file is gone: reading the image must not need it.
        assert!(qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", &path("top.qcow2")])
            .unwrap()
            .success());
        std::fs::remove_file(path("base.raw")).unwrap();
        let provider = LibvirtProvider::connect("test:///default").await.unwrap();
        let facts = provider.inspect(&path("top.qcow2")).await.unwrap();
        assert_eq!(facts.format, DiskFormat::Qcow2);
        assert_eq!(facts.backing_file, Some(path("base.raw")), "joined to the image's directory");
        assert_eq!(facts.backing_format.as_deref(), Some("raw"));
        let err = provider.inspect(&path("base.raw")).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
        let err = provider.inspect(&dir.display().to_string()).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput, "a directory: {err}");
        std::fs::write(path("plain"), b"bytes").unwrap();
        assert_eq!(provider.inspect(&path("plain")).await.unwrap().format, DiskFormat::Raw);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
