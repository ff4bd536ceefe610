//! Several vmlet processes on the real control plane, as a fleet with one
//! process per hypervisor host: exactly one runs the controllers (elected
//! through a Lease), another takes over when it dies or stops, and no two
//! serve the same node. Each process serves a libvirt test-driver host of its
//! own.

mod common;

use common::{test_driver_uri, Host, TestEnv};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// The election Lease's duration in the harness's config (the default).
const LEASE: Duration = Duration::from_secs(15);

/// The election Lease's name (the default `leaderElection.leaseName`); the
/// harness's config names the test's namespace, so the Lease lives there.
const ELECTION_LEASE: &str = "vmlet-controller";

/// A member of the fleet: its name (and so its identity), its node's host
/// suffix and its kubelet API port.
struct Member {
    name: &'static str,
    suffix: &'static str,
    port: u16,
}

/// Start members `one` (host `a`) and `two` (host `b`) and wait until both
/// nodes are Ready.
async fn two_members(env: &mut TestEnv) -> [Member; 2] {
    let one = env.start_member("one", &[Host::new("a", test_driver_uri("host-a.xml"))]);
    let two = env.start_member("two", &[Host::new("b", test_driver_uri("host-b.xml"))]);
    env.wait_node_ready(&env.node("a")).await;
    env.wait_node_ready(&env.node("b")).await;
    [Member { name: "one", suffix: "a", port: one }, Member { name: "two", suffix: "b", port: two }]
}

/// The holder of the election Lease, once it has one.
async fn wait_leader(env: &TestEnv) -> String {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for("a leader of the controllers' election", || {
        let leases = leases.clone();
        async move { leases.get_opt(ELECTION_LEASE).await.ok()??.spec?.holder_identity.filter(|h| !h.is_empty()) }
    })
    .await
}

/// The holder of the election Lease now (`None`: none, or no Lease).
async fn holder(env: &TestEnv) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease = leases.get_opt(ELECTION_LEASE).await.expect("read the election Lease")?;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// `vmlet_controller_leader` as member `port`'s `GET /metrics` says it
/// (as the API server's kubelet client, system:masters), if it answers.
async fn leader_gauge(port: u16) -> Option<i64> {
    let (status, text) = common::kubelet::get(port, "/metrics", common::kubelet::Caller::ApiServer).await?;
    if status != 200 {
        return None;
    }
    text.lines().find_map(|l| l.strip_prefix("vmlet_controller_leader ")).and_then(|v| v.trim().parse().ok())
}

/// Wait until the gauges of `members` read 1 for the member named `leader`
/// and 0 for the others.
async fn wait_gauges(env: &TestEnv, members: &[&Member], leader: &str) {
    env.wait_for(&format!("vmlet_controller_leader 1 at {leader} and 0 elsewhere"), || async {
        for member in members {
            let want = i64::from(member.name == leader);
            if leader_gauge(member.port).await != Some(want) {
                return None;
            }
        }
        Some(())
    })
    .await
}

/// The member whose identity is `identity`.
fn by_identity<'m>(env: &TestEnv, members: &'m [Member; 2], identity: &str) -> (&'m Member, &'m Member) {
    match members.iter().position(|m| env.identity(m.name) == identity) {
        Some(0) => (&members[0], &members[1]),
        Some(_) => (&members[1], &members[0]),
        None => panic!("the election Lease is held by {identity:?}, no member of this test"),
    }
}

/// A VM pinned to `node`, so that it never waits for a dead process's node.
fn vm_on(node: &str) -> serde_json::Value {
    json!({"resources": {"cpu": 1, "memory": "256Mi"}, "nodeSelector": {"kubernetes.io/hostname": node}})
}

#[tokio::test]
async fn exactly_one_of_two_processes_leads_and_the_other_takes_over_when_it_is_killed() {
    let mut env = TestEnv::new("fleet-kill").await;
    let members = two_members(&mut env).await;
    let leader = wait_leader(&env).await;
    let (leading, following) = by_identity(&env, &members, &leader);
    wait_gauges(&env, &[leading, following], leading.name).await;
    env.apply_vm("before", vm_on(&env.node(following.suffix)));
    env.wait_vm_phase("before", "Running").await;

    let (leading, following) = (leading.name, (following.name, following.suffix, following.port));
    env.kill_member(leading);
    let survivor = env.identity(following.0);
    env.wait_for("the surviving process to hold the election Lease", || async {
        (holder(&env).await.as_deref() == Some(survivor.as_str())).then_some(())
    })
    .await;
    let survivor = Member { name: following.0, suffix: following.1, port: following.2 };
    wait_gauges(&env, &[&survivor], survivor.name).await;

    // The new leader's controllers reconcile: a VM made after the kill runs.
    env.apply_vm("after", vm_on(&env.node(survivor.suffix)));
    env.wait_vm_phase("after", "Running").await;
    env.kubectl(&["scale", "virtualmachine/before", "--replicas=0"]);
    env.wait_vm_phase("before", "Stopped").await;
}

#[tokio::test]
async fn a_leader_stopped_with_sigterm_releases_the_lease_for_the_follower() {
    let mut env = TestEnv::new("fleet-term").await;
    let members = two_members(&mut env).await;
    let leader = wait_leader(&env).await;
    let (leading, following) = by_identity(&env, &members, &leader);
    let (leading, follower) = (leading.name, env.identity(following.name));

    let status = env.terminate_member(leading);
    assert!(status.success(), "vmlet {leading} exited with {status} on SIGTERM");
    // Released before it exited: the Lease no longer names it (it is free, or
    // the follower has taken it already), long before the hold could expire.
    let after = holder(&env).await;
    assert_ne!(after.as_deref(), Some(leader.as_str()), "the Lease still names the stopped leader");
    env.wait_for("the follower to hold the election Lease", || async {
        (holder(&env).await.as_deref() == Some(follower.as_str())).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_process_configured_with_a_node_a_live_process_serves_refuses_to_start() {
    let mut env = TestEnv::new("fleet-refuse").await;
    env.start_member("one", &[Host::new("a", test_driver_uri("host-a.xml"))]);
    let node = env.node("a");
    env.wait_node_ready(&node).await;
    let owner = env.identity("one");
    let node_leases: Api<Lease> = Api::namespaced(env.client.clone(), "kube-node-lease");
    let node_holder = || async { node_leases.get_opt(&node).await.ok()??.spec?.holder_identity };
    env.wait_for("the node's Lease held by its process", || async {
        (node_holder().await.as_deref() == Some(owner.as_str())).then_some(())
    })
    .await;
    let election_before = holder(&env).await;

    let (status, log) = env.run_member_to_exit("intruder", &[Host::new("a", test_driver_uri("host-a.xml"))]);
    assert_eq!(status.code(), Some(1), "{log}");
    let refusal = log.lines().find(|l| l.contains("refusing to start")).unwrap_or_else(|| panic!("{log}"));
    assert!(refusal.contains(&node) && refusal.contains(&owner), "names neither node nor holder: {refusal}");

    // It wrote nothing: the node's Lease and the election are as they were.
    assert_eq!(node_holder().await, Some(owner.clone()));
    assert_eq!(holder(&env).await, election_before);
    assert_ne!(election_before, Some(env.identity("intruder")));
    env.wait_node_ready(&node).await;
}

/// Each VM's pod (by the `vmlet.io/vm` label): name, UID, restart count and
/// the start time vmlet reported, as `name uid restarts startedAt`; every VM
/// must have exactly one.
async fn pods_by_vm(env: &TestEnv) -> BTreeMap<String, String> {
    let pods: Api<Pod> = env.pods();
    let mut by_vm: BTreeMap<String, String> = BTreeMap::new();
    for pod in pods.list(&ListParams::default().labels("vmlet.io/vm")).await.expect("list the VM pods").items {
        let vm = pod.labels()["vmlet.io/vm"].clone();
        let status = pod.status.clone().unwrap_or_default();
        let container = status.container_statuses.unwrap_or_default().into_iter().next();
        let restarts = container.as_ref().map_or(0, |c| c.restart_count);
        let started = container.and_then(|c| c.state?.running?.started_at).map(|t| t.0.to_string());
        let line =
            format!("{} {} {restarts} {}", pod.name_any(), pod.uid().unwrap_or_default(), started.unwrap_or_default());
        assert!(by_vm.insert(vm.clone(), line).is_none(), "VirtualMachine {vm} has two pods");
    }
    by_vm
}

/// What a sampler saw while it ran: the holders of the election Lease in the
/// order they came, and every sample at which two members' gauges said 1.
#[derive(Default)]
struct Observed {
    holders: Vec<String>,
    two_leaders: Vec<String>,
}

/// Sample, until `stop` is set, the election Lease's holder and every
/// member's `vmlet_controller_leader` (a member that does not answer within
/// a second, e.g. a stopped one, counts as not leading for that sample).
fn sample(
    env: &TestEnv,
    ports: Vec<(&'static str, u16)>,
    stop: Arc<AtomicBool>,
) -> (Arc<Mutex<Observed>>, tokio::task::JoinHandle<()>) {
    let observed = Arc::new(Mutex::new(Observed::default()));
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let seen = observed.clone();
    let task = tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            let holder = leases.get_opt(ELECTION_LEASE).await.ok().flatten().and_then(|l| l.spec?.holder_identity);
            let mut leading = vec![];
            for (name, port) in &ports {
                let gauge = tokio::time::timeout(Duration::from_secs(1), leader_gauge(*port)).await.ok().flatten();
                if gauge == Some(1) {
                    leading.push(*name);
                }
            }
            {
                let mut seen = seen.lock().unwrap();
                if let Some(holder) = holder.filter(|h| !h.is_empty()) {
                    if seen.holders.last() != Some(&holder) {
                        seen.holders.push(holder);
                    }
                }
                if leading.len() > 1 {
                    seen.two_leaders.push(leading.join(" and "));
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    (observed, task)
}

#[tokio::test]
async fn three_processes_keep_thirty_vms_through_a_stopped_and_a_killed_leader() {
    let mut env = TestEnv::new("fleet-three").await;
    let names = [("one", "a", "host-a.xml"), ("two", "b", "host-b.xml"), ("three", "c", "host-c.xml")];
    let mut ports = vec![];
    for (name, suffix, file) in names {
        // Twelve 1-vCPU VMs fit on the smallest host (4 CPUs).
        let host = Host { cpu_allocation_ratio: 4.0, ..Host::new(suffix, test_driver_uri(file)) };
        ports.push((name, env.start_member(name, &[host])));
    }
    for (_, suffix, _) in names {
        env.wait_node_ready(&env.node(suffix)).await;
    }
    for i in 0..30 {
        env.apply_vm(&format!("vm-{i:02}"), vm_on(&env.node(names[i % 3].1)));
    }
    for i in 0..30 {
        env.wait_vm_phase(&format!("vm-{i:02}"), "Running").await;
    }
    let before = pods_by_vm(&env).await;
    assert_eq!(before.len(), 30);

    let stop = Arc::new(AtomicBool::new(false));
    let (observed, sampler) = sample(&env, ports.clone(), stop.clone());
    let identities: Vec<(&'static str, String)> = names.iter().map(|n| (n.0, env.identity(n.0))).collect();
    let name_of = |identity: &str| identities.iter().find(|(_, i)| i == identity).map(|(n, _)| *n);

    // SIGSTOP of the leader for two lease durations: another takes over;
    // after SIGCONT the old one steps down and never acts beside it.
    let first = wait_leader(&env).await;
    let stopped = name_of(&first).unwrap_or_else(|| panic!("{first} is no member"));
    env.signal_member(stopped, "STOP");
    let paused_at = SystemTime::now();
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let second = env
        .wait_for("another member to hold the Lease for two lease durations after the SIGSTOP", || async {
            let spec = leases.get_opt(ELECTION_LEASE).await.ok()??.spec?;
            let holder = spec.holder_identity.filter(|h| *h != first)?;
            let renewed: SystemTime = spec.renew_time?.0.into();
            (renewed.duration_since(paused_at).ok()? >= 2 * LEASE).then_some(holder)
        })
        .await;
    env.signal_member(stopped, "CONT");
    let leader_port = ports.iter().find(|(n, _)| Some(*n) == name_of(&second)).unwrap().1;
    let stopped_port = ports.iter().find(|(n, _)| *n == stopped).unwrap().1;
    env.wait_for("the resumed member to report that it does not lead", || async {
        (leader_gauge(stopped_port).await == Some(0) && leader_gauge(leader_port).await == Some(1)).then_some(())
    })
    .await;

    // New VMs are placed and started by the new leader's controllers.
    for (i, (_, suffix, _)) in names.iter().enumerate() {
        env.apply_vm(&format!("new-{i}"), vm_on(&env.node(suffix)));
    }
    for i in 0..3 {
        env.wait_vm_phase(&format!("new-{i}"), "Running").await;
    }

    // kill -9 of the leader: a survivor leads, the VMs stay as they were.
    let killed = name_of(&second).unwrap();
    let leaders_before_kill = observed.lock().unwrap().holders.len();
    env.kill_member(killed);
    let killed_at = std::time::Instant::now();
    let third = env
        .wait_for("a survivor to hold the Lease after the kill", || async {
            holder(&env).await.filter(|h| *h != second && name_of(h).is_some())
        })
        .await;
    let takeover = killed_at.elapsed();
    println!("takeover after kill -9 of the leader: {:.1} s (lease {} s)", takeover.as_secs_f64(), LEASE.as_secs());
    assert!(takeover <= 3 * LEASE, "no survivor led within three lease durations: {takeover:?}");
    env.apply_vm("after-kill", vm_on(&env.node(names.iter().find(|n| Some(n.0) == name_of(&third)).unwrap().1)));
    env.wait_vm_phase("after-kill", "Running").await;

    stop.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    let observed = std::mem::take(&mut *observed.lock().unwrap());
    assert!(observed.two_leaders.is_empty(), "two members acted as leaders at once: {:?}", observed.two_leaders);
    assert!(
        observed.holders.len() > leaders_before_kill,
        "the sampler saw no holder after the kill: {:?}",
        observed.holders
    );
    assert_eq!(observed.holders.first(), Some(&first), "{:?}", observed.holders);
    assert!(observed.holders.contains(&second) && observed.holders.contains(&third), "{:?}", observed.holders);

    // No VM was stopped, restarted or given a second pod: the 30 pods are
    // the ones from before (name, UID, restarts, start time).
    let after = pods_by_vm(&env).await;
    for (vm, pod) in &before {
        assert_eq!(after.get(vm), Some(pod), "VirtualMachine {vm}'s pod changed");
    }
}

/// The objects of `deploy/controller.yaml` by kind.
fn controller_manifest() -> BTreeMap<String, serde_json::Value> {
    use serde::Deserialize as _;
    let text = std::fs::read_to_string(common::repo().join("deploy/controller.yaml")).expect("deploy/controller.yaml");
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| {
            let object = serde_json::Value::deserialize(document).expect("a YAML object");
            (object["kind"].as_str().expect("an object with a kind").to_owned(), object)
        })
        .collect()
}

/// `deploy/controller.yaml`, the controllers as a Deployment, as the API
/// server and vmlet take it: the API server accepts both objects as
/// written (server-side dry run), and two replicas run as its containers
/// would (the Deployment's arguments and ConfigMap config, under the
/// ServiceAccount it names, with the namespace, listen address and state
/// directory of the test): one leads and reconciles VMs served by an agent
/// that runs no controller, its `/metrics` answers the API server's client
/// (the controller role's reviews), and when it is stopped as a rollout
/// stops it (SIGTERM) the other takes over.
#[tokio::test]
async fn the_controllers_deployment_elects_one_of_its_replicas_under_the_controller_identity() {
    let mut env = TestEnv::new("fleet-deploy").await;
    let cluster = common::cluster();
    let mut dry_run = std::process::Command::new(cluster.bin.join("kubectl"));
    dry_run.env("KUBECONFIG", &cluster.kubeconfig).args(["apply", "--dry-run=server", "-f"]);
    dry_run.arg(common::repo().join("deploy/controller.yaml"));
    let out = common::deadline::output_within(&mut dry_run, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "the API server refused deploy/controller.yaml: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let manifest = controller_manifest();
    let pod = &manifest["Deployment"]["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "vmlet-controller", "the identity common::controller_identity runs as");
    let args: Vec<String> = serde_json::from_value(pod["containers"][0]["args"].clone()).expect("container args");
    let config_text = manifest["ConfigMap"]["data"]["config.yaml"].as_str().expect("config.yaml in the ConfigMap");
    let config: serde_json::Value = serde_yaml::from_str(config_text).expect("the ConfigMap's config");
    assert_eq!((&config["controller"], &config["hosts"]), (&json!(true), &json!([])), "{config}");

    env.start_agent(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.wait_node_ready(&env.node("a")).await;
    let mut ports = BTreeMap::new();
    for name in ["replica-1", "replica-2"] {
        let port = common::free_port_range(1);
        let mut replica = config.clone();
        replica["namespace"] = json!(env.ns);
        replica["leaderElection"]["namespace"] = json!(env.ns);
        replica["identity"] = json!(env.identity(name));
        replica["stateDir"] = json!(env.dir.join(format!("{name}-state")));
        replica["kubeletApi"] = common::kubelet_api_config(port);
        env.start_controller_replica(name, &replica, &args);
        ports.insert(name, port);
    }

    let leader = wait_leader(&env).await;
    let (leading, following) = if leader == env.identity("replica-1") {
        ("replica-1", "replica-2")
    } else {
        assert_eq!(leader, env.identity("replica-2"), "the election Lease is held by no replica");
        ("replica-2", "replica-1")
    };
    env.wait_for("vmlet_controller_leader 1 at the leader and 0 at the other replica", || async {
        let gauges = (leader_gauge(ports[leading]).await, leader_gauge(ports[following]).await);
        (gauges == (Some(1), Some(0))).then_some(())
    })
    .await;
    env.apply_vm("web", vm_on(&env.node("a")));
    env.wait_vm_phase("web", "Running").await;

    let status = env.terminate_member(leading);
    assert!(status.success(), "replica {leading} exited with {status} on SIGTERM");
    let follower = env.identity(following);
    env.wait_for("the other replica to hold the election Lease", || async {
        (holder(&env).await.as_deref() == Some(follower.as_str())).then_some(())
    })
    .await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    for log in [format!("{leading}.log"), format!("{following}.log")] {
        let text = std::fs::read_to_string(env.dir.join(&log)).expect("a replica's log");
        let forbidden: Vec<&str> = text.lines().filter(|l| l.contains("forbidden")).collect();
        assert!(forbidden.is_empty(), "{log}: the controller role lacks something:\n{}", forbidden.join("\n"));
    }
}
