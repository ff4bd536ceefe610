//! Benchmark: N VMs from one image, time to Running with root disks that are
//! qcow2 overlays on it, with root disks that are full copies of it, and with
//! a bare `qemu-img create -b` + `virsh start` loop, in one run (the root-disk
//! issue's acceptance item: "20 VMs from one 1 GiB image").
//!
//!   hack/cluster.sh up && hack/libvirtd.sh up     # as root
//!   VMLET_LIBVIRT_QEMU_URI=$(hack/libvirtd.sh uri) cargo bench --bench root_disks
//!   VMLET_BENCH_VMS=3 VMLET_BENCH_IMAGE_MIB=64 cargo bench --bench root_disks   # a quick run
//!
//! Setup: a namespace of its own (`rootdisks-<random>`, trusted), this build's
//! vmlet serving the real libvirtd (`VMLET_LIBVIRT_QEMU_URI`) as host `q`
//! (accelerator `auto`; its CPUs overcommitted so that N one-CPU VMs fit, as
//! the guests halt), a libvirt `dir` pool of the namespace's name and two
//! StorageClasses of vmlet's provisioner on it, and the image: a raw file of
//! `VMLET_BENCH_IMAGE_MIB` MiB (default 1024) under the test's storage root,
//! pseudo-random data (incompressible, no zero cluster: a copy copies all of
//! it) but for its first sector, a boot sector that halts the CPU (`cli; hlt;
//! jmp $-3`, `55 AA`), so idle guests cost no CPU. It is the catalogue image
//! `rootdisks-<random>` (a `VirtualMachineImage` with `libvirt.path`). Then
//! three phases, each with N VMs (`VMLET_BENCH_VMS`, default 20) of 1 CPU and
//! 64 MiB that boot the image's sector:
//!
//! 1. **Bare libvirt** (the limit): one VM after the other, `qemu-img create
//!    -f qcow2 -b <image> -F raw`, `virsh define` of a minimal domain (the
//!    overlay as its virtio disk, type `kvm` where /dev/kvm exists, else
//!    `qemu`) and `virsh start`, each VM timed from the create until `virsh
//!    start` returned; vmlet is idle meanwhile. Then all are destroyed,
//!    undefined and removed.
//! 2. **vmlet, overlays**: N VirtualMachines with `spec.image` and
//!    `spec.rootDisk` of the image's size in class `<pool>-overlay` (`format:
//!    qcow2`), all create calls at once; each timed from its create call until
//!    a poll of the VM list (every 100 ms) first sees it Running. Then all are
//!    deleted, until no VM and no volume in the pool is left (timed too).
//! 3. **vmlet, full copies**: the same with class `<pool>-copy` (`format: raw`,
//!    `fromImage: copy`: each root disk a `qemu-img convert` of the image).
//!
//! Printed as each phase ends: how many VMs ran, create→Running per VM (p50,
//! max), the phase's total (first create to last Running) and VMs per second;
//! for 2 and 3 the space the pool's files take once all run (allocated
//! blocks, as `du` counts them) and the teardown time. Last, a table of all
//! three with the vmlet phases' ratios to the bare one (total and p50).
//! Compare the totals: the bare loop's VMs wait for none before them,
//! vmlet's are all in flight together, so their p50 holds the queue. The
//! page cache is not dropped: the image, just written, is likely read from
//! memory. Asserts no timing. Exits 1, after cleaning up, when a phase did not
//! have all N Running within `VMLET_BENCH_TIMEOUT` seconds (default 900; also
//! the limit of each teardown). Everything it made goes at the end, also on a
//! panic: the bare domains and files, the VMs (while vmlet runs, which deletes
//! their volumes), the classes, the pool, the image, the namespace and the
//! storage root. vmlet's log: `target/it/<namespace>/vmlet.log`.
//!
//! Every external command runs under a deadline (tests/support/deadline.rs).

#[path = "../tests/common/mod.rs"]
mod common;

use common::deadline::{self, output_within, VIRSH};
use common::pool::Pool;
use common::{storage_root, CatalogueImage, Host, TestEnv};
use futures::future::join_all;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmlet::v1alpha1::{VirtualMachine, VmPhase};

/// How often the VM list, the pool and the PersistentVolumes are polled.
const POLL: Duration = Duration::from_millis(100);
/// Bound on one quick command that is not virsh (`qemu-img create`).
const COMMAND: Duration = Duration::from_secs(60);
/// How long cleanup waits for the volumes of the VMs it deletes.
const CLEANUP_WAIT: Duration = Duration::from_secs(180);
/// Memory of every VM, bare and vmlet's, in MiB.
const VM_MEMORY_MIB: u64 = 64;

/// The image's first sector: `cli; hlt; jmp $-3` (back to the `hlt`), zeros,
/// and the boot signature `55 AA`: the BIOS boots it and the CPU halts for good.
const BOOT_SECTOR: [u8; 512] = {
    let mut sector = [0u8; 512];
    (sector[0], sector[1], sector[2], sector[3]) = (0xfa, 0xf4, 0xeb, 0xfd);
    (sector[510], sector[511]) = (0x55, 0xaa);
    sector
};

/// What to run, from the environment.
struct Settings {
    /// N: the VMs of each phase (`VMLET_BENCH_VMS`).
    vms: usize,
    /// The image's size in MiB, and every root disk's (`VMLET_BENCH_IMAGE_MIB`).
    image_mib: u64,
    /// How long each phase may take until all N run, and each teardown
    /// (`VMLET_BENCH_TIMEOUT`, seconds).
    timeout: Duration,
}

impl Settings {
    /// Read the settings; panics naming a variable whose value is unusable.
    fn from_env() -> Settings {
        let settings = Settings {
            vms: common::env_or("VMLET_BENCH_VMS", 20),
            image_mib: common::env_or("VMLET_BENCH_IMAGE_MIB", 1024),
            timeout: Duration::from_secs(common::env_or("VMLET_BENCH_TIMEOUT", 900)),
        };
        assert!(settings.vms > 0, "VMLET_BENCH_VMS must be at least 1");
        assert!(settings.image_mib > 0, "VMLET_BENCH_IMAGE_MIB must be at least 1");
        settings
    }
}

/// One phase's figures.
struct Phase {
    /// What ran, for the table.
    label: &'static str,
    /// How many VMs were to run.
    wanted: usize,
    /// Create→Running of each VM that ran, shortest first.
    latencies: Vec<Duration>,
    /// From the first create to the last VM Running (of those that ran).
    total: Duration,
    /// Bytes the pool's files take once all ran (vmlet's phases).
    pool_bytes: Option<u64>,
}

impl Phase {
    /// A phase of `label` with `latencies` in any order.
    fn new(label: &'static str, wanted: usize, mut latencies: Vec<Duration>, total: Duration) -> Phase {
        latencies.sort();
        Phase { label, wanted, latencies, total, pool_bytes: None }
    }

    /// Whether all wanted VMs ran.
    fn complete(&self) -> bool {
        self.latencies.len() == self.wanted
    }

    /// The median create→Running (nearest rank); zero when none ran.
    fn p50(&self) -> Duration {
        let rank = self.latencies.len().div_ceil(2);
        self.latencies.get(rank.saturating_sub(1)).copied().unwrap_or_default()
    }

    /// The longest create→Running; zero when none ran.
    fn max(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }

    /// VMs Running per second over [`Phase::total`].
    fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.total.as_secs_f64().max(1e-3)
    }

    /// Print the phase's line: how many ran, p50 and max per VM, total, VMs/s.
    fn print(&self) {
        let ran = self.latencies.len();
        let not_all =
            if self.complete() { String::new() } else { format!(" (NOT ALL: {} did not)", self.wanted - ran) };
        println!(
            "  {ran} of {} VMs Running{not_all}: per VM p50 {}, max {}; total {} (first create → last Running); {:.2} VMs/s",
            self.wanted,
            secs(self.p50()),
            secs(self.max()),
            secs(self.total),
            self.per_second()
        );
        if let Some(bytes) = self.pool_bytes {
            println!("  pool's files once all ran: {} ({} per VM)", mib(bytes), mib(bytes / self.wanted as u64));
        }
    }
}

/// `d` in seconds, e.g. `1.23 s`.
fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// `bytes` in MiB, e.g. `12.5 MiB`.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// The bare phase's domains and files, so that they can be removed at its
/// end or, after a panic, by [`Bench`]'s drop.
struct BareVms {
    /// The libvirtd they are defined on.
    uri: String,
    /// The phase's directory: overlays and domain XML.
    dir: PathBuf,
    /// The domains defined so far.
    domains: Vec<String>,
}

impl BareVms {
    /// Destroy and undefine every domain, remove the directory. Never
    /// panics (it runs in a drop too): a failure is reported on stderr.
    fn remove(&mut self) {
        for domain in self.domains.drain(..) {
            for args in [["destroy", &domain], ["undefine", &domain]] {
                let mut virsh = Command::new("virsh");
                virsh.arg("-c").arg(&self.uri).args(args);
                match deadline::run(&mut virsh, VIRSH) {
                    Ok(out) if out.status.success() => {}
                    Ok(out) => eprintln!("virsh {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()),
                    Err(timed_out) => eprintln!("{timed_out}"),
                }
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!("remove {}: {e}", self.dir.display());
            }
        }
    }
}

/// The storage root and what vmlet may leave of it: removed last.
struct Files {
    /// The namespace, whose claims' PersistentVolumes may be left.
    ns: String,
    /// The test's storage root: the image, the pool, the bare phase's files.
    root: PathBuf,
}

impl Drop for Files {
    /// Release the PersistentVolumes of the namespace's claims that are left
    /// (vmlet, which would have removed them, is gone by now) and remove the
    /// storage root with all in it.
    fn drop(&mut self) {
        for volume in persistent_volumes_of(&self.ns) {
            let release = r#"{"metadata":{"finalizers":null}}"#;
            cleanup_kubectl(&["patch", "pv", &volume, "--type=merge", "-p", release]);
            cleanup_kubectl(&["delete", "pv", &volume, "--ignore-not-found", "--wait=false"]);
        }
        if let Err(e) = std::fs::remove_dir_all(&self.root) {
            eprintln!("remove {}: {e}", self.root.display());
        }
    }
}

/// Everything the bench made. Dropping it removes all of it, also after a
/// panic: first ([`Drop::drop`]) the bare domains and the VMs, waiting (up to
/// [`CLEANUP_WAIT`]) while vmlet deletes their volumes; then its fields in
/// order: the catalogue image, the pool and its classes, the namespace and
/// vmlet, and last the storage root ([`Files`]).
struct Bench {
    /// The bare phase's domains and files.
    bare: BareVms,
    /// The catalogue image (made at setup, after the fields below).
    image: Option<CatalogueImage>,
    /// The pool and its classes (made at setup, after the fields below).
    pool: Option<Pool>,
    /// The namespace and vmlet.
    env: TestEnv,
    /// The storage root.
    files: Files,
}

impl Bench {
    /// The pool, made at setup.
    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("the pool is made at setup")
    }

    /// The catalogue image's name, made at setup.
    fn image(&self) -> &str {
        &self.image.as_ref().expect("the image is made at setup").0
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.bare.remove();
        let mut delete = self.env.kubectl_command();
        let args = ["delete", "virtualmachines", "--all", "--wait=true", "--timeout=120s"];
        if let Err(timed_out) = deadline::run(delete.args(args), common::kubectl_deadline(&args)) {
            eprintln!("cleanup: {timed_out}");
        }
        let start = Instant::now();
        while !persistent_volumes_of(&self.env.ns).is_empty() && start.elapsed() < CLEANUP_WAIT {
            std::thread::sleep(POLL);
        }
    }
}

/// kubectl `args` against the cluster for cleanup: a failure or a timeout is
/// reported on stderr, never a panic.
fn cleanup_kubectl(args: &[&str]) -> Option<std::process::Output> {
    let cluster = common::cluster();
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(args);
    match deadline::run(&mut kubectl, common::kubectl_deadline(args)) {
        Ok(out) if out.status.success() => Some(out),
        Ok(out) => {
            eprintln!("cleanup: kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
            None
        }
        Err(timed_out) => {
            eprintln!("cleanup: {timed_out}");
            None
        }
    }
}

/// The PersistentVolumes bound to claims of namespace `ns`; none when
/// kubectl fails.
fn persistent_volumes_of(ns: &str) -> Vec<String> {
    let items =
        format!(r#"jsonpath={{range .items[?(@.spec.claimRef.namespace=="{ns}")]}}{{.metadata.name}}{{"\n"}}{{end}}"#);
    let out = cleanup_kubectl(&["get", "pv", "-o", &items]);
    out.map(|out| String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()).unwrap_or_default()
}

/// Write the image at `path`: `mib` MiB of pseudo-random data (xorshift64*)
/// but for its first sector, [`BOOT_SECTOR`]; readable by QEMU's user.
fn write_image(path: &Path, mib: u64) {
    let file = std::fs::File::create(path).expect("create the image");
    let mut file = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    let mut chunk = vec![0u8; 1 << 20];
    for index in 0..mib {
        for word in chunk.chunks_exact_mut(8) {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            word.copy_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        }
        if index == 0 {
            chunk[..BOOT_SECTOR.len()].copy_from_slice(&BOOT_SECTOR);
        }
        file.write_all(&chunk).expect("write the image");
    }
    let file = file.into_inner().expect("flush the image");
    file.sync_all().expect("sync the image");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).expect("make the image readable");
}

/// The bytes the files directly in `dir` take on disk (allocated blocks, as
/// `du` counts them).
fn allocated_bytes(dir: &Path) -> u64 {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    entries.filter_map(|entry| entry.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.blocks() * 512).sum()
}

/// `what` must have succeeded: `Ok`, or `Err` with its exit status and stderr.
fn succeeded(what: &str, out: std::process::Output) -> Result<(), String> {
    if out.status.success() {
        return Ok(());
    }
    Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
}

/// A minimal domain `name` of `domain_type` (`kvm` or `qemu`): 1 vCPU,
/// [`VM_MEMORY_MIB`], booting the qcow2 `disk` as its virtio disk. The names
/// and paths are the bench's own and hold no XML special character.
fn bare_domain_xml(name: &str, domain_type: &str, disk: &Path) -> String {
    format!(
        r#"<domain type='{domain_type}'>
  <name>{name}</name>
  <memory unit='MiB'>{VM_MEMORY_MIB}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <boot dev='hd'/>
  </os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
  </devices>
</domain>
"#,
        disk = disk.display()
    )
}

/// Bare VM `i`: an overlay on `image` in the phase's directory, defined (and
/// noted in `bare` for removal) and started.
fn start_bare_vm(bare: &mut BareVms, ns: &str, i: usize, domain_type: &str, image: &Path) -> Result<(), String> {
    let name = format!("{ns}-bare-{i:02}");
    let disk = bare.dir.join(format!("bare-{i:02}.qcow2"));
    let mut create = Command::new("qemu-img");
    create.args(["create", "-q", "-f", "qcow2", "-b"]).arg(image).args(["-F", "raw"]).arg(&disk);
    succeeded("qemu-img create", output_within(&mut create, COMMAND))?;
    let xml = bare.dir.join(format!("bare-{i:02}.xml"));
    std::fs::write(&xml, bare_domain_xml(&name, domain_type, &disk)).expect("write the domain XML");
    let virsh = |args: &[&str], file: Option<&Path>| {
        let mut virsh = Command::new("virsh");
        virsh.arg("-c").arg(&bare.uri).args(args).args(file);
        output_within(&mut virsh, VIRSH)
    };
    succeeded("virsh define", virsh(&["define"], Some(&xml)))?;
    bare.domains.push(name.clone());
    succeeded("virsh start", virsh(&["start", &name], None))
}

/// Phase 1: for each of N VMs in turn, an overlay on `image`, defined and
/// started, timed until `virsh start` returned; stops at the first failure
/// or at the timeout. Then all are removed.
fn run_bare(bench: &mut Bench, settings: &Settings, image: &Path) -> Phase {
    let domain_type = if Path::new("/dev/kvm").exists() { "kvm" } else { "qemu" };
    println!(
        "phase 1/3: bare libvirt, {} VMs from the {} MiB image one after the other: qemu-img create -b, \
         virsh define (type {domain_type}), virsh start",
        settings.vms, settings.image_mib
    );
    std::fs::create_dir_all(&bench.bare.dir).expect("create the bare phase's directory");
    let mut latencies = Vec::with_capacity(settings.vms);
    let first = Instant::now();
    for i in 0..settings.vms {
        if first.elapsed() >= settings.timeout {
            println!("  timed out after {:?}", settings.timeout);
            break;
        }
        let start = Instant::now();
        match start_bare_vm(&mut bench.bare, &bench.env.ns, i, domain_type, image) {
            Ok(()) => latencies.push(start.elapsed()),
            Err(e) => {
                println!("  VM {i}: {e}");
                break;
            }
        }
    }
    let phase = Phase::new("bare qemu-img -b + virsh", settings.vms, latencies, first.elapsed());
    phase.print();
    let start = Instant::now();
    bench.bare.remove();
    println!("  destroyed, undefined and removed in {}", secs(start.elapsed()));
    phase
}

/// Poll the VMs of `vms` every [`POLL`] until each of `names` was seen
/// Running, or until `deadline`: when each was first seen so.
async fn first_seen_running(
    vms: &Api<VirtualMachine>,
    names: &[String],
    deadline: Instant,
) -> HashMap<String, Instant> {
    let mut running_at = HashMap::new();
    while running_at.len() < names.len() && Instant::now() < deadline {
        match vms.list(&ListParams::default()).await {
            Ok(list) => {
                let now = Instant::now();
                for vm in list.items {
                    let running = vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running);
                    if running && names.contains(&vm.name_any()) {
                        running_at.entry(vm.name_any()).or_insert(now);
                    }
                }
            }
            Err(e) => eprintln!("  listing VMs (retrying): {e}"),
        }
        tokio::time::sleep(POLL).await;
    }
    running_at
}

/// Delete every VM of the namespace and wait until none is left and the
/// pool holds no volume: the time that took, or what was left at the timeout.
async fn delete_all(bench: &Bench, timeout: Duration) -> Result<Duration, String> {
    let vms = bench.env.vms();
    let start = Instant::now();
    vms.delete_collection(&DeleteParams::default(), &ListParams::default()).await.expect("delete the VMs");
    loop {
        let left = vms.list_metadata(&ListParams::default()).await.map(|l| l.items.len()).unwrap_or(usize::MAX);
        let volumes = bench.pool().volumes();
        if left == 0 && volumes.is_empty() {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= timeout {
            return Err(format!("after {timeout:?}, VMs left: {left}, volumes left: {volumes:?}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Phases 2 and 3: N VMs with a root disk of `class`, created at once (VM
/// names `<tag>-00`, …), each timed from its create call until it was seen
/// Running; the pool's files measured once all ran; then all deleted until
/// the pool is empty (`Err` saying what was left when it did not get there).
async fn run_vmlet(
    bench: &Bench,
    settings: &Settings,
    label: &'static str,
    tag: &str,
    class: &str,
) -> (Phase, Result<Duration, String>) {
    let spec = json!({
        "resources": {"cpu": 1, "memory": format!("{VM_MEMORY_MIB}Mi")},
        "image": bench.image(),
        "rootDisk": {"size": format!("{}Mi", settings.image_mib), "storageClassName": class},
        "powerOffMode": "Hard", "shutdownTimeoutSeconds": 0,
    });
    let names: Vec<String> = (0..settings.vms).map(|i| format!("{tag}-{i:02}")).collect();
    let objects = names.iter().map(|name| {
        serde_json::from_value::<VirtualMachine>(bench.env.vm_object(name, &spec)).expect("a VirtualMachine")
    });
    let vms = bench.env.vms();
    let first = Instant::now();
    let creates = join_all(objects.map(|vm| {
        let vms = vms.clone();
        async move {
            let at = Instant::now();
            vms.create(&PostParams::default(), &vm)
                .await
                .unwrap_or_else(|e| panic!("create VM {}: {e}", vm.name_any()));
            (vm.name_any(), at)
        }
    }));
    let (created, running_at) = tokio::join!(creates, first_seen_running(&vms, &names, first + settings.timeout));
    let created: HashMap<String, Instant> = created.into_iter().collect();
    let latencies = running_at.iter().map(|(name, at)| at.saturating_duration_since(created[name])).collect();
    let total = running_at.values().max().map_or(Duration::ZERO, |last| last.saturating_duration_since(first));
    let mut phase = Phase::new(label, settings.vms, latencies, total);
    phase.pool_bytes = Some(allocated_bytes(&Pool::dir(&bench.env)));
    phase.print();
    if !phase.complete() {
        println!("{}", bench.env.diagnostics());
    }
    let deleted = delete_all(bench, settings.timeout).await;
    match &deleted {
        Ok(took) => println!("  all deleted, the pool empty, in {}", secs(*took)),
        Err(left) => println!("  NOT ALL DELETED: {left}"),
    }
    (phase, deleted)
}

/// `phase` against the bare phase: ratios of total and p50, e.g. `1.52×`.
fn ratios(phase: &Phase, bare: &Phase) -> (String, String) {
    if !phase.complete() || !bare.complete() {
        return ("–".into(), "–".into());
    }
    let ratio = |a: Duration, b: Duration| format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64().max(1e-6));
    (ratio(phase.total, bare.total), ratio(phase.p50(), bare.p50()))
}

/// Print the table of all phases, the vmlet ones against the first (bare).
fn print_table(settings: &Settings, phases: &[Phase]) {
    println!(
        "root_disks: {} VMs (1 CPU, {VM_MEMORY_MIB} MiB) from one {} MiB image, in one run:",
        settings.vms, settings.image_mib
    );
    println!(
        "  {:<28}{:>5}{:>10}{:>10}{:>10}{:>8}{:>12}{:>10}{:>13}",
        "", "ran", "p50/VM", "max/VM", "total", "VMs/s", "total÷bare", "p50÷bare", "pool's files"
    );
    for (index, phase) in phases.iter().enumerate() {
        let (total_ratio, p50_ratio) = if index == 0 { Default::default() } else { ratios(phase, &phases[0]) };
        println!(
            "  {:<28}{:>5}{:>10}{:>10}{:>10}{:>8.2}{:>12}{:>10}{:>13}",
            phase.label,
            format!("{}/{}", phase.latencies.len(), phase.wanted),
            secs(phase.p50()),
            secs(phase.max()),
            secs(phase.total),
            phase.per_second(),
            total_ratio,
            p50_ratio,
            phase.pool_bytes.map(mib).unwrap_or_default()
        );
    }
}

/// Setup, the three phases and the table; whether every phase had all its
/// VMs Running and every teardown finished. Everything made is removed when
/// this returns or panics.
async fn run(settings: &Settings) -> bool {
    let env = TestEnv::new("rootdisks").await;
    let root = storage_root(&env);
    let bare = BareVms { uri: common::qemu_uri(), dir: root.join("bare"), domains: vec![] };
    let files = Files { ns: env.ns.clone(), root };
    let mut bench = Bench { bare, image: None, pool: None, env, files };

    let root = &bench.files.root;
    std::fs::create_dir_all(root).expect("create the storage root");
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("make the storage root readable");
    let image = root.join("image.raw");
    let start = Instant::now();
    write_image(&image, settings.image_mib);
    println!(
        "setup: namespace {}, image {} ({} MiB, pseudo-random but for a halting boot sector) written in {}",
        bench.env.ns,
        image.display(),
        settings.image_mib,
        secs(start.elapsed())
    );
    let pool = Pool::new(&bench.env);
    let (overlay, copy) = (format!("{}-overlay", pool.name), format!("{}-copy", pool.name));
    pool.class_named(&bench.env, &overlay, json!({"format": "qcow2"}), false);
    pool.class_named(&bench.env, &copy, json!({"format": "raw", "fromImage": "copy"}), false);
    bench.pool = Some(pool);
    let catalogue = json!({"libvirt": {"path": image}});
    bench.image = Some(CatalogueImage::create(&bench.env, &bench.env.ns, catalogue));

    // Enough CPUs for N one-CPU VMs: the guests halt.
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let ratio = (2.0 * settings.vms as f64 / cpus as f64).max(8.0);
    bench.env.start_vmlet(&[Host { cpu_allocation_ratio: ratio, ..Host::qemu("q") }]);
    wait_schedulable(&bench.env).await;
    println!(
        "  vmlet serves {} as node {} ({cpus} CPUs × {ratio}), log {}",
        bench.bare.uri,
        bench.env.node("q"),
        bench.env.dir.join("vmlet.log").display()
    );

    let mut phases = vec![run_bare(&mut bench, settings, &image)];
    let mut torn_down = true;
    for (number, label, tag, class) in
        [(2, "vmlet, qcow2 overlays", "overlay", &overlay), (3, "vmlet, full raw copies", "copy", &copy)]
    {
        if !torn_down {
            println!("phase {number}/3 skipped: the pool still holds the last phase's volumes");
            break;
        }
        let (n, image_mib) = (settings.vms, settings.image_mib);
        println!("phase {number}/3: {label}, {n} VMs from the {image_mib} MiB image (class {class}), created at once");
        let (phase, deleted) = run_vmlet(&bench, settings, label, tag, class).await;
        torn_down = deleted.is_ok();
        phases.push(phase);
    }
    print_table(settings, &phases);
    torn_down && phases.len() == 3 && phases.iter().all(Phase::complete)
}

/// Wait until the node of host `q` is Ready and carries no
/// `node.kubernetes.io/*` taint, and the namespace has its default
/// ServiceAccount: before, VM pods would wait for the scheduler's or the
/// API server's retries, which phase 2 would count.
async fn wait_schedulable(env: &TestEnv) {
    let node = env.node("q");
    env.wait_node_ready(&node).await;
    let nodes = env.nodes_api();
    env.wait_for(&format!("node {node} without node.kubernetes.io taints"), || {
        let nodes = nodes.clone();
        let node = node.clone();
        async move {
            let taints = nodes.get(&node).await.ok()?.spec?.taints.unwrap_or_default();
            taints.iter().all(|t| !t.key.starts_with("node.kubernetes.io/")).then_some(())
        }
    })
    .await;
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for("the namespace's default ServiceAccount", || {
        let accounts = accounts.clone();
        async move { accounts.get_opt("default").await.ok()?.map(|_| ()) }
    })
    .await;
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; any other argument is ignored.
    let settings = Settings::from_env();
    if !run(&settings).await {
        eprintln!("root_disks: not every phase had all {} VMs Running (and gone again) in time", settings.vms);
        std::process::exit(1);
    }
}
