//! Several vmlet processes on the real control plane, as a fleet with one
//! process per hypervisor host: exactly one runs the controllers (elected
//! through a Lease), another takes over when it dies or stops, and no two
//! serve the same node. Each process serves a libvirt test-driver host of its
//! own.

mod common;

use common::{test_driver_uri, Host, TestEnv};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::json;

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
