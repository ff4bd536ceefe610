//! Live and cold migration through the libvirt provider between two real
//! libvirt hosts, mig-a and mig-b (`hack/hosts.sh`: two libvirtd in their own
//! network and mount namespaces on this machine, reached over TCP).
//!
//! Needs root and `VMLET_LIBVIRT_MIG_A_URI` / `VMLET_LIBVIRT_MIG_B_URI`
//! (`hack/test.sh` starts the hosts and sets them); without root the tests say
//! loudly that they skip. The live tests boot `test-vms/guest/build.sh`'s guest
//! from a kernel and initramfs under `/var/lib/vmlet/test-guests/`, which both
//! hosts' QEMU read at the same path; it has no disk, so nothing but memory
//! moves. Each test names its VMs in a namespace of its own (`vmlet-mig-<test>`)
//! and first removes what an earlier run of it left there.

mod common;
use common::deadline::{output_within, run, VIRSH};
use common::guest::{exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, uptime, RunDir, BOOT_DEADLINE};

use std::io::ErrorKind as IoErrorKind;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use vmlet_libvirt::{AcceleratorSetting, LibvirtProvider};
use vmlet_provider::{
    ErrorKind, Migration, MigrationMode, MigrationProgress, MigrationTarget, PowerState, Provider, VmSpec,
};

/// A live migration of the idle 256 MiB guest took 2–4 s here; generous for
/// a loaded 2-core CI host.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);
/// The root namespace's address on hack/hosts.sh's bridge: nothing of libvirt
/// listens there.
const BRIDGE_ADDRESS: &str = "10.237.0.1";
/// An address in hack/hosts.sh's network that no host has.
const NO_HOST_URI: &str = "qemu+tcp://10.237.0.99/system";
/// The most a migration with timeout T may take to fail: T, plus the abort
/// and the wait for libvirt to end the aborted migration (see migration.rs),
/// plus slack for a loaded host.
const ABORT_ALLOWANCE: Duration = Duration::from_secs(30 + 30 + 10);

/// A provider for each host, named as vmlet would name them.
struct Hosts {
    a: LibvirtProvider,
    b: LibvirtProvider,
}

impl Hosts {
    /// Both hosts, without the VMs an earlier run of the test left in
    /// `namespace`.
    async fn connect(uris: (String, String), accelerator: AcceleratorSetting, namespace: &str) -> Hosts {
        let connect = |uri: String, name: &'static str| async move {
            LibvirtProvider::connect_with(&uri, accelerator).await.expect("connect").with_host_name(name)
        };
        let hosts = Hosts { a: connect(uris.0, "mig-a").await, b: connect(uris.1, "mig-b").await };
        for provider in [&hosts.a, &hosts.b] {
            remove_leftovers(provider, namespace).await;
        }
        hosts
    }
}

/// The test guest booted on `provider`'s host from a kernel and initramfs in
/// a run directory of its own (which must outlive the VM), its agent
/// answering.
async fn boot_guest(provider: &LibvirtProvider, guest: &Path, namespace: &str, what: &str) -> (VmSpec, RunDir) {
    let mut spec = common::unique_spec(namespace, what);
    let run_dir = RunDir::new(guest, &spec.name, &["vmlinuz", "initrd.img"]);
    spec.kernel_boot = Some(run_dir.kernel_boot(guest));
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");
    exec_when_ready(provider, &spec.id, &["true"], BOOT_DEADLINE).await;
    (spec, run_dir)
}

fn migration(provider: &LibvirtProvider) -> &dyn Migration {
    provider.migration().expect("QEMU hosts migrate")
}

/// Names of the running domains on `uri`, by `virsh list --state-running`.
fn running_on(uri: &str) -> Vec<String> {
    let out = output_within(Command::new("virsh").args(["-c", uri, "list", "--state-running", "--name"]), VIRSH);
    assert!(out.status.success(), "virsh list on {uri}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
}

/// One sample of where the domain runs.
#[derive(Clone, Copy, Debug)]
struct Sample {
    /// When the sample began (its target listing), since the sampler started.
    at: Duration,
    on_target: bool,
    on_source: bool,
}

/// Samples the running domains of both hosts every ~50 ms until stopped, as
/// `virsh list --state-running` does (`virConnectListAllDomains`), on
/// connections of its own (a virsh process per sample spent most of the
/// interval starting and connecting). Target first: a domain seen running on
/// the target and *then* on the source ran on both at once (the source stops
/// the guest before the target resumes it, and resumes it again only if the
/// target never did). Sampling the source first could see it just before the
/// switch-over and the target just after.
struct Sampler {
    started: Instant,
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl Sampler {
    fn start(name: &str, source: &str, target: &str) -> Sampler {
        let open = |uri: &str| virt::connect::Connect::open(Some(uri)).unwrap_or_else(|e| panic!("open {uri}: {e}"));
        let (source, target) = (open(source), open(target));
        let is_running = move |conn: &virt::connect::Connect, name: &str| {
            let running = conn.list_all_domains(virt::sys::VIR_CONNECT_LIST_DOMAINS_RUNNING).expect("list domains");
            running.iter().any(|domain| domain.name().is_ok_and(|n| n == name))
        };
        let started = Instant::now();
        let (samples, stop) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (name, into, flag) = (name.to_owned(), Arc::clone(&samples), Arc::clone(&stop));
        let thread = thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let at = started.elapsed();
                let on_target = is_running(&target, &name);
                let on_source = is_running(&source, &name);
                into.lock().unwrap().push(Sample { at, on_target, on_source });
                thread::sleep(Duration::from_millis(50));
            }
        });
        Sampler { started, samples, stop, thread }
    }

    /// Wait (up to a minute) until a sample begun after `instant` was taken
    /// (both its listings then saw the hosts as they were after `instant`).
    async fn wait_for_sample_after(&self, instant: Instant) {
        let since = instant - self.started;
        let taken = || self.samples.lock().unwrap().last().is_some_and(|last| last.at > since);
        let sampled = async {
            while !taken() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // A deadline against a stuck sampler, not a speed goal.
        tokio::time::timeout(Duration::from_secs(60), sampled).await.expect("the sampler took no sample for a minute");
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler thread");
        Arc::try_unwrap(self.samples).expect("sampler done").into_inner().unwrap()
    }
}

/// The completed migration's downtime in ms as the target's libvirtd recorded
/// it (`virsh domjobinfo --completed`), if it says.
fn downtime_ms(uri: &str, name: &str) -> Option<u64> {
    let out = output_within(Command::new("virsh").args(["-c", uri, "domjobinfo", "--completed", name]), VIRSH);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("Total downtime:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// `virsh migrate-setspeed` on the running domain `name` (MiB/s).
fn set_migration_speed(uri: &str, name: &str, mib_per_second: u64) {
    let speed = mib_per_second.to_string();
    let out = output_within(Command::new("virsh").args(["-c", uri, "migrate-setspeed", name, &speed]), VIRSH);
    assert!(out.status.success(), "virsh migrate-setspeed: {}", String::from_utf8_lossy(&out.stderr));
}

/// Live-migrate `spec`'s running guest from `from` to `to` while sampling both
/// hosts; checks that it never ran on both, that it runs on the target with the
/// same backend id and is gone from the source, and that the guest did not
/// restart. Returns the wall time.
async fn move_live(spec: &VmSpec, from: &LibvirtProvider, to: &LibvirtProvider) -> Duration {
    let id = &spec.id;
    let before = from.get(id).await.expect("get on the source").expect("on the source");
    assert_eq!(before.power, PowerState::Running);
    let uptime_before = uptime(from, id).await;

    let sampler = Sampler::start(&before.backend_name, from.uri(), to.uri());
    // A sample of the start state before anything moves.
    sampler.wait_for_sample_after(Instant::now()).await;
    let started = Instant::now();
    migration(from)
        .migrate(id, &migration(to).target(), MigrationMode::Live, MIGRATION_TIMEOUT)
        .await
        .expect("migrate");
    let wall = started.elapsed();
    // A sample of the end state: libvirt returns once the target runs the guest.
    sampler.wait_for_sample_after(Instant::now()).await;
    let samples = sampler.finish();

    let both: Vec<_> = samples.iter().filter(|s| s.on_target && s.on_source).collect();
    assert!(both.is_empty(), "the domain ran on both hosts: {both:?}");
    assert!(samples.len() >= 3, "too few samples to tell: {samples:?}");
    assert!(samples.first().is_some_and(|s| s.on_source), "first sample: {:?}", samples.first());
    assert!(samples.last().is_some_and(|s| s.on_target && !s.on_source), "last sample: {:?}", samples.last());
    let gap = samples.windows(2).map(|w| w[1].at - w[0].at).max().unwrap_or_default();
    // S: on the source, T: on the target, -: running on neither.
    let timeline: String = samples
        .iter()
        .map(|s| match (s.on_source, s.on_target) {
            (true, _) => 'S',
            (false, true) => 'T',
            (false, false) => '-',
        })
        .collect();

    let after = to.get(id).await.expect("get on the target").expect("the target provider finds the VM");
    assert_eq!(after.backend_id, before.backend_id, "same domain UUID on the target");
    assert_eq!(after.backend_name, before.backend_name);
    assert_eq!(after.power, PowerState::Running);
    assert_eq!(from.get(id).await.expect("get on the source"), None, "gone from the source");
    assert!(from.list().await.expect("list on the source").iter().all(|vm| vm.id != *id));

    let uptime_after = uptime(to, id).await;
    assert!(
        uptime_after > uptime_before,
        "the guest kept running: uptime {uptime_before} s before, {uptime_after} s after"
    );
    println!(
        "live migration {} -> {}: {wall:?} wall, downtime {:?} ms (libvirt), {} samples {timeline} (largest gap \
         {gap:?}), uptime {uptime_before:.1} s -> {uptime_after:.1} s",
        migration(from).target().host,
        migration(to).target().host,
        downtime_ms(to.uri(), &after.backend_name),
        samples.len(),
    );
    wall
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_guest_moves_live_to_the_other_host_and_back() {
    let Some(uris) = common::two_hosts("a_running_guest_moves_live_to_the_other_host_and_back") else { return };
    let guest = guest_dir();
    const NS: &str = "vmlet-mig-live";
    let hosts = Hosts::connect(uris, guest_accelerator(&guest), NS).await;
    let (spec, _run_dir) = boot_guest(&hosts.a, &guest, NS, "live").await;
    let id = spec.id.clone();

    move_live(&spec, &hosts.a, &hosts.b).await;
    let on_b = exec_when_ready(&hosts.b, &id, &["uname", "-r"], BOOT_DEADLINE).await;
    assert!(!on_b.stdout.trim().is_empty(), "the guest agent answers on the target: {on_b:?}");
    move_live(&spec, &hosts.b, &hosts.a).await;

    hosts.a.destroy(&id).await.expect("destroy");
    hosts.a.undefine(&id).await.expect("undefine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_outlasts_its_timeout_is_aborted_and_the_guest_keeps_running() {
    let Some(uris) = common::two_hosts("a_migration_that_outlasts_its_timeout_is_aborted") else { return };
    let guest = guest_dir();
    const NS: &str = "vmlet-mig-abort";
    let hosts = Hosts::connect(uris, guest_accelerator(&guest), NS).await;
    let (spec, _run_dir) = boot_guest(&hosts.a, &guest, NS, "slow").await;
    let id = spec.id.clone();
    let uptime_before = uptime(&hosts.a, &id).await;

    // 1 MiB/s: copying the booted guest's memory takes far longer than 8 s.
    set_migration_speed(hosts.a.uri(), &spec.backend_name(), 1);
    let timeout = Duration::from_secs(8);
    let (source, watch_id, stop) = (hosts.a.clone(), id.clone(), Arc::new(AtomicBool::new(false)));
    let watching = Arc::clone(&stop);
    let watcher = tokio::spawn(async move {
        let mut seen: Option<MigrationProgress> = None;
        while !watching.load(Ordering::Relaxed) {
            match migration(&source).progress(&watch_id).await.expect("progress") {
                Some(progress) if progress.processed_bytes > 0 => seen = Some(progress),
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        seen
    });
    let started = Instant::now();
    // The call must honour its own deadline (plus the abort): a hang fails here.
    let err = tokio::time::timeout(
        timeout + ABORT_ALLOWANCE,
        migration(&hosts.a).migrate(&id, &migration(&hosts.b).target(), MigrationMode::Live, timeout),
    )
    .await
    .expect("migrate() returned within its timeout plus the abort allowance")
    .expect_err("a migration at 1 MiB/s cannot finish in 8 s");
    println!("aborted after {:?}: {err}", started.elapsed());
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains("did not finish within 8s"), "{err}");

    let here = hosts.a.get(&id).await.expect("get").expect("still on mig-a");
    assert_eq!(here.power, PowerState::Running);
    assert_eq!(hosts.b.get(&id).await.expect("get on mig-b"), None);
    assert!(!running_on(hosts.b.uri()).contains(&spec.backend_name()));
    assert!(uptime(&hosts.a, &id).await > uptime_before, "the guest kept running");
    assert_eq!(migration(&hosts.a).progress(&id).await.expect("progress"), None, "no migration runs now");

    stop.store(true, Ordering::Relaxed);
    let seen = watcher.await.expect("progress watcher");
    let progress = seen.expect("progress was reported while the migration ran");
    assert!(progress.total_bytes >= progress.processed_bytes, "{progress:?}");
    println!("progress seen: {progress:?}");

    hosts.a.destroy(&id).await.expect("destroy");
    hosts.a.undefine(&id).await.expect("undefine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_off_vm_moves_cold_with_its_identity() {
    let Some(uris) = common::two_hosts("a_shut_off_vm_moves_cold_with_its_identity") else { return };
    const NS: &str = "vmlet-mig-cold";
    let hosts = Hosts::connect(uris, AcceleratorSetting::Tcg, NS).await;
    // No guest OS: QEMU idles in the firmware, enough for a definition's move.
    let spec = common::unique_spec(NS, "cold");
    let id = &spec.id;
    let defined = hosts.a.ensure_defined(&spec).await.expect("define on mig-a");
    let to_b = migration(&hosts.b).target();
    assert_eq!((to_b.host.as_str(), to_b.address.as_str()), ("mig-b", hosts.b.uri()));

    let err = migration(&hosts.a).migrate(id, &to_b, MigrationMode::Live, MIGRATION_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "a live migration of a shut-off VM: {err}");

    let started = Instant::now();
    migration(&hosts.a).migrate(id, &to_b, MigrationMode::Cold, MIGRATION_TIMEOUT).await.expect("cold migration");
    println!("cold migration mig-a -> mig-b: {:?}", started.elapsed());
    let moved = hosts.b.get(id).await.expect("get on mig-b").expect("on mig-b");
    assert_eq!((moved.backend_id.as_str(), moved.power), (defined.backend_id.as_str(), PowerState::Off));
    assert_eq!(hosts.a.get(id).await.expect("get on mig-a"), None);
    let err = migration(&hosts.a).migrate(id, &to_b, MigrationMode::Cold, MIGRATION_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "moved already: {err}");

    hosts.b.start(id).await.expect("start on mig-b");
    let to_a = migration(&hosts.a).target();
    let err = migration(&hosts.b).migrate(id, &to_a, MigrationMode::Cold, MIGRATION_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "a cold migration of a running VM: {err}");
    hosts.b.destroy(id).await.expect("destroy on mig-b");
    migration(&hosts.b).migrate(id, &to_a, MigrationMode::Cold, MIGRATION_TIMEOUT).await.expect("cold migration back");
    let back = hosts.a.get(id).await.expect("get on mig-a").expect("back on mig-a");
    assert_eq!(back.backend_id, defined.backend_id);
    assert_eq!(hosts.b.get(id).await.expect("get on mig-b"), None);

    hosts.a.undefine(id).await.expect("undefine");
}

/// A TCP listener that accepts connections and never answers: a hung daemon.
struct SilentListener {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl SilentListener {
    fn start(address: &str) -> SilentListener {
        let listener = TcpListener::bind((address, 0)).expect("bind a silent listener");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("local addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut held = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => held.push(stream),
                    Err(err) if err.kind() == IoErrorKind::WouldBlock => thread::sleep(Duration::from_millis(50)),
                    Err(err) => panic!("accept: {err}"),
                }
            }
        });
        SilentListener { port, stop, thread: Some(thread) }
    }
}

impl Drop for SilentListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_to_a_target_that_cannot_be_reached_fails_transient_and_the_vm_stays() {
    let Some(uris) = common::two_hosts("a_migration_to_a_target_that_cannot_be_reached") else { return };
    const NS: &str = "vmlet-mig-unreachable";
    let hosts = Hosts::connect(uris, AcceleratorSetting::Tcg, NS).await;
    let spec = common::unique_spec(NS, "stay");
    let id = &spec.id;
    hosts.a.ensure_defined(&spec).await.expect("define on mig-a");
    hosts.a.start(id).await.expect("start on mig-a");

    let silent = SilentListener::start(BRIDGE_ADDRESS);
    let timeout = Duration::from_secs(10);
    let targets = [
        ("no such host", NO_HOST_URI.to_owned()),
        ("nothing listening", format!("qemu+tcp://{BRIDGE_ADDRESS}:1/system")),
        ("a daemon that never answers", format!("qemu+tcp://{BRIDGE_ADDRESS}:{}/system", silent.port)),
    ];
    for (what, uri) in targets {
        let target = MigrationTarget { host: what.into(), address: uri };
        let started = Instant::now();
        // The call must honour its own deadline: a hang fails here.
        let err = tokio::time::timeout(
            timeout + Duration::from_secs(5),
            migration(&hosts.a).migrate(id, &target, MigrationMode::Live, timeout),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: migrate() did not return within its timeout"))
        .unwrap_err();
        println!("{what}: {:?} after {:?}: {}", err.kind, started.elapsed(), err.message);
        assert_eq!(err.kind, ErrorKind::Transient, "{what}: {err}");
        let here = hosts.a.get(id).await.expect("get").expect("still on mig-a");
        assert_eq!(here.power, PowerState::Running, "{what}");
    }

    // A host without a migration URI, and the source itself.
    let no_uri = MigrationTarget { host: "local".into(), address: String::new() };
    let err = migration(&hosts.a).migrate(id, &no_uri, MigrationMode::Live, timeout).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    let err = migration(&hosts.a).migrate(id, &migration(&hosts.a).target(), MigrationMode::Live, timeout).await;
    let err = err.expect_err("a migration to the same host");
    println!("to itself: {:?}: {}", err.kind, err.message);
    assert_ne!(err.kind, ErrorKind::Transient, "retrying a migration to the source itself cannot help: {err}");
    assert_eq!(hosts.a.get(id).await.expect("get").expect("still on mig-a").power, PowerState::Running);

    drop(silent);
    hosts.a.destroy(id).await.expect("destroy");
    hosts.a.undefine(id).await.expect("undefine");
    // Nothing arrived on mig-b.
    assert!(run(Command::new("virsh").args(["-c", hosts.b.uri(), "dominfo", &spec.backend_name()]), VIRSH)
        .map(|out| !out.status.success())
        .unwrap_or_else(|e| panic!("{e}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_with_a_local_disk_moves_live_only_where_unsafe_migration_is_allowed() {
    let Some(uris) = common::two_hosts("a_vm_with_a_local_disk_moves_live_only_where_unsafe") else { return };
    const NS: &str = "vmlet-mig-disk";
    let guest = guest_dir();
    let hosts = Hosts::connect(uris, AcceleratorSetting::Tcg, NS).await;
    // A qcow2 disk on the local file system both hosts see at the same path,
    // and no OS: the firmware finds nothing to boot and idles.
    let mut spec = common::unique_spec(NS, "disk");
    let run_dir = RunDir::new(&guest, &spec.name, &["disk.qcow2"]);
    spec.image = Some(run_dir.path("disk.qcow2"));
    let id = &spec.id;
    let defined = hosts.a.ensure_defined(&spec).await.expect("define on mig-a");
    hosts.a.start(id).await.expect("start on mig-a");
    let to_b = migration(&hosts.b).target();

    let err = migration(&hosts.a).migrate(id, &to_b, MigrationMode::Live, MIGRATION_TIMEOUT).await.unwrap_err();
    println!("without VIR_MIGRATE_UNSAFE: {err}");
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
    assert!(err.message.contains("disks"), "{err}");
    assert_eq!(hosts.a.get(id).await.expect("get").expect("still on mig-a").power, PowerState::Running);

    let unsafe_a = hosts.a.clone().with_unsafe_migration(true);
    migration(&unsafe_a).migrate(id, &to_b, MigrationMode::Live, MIGRATION_TIMEOUT).await.expect("unsafe migration");
    let moved = hosts.b.get(id).await.expect("get on mig-b").expect("on mig-b");
    assert_eq!((moved.backend_id.as_str(), moved.power), (defined.backend_id.as_str(), PowerState::Running));
    assert_eq!(hosts.a.get(id).await.expect("get on mig-a"), None);

    hosts.b.destroy(id).await.expect("destroy");
    hosts.b.undefine(id).await.expect("undefine");
}
