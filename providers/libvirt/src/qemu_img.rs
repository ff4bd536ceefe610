//! `qemu-img` on this machine (Debian package `qemu-utils`), every run with a
//! deadline: reading an image's size and internal snapshots, copying an image
//! into a new one, and putting an inactive qcow2 image back to one of its
//! internal snapshots.
//!
//! Runs only where the files are, so only for local libvirt connections (the
//! callers check). The child is killed when its deadline passes or its caller
//! stops waiting (`kill_on_drop`).

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;
use vmlet_provider::{Error, ErrorKind, Result};

/// The program run; found on `PATH`.
const QEMU_IMG: &str = "qemu-img";

/// What `qemu-img info` says about an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ImageInfo {
    /// The disk's size as the guest sees it, in bytes (`virtual-size`).
    pub(crate) virtual_size: u64,
    /// The image format (`qcow2`, `raw`).
    pub(crate) format: String,
    /// The names of the internal snapshots the image holds (qcow2 only;
    /// empty for other formats), in the image's order.
    pub(crate) snapshots: Vec<String>,
}

/// `qemu-img info -U --output=json -f <format> <path>` (format probed when
/// `None`), within `deadline`. `-U` reads an image in use by a running VM
/// without taking its lock.
///
/// Errors (for `operation`): `Transient` when qemu-img did not finish in time;
/// `Unsupported` when qemu-img is not installed; `Permanent` with qemu-img's
/// message when it failed (a file that is no image, no permission).
pub(crate) async fn info(
    operation: &'static str,
    path: &str,
    format: Option<&str>,
    deadline: Duration,
) -> Result<ImageInfo> {
    let mut command = Command::new(QEMU_IMG);
    command.args(["info", "-U", "--output=json"]);
    if let Some(format) = format {
        command.args(["-f", format]);
    }
    command.arg(path);
    let output = run(operation, command, deadline, &mut |_| {}).await?;
    parse_info(&output).ok_or_else(|| {
        Error::new(
            operation,
            ErrorKind::Permanent,
            format!("qemu-img info {path} printed no virtual-size and format: {}", String::from_utf8_lossy(&output)),
        )
    })
}

/// The size, format and snapshot names in `qemu-img info --output=json`'s
/// answer.
fn parse_info(json: &[u8]) -> Option<ImageInfo> {
    let info: serde_json::Value = serde_json::from_slice(json).ok()?;
    let snapshots = match info.get("snapshots") {
        None => Vec::new(),
        Some(list) => list.as_array()?.iter().map(|s| s["name"].as_str().map(str::to_owned)).collect::<Option<_>>()?,
    };
    Some(ImageInfo {
        virtual_size: info["virtual-size"].as_u64()?,
        format: info["format"].as_str()?.to_owned(),
        snapshots,
    })
}

/// `qemu-img convert -p -t writeback -f <format> -O <output_format> <source>
/// <target>`: a new, independent image at `target` (`qcow2` or `raw`) with
/// what `source` holds (backing files flattened, zero blocks not stored;
/// internal snapshots are not copied), flushed to disk before qemu-img exits. Calls `percent` with qemu-img's progress (0.0 to 100.0) as it
/// reports it. `target` must not exist yet: it is created, and removed again
/// when the copy fails or does not finish within `deadline`.
///
/// Errors (for `operation`): `Transient` after `deadline` (qemu-img killed);
/// `Unsupported` when qemu-img is not installed; `Permanent` with qemu-img's
/// message when the copy failed (no room left, an unreadable source, an image
/// locked by a running VM).
pub(crate) async fn convert(
    operation: &'static str,
    source: &str,
    format: &str,
    target: &str,
    output_format: &str,
    deadline: Duration,
    percent: &mut (dyn FnMut(f64) + Send),
) -> Result<()> {
    let mut command = Command::new(QEMU_IMG);
    command.args(["convert", "-p", "-t", "writeback", "-f", format, "-O", output_format, source, target]);
    match run(operation, command, deadline, percent).await {
        Ok(_) => Ok(()),
        Err(mut err) => {
            if remove_partial(target) {
                err.message.push_str("; the partial copy was removed");
            }
            Err(err)
        }
    }
}

/// `qemu-img convert -n -t writeback -f <format> -O <output_format>
/// <source> <target>`: what `source` holds (backing files flattened) written
/// into the existing image `target` (at least as large; what lies beyond
/// `source`'s size is left as it is), flushed to disk before qemu-img exits.
/// Both formats are stated: nothing is probed.
///
/// Errors (for `operation`): as [`convert`]'s; `target` is left as it is.
pub(crate) async fn convert_into(
    operation: &'static str,
    source: &str,
    format: &str,
    target: &str,
    output_format: &str,
    deadline: Duration,
) -> Result<()> {
    let mut command = Command::new(QEMU_IMG);
    command.args(["convert", "-n", "-t", "writeback", "-f", format, "-O", output_format, source, target]);
    run(operation, command, deadline, &mut |_| {}).await.map(drop)
}

/// `qemu-img convert -U -p -t writeback -f qcow2 -l snapshot.name=<snapshot>
/// -O qcow2 <source> <target>`: a new, independent qcow2 image at `target`
/// with what the qcow2 image `source` held at its internal snapshot
/// `snapshot` (a name [`crate::snapshot`] checked: no `,` or `=`). `-U`
/// reads an image a running VM has open: the clusters an internal snapshot
/// references are never written while it exists (QEMU copies a shared
/// cluster before writing it), so the copy is consistent as long as nobody
/// deletes the snapshot meanwhile (the caller holds the VM's job claim and
/// checks the snapshot table before and after). `target` must not exist
/// yet; it is removed again when the copy fails.
///
/// Errors (for `operation`): as [`convert`]'s.
pub(crate) async fn convert_snapshot(
    operation: &'static str,
    source: &str,
    snapshot: &str,
    target: &str,
    deadline: Duration,
) -> Result<()> {
    let mut command = Command::new(QEMU_IMG);
    let selected = format!("snapshot.name={snapshot}");
    command.args(["convert", "-U", "-p", "-t", "writeback", "-f", "qcow2", "-l", &selected, "-O", "qcow2"]);
    command.args([source, target]);
    match run(operation, command, deadline, &mut |_| {}).await {
        Ok(_) => Ok(()),
        Err(mut err) => {
            if remove_partial(target) {
                err.message.push_str("; the partial copy was removed");
            }
            Err(err)
        }
    }
}

/// `qemu-img create -f qcow2 -b <backing> -F qcow2 <target>`: a new, empty
/// qcow2 image at `target` (which must not exist: checked, `InvalidInput`)
/// that reads through to the qcow2 image `backing` (an absolute path, kept
/// as it is in the new image's header) and has its virtual size.
///
/// Errors (for `operation`): as [`info`]'s, `Permanent` when `backing`
/// cannot be opened.
pub(crate) async fn create_with_backing(
    operation: &'static str,
    target: &str,
    backing: &str,
    deadline: Duration,
) -> Result<()> {
    if std::path::Path::new(target).exists() {
        return Err(Error::new(operation, ErrorKind::InvalidInput, format!("{target} exists already")));
    }
    let mut command = Command::new(QEMU_IMG);
    command.args(["create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2", target]);
    match run(operation, command, deadline, &mut |_| {}).await {
        Ok(_) => Ok(()),
        Err(err) => {
            remove_partial(target);
            Err(err)
        }
    }
}

/// `qemu-img snapshot -a <name> --image-opts driver=qcow2,file.filename=<path>`:
/// put the qcow2 image `path` back to
/// its internal snapshot `name` (what it holds now is lost; the snapshot is
/// kept). qemu-img takes the image's write lock, so this fails while a VM
/// (or another qemu-img) has the image open.
///
/// Errors (for `operation`): `Transient` after `deadline` (qemu-img killed:
/// the image may be half reverted; run it again); `Unsupported` when qemu-img
/// is not installed; `Permanent` with qemu-img's message when it failed (no
/// such snapshot, the image locked: the message says `lock`).
pub(crate) async fn apply_snapshot(operation: &'static str, path: &str, name: &str, deadline: Duration) -> Result<()> {
    // `snapshot` takes no `-f`: the format is stated in image options, so
    // that qemu-img never probes it. Option values double their commas.
    let options = format!("driver=qcow2,file.filename={}", path.replace(',', ",,"));
    let mut command = Command::new(QEMU_IMG);
    command.args(["snapshot", "-a", name, "--image-opts", &options]);
    run(operation, command, deadline, &mut |_| {}).await.map(drop)
}

/// Remove the partial file `path` that a failed copy left; true when there was
/// one. A failure to remove it is logged.
pub(crate) fn remove_partial(path: &str) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => false,
        Err(err) => {
            tracing::warn!(path, error = %err, "cannot remove the partial copy");
            false
        }
    }
}

/// Run `command` (a qemu-img command line) to its end within `deadline` and
/// return its stdout; lines of stdout that carry progress (`(12.50/100%)`,
/// ended by `\r`) go to `percent` as they arrive.
async fn run(
    operation: &'static str,
    mut command: Command,
    deadline: Duration,
    percent: &mut (dyn FnMut(f64) + Send),
) -> Result<Vec<u8>> {
    let line = format!("{:?}", command.as_std()).replace('"', "");
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    let mut child = command.spawn().map_err(|err| {
        let kind =
            if err.kind() == std::io::ErrorKind::NotFound { ErrorKind::Unsupported } else { ErrorKind::Permanent };
        Error::new(
            operation,
            kind,
            format!("cannot run {QEMU_IMG} ({err}); install it on the libvirt host (Debian: qemu-utils)"),
        )
        .with_source(err)
    })?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(Error::new(operation, ErrorKind::Permanent, format!("`{line}`: no pipes to the child")));
    };
    let errors = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = stderr.read_to_end(&mut text).await;
        text
    });
    let finished = tokio::time::timeout(deadline, async {
        let (mut out, mut pending, mut chunk) = (Vec::new(), Vec::new(), [0u8; 4096]);
        loop {
            let n = stdout.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
            pending.extend_from_slice(&chunk[..n]);
            while let Some(end) = pending.iter().position(|b| *b == b'\r' || *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if let Some(done) = parse_percent(&String::from_utf8_lossy(&line)) {
                    percent(done);
                }
            }
        }
        let status = child.wait().await?;
        Ok::<_, std::io::Error>((status, out))
    })
    .await;
    let (status, out) = match finished {
        Ok(Ok(done)) => done,
        Ok(Err(err)) => {
            return Err(Error::new(operation, ErrorKind::Permanent, format!("`{line}`: {err}")).with_source(err))
        }
        Err(_) => {
            // Killed and reaped before the caller removes what it wrote.
            let _ = child.kill().await;
            return Err(Error::new(
                operation,
                ErrorKind::Transient,
                format!("`{line}` did not finish within {}s and was killed", deadline.as_secs_f32()),
            ));
        }
    };
    let errors = errors.await.unwrap_or_default();
    if !status.success() {
        let message = String::from_utf8_lossy(&errors);
        return Err(Error::new(
            operation,
            ErrorKind::Permanent,
            format!("`{line}` failed ({status}): {}", message.trim()),
        ));
    }
    Ok(out)
}

/// The percentage in one progress line of `qemu-img -p` (`    (12.50/100%)`).
fn parse_percent(line: &str) -> Option<f64> {
    let inside = line.trim().strip_prefix('(')?.strip_suffix("/100%)")?;
    inside.parse().ok().filter(|p: &f64| (0.0..=100.0).contains(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_are_read_as_qemu_img_prints_them() {
        assert_eq!(parse_percent("    (0.00/100%)\r"), Some(0.0));
        assert_eq!(parse_percent("    (12.50/100%)\r"), Some(12.5));
        assert_eq!(parse_percent("    (100.00/100%)\n"), Some(100.0));
        assert_eq!(parse_percent("qemu-img: error"), None);
        assert_eq!(parse_percent("(250.00/100%)"), None);
    }

    #[test]
    fn info_is_read_from_qemu_imgs_json() {
        let json = br#"{"virtual-size": 67108864, "filename": "/d.qcow2", "format": "qcow2", "actual-size": 200704}"#;
        let image = ImageInfo { virtual_size: 64 << 20, format: "qcow2".into(), snapshots: vec![] };
        assert_eq!(parse_info(json), Some(image));
        assert_eq!(parse_info(br#"{"format": "raw"}"#), None);
        assert_eq!(parse_info(b"qemu-img: Could not open"), None);
    }

    #[test]
    fn internal_snapshots_are_read_by_name() {
        let json = br#"{"snapshots": [{"id": "1", "name": "a", "vm-state-size": 0},
            {"id": "2", "name": "b.2", "vm-state-size": 110952448}],
            "virtual-size": 1048576, "format": "qcow2"}"#;
        let info = parse_info(json).expect("parsed");
        assert_eq!(info.snapshots, ["a", "b.2"]);
        assert_eq!(parse_info(br#"{"snapshots": [{"id": "1"}], "virtual-size": 1, "format": "qcow2"}"#), None);
    }
}
