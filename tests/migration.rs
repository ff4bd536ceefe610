//! Migration through scheduling on two real libvirt hosts: `hack/hosts.sh`
//! runs mig-a and mig-b, each a libvirtd in a network and mount namespace of
//! its own, reached as `qemu+tcp://10.237.0.1x/system` (`hack/test.sh`
//! exports their URIs). `kubectl drain` moves VMs between them; what the
//! daemons really did is checked with virsh, sampled while the VM moves.
//! The tests run on a multi-threaded runtime: their samplers keep sampling
//! while the test thread waits for `kubectl drain`.

mod common;

use common::deadline::{output_within, VIRSH};
use common::{guest_accelerator, guest_for, guest_vm_spec, Host, TestEnv};
use serde_json::json;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmlet::v1alpha1::VirtualMachine;

/// The URI of harness host `host` (`A` or `B`), from `hack/test.sh`.
fn mig_uri(host: &str) -> String {
    let var = format!("VMLET_LIBVIRT_MIG_{host}_URI");
    std::env::var(&var).ok().filter(|u| !u.is_empty()).unwrap_or_else(|| {
        panic!("{var} is unset: run the tests with hack/test.sh, which starts the two hosts (hack/hosts.sh up)")
    })
}

/// Harness host `host` for the vmlet config (node `<ns>-a` or `-b`): guests as
/// `accelerator`, CPUs overcommitted so that a few 1-CPU VMs fit on a small
/// machine, and unsafe migration allowed (both daemons see the test's disk at
/// the same path on this machine's file system: truly shared).
fn mig_host(host: &'static str, accelerator: &'static str) -> Host<'static> {
    let suffix = if host == "A" { "a" } else { "b" };
    Host { accelerator: Some(accelerator), cpu_allocation_ratio: 8.0, ..Host::new(suffix, mig_uri(host)) }
        .with("allowUnsafeMigration", json!(true))
}

/// `virsh -c <uri> domstate <domain>`, trimmed; empty when the domain is not
/// defined there.
fn domstate(uri: &str, domain: &str) -> String {
    let out = output_within(Command::new("virsh").args(["-c", uri, "domstate", domain]), VIRSH);
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    } else {
        String::new()
    }
}

/// Whether `domain` is defined persistently on `uri` (`virsh dominfo`).
fn persistent(uri: &str, domain: &str) -> bool {
    let out = output_within(Command::new("virsh").args(["-c", uri, "dominfo", domain]), VIRSH);
    String::from_utf8_lossy(&out.stdout).lines().any(|l| l.starts_with("Persistent:") && l.ends_with("yes"))
}

/// Samples, every 50 ms until stopped, whether `domain` runs on mig-a and on
/// mig-b.
struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<(bool, bool)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(domains: Vec<String>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (a, b) = (mig_uri("A"), mig_uri("B"));
        let thread = std::thread::spawn({
            let (stop, samples) = (stop.clone(), samples.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    for domain in &domains {
                        // Two reads are never one instant: a, b, a again. A
                        // move hands over once (the source pauses before the
                        // target resumes, and never runs again after it), so
                        // a domain that ran on both hosts throughout the
                        // bracket did, and a sample spanning the handover
                        // does not say so.
                        let first_a = domstate(&a, domain) == "running";
                        let on_b = domstate(&b, domain) == "running";
                        let on_a = first_a && domstate(&a, domain) == "running";
                        samples.lock().unwrap().push((on_a, on_b));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        Sampler { stop, samples, thread: Some(thread) }
    }

    /// Stop; the samples taken.
    fn finish(mut self) -> Vec<(bool, bool)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

/// Phases VM `name` went through while polled every 200 ms, until `stop`.
fn watch_phases(env: &TestEnv, name: &str, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<String>> {
    let vms = env.vms();
    let name = name.to_owned();
    tokio::spawn(async move {
        let mut seen: Vec<String> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if let Ok(vm) = vms.get(&name).await {
                if let Some(phase) = vm.status.and_then(|s| s.phase) {
                    let phase = serde_json::to_value(phase).unwrap().as_str().unwrap().to_owned();
                    if seen.last() != Some(&phase) {
                        seen.push(phase);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        seen
    })
}

/// The guest's uptime in seconds, through `kubectl exec` on its pod (the guest
/// agent answers some seconds after boot).
async fn uptime(env: &TestEnv, pod: &str) -> f64 {
    env.wait_for(&format!("the guest's uptime through pod {pod}"), || {
        let out = env.kubectl_output(&["exec", pod, "--", "cat", "/proc/uptime"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        async move { out.status.success().then(|| text.split_whitespace().next()?.parse().ok()).flatten() }
    })
    .await
}

/// The bridge of the guest LAN both hosts share (`hack/hosts.sh`).
fn mig_lan_bridge() -> String {
    std::env::var("VMLET_MIG_LAN_BRIDGE").ok().filter(|b| !b.is_empty()).unwrap_or_else(|| {
        panic!("VMLET_MIG_LAN_BRIDGE is unset: run the tests with hack/test.sh, which makes the hosts' guest LAN")
    })
}

/// Pod `pod`'s IP, once it reports one.
async fn pod_ip(env: &TestEnv, pod: &str) -> String {
    let pods = env.pods();
    env.wait_for(&format!("pod {pod} to report its IP"), || {
        let pods = pods.clone();
        async move { pods.get_opt(pod).await.ok()??.status?.pod_ip }
    })
    .await
}

/// A VM that runs on mig-a: mig-b cordoned while it starts.
async fn running_on_a(env: &TestEnv, name: &str, spec: serde_json::Value) -> VirtualMachine {
    env.kubectl(&["cordon", &env.node("b")]);
    env.apply_vm(name, spec);
    let vm = env.wait_vm_phase(name, "Running").await;
    assert_eq!(vm.status.as_ref().unwrap().node_name.as_deref(), Some(env.node("a").as_str()));
    env.kubectl(&["uncordon", &env.node("b")]);
    vm
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_moves_a_running_guest_live_to_the_other_host_without_a_restart() {
    let mut env = TestEnv::new("migrate").await;
    let guest = guest_for(&env);
    let accelerator = guest_accelerator(&guest);
    let (a, b) = (env.node("a"), env.node("b"));
    // Both hosts offer the guest LAN they share (a bridge in each host's
    // namespace, one layer-2 segment with the harness's DHCP server).
    let lan = json!([{"name": "lan", "bridge": mig_lan_bridge()}]);
    env.start_vmlet(&[
        mig_host("A", accelerator).with("networks", lan.clone()),
        mig_host("B", accelerator).with("networks", lan),
    ]);
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    let mut spec = guest_vm_spec(&guest);
    spec["networks"] = json!([{"name": "lan"}]);
    let vm = running_on_a(&env, "web", spec).await;
    let domain_uuid = vm.status.unwrap().provider_id.unwrap();
    let domain = format!("{}_web", env.ns);
    let evicted = env.pod_of("web").await;
    let before = uptime(&env, &evicted).await;
    // Its address on the bridge comes from the guest agent (no libvirt lease).
    let address = pod_ip(&env, &evicted).await;
    assert!(address.starts_with("10.240.0."), "the guest's address on the shared LAN: {address}");

    let sampler = Sampler::start(vec![domain.clone()]);
    let stop = Arc::new(AtomicBool::new(false));
    let phases = watch_phases(&env, "web", stop.clone());
    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=300s"]);
    let samples = sampler.finish();
    stop.store(true, Ordering::Relaxed);
    let phases = phases.await.unwrap();
    assert!(
        drained.status.success(),
        "drain failed: {}\n{}",
        String::from_utf8_lossy(&drained.stderr),
        env.diagnostics()
    );

    assert!(samples.len() > 5, "too few samples of the domain's state: {samples:?}");
    assert!(!samples.iter().any(|(on_a, on_b)| *on_a && *on_b), "the domain ran on both hosts at once: {samples:?}");
    assert!(phases.iter().any(|p| p == "Migrating"), "kubectl get vm -w would not have shown Migrating: {phases:?}");

    let vm = env.wait_vm_phase("web", "Running").await;
    let status = vm.status.unwrap();
    assert_eq!(status.node_name.as_deref(), Some(b.as_str()));
    assert_eq!(status.placement.as_ref().map(|p| p.node_name.as_str()), Some(b.as_str()));
    assert_eq!(status.provider_id.as_deref(), Some(domain_uuid.as_str()), "the same domain, moved");
    let migration = status.migration.expect("status.migration");
    assert_eq!(serde_json::to_value(migration.phase).unwrap(), "Succeeded");
    assert_eq!((migration.source_node.as_str(), migration.target_node.as_deref()), (a.as_str(), Some(b.as_str())));
    assert_eq!(migration.mode.as_deref(), Some("Live"));
    assert!(migration.start_time.is_some() && migration.end_time.is_some(), "{migration:?}");

    let current = env.pod_of("web").await;
    assert_ne!(current, evicted, "the target pod is the VM's pod now");
    assert!(env.pods().get_opt(&evicted).await.unwrap().is_none(), "the evicted pod's deletion completed");
    let after = uptime(&env, &current).await;
    assert!(after > before, "the guest rebooted: uptime {before} s before, {after} s after");
    assert_eq!(pod_ip(&env, &current).await, address, "the pod on the new host reports the guest's address");
    assert_eq!(domstate(&mig_uri("A"), &domain), "", "the domain is still defined on mig-a");
    assert_eq!(domstate(&mig_uri("B"), &domain), "running");
    assert!(persistent(&mig_uri("B"), &domain), "the domain is transient on mig-b");

    let events = env.kubectl(&["get", "events", "-o", "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}"]);
    for expected in ["Migrating", "Migrated"] {
        assert!(events.lines().any(|r| r == expected), "no {expected} event: {events}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_a_target_the_source_cannot_reach_fails_and_the_vm_runs_on() {
    let mut env = TestEnv::new("migrate-fail").await;
    let (a, b) = (env.node("a"), env.node("b"));
    // mig-b answers vmlet, but tells other hosts' daemons to reach it where
    // nothing listens (its own address, port 1).
    let unreachable = mig_uri("B").replace("/system", "").replace("qemu+tcp://", "");
    let unreachable = format!("qemu+tcp://{}:1/system", unreachable.split(':').next().unwrap());
    env.start_vmlet(&[mig_host("A", "auto"), mig_host("B", "auto").with("migrationUri", json!(unreachable))]);
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    running_on_a(&env, "web", json!({"resources": {"cpu": 1, "memory": "128Mi"}})).await;
    let domain = format!("{}_web", env.ns);
    let evicted = env.pod_of("web").await;

    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=20s"]);
    assert!(!drained.status.success(), "drain finished although the VM could not move");
    let vms = env.vms();
    let failed = env
        .wait_for("the migration to report its failure", || {
            let vms = vms.clone();
            async move {
                // The agent records the failure, the controller mirrors it
                // into the condition; the agent retries with backoff, so wait
                // for a moment that shows both.
                let status = vms.get("web").await.ok()?.status?;
                let failed = serde_json::to_value(status.migration.as_ref()?.phase).ok()? == "Failed";
                let shown = status.conditions.iter().any(|c| c.type_ == "Migrating" && c.reason == "MigrationFailed");
                (failed && shown).then_some(status)
            }
        })
        .await;
    let message = failed.migration.as_ref().unwrap().message.clone().unwrap_or_default();
    assert!(!message.is_empty(), "a failed migration says why");
    let condition = failed.conditions.iter().find(|c| c.type_ == "Migrating").expect("Migrating condition");
    assert_eq!((condition.status.as_str(), condition.reason.as_str()), ("False", "MigrationFailed"));
    assert_eq!(domstate(&mig_uri("A"), &domain), "running", "the VM keeps running on mig-a");
    assert_eq!(domstate(&mig_uri("B"), &domain), "", "nothing of the VM on mig-b");
    let pod = env.pods().get(&evicted).await.unwrap();
    assert!(pod.metadata.deletion_timestamp.is_some(), "the evicted pod waits (and so does drain)");
    let events = env.kubectl(&["get", "events", "--field-selector", "reason=MigrationFailed", "-o", "name"]);
    assert!(!events.trim().is_empty(), "no MigrationFailed event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disruption_budget_of_one_moves_three_vms_one_at_a_time() {
    let mut env = TestEnv::new("migrate-pdb").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_vmlet(&[mig_host("A", "auto"), mig_host("B", "auto")]);
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    // No guest OS: real, cheap QEMU processes idling in the firmware.
    let names = ["vm-1", "vm-2", "vm-3"];
    env.kubectl(&["cordon", &b]);
    for name in names {
        env.apply_vm(name, json!({"resources": {"cpu": 1, "memory": "128Mi"}}));
    }
    for name in names {
        env.wait_vm_phase(name, "Running").await;
    }
    env.kubectl(&["uncordon", &b]);
    let pdb = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "vms", "namespace": env.ns},
        "spec": {"maxUnavailable": 1, "selector": {"matchExpressions": [{"key": "vmlet.io/vm", "operator": "Exists"}]}},
    });
    let out = env.apply(&serde_yaml::to_string(&pdb).unwrap());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let stop = Arc::new(AtomicBool::new(false));
    let vms = env.vms();
    let most_at_once = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut most = 0;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(list) = vms.list(&Default::default()).await {
                    let moving = list
                        .items
                        .iter()
                        .filter(|vm| {
                            vm.status.as_ref().and_then(|s| s.migration.as_ref()).is_some_and(|m| m.is_active())
                        })
                        .count();
                    most = most.max(moving);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            most
        }
    });
    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=300s"]);
    stop.store(true, Ordering::Relaxed);
    let most = most_at_once.await.unwrap();
    assert!(
        drained.status.success(),
        "drain failed: {}\n{}",
        String::from_utf8_lossy(&drained.stderr),
        env.diagnostics()
    );
    assert_eq!(most, 1, "more than one VM moved at once under maxUnavailable 1");
    for name in names {
        let vm = env.wait_vm_phase(name, "Running").await;
        assert_eq!(vm.status.unwrap().node_name.as_deref(), Some(b.as_str()), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_migrate_vm_is_shut_down_moved_and_started_on_the_other_host() {
    let mut env = TestEnv::new("migrate-cold").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_vmlet(&[mig_host("A", "auto"), mig_host("B", "auto")]);
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    // No guest OS: the firmware ignores ACPI, so the shutdown runs into its 2 s.
    let spec = json!({"resources": {"cpu": 1, "memory": "128Mi"}, "evictionStrategy": "ColdMigrate",
                      "shutdownTimeoutSeconds": 2});
    let vm = running_on_a(&env, "web", spec).await;
    let domain_uuid = vm.status.unwrap().provider_id.unwrap();
    let domain = format!("{}_web", env.ns);

    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=300s"]);
    assert!(
        drained.status.success(),
        "drain failed: {}\n{}",
        String::from_utf8_lossy(&drained.stderr),
        env.diagnostics()
    );
    let vm = env.wait_vm_phase("web", "Running").await;
    let status = vm.status.unwrap();
    assert_eq!(status.node_name.as_deref(), Some(b.as_str()));
    assert_eq!(status.provider_id.as_deref(), Some(domain_uuid.as_str()), "the same domain, moved");
    let migration = status.migration.unwrap();
    assert_eq!(migration.mode.as_deref(), Some("Cold"));
    assert_eq!(serde_json::to_value(migration.phase).unwrap(), "Succeeded");
    assert_eq!(domstate(&mig_uri("A"), &domain), "", "still defined on mig-a");
    assert_eq!(domstate(&mig_uri("B"), &domain), "running");
    assert!(persistent(&mig_uri("B"), &domain));
}

/// A VM whose data disk is a claim of a shared pool (the same `dir` pool on
/// mig-a and mig-b, on a directory both see; class parameter `shared`)
/// is drained live with it: the claim may be `ReadWriteMany`, its
/// PersistentVolume is no one host's, and the guest reads on mig-b what it
/// wrote on mig-a, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_moves_a_vm_live_with_its_disk_on_a_shared_pool() {
    let mut env = TestEnv::new("migrate-pool").await;
    let guest = guest_for(&env);
    let accelerator = guest_accelerator(&guest);
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_vmlet(&[mig_host("A", accelerator), mig_host("B", accelerator)]);
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    let pool = common::pool::Pool::on(&env, &[mig_uri("A"), mig_uri("B")]);
    pool.class(&env, json!({"format": "raw", "shared": "true"}), false);
    let claim = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
        "spec": {"storageClassName": pool.name, "accessModes": ["ReadWriteMany"],
                 "resources": {"requests": {"storage": "64Mi"}}}});
    let applied = env.apply(&claim.to_string());
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
    let mut spec = guest_vm_spec(&guest);
    spec["disks"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    running_on_a(&env, "web", spec).await;
    let domain = format!("{}_web", env.ns);

    // The volume: made on mig-a, its PersistentVolume tied to no host.
    let volumes = pool.volumes_of("data");
    assert_eq!(volumes.len(), 1, "{volumes:?}");
    let path = format!("{}/{}", common::pool::Pool::dir(&env).display(), volumes[0]);
    let pv_name = env.kubectl(&["get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}"]);
    let pv = env.kubectl(&["get", "pv", pv_name.trim(), "-o", "json"]);
    let pv: serde_json::Value = serde_json::from_str(&pv).unwrap();
    assert_eq!(pv["spec"]["nodeAffinity"], serde_json::Value::Null, "{pv}");
    assert_eq!(pv["spec"]["accessModes"], json!(["ReadWriteMany"]));
    assert_eq!(pv["spec"]["csi"]["volumeAttributes"]["shared"], "true");

    let evicted = env.pod_of("web").await;
    let mark = format!("moved-{}", env.ns);
    let write = format!(
        "dev=$({}) && printf '%s\\n' {mark} | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok",
        common::device_named("data")
    );
    assert_eq!(env.exec_stdout(&evicted, &write).await, "ok");
    let before = uptime(&env, &evicted).await;

    let sampler = Sampler::start(vec![domain.clone()]);
    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=300s"]);
    let samples = sampler.finish();
    assert!(
        drained.status.success(),
        "drain failed: {}\n{}",
        String::from_utf8_lossy(&drained.stderr),
        env.diagnostics()
    );
    assert!(!samples.iter().any(|(on_a, on_b)| *on_a && *on_b), "the domain ran on both hosts at once: {samples:?}");
    let vm = env.wait_vm_phase("web", "Running").await;
    let status = vm.status.unwrap();
    assert_eq!(status.node_name.as_deref(), Some(b.as_str()));
    assert_eq!(status.migration.as_ref().and_then(|m| m.mode.as_deref()), Some("Live"));

    let current = env.pod_of("web").await;
    let after = uptime(&env, &current).await;
    assert!(after > before, "the guest rebooted: uptime {before} s before, {after} s after");
    let read = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", common::device_named("data"));
    assert_eq!(env.exec_stdout(&current, &read).await, mark, "the guest reads on mig-b what it wrote on mig-a");
    let listed = output_within(Command::new("virsh").args(["-c", &mig_uri("B"), "domblklist", &domain]), VIRSH);
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&path), "{}", String::from_utf8_lossy(&listed.stdout));
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true"]);
    drop(env);
    drop(pool);
}
