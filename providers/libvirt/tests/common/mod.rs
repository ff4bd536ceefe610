//! Shared by the provider's tests against a real libvirtd.

/// Deadlines for external commands (virsh, the guest build), shared with the
/// workspace's integration tests.
#[path = "../../../../tests/support/deadline.rs"]
pub mod deadline;

/// Disk images read with qemu-img.
#[allow(dead_code)] // not every test binary reads images
pub mod disk;

/// The test guest: its files, commands in it, waiting for it.
#[allow(dead_code)] // not every test binary boots a guest
pub mod guest;

use std::time::{SystemTime, UNIX_EPOCH};
use vmlet_provider::{VmId, VmSpec};

/// The real libvirtd's URI (`hack/test.sh` starts it and sets the variable).
#[allow(dead_code)] // the tests on two hosts use their own
pub fn qemu_uri() -> String {
    std::env::var("VMLET_LIBVIRT_QEMU_URI")
        .ok()
        .filter(|uri| !uri.is_empty())
        .expect("VMLET_LIBVIRT_QEMU_URI is unset: run the tests with hack/test.sh, which starts libvirtd and sets it")
}

/// The URIs of the two libvirt hosts `hack/hosts.sh` runs (mig-a, mig-b), or
/// `None` when the tests do not run as root (the hosts need root, and so do
/// the guest files): the caller then skips, saying so loudly. As root the
/// variables must be set: `hack/test.sh` sets them.
#[allow(dead_code)] // only the tests on two hosts use it
pub fn two_hosts(test: &str) -> Option<(String, String)> {
    if !running_as_root() {
        eprintln!(
            "\n*** SKIPPED {test}: needs root (two libvirtd in namespaces, guest files QEMU reads); \
             run hack/test.sh as root ***\n"
        );
        return None;
    }
    let var = |name: &str| {
        std::env::var(name).ok().filter(|uri| !uri.is_empty()).unwrap_or_else(|| {
            panic!("{name} is unset: run the tests with hack/test.sh, or `hack/hosts.sh up` and `eval \"$(hack/hosts.sh uris)\"`")
        })
    };
    Some((var("VMLET_LIBVIRT_MIG_A_URI"), var("VMLET_LIBVIRT_MIG_B_URI")))
}

/// Whether this process runs as root (its effective uid, from /proc).
#[allow(dead_code)]
fn running_as_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        .unwrap_or(false)
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

/// A spec unique to this run in `namespace`, named `<what>-<pid>-<n>`: 1 vCPU,
/// 256 MiB, no ceilings, no files.
#[allow(dead_code)] // not every test binary defines VMs this way
pub fn unique_spec(namespace: &str, what: &str) -> VmSpec {
    let (id, nanos) = unique_uid();
    VmSpec {
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
        id,
        namespace: namespace.into(),
        name: format!("{what}-{}-{}", std::process::id(), nanos % 1_000_000_000),
        cpus: 1,
        memory_bytes: 256 * 1024 * 1024,
        max_cpus: None,
        max_memory_bytes: None,
        image: None,
        image_backing_chain: None,
        kernel_boot: None,
    }
}
