//! Benchmark: backing up a running real guest's disk with vmlet, next to a
//! plain copy of the same disk file on the same host, in the same run (issue
//! 10: "backup throughput against a plain copy of the same disk").
//!
//!   hack/libvirtd.sh up     # as root; hack/test.sh's environment
//!   VMLET_LIBVIRT_QEMU_URI=$(hack/libvirtd.sh uri) cargo bench --bench backup
//!
//! Provider level, no Kubernetes: the libvirt provider on
//! `VMLET_LIBVIRT_QEMU_URI` boots the test guest (`test-vms/guest/build.sh`)
//! with a qcow2 disk of `VMLET_BENCH_DISK_MIB` MiB (default 1024) filled host
//! side with pseudo-random data (incompressible, no zero clusters to skip),
//! in a run directory under `/var/lib/vmlet/test-guests`, and waits until its
//! agent answers. Then, `VMLET_BENCH_ROUNDS` times (default 3), each copy of
//! that disk to a new file in the same directory, starting with an empty page
//! cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, so every copy reads the
//! disk; without root it says it could not):
//!
//! 1. **vmlet**: `Backup::backup` of the running VM, quiesced (libvirt's
//!    push-mode backup job, which vmlet polls once a second), timed as its
//!    caller sees it; libvirt's own record of the job's time is shown too.
//!    The test guest runs from its initrd with the disk unmounted, so the
//!    freeze finds no file system: quiescing costs the agent round trips.
//! 2. **The limit**: `cp --sparse=never` of the disk file while the VM runs
//!    (QEMU's lock does not stop a reader), and `qemu-img convert -U -O qcow2`
//!    of it (the copy vmlet makes of a stopped VM's disk).
//!
//! Each copy is timed until its file is on disk: the copy, then an fsync of
//! the file (`sync FILE`), shown apart. Throughput is the disk's virtual size
//! (all of it data) over that time, in MiB/s (2^20 bytes per second). Each
//! file is removed after it was measured. Prints each round, then medians
//! and vmlet's ratio to each plain copy; asserts no timing. The domain and
//! the run directory go at the end, also on a panic. `RUST_LOG=vmlet_libvirt=info`
//! adds the provider's log lines (when the job began and ended).
//!
//! Every external command runs under a deadline (tests/support/deadline.rs).

#[path = "../tests/common/mod.rs"]
mod common;

use common::deadline::{output_within, run, run_echoing, GUEST_BUILD, VIRSH};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tracing_subscriber::EnvFilter;
use vmlet_libvirt::{AcceleratorSetting, LibvirtProvider};
use vmlet_provider::{BackupRequest, KernelBoot, Provider, VmId, VmSpec};

/// Where the run directories go: readable by QEMU's user (libvirt-qemu).
const RUN_DIRS: &str = "/var/lib/vmlet/test-guests";
/// The namespace of the bench's VM (its domain is `<namespace>_<name>`).
const NAMESPACE: &str = "vmlet-bench-backup";
/// How long the guest may take to boot until its agent answers.
const BOOT: Duration = Duration::from_secs(240);
/// Bound on a quick command (qemu-img info, sync, virsh).
const COMMAND: Duration = Duration::from_secs(120);

/// `what` must have succeeded; its stdout.
fn succeeded(what: &str, out: std::process::Output) -> String {
    assert!(out.status.success(), "{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn virsh(uri: &str, args: &[&str]) -> std::process::Output {
    output_within(Command::new("virsh").arg("-c").arg(uri).args(args), VIRSH)
}

/// The domain and its run directory, destroyed, undefined and removed on
/// drop: at the end, and on a panic.
struct Cleanup {
    uri: String,
    domain: String,
    dir: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        // `run`, not `output_within`: a panic here, during a panic, aborts.
        for args in [["destroy", &self.domain], ["undefine", &self.domain]] {
            let _ = run(Command::new("virsh").arg("-c").arg(&self.uri).args(args), VIRSH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Destroy and undefine what an interrupted earlier run left (domains of
/// [`NAMESPACE`]), and their run directories.
async fn remove_leftovers(provider: &LibvirtProvider) {
    for vm in provider.list().await.expect("list the host's VMs") {
        if let Some(name) = vm.backend_name.strip_prefix(&format!("{NAMESPACE}_")) {
            println!("removing leftover {} from an earlier run", vm.backend_name);
            let _ = provider.destroy(&vm.id).await;
            provider.undefine(&vm.id).await.expect("undefine a leftover");
            let _ = std::fs::remove_dir_all(Path::new(RUN_DIRS).join(name));
        }
    }
}

/// The built test guest's directory, and the accelerator that boots it here.
fn built_guest() -> (PathBuf, AcceleratorSetting) {
    let script = common::repo().join("test-vms/guest/build.sh");
    let out = run_echoing(&mut Command::new(&script), GUEST_BUILD).unwrap_or_else(|timed_out| panic!("{timed_out}"));
    let stdout = succeeded("test-vms/guest/build.sh", out);
    let built = PathBuf::from(stdout.lines().last().expect("build.sh printed the guest directory").trim());
    common::probe_accelerator(&built);
    let accelerator = match common::guest_accelerator(&built) {
        "kvm" => AcceleratorSetting::Kvm,
        _ => AcceleratorSetting::Tcg,
    };
    (built, accelerator)
}

/// Write a qcow2 of `bytes` at `disk`, every byte pseudo-random (xorshift64*,
/// through a raw file next to it that is removed again).
fn random_disk(disk: &Path, bytes: u64) {
    let raw = disk.with_extension("raw");
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&raw).expect("create the raw"));
    let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(std::process::id());
    let mut chunk = vec![0u8; 1 << 20];
    for _ in 0..bytes / chunk.len() as u64 {
        for word in chunk.chunks_exact_mut(8) {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            word.copy_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        }
        file.write_all(&chunk).expect("write the raw");
    }
    file.into_inner().expect("flush the raw").sync_all().expect("sync the raw");
    let (raw_path, disk_path) = (raw.display().to_string(), disk.display().to_string());
    let mut convert = Command::new("qemu-img");
    convert.args(["convert", "-f", "raw", "-O", "qcow2", &raw_path, &disk_path]);
    succeeded("qemu-img convert of the raw to qcow2", output_within(&mut convert, copy_deadline(bytes)));
    std::fs::remove_file(&raw).expect("remove the raw");
}

/// Bound on copying `bytes`: generous (2 MiB/s), so only a hang reaches it.
fn copy_deadline(bytes: u64) -> Duration {
    Duration::from_secs(120 + (bytes >> 21))
}

/// `qemu-img info` of `path`: its virtual size.
fn virtual_size(path: &Path) -> u64 {
    let out = output_within(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(path), COMMAND);
    let info: serde_json::Value = serde_json::from_str(&succeeded("qemu-img info", out)).expect("qemu-img info JSON");
    info["virtual-size"].as_u64().expect("virtual-size")
}

/// Write back all dirty data, then drop the page cache so that the next
/// copy reads from the disk; false when the cache could not be dropped.
fn drop_page_cache() -> bool {
    succeeded("sync", output_within(&mut Command::new("sync"), COMMAND));
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// One copy's times: the copy, then the fsync of its file.
#[derive(Clone, Copy)]
struct Timed {
    copy: Duration,
    fsync: Duration,
}

impl Timed {
    /// Throughput in MiB/s for `bytes` over the copy and its fsync.
    fn mib_per_s(self, bytes: u64) -> f64 {
        bytes as f64 / f64::from(1 << 20) / (self.copy + self.fsync).as_secs_f64().max(1e-6)
    }

    fn show(self, bytes: u64) -> String {
        format!(
            "{:7.1} MiB/s  ({:.2} s copy + {:.2} s fsync)",
            self.mib_per_s(bytes),
            self.copy.as_secs_f64(),
            self.fsync.as_secs_f64()
        )
    }
}

/// fsync `file` (timed), then remove it; its size before.
fn fsync_and_remove(file: &Path, copy: Duration) -> (Timed, u64) {
    let start = Instant::now();
    succeeded("sync FILE", output_within(Command::new("sync").arg(file), COMMAND));
    let timed = Timed { copy, fsync: start.elapsed() };
    let size = std::fs::metadata(file).expect("the copy").len();
    std::fs::remove_file(file).expect("remove the copy");
    (timed, size)
}

/// Time the external copy `command` (which writes `target`), its fsync
/// included; `target` is removed after.
fn plain_copy(what: &str, command: &mut Command, target: &Path, bytes: u64) -> Timed {
    let start = Instant::now();
    succeeded(what, output_within(command, copy_deadline(bytes)));
    fsync_and_remove(target, start.elapsed()).0
}

/// libvirt's record of the last completed job of `domain` (`virsh domjobinfo
/// --completed`): its elapsed time, when it has one.
fn completed_job_time(uri: &str, domain: &str) -> Option<Duration> {
    let out = virsh(uri, &["domjobinfo", "--completed", domain]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|line| line.trim().strip_prefix("Time elapsed:"))?;
    let millis = line.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_millis(millis))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // The provider's own log lines (when the job began and ended) with RUST_LOG.
    tracing_subscriber::fmt().with_env_filter(EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let rounds: usize = common::env_or("VMLET_BENCH_ROUNDS", 3).max(1);
    let disk_mib: u64 = common::env_or("VMLET_BENCH_DISK_MIB", 1024).max(1);
    let uri = common::qemu_uri();
    let (built, accelerator) = built_guest();
    let provider = LibvirtProvider::connect_with(&uri, accelerator).await.expect("connect to libvirtd");
    let backup = provider.backup().expect("the libvirt provider backs up");
    remove_leftovers(&provider).await;

    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos();
    let name = format!("bench-backup-{}", std::process::id());
    let dir = Path::new(RUN_DIRS).join(&name);
    std::fs::create_dir_all(&dir).expect("create the run directory");
    let cleanup = Cleanup { uri: uri.clone(), domain: vmlet_provider::backend_name(NAMESPACE, &name), dir };
    let dir = &cleanup.dir;
    for file in ["vmlinuz", "initrd.img"] {
        std::fs::copy(built.join(file), dir.join(file)).unwrap_or_else(|e| panic!("copy {file}: {e}"));
    }
    let mut chmod = Command::new("chmod");
    chmod.args(["-R", "a+rX"]).arg(dir);
    succeeded("chmod -R a+rX the run directory", output_within(&mut chmod, COMMAND));

    let disk = dir.join("disk.qcow2");
    let start = Instant::now();
    random_disk(&disk, disk_mib << 20);
    let bytes = virtual_size(&disk);
    println!(
        "backup: {disk_mib} MiB qcow2 of pseudo-random data ({} bytes on file), written in {:.1} s",
        std::fs::metadata(&disk).expect("the disk").len(),
        start.elapsed().as_secs_f64()
    );

    let path = |f: &str| dir.join(f).display().to_string();
    let cmdline = std::fs::read_to_string(built.join("cmdline")).expect("cmdline").trim().to_owned();
    let spec = VmSpec {
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
        id: VmId(format!("00000000-0000-4000-8000-{:012x}", nanos & 0xffff_ffff_ffff)),
        namespace: NAMESPACE.into(),
        name,
        cpus: 1,
        memory_bytes: 256 << 20,
        max_cpus: None,
        max_memory_bytes: None,
        image: Some(path("disk.qcow2")),
        image_backing_chain: None,
        kernel_boot: Some(KernelBoot {
            kernel: path("vmlinuz"),
            initrd: Some(path("initrd.img")),
            cmdline: Some(cmdline),
        }),
    };
    provider.ensure_defined(&spec).await.expect("define the guest");
    provider.start(&spec.id).await.expect("start the guest");
    let start = Instant::now();
    let ping = r#"{"execute":"guest-ping"}"#;
    while !virsh(&uri, &["qemu-agent-command", &cleanup.domain, ping]).status.success() {
        assert!(start.elapsed() < BOOT, "the guest's agent did not answer within {BOOT:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!(
        "  guest ({}) booted, agent answers after {:.1} s; disk virtual size {bytes} bytes ({} MiB)",
        provider.accelerator().map_or("?", |a| a.as_str()),
        start.elapsed().as_secs_f64(),
        bytes >> 20
    );

    let cache = if drop_page_cache() {
        "each copy starts with an empty page cache"
    } else {
        "the page cache could NOT be dropped (not root?): copies may read from memory"
    };
    println!("  {rounds} rounds; {cache}; MiB/s = virtual size / (copy + fsync of the file)");

    let mib_per_s = |t: Duration| bytes as f64 / f64::from(1 << 20) / t.as_secs_f64().max(1e-6);
    let (mut vmlet, mut jobs, mut cp, mut convert) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let target = dir.join(format!("backup-{round}.qcow2"));
        drop_page_cache();
        let request = BackupRequest {
            data_disks: Vec::new(),
            target: target.display().to_string(),
            quiesce: true,
            timeout: copy_deadline(bytes),
            checkpoint: None,
            incremental: None,
        };
        let start = Instant::now();
        let outcome = backup.backup(&spec.id, &request, &|_| {}).await.expect("vmlet backup");
        let (timed, file_bytes) = fsync_and_remove(&target, start.elapsed());
        assert_eq!(outcome.bytes, bytes, "the backup copied the whole disk: {outcome:?}");
        println!("  round {round}: {:<20} {}", "vmlet backup", timed.show(bytes));
        let job = completed_job_time(&uri, &cleanup.domain);
        let job = job.map_or_else(
            || "libvirt kept no job time".to_owned(),
            |job| {
                jobs.push(mib_per_s(job));
                format!("libvirt's job {:.2} s ({:.1} MiB/s)", job.as_secs_f64(), mib_per_s(job))
            },
        );
        println!("           backup file {file_bytes} bytes, {job}, {:?}", outcome.consistency);
        vmlet.push(timed);

        let copy = dir.join(format!("cp-{round}.qcow2"));
        drop_page_cache();
        let timed = plain_copy(
            "cp --sparse=never",
            Command::new("cp").arg("--sparse=never").arg(&disk).arg(&copy),
            &copy,
            bytes,
        );
        println!("{:11}{:<20} {}", "", "cp --sparse=never", timed.show(bytes));
        cp.push(timed);

        drop_page_cache();
        let timed = plain_copy(
            "qemu-img convert -U",
            Command::new("qemu-img").args(["convert", "-U", "-f", "qcow2", "-O", "qcow2"]).arg(&disk).arg(&copy),
            &copy,
            bytes,
        );
        println!("{:11}{:<20} {}", "", "qemu-img convert -U", timed.show(bytes));
        convert.push(timed);
    }

    let rate = |all: &[Timed]| median(all.iter().map(|t| t.mib_per_s(bytes)).collect());
    let (vmlet, cp, convert) = (rate(&vmlet), rate(&cp), rate(&convert));
    println!("  median of {rounds} rounds ({} MiB disk, MiB/s to disk):", bytes >> 20);
    let line = |what: &str, rate: f64, ratio: &str| println!("    {what:<38}{rate:7.1} MiB/s{ratio}");
    line("vmlet backup (running VM, quiesced)", vmlet, "");
    if !jobs.is_empty() {
        line("  libvirt's backup job alone", median(jobs), "");
    }
    line("cp --sparse=never", cp, &format!("   vmlet / cp:       {:.2}×", vmlet / cp));
    line("qemu-img convert -U -O qcow2", convert, &format!("   vmlet / qemu-img: {:.2}×", vmlet / convert));
    drop(cleanup);
}
