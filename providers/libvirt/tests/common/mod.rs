//! Shared by the provider's tests against a real libvirtd.

/// Deadlines for external commands (virsh, the guest build), shared with the
/// workspace's integration tests.
#[path = "../../../../tests/support/deadline.rs"]
pub mod deadline;

use std::time::{SystemTime, UNIX_EPOCH};
use vmlet_provider::VmId;

/// The real libvirtd's URI (`hack/test.sh` starts it and sets the variable).
pub fn qemu_uri() -> String {
    std::env::var("VMLET_LIBVIRT_QEMU_URI")
        .ok()
        .filter(|uri| !uri.is_empty())
        .expect("VMLET_LIBVIRT_QEMU_URI is unset: run the tests with hack/test.sh, which starts libvirtd and sets it")
}

/// A UUID-shaped uid unique to this run (clock and pid), and the nanoseconds it
/// came from, for unique names.
pub fn unique_uid() -> (VmId, u128) {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos();
    let pid = std::process::id();
    let uid = format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (nanos >> 64) as u32 ^ pid,
        (nanos >> 48) as u16,
        (nanos >> 36) as u16 & 0xfff,
        (nanos >> 24) as u16 & 0xfff,
        nanos as u64 & 0xffff_ffff_ffff,
    );
    (VmId(uid), nanos)
}
