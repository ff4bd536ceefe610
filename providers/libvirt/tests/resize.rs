//! Resizing a running guest through the libvirt provider on a real libvirtd
//! (hack/hosts.sh's mig-b): vCPU hot-plug and the balloon within the ceilings
//! the VM was defined with, refusals beyond them and below what the guest
//! uses, and a resize for the next start.
//!
//! Needs root and `VMLET_LIBVIRT_MIG_B_URI` (`hack/test.sh` starts the hosts
//! and sets it); without root the test says loudly that it skips. The guest is
//! `test-vms/guest/build.sh`'s, booted from a kernel and initramfs; what the
//! guest sees is read through its agent (`nproc`, `/proc/meminfo`,
//! `/proc/uptime`).

mod common;
use common::guest::{
    exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, uptime, wait_for, RunDir, BOOT_DEADLINE,
};

use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{ErrorKind, PowerState, Provider, ResizeScope, Resources, VmId, VmStatus};

const NAMESPACE: &str = "vmlet-resize-it";
const MIB: u64 = 1024 * 1024;
/// How long the guest gets to take a change in (bring a vCPU online, move its
/// balloon, report its memory use every 5 s): generous for a loaded host.
const SETTLE: Duration = Duration::from_secs(120);

fn resources(cpus: u32, memory_mib: u64) -> Resources {
    Resources { cpus, memory_bytes: memory_mib * MIB }
}

async fn status(provider: &LibvirtProvider, id: &VmId) -> VmStatus {
    provider.get(id).await.expect("get").expect("defined")
}

/// `nproc` in the guest.
async fn online_cpus(provider: &LibvirtProvider, id: &VmId) -> u32 {
    let out = exec_when_ready(provider, id, &["nproc"], BOOT_DEADLINE).await;
    out.stdout.trim().parse().unwrap_or_else(|e| panic!("nproc printed {:?}: {e}", out.stdout))
}

/// `MemTotal` of the guest's /proc/meminfo, in KiB.
async fn guest_mem_total_kib(provider: &LibvirtProvider, id: &VmId) -> u64 {
    let out = exec_when_ready(provider, id, &["cat", "/proc/meminfo"], BOOT_DEADLINE).await;
    let line = out.stdout.lines().find_map(|line| line.strip_prefix("MemTotal:")).expect("MemTotal in /proc/meminfo");
    line.split_whitespace().next().and_then(|kib| kib.parse().ok()).expect("MemTotal in kB")
}

/// The guest's memory use as the provider's stats report it (working set).
async fn used_mib(provider: &LibvirtProvider, id: &VmId) -> u64 {
    provider.stats().expect("stats").stats(id).await.expect("stats").memory_working_set_bytes / MIB
}

/// Wait until the provider reports `want` for the VM; returns that status.
async fn wait_for_status(
    provider: &LibvirtProvider,
    id: &VmId,
    what: &str,
    want: impl Fn(&VmStatus) -> bool,
) -> VmStatus {
    wait_for(what, SETTLE, || async {
        let now = status(provider, id).await;
        if want(&now) {
            Ok(now)
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_guest_grows_and_shrinks_within_its_ceilings_and_takes_a_new_size_at_its_next_start() {
    let Some((_, uri)) = common::two_hosts("a_running_guest_grows_and_shrinks_within_its_ceilings") else { return };
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    remove_leftovers(&provider, NAMESPACE).await;
    let mut spec = common::unique_spec(NAMESPACE, "resize");
    let run_dir = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img"]);
    (spec.max_cpus, spec.max_memory_bytes) = (Some(2), Some(512 * MIB));
    spec.kernel_boot = Some(run_dir.kernel_boot(&guest));
    let id = spec.id.clone();
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");
    let resize = provider.resize().expect("QEMU resizes");
    assert_eq!(online_cpus(&provider, &id).await, 1);
    // The guest boots with 512 MiB; its balloon driver then takes it to 256.
    let booted = wait_for_status(&provider, &id, "256 MiB after boot", |s| s.memory_bytes == 256 * MIB).await;
    assert_eq!((booted.cpus, booted.max_cpus, booted.max_memory_bytes, booted.next_start), (1, 2, 512 * MIB, None));
    let mut last_uptime = uptime(&provider, &id).await;

    // 1 -> 2 vCPUs: hot-plugged and online in the guest, without a reboot.
    resize.resize(&id, resources(2, 256), resources(2, 512), ResizeScope::Live).await.expect("2 vCPUs");
    assert_eq!(status(&provider, &id).await.cpus, 2);
    wait_for("nproc = 2 in the guest", SETTLE, || async {
        match online_cpus(&provider, &id).await {
            2 => Ok(()),
            n => Err(format!("nproc {n}")),
        }
    })
    .await;
    let now = uptime(&provider, &id).await;
    assert!(now > last_uptime, "no reboot: uptime {last_uptime} s, then {now} s");
    last_uptime = now;

    // 256 -> 384 MiB: the balloon lets go of 128 MiB.
    let total_before = guest_mem_total_kib(&provider, &id).await;
    resize.resize(&id, resources(2, 384), resources(2, 512), ResizeScope::Live).await.expect("384 MiB");
    let grown = wait_for_status(&provider, &id, "384 MiB", |s| s.memory_bytes == 384 * MIB).await;
    assert_eq!(grown.next_start, None, "the definition took the size too: {grown:?}");
    let total_after = wait_for("the guest to see more memory", SETTLE, || async {
        let total = guest_mem_total_kib(&provider, &id).await;
        if total >= total_before + 120 * 1024 {
            Ok(total)
        } else {
            Err(format!("MemTotal {total} kB, before {total_before} kB"))
        }
    })
    .await;
    println!("guest MemTotal {total_before} kB -> {total_after} kB");
    let now = uptime(&provider, &id).await;
    assert!(now > last_uptime, "no reboot: uptime {last_uptime} s, then {now} s");
    last_uptime = now;

    // Beyond the ceilings: refused, nothing changes.
    for (to, ceiling) in [(resources(3, 384), "maxCpu"), (resources(2, 640), "maxMemory")] {
        let err = resize.resize(&id, to, resources(4, 1024), ResizeScope::Live).await.expect_err("beyond a ceiling");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains(ceiling) && err.message.contains("restarted"), "{err}");
    }
    let unchanged = status(&provider, &id).await;
    assert_eq!((unchanged.cpus, unchanged.memory_bytes, unchanged.next_start), (2, 384 * MIB, None));

    // Below what the guest uses: refused, with both figures. 150 MiB in its
    // tmpfs leave the 384 MiB guest room for its agent and shell.
    exec_when_ready(&provider, &id, &["dd", "if=/dev/zero", "of=/run/fill", "bs=1M", "count=150"], SETTLE).await;
    let used = wait_for("the guest to report the 150 MiB in use", SETTLE, || async {
        let used = used_mib(&provider, &id).await;
        if used >= 150 {
            Ok(used)
        } else {
            Err(format!("{used} MiB in use"))
        }
    })
    .await;
    let err = resize.resize(&id, resources(2, 128), resources(2, 512), ResizeScope::Live).await.expect_err("shrink");
    println!("shrinking below use ({used} MiB): {err}");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("MiB of memory now") && err.message.contains("128 MiB"), "{err}");
    assert_eq!(status(&provider, &id).await.memory_bytes, 384 * MIB, "nothing taken");
    let now = uptime(&provider, &id).await;
    assert!(now > last_uptime, "the guest runs on: uptime {last_uptime} s, then {now} s");
    last_uptime = now;

    // Freed again, the guest can give memory back.
    exec_when_ready(&provider, &id, &["rm", "/run/fill"], SETTLE).await;
    wait_for("the guest to report its memory freed", SETTLE, || async {
        let used = used_mib(&provider, &id).await;
        if used < 128 {
            Ok(())
        } else {
            Err(format!("{used} MiB in use"))
        }
    })
    .await;
    resize.resize(&id, resources(2, 256), resources(2, 512), ResizeScope::Live).await.expect("shrink to 256 MiB");
    wait_for_status(&provider, &id, "256 MiB", |s| s.memory_bytes == 256 * MIB).await;
    let now = uptime(&provider, &id).await;
    assert!(now > last_uptime, "no reboot: uptime {last_uptime} s, then {now} s");

    // For the next start, beyond today's ceilings: shown, then applied by a restart.
    resize.resize(&id, resources(3, 320), resources(4, 768), ResizeScope::NextStart).await.expect("next start");
    let waiting = status(&provider, &id).await;
    assert_eq!((waiting.cpus, waiting.memory_bytes), (2, 256 * MIB), "the running guest keeps its size");
    assert_eq!((waiting.max_cpus, waiting.max_memory_bytes), (2, 512 * MIB), "and its ceilings");
    assert_eq!(waiting.next_start, Some(resources(3, 320)));
    provider.destroy(&id).await.expect("destroy");
    provider.start(&id).await.expect("start");
    assert_eq!(online_cpus(&provider, &id).await, 3);
    // It boots with the new ceiling, 768 MiB, until its balloon takes it to 320.
    let restarted = wait_for_status(&provider, &id, "320 MiB after the restart", |s| s.memory_bytes == 320 * MIB).await;
    assert_eq!(restarted.power, PowerState::Running);
    assert_eq!((restarted.cpus, restarted.max_cpus, restarted.max_memory_bytes), (3, 4, 768 * MIB), "{restarted:?}");
    assert_eq!(restarted.next_start, None);

    provider.destroy(&id).await.expect("destroy");
    provider.undefine(&id).await.expect("undefine");
}
