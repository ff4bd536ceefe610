//! Disk images on the host, read with qemu-img (`-U`: also while a VM has
//! them open), each run with a deadline.

use std::process::Command;
use std::time::Duration;

use super::deadline::output_within;

/// Bound on one qemu-img run on the test guest's small disk.
const QEMU_IMG: Duration = Duration::from_secs(60);

/// `qemu-img info -U --output=json <path>`, parsed.
fn info(path: &str) -> serde_json::Value {
    let out = output_within(Command::new("qemu-img").args(["info", "-U", "--output=json", path]), QEMU_IMG);
    assert!(out.status.success(), "qemu-img info {path}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("qemu-img info JSON")
}

/// What `qemu-img info` says of `path`: (format, virtual size).
pub fn image_info(path: &str) -> (String, u64) {
    let info = info(path);
    (info["format"].as_str().expect("format").to_owned(), info["virtual-size"].as_u64().expect("virtual-size"))
}

/// The names of the internal snapshots the qcow2 image `path` holds.
pub fn snapshot_names(path: &str) -> Vec<String> {
    let info = info(path);
    let Some(list) = info["snapshots"].as_array() else {
        return Vec::new();
    };
    list.iter().map(|s| s["name"].as_str().expect("a snapshot's name").to_owned()).collect()
}

/// The first `len` bytes of the qcow2 disk `path` as the guest would read
/// them, through a raw copy next to it.
pub fn disk_head(path: &str, len: usize) -> Vec<u8> {
    let raw = format!("{path}.raw");
    let out = output_within(
        Command::new("qemu-img").args(["convert", "-U", "-f", "qcow2", "-O", "raw", path, &raw]),
        QEMU_IMG,
    );
    assert!(out.status.success(), "qemu-img convert {path} to raw: {}", String::from_utf8_lossy(&out.stderr));
    let data = std::fs::read(&raw).expect("read the raw copy");
    std::fs::remove_file(&raw).expect("remove the raw copy");
    data[..len].to_vec()
}
