//! Benchmark: moving and resizing an idle real guest through Kubernetes, next
//! to the same operations done bare with virsh between the same daemons.
//!
//!   hack/test.sh's environment, then: cargo bench --bench migrate
//!
//! Needs the control plane and the two harness hosts (`hack/hosts.sh up`;
//! `VMLET_LIBVIRT_MIG_A_URI`, `VMLET_LIBVIRT_MIG_B_URI`). Prints figures;
//! asserts no timing. In one run, `VMLET_BENCH_ROUNDS` times (default 3):
//!
//! 1. **Bare** (the limit): a copy of the test guest, defined on mig-a through
//!    the libvirt provider and booted until its agent answers, then `virsh
//!    migrate --live --p2p --persistent --undefinesource --unsafe` to mig-b,
//!    timed; then `virsh setvcpus --live` 1 → 2 plus `--guest` (online in the
//!    guest), timed. vmlet is not running meanwhile.
//! 2. **vmlet**: the guest as a VirtualMachine on mig-a; `kubectl drain` of
//!    mig-a, timed until the VM reports Running on mig-b (`status.nodeName`);
//!    then `kubectl patch` 1 → 2 vCPUs, timed until `kubectl exec -- nproc`
//!    prints 2.
//!
//! Every external command runs under a deadline (tests/support/deadline.rs).

#[path = "../tests/common/mod.rs"]
mod common;

use common::deadline::{output_within, KUBECTL, VIRSH};
use common::{guest_accelerator, guest_for, guest_vm_spec, Host, TestEnv};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use vmlet_provider::{KernelBoot, Provider, VmId, VmSpec};

/// How long a guest may take to boot until its agent answers.
const BOOT: Duration = Duration::from_secs(180);

fn mig_uri(host: &str) -> String {
    std::env::var(format!("VMLET_LIBVIRT_MIG_{host}_URI"))
        .ok()
        .filter(|u| !u.is_empty())
        .expect("VMLET_LIBVIRT_MIG_A_URI/B_URI unset: run through hack/test.sh's environment (hack/hosts.sh up)")
}

fn virsh(uri: &str, args: &[&str]) -> std::process::Output {
    output_within(Command::new("virsh").arg("-c").arg(uri).args(args), VIRSH)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Poll `check` every 100 ms until it is true, at most `limit`.
async fn until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The test guest in `guest`, as a provider spec with its own disk copy.
fn bare_spec(guest: &Path, round: usize) -> VmSpec {
    let disk = guest.join(format!("bare-{round}.qcow2"));
    std::fs::copy(guest.join("disk.qcow2"), &disk).expect("copy the guest's disk");
    let path = |f: &str| guest.join(f).display().to_string();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    VmSpec {
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
        id: VmId(format!("00000000-0000-4000-8000-{:012x}", nanos & 0xffff_ffff_ffff)),
        namespace: "vmlet-bench".into(),
        name: format!("bare-migrate-{round}-{}", std::process::id()),
        cpus: 1,
        memory_bytes: 256 << 20,
        max_cpus: Some(2),
        max_memory_bytes: None,
        image: Some(disk.display().to_string()),
        image_backing_chain: None,
        kernel_boot: Some(KernelBoot {
            kernel: path("vmlinuz"),
            initrd: Some(path("initrd.img")),
            cmdline: Some(std::fs::read_to_string(guest.join("cmdline")).unwrap().trim().to_owned()),
        }),
    }
}

/// One bare round: (live migration, vCPU hot-plug until online).
async fn bare_round(guest: &Path, accelerator: &str, round: usize) -> (Duration, Duration) {
    use vmlet_libvirt::{AcceleratorSetting, LibvirtProvider};
    let setting = if accelerator == "kvm" { AcceleratorSetting::Kvm } else { AcceleratorSetting::Tcg };
    let (a, b) = (mig_uri("A"), mig_uri("B"));
    let on_a = LibvirtProvider::connect_with(&a, setting).await.expect("connect to mig-a");
    let on_b = LibvirtProvider::connect_with(&b, setting).await.expect("connect to mig-b");
    let spec = bare_spec(guest, round);
    let name = spec.backend_name();
    on_a.ensure_defined(&spec).await.expect("define the bare guest");
    on_a.start(&spec.id).await.expect("start the bare guest");
    let ping = r#"{"execute":"guest-ping"}"#;
    until("the bare guest's agent", BOOT, || virsh(&a, &["qemu-agent-command", &name, ping]).status.success()).await;

    let start = Instant::now();
    let migrate = virsh(&a, &["migrate", "--live", "--p2p", "--persistent", "--undefinesource", "--unsafe", &name, &b]);
    let migrated = start.elapsed();
    assert!(migrate.status.success(), "virsh migrate: {}", String::from_utf8_lossy(&migrate.stderr));

    let start = Instant::now();
    let live = virsh(&b, &["setvcpus", &name, "2", "--live"]);
    assert!(live.status.success(), "virsh setvcpus --live: {}", String::from_utf8_lossy(&live.stderr));
    let online = virsh(&b, &["setvcpus", &name, "2", "--guest"]);
    assert!(online.status.success(), "virsh setvcpus --guest: {}", String::from_utf8_lossy(&online.stderr));
    let resized = start.elapsed();

    on_b.destroy(&spec.id).await.expect("destroy the bare guest");
    on_b.undefine(&spec.id).await.expect("undefine the bare guest");
    let _ = std::fs::remove_file(spec.image.as_deref().unwrap());
    (migrated, resized)
}

/// One vmlet round on `env` (vmlet running): (drain → Running on mig-b,
/// patch → nproc 2).
async fn vmlet_round(env: &TestEnv, guest: &Path, round: usize) -> (Duration, Duration) {
    let (a, b) = (env.node("a"), env.node("b"));
    let name = format!("web-{round}");
    env.kubectl(&["uncordon", &a]);
    env.kubectl(&["cordon", &b]);
    let mut spec = guest_vm_spec(guest);
    spec["resources"] = json!({"cpu": 1, "memory": "256Mi", "maxCpu": 2});
    env.apply_vm(&name, spec);
    env.wait_vm_phase(&name, "Running").await;
    env.kubectl(&["uncordon", &b]);
    let pod = env.pod_of(&name).await;
    let exec_ok = |pod: &str, args: &[&str]| {
        let mut all = vec!["exec", pod, "--"];
        all.extend_from_slice(args);
        env.kubectl_output(&all)
    };
    until("the guest's agent through kubectl exec", BOOT, || exec_ok(&pod, &["true"]).status.success()).await;

    let vms = env.vms();
    let start = Instant::now();
    let drain = {
        let cluster = common::cluster();
        let (kubectl, kubeconfig, node) = (cluster.bin.join("kubectl"), cluster.kubeconfig.clone(), a.clone());
        std::thread::spawn(move || {
            output_within(
                Command::new(kubectl).arg("--kubeconfig").arg(kubeconfig).args([
                    "drain",
                    &node,
                    "--ignore-daemonsets",
                    "--timeout=300s",
                ]),
                KUBECTL * 6,
            )
        })
    };
    let moved = loop {
        let vm = vms.get(&name).await.expect("read the VM");
        let status = vm.status.unwrap_or_default();
        let running = status.phase.map(|p| serde_json::to_value(p).unwrap()) == Some(json!("Running"));
        if running && status.node_name.as_deref() == Some(b.as_str()) {
            break start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(300), "the VM did not reach Running on {b}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drained = drain.join().expect("drain thread");
    assert!(drained.status.success(), "drain: {}", String::from_utf8_lossy(&drained.stderr));

    let pod = env.pod_of(&name).await;
    let start = Instant::now();
    env.kubectl(&["patch", "virtualmachine", &name, "--type=merge", "-p", r#"{"spec":{"resources":{"cpu":2}}}"#]);
    until("nproc 2 in the guest", Duration::from_secs(120), || {
        String::from_utf8_lossy(&exec_ok(&pod, &["nproc"]).stdout).trim() == "2"
    })
    .await;
    let resized = start.elapsed();
    env.kubectl(&["delete", "virtualmachine", &name, "--wait=true", "--timeout=120s"]);
    (moved, resized)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::var("VMLET_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let mut env = TestEnv::new("bench-migrate").await;
    let guest = guest_for(&env);
    let accelerator = guest_accelerator(&guest);
    println!("migrate: idle test guest (1 vCPU, 256Mi, {accelerator}), mig-a → mig-b, {rounds} rounds");

    let mut bare = Vec::new();
    for round in 0..rounds {
        bare.push(bare_round(&guest, accelerator, round).await);
    }

    let host = |h: &'static str, suffix: &'static str| {
        Host { accelerator: Some(accelerator), cpu_allocation_ratio: 8.0, ..Host::new(suffix, mig_uri(h)) }
            .with("allowUnsafeMigration", json!(true))
    };
    env.start_vmlet(&[host("A", "a"), host("B", "b")]);
    env.wait_node_ready(&env.node("a")).await;
    env.wait_node_ready(&env.node("b")).await;
    let mut vmlet = Vec::new();
    for round in 0..rounds {
        vmlet.push(vmlet_round(&env, &guest, round).await);
    }

    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (bare_move, bare_resize) =
        (median(bare.iter().map(|r| r.0).collect()), median(bare.iter().map(|r| r.1).collect()));
    let (move_, resize) = (median(vmlet.iter().map(|r| r.0).collect()), median(vmlet.iter().map(|r| r.1).collect()));
    println!(
        "  bare virsh migrate --live --p2p:         median {} (each: {:?})",
        secs(bare_move),
        bare.iter().map(|r| secs(r.0)).collect::<Vec<_>>()
    );
    println!(
        "  vmlet kubectl drain → Running on mig-b:  median {} (each: {:?})",
        secs(move_),
        vmlet.iter().map(|r| secs(r.0)).collect::<Vec<_>>()
    );
    println!(
        "  drain / bare:                            {:.2}×",
        move_.as_secs_f64() / bare_move.as_secs_f64().max(1e-3)
    );
    println!("  bare virsh setvcpus --live + --guest:    median {}", secs(bare_resize));
    println!("  vmlet kubectl patch → nproc 2:           median {}", secs(resize));
    println!(
        "  patch / bare:                            {:.2}×",
        resize.as_secs_f64() / bare_resize.as_secs_f64().max(1e-3)
    );
}
