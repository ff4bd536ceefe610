//! Benchmark: N VMs cloned from a template and powered on in vSphere, once
//! by a bare SOAP client and once through vmlet and Kubernetes, in one run
//! against the same server.
//!
//!   hack/test.sh's environment (or `hack/cluster.sh up && hack/vsphere.sh up`
//!   and their `env`), then: cargo bench --bench vsphere_clones
//!
//! The server is govmomi's simulator (`hack/vsphere.sh`: cluster DC0_C0 of
//! three ESXi hosts, template `template-c0`). Prints figures; asserts no
//! timing. Both runs make the same VMs (one vCPU, [`MEMORY_MIB`] MiB) with
//! the same number of requests in flight (`VMLET_BENCH_CONCURRENCY`,
//! default 8):
//!
//! 1. **Bare** (the limit): a vim25 session of the bench's own, no vmlet,
//!    no Kubernetes: per VM a `CloneVM_Task` of the template onto the
//!    cluster's hosts in turn, then `PowerOnVM_Task`, each task waited for;
//!    the VMs are then powered off and destroyed.
//! 2. **vmlet**: one vmlet process serving the three hosts as nodes
//!    (allocation ratios raised so that N small VMs fit); N VirtualMachines
//!    are created through the API server and timed until a watch sees each
//!    `status.phase: Running` (kube-scheduler places them; the agents clone
//!    and power on); then all are deleted through the product.
//!
//! Printed for each run: latency from the start of a VM's first request to
//! powered on (bare) or Running (vmlet), p50/p95/max, and throughput (VMs
//! per second from the first request to the last VM up); then vmlet against
//! the bare client: throughput ratio and p50 ratio.
//!
//! Environment: `VMLET_BENCH_VMS` (N, default 100), `VMLET_BENCH_CONCURRENCY`,
//! `VMLET_BENCH_TIMEOUT` (seconds each run may take, default 600). Every
//! vSphere call has its task deadline, every kubectl call its own
//! (tests/support/deadline.rs). Exits 1 when a run did not bring all N up.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "apply_to_running/measure.rs"]
mod measure;
#[path = "../providers/vsphere/tests/common/mod.rs"]
mod vsphere_harness;

use common::{TestEnv, VCenterTrust};
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};
use vmlet::v1alpha1::{VirtualMachine, VmPhase};
use vmlet_vsphere::{
    clone_vm, destroy_vm, list_hosts, list_templates, power_off, power_on, CloneRequest, Hardware, Host, Session,
};

/// The simulator's cluster: three ESXi hosts.
const CLUSTER_HOSTS: [&str; 3] = ["DC0_C0_H0", "DC0_C0_H1", "DC0_C0_H2"];
/// The template both runs clone.
const TEMPLATE: &str = "template-c0";
/// Memory of every VM, in MiB (vSphere wants a multiple of 4).
const MEMORY_MIB: u64 = 64;
/// Deadline of each vSphere task of the bare run.
const TASK: Duration = Duration::from_secs(120);

struct Settings {
    vms: usize,
    concurrency: usize,
    timeout: Duration,
}

fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v.parse().unwrap_or_else(|_| panic!("{name}={v:?}: give a whole number")),
        _ => default,
    }
}

/// The `p`th percentile (nearest rank) of `sorted`; zero when it is empty.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50 and throughput of the bare run, as [`measure::Figures`].
struct Bare {
    figures: Option<measure::Figures>,
    up: usize,
}

/// Clone and power on `settings.vms` VMs with a session of the bench's own;
/// print the figures; power off and destroy them.
async fn bare(session: &Session, settings: &Settings) -> Bare {
    let hosts: Vec<Host> = list_hosts(session)
        .await
        .expect("list the simulator's hosts")
        .into_iter()
        .filter(|h| CLUSTER_HOSTS.contains(&h.name.as_str()))
        .collect();
    assert_eq!(hosts.len(), CLUSTER_HOSTS.len(), "the simulator lacks cluster DC0_C0's hosts: {hosts:?}");
    let templates = list_templates(session).await.expect("list templates");
    let template = templates.iter().find(|t| t.name == TEMPLATE).expect("the simulator has template-c0");
    let folder = template.folder.clone().expect("the template's folder");
    let run = format!("bench-bare-{}", std::process::id());

    let first = Instant::now();
    let made = futures::stream::iter(0..settings.vms)
        .map(|i| {
            let (host, folder, run) = (&hosts[i % hosts.len()], &folder, &run);
            async move {
                let started = Instant::now();
                let name = format!("{run}-{i:03}");
                let pool = host.resource_pool.as_ref().expect("the host's resource pool");
                let request = CloneRequest {
                    template: &template.moref,
                    folder,
                    name: &name,
                    host: &host.moref,
                    pool,
                    datastore: None,
                    snapshot: None,
                    uid: &name,
                    hardware: Hardware { cpus: 1, memory_mib: MEMORY_MIB, max_cpus: 1, max_memory_mib: MEMORY_MIB },
                    nics: &[],
                };
                let vm = clone_vm(session, &request, TASK).await.map_err(|e| format!("clone {name}: {e}"))?;
                power_on(session, &vm, TASK).await.map_err(|e| format!("power on {name}: {e}"))?;
                Ok::<_, String>((vm, started.elapsed(), Instant::now()))
            }
        })
        .buffer_unordered(settings.concurrency)
        .collect::<Vec<_>>();
    let made = tokio::time::timeout(settings.timeout, made).await.unwrap_or_default();
    let (up, failed): (Vec<_>, Vec<_>) = made.into_iter().partition(Result::is_ok);
    let up: Vec<_> = up.into_iter().map(Result::unwrap).collect();
    for e in failed.iter().take(5) {
        println!("  FAILED: {}", e.as_ref().unwrap_err());
    }
    let mut latencies: Vec<Duration> = up.iter().map(|(_, took, _)| *took).collect();
    latencies.sort();
    let span = up.iter().map(|(_, _, at)| at.saturating_duration_since(first)).max();
    println!("  VMs up:                {} of {}", up.len(), settings.vms);
    println!("  clone+on p50:          {}", measure::ms(percentile(&latencies, 50.0)));
    println!("  clone+on p95:          {}", measure::ms(percentile(&latencies, 95.0)));
    println!("  clone+on max:          {}", measure::ms(latencies.last().copied().unwrap_or_default()));
    let figures = span.map(|span| {
        let per_second = up.len() as f64 / span.as_secs_f64().max(1e-3);
        println!(
            "  throughput:            {per_second:.1} VMs/s ({} VMs from first clone to last power-on in {})",
            up.len(),
            measure::ms(span)
        );
        measure::Figures { p50: percentile(&latencies, 50.0), per_second }
    });

    // Cleanup, also with a deadline per task; a VM left behind is named.
    let cleanup = futures::stream::iter(up.iter().map(|(vm, _, _)| vm.clone()))
        .map(|vm| async move {
            let _ = power_off(session, &vm, TASK).await;
            if let Err(e) = destroy_vm(session, &vm, TASK).await {
                println!("  cleanup: could not destroy {}: {e}", vm.value);
            }
        })
        .buffer_unordered(settings.concurrency)
        .collect::<Vec<_>>();
    if tokio::time::timeout(settings.timeout, cleanup).await.is_err() {
        println!("  cleanup: not done within {:?}; VMs named {run}-* may be left", settings.timeout);
    }
    Bare { figures, up: up.len() }
}

fn vm_is_running(vm: &VirtualMachine) -> bool {
    vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running)
}

/// vmlet on the cluster's three hosts, with allocation ratios that let
/// `vms` small VMs fit (the simulator's hosts have few cores and GiB).
async fn vmlet_run(settings: &Settings) -> (Option<measure::Figures>, bool) {
    let mut env = TestEnv::new("vsbench").await;
    env.write_vmlet_on_vcenter(&CLUSTER_HOSTS, &[TEMPLATE], &VCenterTrust::ca_file_from_env());
    let path = env.dir.join("vmlet.yaml");
    let mut config: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["vcenters"][0]["cpuAllocationRatio"] = json!(64.0);
    config["vcenters"][0]["memoryAllocationRatio"] = json!(8.0);
    std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
    env.restart_vmlet();
    for host in CLUSTER_HOSTS {
        env.wait_node_ready(&env.node(&vmlet::vcenters::node_name_of_host(host))).await;
    }
    let objects: Vec<VirtualMachine> = (0..settings.vms)
        .map(|i| {
            let mut object = env.vm_object(
                &format!("vm-{i:03}"),
                &json!({"image": TEMPLATE, "resources": {"cpu": 1, "memory": format!("{MEMORY_MIB}Mi")},
                        "powerOffMode": "Hard", "shutdownTimeoutSeconds": 0}),
            );
            object["metadata"]["namespace"] = json!(env.ns);
            serde_json::from_value(object).expect("VirtualMachine")
        })
        .collect();
    let timeline =
        measure::create_until_running(&env.vms(), objects, settings.concurrency, settings.timeout, vm_is_running).await;
    timeline.print("VMs", settings.concurrency);
    let all = timeline.all_running();
    (timeline.figures(), all)
    // `env` drops here: the VMs are deleted through vmlet, then vmlet stops.
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(harness) = vsphere_harness::harness("vsphere_clones bench") else { return };
    let settings = Settings {
        vms: env_number("VMLET_BENCH_VMS", 100) as usize,
        concurrency: env_number("VMLET_BENCH_CONCURRENCY", 8).max(1) as usize,
        timeout: Duration::from_secs(env_number("VMLET_BENCH_TIMEOUT", 600)),
    };
    println!(
        "vsphere_clones: {} VMs of {TEMPLATE} ({MEMORY_MIB} MiB, 1 vCPU), {} in flight, on {}",
        settings.vms, settings.concurrency, harness.url
    );
    let session = Session::connect(harness.config()).await.expect("a session with the simulator");

    println!("\nbare SOAP client (CloneVM_Task + PowerOnVM_Task, no vmlet):");
    let bare = bare(&session, &settings).await;

    println!("\nvmlet (VirtualMachines through the API server, 3 ESXi nodes):");
    let (vmlet, vmlet_all) = vmlet_run(&settings).await;

    println!("\nvmlet against the bare client:");
    if let (Some(b), Some(v)) = (bare.figures, vmlet) {
        println!(
            "  throughput ratio:      {:.2}× ({:.1} vs {:.1} VMs/s)",
            v.per_second / b.per_second.max(1e-9),
            v.per_second,
            b.per_second
        );
        println!(
            "  p50 ratio:             {:.2}× ({} vs {})",
            v.p50.as_secs_f64() / b.p50.as_secs_f64().max(1e-9),
            measure::ms(v.p50),
            measure::ms(b.p50)
        );
    }
    if bare.up < settings.vms || !vmlet_all {
        println!("NOT ALL UP: bare {} of {}, vmlet all Running: {vmlet_all}", bare.up, settings.vms);
        std::process::exit(1);
    }
}
