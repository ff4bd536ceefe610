//! Benchmark: how fast N VirtualMachines go from create to `status.phase:
//! Running` under vmlet, next to what the control plane alone takes for N pods.
//!
//!   cargo bench --bench apply_to_running                  # N = 100 VMs, 3 hosts
//!   VMLET_BENCH_VMS=300 VMLET_BENCH_HOSTS=3 cargo bench --bench apply_to_running
//!   VMLET_BENCH_VMS=2000 VMLET_BENCH_HOSTS=100 cargo bench --bench apply_to_running
//!
//! Uses the real local control plane (`hack/cluster.sh up`, reused when running;
//! `VMLET_CLUSTER_DIR`, `APISERVER_PORT` and `ETCD_PORT` select another one, as
//! for the script). Prints figures; asserts no timing. Two runs, one after the
//! other, with the same N and the same number of create calls in flight:
//!
//! 1. **Baseline** (`apply_to_running/baseline.rs`), in namespace
//!    `bench-<random>-baseline`: N plain pods with the VM pods' requests (1 cpu,
//!    64Mi) placed by kube-scheduler on a Node of the same name that the bench
//!    creates (Ready, its Lease renewed by the bench) and that no agent serves;
//!    the bench writes each pod's status Running and Ready as soon as it sees
//!    the pod bound. Its namespace, Node and Lease are removed before step 2.
//! 2. **vmlet**, in namespace `bench-<random>`: one vmlet process (this build's
//!    binary) serving `VMLET_BENCH_HOSTS` libvirt test-driver hosts, nodes
//!    `bench-<random>-h000`, `-h001`, … labelled `vmlet.io/bench=<namespace>`,
//!    whose inventories are generated under target/bench/<namespace>/ with room
//!    for twice their even share of the VMs (kube-scheduler spreads them). N
//!    one-CPU 64Mi VirtualMachines are created, then deleted as they were
//!    created (one call each, the same number in flight).
//!
//! Printed for each run: the time the create calls took; create→Running
//! latency per object (p50/p95/max, from a watch); throughput (objects Running
//! per second, first create to last Running). For vmlet also: VMs per host
//! (min/max, and each host's count for up to ten hosts), vmlet's RSS once all
//! VMs are Running (VmRSS, and the peak so far, VmHWM, from /proc/<pid>/status,
//! in MiB; and VmRSS split into RssAnon, the heap and stacks, and RssFile, the
//! code read in, which does not grow with N) and per VM (RSS all Running minus RSS before the first VM, / N, in
//! KiB), vmlet's and kube-apiserver's CPU over `VMLET_BENCH_IDLE_SECONDS`
//! (default 60) with every VM Running and idle and vmlet's RSS after it (by
//! then vmlet has returned what the burst freed: `src/heap.rs`), the test driver's own share
//! of the memory (the same N domains defined and started in a bare `virsh -c
//! test:///default`, `apply_to_running/test_driver.rs`: on a real host they
//! live in libvirtd) and vmlet's own per VM beside it, the time from deleting all
//! VMs until no VirtualMachine is left (finalizers released) next to the
//! create→all-Running time, and the peak RSS of the whole run. Last, vmlet
//! against the baseline: p50 ratio (target ≤ 2×) and throughput ratio
//! (target ≥ 0.7×).
//!
//! Environment: `VMLET_BENCH_VMS` (N, default 100), `VMLET_BENCH_HOSTS` (test-driver
//! hosts, 1..=999, default 3), `VMLET_BENCH_CONCURRENCY` (create calls in flight,
//! default 8), `VMLET_BENCH_IDLE_SECONDS` (the idle CPU window, 0 to skip),
//! `VMLET_BENCH_TIMEOUT` (seconds each wait may take, default 900:
//! the baseline's pods Running, the VMs Running, the VMs gone),
//! `VMLET_BENCH_HEAPTRACK` (a file: vmlet runs with heaptrack's preload library
//! writing its raw trace there, to be read with
//! `heaptrack_interpret < FILE | gzip > trace.gz` and `heaptrack_print trace.gz`;
//! the RSS figures are then heaptrack's as well as vmlet's). It also prints the
//! API requests per VM that deleting them cost. Every external
//! command runs under a deadline (tests/support/deadline.rs). Exits 1 after
//! cleaning up when a run did not reach Running for all N within the timeout
//! (printing how many did) or the VMs were not gone in time.

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "apply_to_running/baseline.rs"]
mod baseline;
#[path = "apply_to_running/measure.rs"]
mod measure;
#[path = "support/process.rs"]
mod process;
#[path = "apply_to_running/requests.rs"]
mod requests;
#[path = "apply_to_running/test_driver.rs"]
mod test_driver;

use common::deadline::{self, kill_and_reap, wait_within};
use common::ClusterEnv;
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::Client;
use measure::{ms, Timeline};
use requests::Requests;
use serde_json::json;
use std::collections::BTreeMap;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use vmlet::v1alpha1::{VirtualMachine, VmPhase};

/// Memory of every VM, and request of every baseline pod.
pub const VM_MEMORY: &str = "64Mi";
/// [`VM_MEMORY`] in MiB.
pub const VM_MEMORY_MIB: u64 = 64;
/// Node label tying the bench's VMs to its vmlet's nodes.
const BENCH_LABEL: &str = "vmlet.io/bench";
/// How long vmlet may take to exit after SIGTERM before it is killed.
const VMLET_STOP: Duration = Duration::from_secs(20);
/// How long a killed vmlet may take to be reaped.
const VMLET_REAP: Duration = Duration::from_secs(10);
/// Hosts up to this many get their VM count printed one by one.
const PLACEMENT_LISTED_UP_TO: usize = 10;

/// What to run, from the environment.
pub struct Settings {
    /// N: VMs, and pods of the baseline (`VMLET_BENCH_VMS`).
    pub vms: usize,
    /// Test-driver hosts of the vmlet run (`VMLET_BENCH_HOSTS`).
    pub hosts: usize,
    /// Create calls in flight, in both runs (`VMLET_BENCH_CONCURRENCY`).
    pub concurrency: usize,
    /// Limit of each wait (`VMLET_BENCH_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// How long vmlet's CPU is measured with all VMs Running and idle
    /// (`VMLET_BENCH_IDLE_SECONDS`, default 60; 0 skips it).
    pub idle: Duration,
}

impl Settings {
    /// Read the settings; panics naming a variable whose value is unusable.
    fn from_env() -> Settings {
        let settings = Settings {
            vms: common::env_or("VMLET_BENCH_VMS", 100),
            hosts: common::env_or("VMLET_BENCH_HOSTS", 3),
            concurrency: common::env_or("VMLET_BENCH_CONCURRENCY", 8),
            timeout: Duration::from_secs(common::env_or("VMLET_BENCH_TIMEOUT", 900)),
            idle: Duration::from_secs(common::env_or("VMLET_BENCH_IDLE_SECONDS", 60)),
        };
        assert!(settings.vms > 0, "VMLET_BENCH_VMS must be at least 1");
        assert!((1..=999).contains(&settings.hosts), "VMLET_BENCH_HOSTS must be 1..=999 (node names end in -h000)");
        assert!(settings.concurrency > 0, "VMLET_BENCH_CONCURRENCY must be at least 1");
        settings
    }
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; any other argument (e.g. a filter) is ignored.
    let settings = Settings::from_env();
    let (n, hosts, concurrency) = (settings.vms, settings.hosts, settings.concurrency);
    let cluster = common::cluster();
    let client = common::client().await;
    let ns = format!("bench-{}", unique_suffix());
    let baseline_ns = format!("{ns}-baseline");
    println!(
        "apply_to_running: N = {n}, {concurrency} create calls in flight, timeout {:?} per wait",
        settings.timeout
    );

    println!(
        "baseline: {n} pods (1 cpu, {VM_MEMORY}) on Node {baseline_ns} that no agent serves, namespace {baseline_ns}"
    );
    let (baseline, baseline_requests) = baseline::run(cluster, &client, &baseline_ns, &settings).await;
    baseline.print("pods", concurrency);
    baseline_requests.print_per_object("API requests/object", n);

    println!("vmlet: {n} VMs (1 CPU, {VM_MEMORY} each) on {hosts} test-driver hosts, namespace {ns}");
    let vmlet = run_vmlet(cluster, &client, &ns, &settings).await;

    if let (Some(figures), Some(baseline)) = (vmlet.timeline.figures(), baseline.figures()) {
        println!("vmlet / baseline (same N, same create concurrency):");
        println!(
            "  p50 create→Running:    {:.2}× ({} / {}; target ≤ 2×)",
            figures.p50.as_secs_f64() / baseline.p50.as_secs_f64().max(1e-6),
            ms(figures.p50),
            ms(baseline.p50)
        );
        println!(
            "  throughput:            {:.2}× ({:.1} VMs/s / {:.1} pods/s; target ≥ 0.7×)",
            figures.per_second / baseline.per_second,
            figures.per_second,
            baseline.per_second
        );
        println!(
            "  API requests/object:   {:.2}× ({:.1} / {:.1})",
            vmlet.requests.total() / baseline_requests.total().max(1.0),
            vmlet.requests.total() / n as f64,
            baseline_requests.total() / n as f64
        );
    }
    let mut failures = Vec::new();
    if !baseline.all_running() {
        failures.push(format!("{} of {n} baseline pods reached Running", baseline.reached()));
    }
    if !vmlet.timeline.all_running() {
        failures.push(format!("{} of {n} VMs reached Running", vmlet.timeline.reached()));
    }
    if let Err(left) = vmlet.deleted {
        failures.push(format!("{left} VMs were still present after the delete"));
    }
    if !failures.is_empty() {
        eprintln!("apply_to_running: {}; vmlet log: {}", failures.join("; "), vmlet.log.display());
        std::process::exit(1);
    }
}

/// What the vmlet run measured beyond what it printed.
struct VmletOutcome {
    /// Create→Running of the VMs.
    timeline: Timeline,
    /// API requests served from the first create to the last Running.
    requests: Requests,
    /// Time from the delete call until no VM was left, or how many were left
    /// at the timeout.
    deleted: Result<Duration, usize>,
    /// vmlet's log.
    log: std::path::PathBuf,
}

/// The vmlet run in namespace `ns`: start vmlet on the generated hosts, create
/// the VMs, print the figures, delete the VMs, stop vmlet and remove
/// everything it created.
async fn run_vmlet(cluster: &'static ClusterEnv, client: &Client, ns: &str, settings: &Settings) -> VmletOutcome {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap())
        .await
        .expect("create namespace");
    let nodes: Vec<String> = (0..settings.hosts).map(|i| format!("{ns}-h{i:03}")).collect();
    let mut under_test = VmletUnderTest { cluster, ns: ns.to_owned(), nodes: nodes.clone(), vmlet: None };

    let dir = common::repo().join("target/bench").join(ns);
    std::fs::create_dir_all(&dir).expect("create bench dir");
    let config_path = write_vmlet_config(&dir, ns, &nodes, settings.vms);
    let log = dir.join("vmlet.log");
    let log_file = std::fs::File::create(&log).expect("create vmlet log");
    let mut command = Command::new(env!("CARGO_BIN_EXE_vmlet"));
    command
        .args(["run", "--config"])
        .arg(&config_path)
        .env("KUBECONFIG", &cluster.kubeconfig)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log_file);
    if let Some(raw) = std::env::var_os("VMLET_BENCH_HEAPTRACK") {
        // heaptrack's preload library in vmlet alone (not in cargo, kubectl or
        // this bench), writing its raw trace to the file named.
        let preload = heaptrack_preload().expect("VMLET_BENCH_HEAPTRACK: libheaptrack_preload.so not found");
        println!("  vmlet under heaptrack: raw trace {}", raw.to_string_lossy());
        command.env("LD_PRELOAD", preload).env("DUMP_HEAPTRACK_OUTPUT", raw);
    }
    let child = command.spawn().expect("start vmlet");
    let pid = child.id();
    under_test.vmlet = Some(child);
    println!("  vmlet: {} (pid {pid}), log {}", env!("CARGO_BIN_EXE_vmlet"), log.display());

    // The clock starts once the nodes are schedulable: Ready and without the
    // not-ready taint the API server puts on new nodes.
    let started = Instant::now();
    let startup_limit = Duration::from_secs(180 + settings.hosts as u64);
    let what = format!("vmlet's nodes (log: {})", log.display());
    wait_nodes_schedulable(client, &format!("{BENCH_LABEL}={ns}"), nodes.len(), startup_limit, &what).await;
    println!("  nodes schedulable after {}", ms(started.elapsed()));
    wait_default_service_account(client, ns, Duration::from_secs(60)).await;
    let rss_empty = process::status_mib(pid, "VmRSS");
    if let (Some(rss), Some(anon)) = (rss_empty, process::status_mib(pid, "RssAnon")) {
        println!("  vmlet RSS, no VMs:     {rss:.1} MiB (VmRSS; {anon:.1} MiB RssAnon)");
    }

    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), ns);
    let objects = (0..settings.vms).map(|i| vm_object(&format!("vm-{i:04}"), ns)).collect();
    let before = Requests::read(client).await;
    let timeline =
        measure::create_until_running(&vms, objects, settings.concurrency, settings.timeout, vm_is_running).await;
    let requests = Requests::read(client).await.since(&before);
    timeline.print("VMs", settings.concurrency);
    requests.print_per_object("API requests/object", settings.vms);
    print_placement(&vms, &nodes).await;
    let mut per_vm_kib = None;
    if let (Some(now), Some(peak)) = (process::status_mib(pid, "VmRSS"), process::status_mib(pid, "VmHWM")) {
        println!("  vmlet RSS:             {now:.1} MiB now (VmRSS, all Running), {peak:.1} MiB peak (VmHWM)");
        if let (Some(anon), Some(file)) = (process::status_mib(pid, "RssAnon"), process::status_mib(pid, "RssFile")) {
            // RssFile is the binary's and libraries' pages read in: shared,
            // clean, and the same at any N.
            println!("  vmlet RSS by kind:     {anon:.1} MiB anonymous (RssAnon: heap, stacks), {file:.1} MiB file (RssFile: code)");
        }
        if let Some(empty) = rss_empty {
            let kib = (now - empty) * 1024.0 / timeline.reached().max(1) as f64;
            println!("  vmlet memory per VM:   {kib:.1} KiB ((RSS all Running - RSS no VMs) / {})", timeline.reached());
            per_vm_kib = Some(kib);
        }
    }
    print_idle_cpu(pid, settings.idle).await;
    if !settings.idle.is_zero() {
        // Steady state: vmlet hands what the burst freed back to the system
        // within a period (src/heap.rs), which the idle window spans.
        if let (Some(now), Some(anon)) = (process::status_mib(pid, "VmRSS"), process::status_mib(pid, "RssAnon")) {
            println!("  vmlet RSS after idle:  {now:.1} MiB (VmRSS; {anon:.1} MiB RssAnon)");
        }
    }
    // After the idle window, which it would disturb.
    print_test_driver_share(timeline.reached(), per_vm_kib);

    // Teardown through the product: delete every VM and wait until all are gone.
    let before_delete = Requests::read(client).await;
    let names = (0..settings.vms).map(|i| format!("vm-{i:04}")).collect();
    let deleted = delete_all_until_gone(&vms, names, settings.concurrency, settings.timeout).await;
    Requests::read(client).await.since(&before_delete).print_per_object("delete requests/VM", timeline.reached());
    match (deleted, timeline.span()) {
        (Ok(took), Some(created)) => println!(
            "  delete all → gone:     {} for {} VMs ({:.2}× the {} from first create to last Running)",
            ms(took),
            timeline.reached(),
            took.as_secs_f64() / created.as_secs_f64().max(1e-3),
            ms(created)
        ),
        (Ok(took), None) => println!("  delete all → gone:     {}", ms(took)),
        (Err(left), _) => {
            println!("  delete all → gone:     NOT DONE: {left} VMs still present after {:?}", settings.timeout)
        }
    }
    if let Some(peak) = process::status_mib(pid, "VmHWM") {
        println!("  vmlet peak RSS:        {peak:.1} MiB (VmHWM, whole run)");
    }
    under_test.stop_vmlet();
    drop(under_test);
    VmletOutcome { timeline, requests, deleted, log }
}

/// The test driver's own memory for `vms` running domains, measured in a
/// bare virsh ([`test_driver`]), and what is left of vmlet's `per_vm_kib`
/// beside it: vmlet's own memory per VM.
fn print_test_driver_share(vms: usize, per_vm_kib: Option<f64>) {
    if vms == 0 {
        return;
    }
    match test_driver::rss_for_domains(vms, Duration::from_secs(600)) {
        Some((empty, full)) => {
            let driver_kib = (full - empty) * 1024.0 / vms as f64;
            let own = per_vm_kib.map_or("unknown".to_owned(), |kib| format!("{:.1} KiB", kib - driver_kib));
            println!(
                "  test driver's share:   {driver_kib:.1} KiB per domain (the same {vms} domains in a bare virsh: \
                 {empty:.1} → {full:.1} MiB); vmlet's own per VM: {own}"
            );
        }
        None => println!("  test driver's share:   not measured (virsh missing, failed or took over 600 s)"),
    }
}

/// CPU use of vmlet (`pid`) and of the API server over `window` with every
/// VM Running and nothing changing: what vmlet costs while it only keeps
/// watch, next to what the control plane itself costs meanwhile.
async fn print_idle_cpu(pid: u32, window: Duration) {
    if window.is_zero() {
        return;
    }
    let apiserver = process::pid_of("kube-apiserver");
    let pids: Vec<u32> = [Some(pid), apiserver].into_iter().flatten().collect();
    let percent = process::cpu_percent_over(&pids, window).await;
    let show = |p: Option<f64>| p.map_or("unknown".to_owned(), |p| format!("{p:.2}% of a core"));
    let server = if apiserver.is_some() { show(percent.get(1).copied().flatten()) } else { "not found".to_owned() };
    println!(
        "  idle CPU over {} s:     vmlet {}; kube-apiserver {server} (utime+stime, /proc/<pid>/stat)",
        window.as_secs(),
        show(percent.first().copied().flatten())
    );
}

/// Whether the VM reports `status.phase: Running`.
fn vm_is_running(vm: &VirtualMachine) -> bool {
    vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running)
}

/// VirtualMachine `name`: one CPU, [`VM_MEMORY`], hard power-off, on the
/// bench's nodes of namespace `ns` only.
fn vm_object(name: &str, ns: &str) -> VirtualMachine {
    serde_json::from_value(json!({
        "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "resources": {"cpu": 1, "memory": VM_MEMORY},
                 "powerOffMode": "Hard", "shutdownTimeoutSeconds": 0,
                 "nodeSelector": {BENCH_LABEL: ns}},
    }))
    .expect("VirtualMachine")
}

/// CPUs of each generated host: twice its even share of `vms` (at least 8),
/// so that all fit and kube-scheduler places them by spreading, not by what
/// is left.
fn cpus_per_host(vms: usize, hosts: usize) -> usize {
    (2 * vms.div_ceil(hosts)).max(8)
}

/// Write one test-driver inventory per node in `nodes` and vmlet's config
/// (namespace `ns`, a kubelet API port of its own) into `dir`; returns the
/// config's path.
fn write_vmlet_config(dir: &std::path::Path, ns: &str, nodes: &[String], vms: usize) -> std::path::PathBuf {
    let cpus = cpus_per_host(vms, nodes.len());
    let hosts: Vec<_> = nodes
        .iter()
        .map(|node| {
            let file = dir.join(format!("{node}.xml"));
            std::fs::write(&file, inventory(cpus, cpus.max(16))).expect("write inventory");
            json!({"name": node, "provider": "libvirt", "uri": format!("test://{}", file.display()),
                   "labels": {BENCH_LABEL: ns}, "maxPods": cpus.max(110)})
        })
        .collect();
    // Self-signed kubelet API: the bench uses no logs or exec.
    // Below the ephemeral range: a port picked there may be taken by an
    // outgoing connection before vmlet listens on it (it was, at N=10,000).
    let port = common::free_port_range(1);
    let config = json!({
        "namespace": ns,
        "stateDir": dir.join("state"),
        "kubeletPort": port,
        "kubeletApi": {"listen": format!("127.0.0.1:{port}")},
        "hosts": hosts,
    });
    let path = dir.join("vmlet.yaml");
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).expect("write config");
    path
}

/// A libvirt test-driver inventory (format of test-vms/hosts/host-a.xml) with
/// `cpus` logical CPUs and `gib` GiB of memory.
fn inventory(cpus: usize, gib: usize) -> String {
    format!(
        r#"<?xml version="1.0"?>
<!-- generated by benches/apply_to_running.rs: {cpus} CPUs, {gib} GiB -->
<node>
  <cpu>
    <mhz>2400</mhz>
    <model>x86_64</model>
    <nodes>1</nodes>
    <sockets>1</sockets>
    <cores>{cpus}</cores>
    <threads>1</threads>
    <active>{cpus}</active>
  </cpu>
  <memory>{kib}</memory>
</node>
"#,
        kib = gib * 1024 * 1024
    )
}

/// Print how many VMs each node of `nodes` runs: hosts used, fewest and most,
/// and each host's count when there are few.
async fn print_placement(vms: &Api<VirtualMachine>, nodes: &[String]) {
    let mut per_node: BTreeMap<&str, usize> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    let mut elsewhere = 0;
    let list = match vms.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(e) => return println!("  placement:             unknown (listing VMs: {e})"),
    };
    for node in list.items.iter().filter_map(|vm| vm.status.as_ref()?.node_name.as_deref()) {
        match per_node.get_mut(node) {
            Some(count) => *count += 1,
            None => elsewhere += 1,
        }
    }
    let used = per_node.values().filter(|c| **c > 0).count();
    let (fewest, most) = (per_node.values().min().unwrap_or(&0), per_node.values().max().unwrap_or(&0));
    let mut line = format!("{used} of {} hosts used, {fewest}..{most} VMs per host", nodes.len());
    if elsewhere > 0 {
        line += &format!(", {elsewhere} on other nodes");
    }
    if nodes.len() <= PLACEMENT_LISTED_UP_TO {
        let each: Vec<String> = per_node.iter().map(|(node, count)| format!("{node}: {count}")).collect();
        line += &format!(" ({})", each.join(", "));
    }
    println!("  placement:             {line}");
}

/// Delete the VirtualMachines `names` of `vms` as they were created: one call
/// each, `concurrency` in flight (the API server serves one `deletecollection`
/// with a single worker by default, `--delete-collection-workers`, which would
/// measure that worker instead), printing how long the calls took; then poll
/// (every 200 ms, one item per list) until none is left, for up to `limit`.
/// Returns the time from the first call until then, or how many were left at
/// the limit. A VM already gone counts as deleted.
async fn delete_all_until_gone(
    vms: &Api<VirtualMachine>,
    names: Vec<String>,
    concurrency: usize,
    limit: Duration,
) -> Result<Duration, usize> {
    let started = Instant::now();
    let count = names.len();
    use futures::{StreamExt as _, TryStreamExt as _};
    let deletes = futures::stream::iter(names)
        .map(|name| {
            let vms = vms.clone();
            async move {
                match vms.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    Err(e) => Err(e),
                }
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>();
    match tokio::time::timeout(limit, deletes).await {
        Ok(Ok(_)) => {
            println!("  delete calls:          {} for {count} VMs ({concurrency} in flight)", ms(started.elapsed()))
        }
        Ok(Err(e)) => panic!("a delete call failed: {e}"),
        Err(_) => return Err(count),
    }
    let mut left = usize::MAX;
    while started.elapsed() < limit {
        if let Ok(page) = vms.list_metadata(&ListParams::default().limit(1)).await {
            let remaining = page.metadata.remaining_item_count.unwrap_or(0).max(0) as usize;
            left = page.items.len() + remaining;
            if left == 0 {
                return Ok(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(left)
}

/// heaptrack's preload library, where Debian's `heaptrack` package puts it.
fn heaptrack_preload() -> Option<std::path::PathBuf> {
    ["/usr/lib/x86_64-linux-gnu/heaptrack/libheaptrack_preload.so", "/usr/lib/heaptrack/libheaptrack_preload.so"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|path| path.exists())
}

/// Six random hex digits for the namespace name.
fn unique_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:06x}", h.finish() & 0xff_ffff)
}

/// Run kubectl for cleanup, within its deadline (`common::kubectl_deadline`):
/// a timeout or a failure is reported on stderr and cleanup goes on.
pub fn cleanup_kubectl(cluster: &ClusterEnv, args: &[&str]) -> Option<Output> {
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(args);
    match deadline::run(&mut kubectl, common::kubectl_deadline(args)) {
        Ok(out) if out.status.success() => Some(out),
        Ok(out) => {
            eprintln!("cleanup: kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
            Some(out)
        }
        Err(timed_out) => {
            eprintln!("cleanup: {timed_out}");
            None
        }
    }
}

/// The vmlet run's namespace, nodes and process; dropping it cleans up, even
/// after a panic.
struct VmletUnderTest {
    cluster: &'static ClusterEnv,
    ns: String,
    nodes: Vec<String>,
    vmlet: Option<Child>,
}

impl VmletUnderTest {
    /// SIGTERM vmlet (it reports its nodes NotReady and exits), wait up to
    /// [`VMLET_STOP`], then SIGKILL it.
    fn stop_vmlet(&mut self) {
        let Some(mut child) = self.vmlet.take() else { return };
        let term =
            deadline::run(Command::new("kill").args(["-TERM", &child.id().to_string()]), Duration::from_secs(10));
        if let Err(timed_out) = term {
            eprintln!("stopping vmlet: {timed_out}");
        }
        if wait_within(&mut child, VMLET_STOP).is_none() && kill_and_reap(&mut child, VMLET_REAP).is_none() {
            eprintln!("vmlet (pid {}) still not reaped {VMLET_REAP:?} after SIGKILL", child.id());
        }
    }
}

impl Drop for VmletUnderTest {
    /// Delete the VMs while vmlet still runs (it undefines their domains), stop
    /// vmlet, release what is left, delete the namespace and the nodes.
    fn drop(&mut self) {
        let (cluster, ns) = (self.cluster, self.ns.clone());
        let ns = ns.as_str();
        if self.vmlet.is_some() {
            cleanup_kubectl(
                cluster,
                &["-n", ns, "delete", "virtualmachines", "--all", "--wait=true", "--timeout=120s"],
            );
        }
        self.stop_vmlet();
        let leftover = cleanup_kubectl(cluster, &["-n", ns, "get", "virtualmachines", "-o", "name"]);
        for vm in String::from_utf8_lossy(&leftover.map(|o| o.stdout).unwrap_or_default()).lines() {
            let release = r#"{"metadata":{"finalizers":null}}"#;
            cleanup_kubectl(cluster, &["-n", ns, "patch", vm, "--type=merge", "-p", release]);
        }
        cleanup_kubectl(cluster, &["delete", "namespace", ns, "--wait=false"]);
        if !self.nodes.is_empty() {
            // One deletecollection request: `kubectl delete node A B …`
            // deletes one by one at client-go's default 5 requests per
            // second, and 500 nodes outlasted the cleanup's deadline.
            let collection = format!("/api/v1/nodes?labelSelector={BENCH_LABEL}%3D{ns}");
            cleanup_kubectl(cluster, &["delete", "--raw", &collection]);
        }
    }
}

/// Wait until `count` nodes matching label `selector` are Ready and carry no
/// `node.kubernetes.io/*` taint; panics naming `what` after `limit`.
pub async fn wait_nodes_schedulable(client: &Client, selector: &str, count: usize, limit: Duration, what: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = Instant::now() + limit;
    loop {
        let listed = nodes.list(&ListParams::default().labels(selector)).await.map(|l| l.items).unwrap_or_default();
        let schedulable = listed
            .iter()
            .filter(|node| {
                let ready = node
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                let tainted = node
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| t.iter().any(|t| t.key.starts_with("node.kubernetes.io/")));
                ready && !tainted
            })
            .count();
        if schedulable >= count {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {schedulable} of {count} schedulable after {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Wait until namespace `ns` has its `default` ServiceAccount (created by the
/// controller manager shortly after the namespace): pods are refused before.
pub async fn wait_default_service_account(client: &Client, ns: &str, limit: Duration) {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + limit;
    while !matches!(accounts.get_opt("default").await, Ok(Some(_))) {
        assert!(Instant::now() < deadline, "namespace {ns} has no default ServiceAccount after {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
