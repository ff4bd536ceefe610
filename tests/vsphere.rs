//! vmlet on a vSphere API server (`hack/vsphere.sh`: govmomi's simulator,
//! datacenter DC0 with cluster DC0_C0 of three ESXi hosts), driven through
//! the real control plane and kubectl, with vmlet configured as a user
//! would: a `vcenters` entry naming the cluster's hosts and the templates
//! tenants may clone.
//!
//! What vSphere did is read back from the simulator over vim25 SOAP with
//! the provider crate's client on a session of its own. Needs
//! `hack/test.sh` (which starts the simulator and exports
//! `VMLET_VSPHERE_*`); fails saying how to start it otherwise, unless
//! `VMLET_SKIP_VSPHERE=1`.

mod common;

#[path = "../providers/vsphere/tests/common/mod.rs"]
mod vsphere_harness; // (allows dead code itself: the provider's tests use more of it)

use common::{TestEnv, VCenterTrust};
use serde_json::json;
use vmlet::vcenters::node_name_of_host;
use vmlet_vsphere::{list_hosts, list_vms, relocate_vm, Host, PowerState, Session, Vm};
use vsphere_harness::{harness, Harness};

/// The simulator, shared by the tests of this binary (they run at once);
/// the test that stops its process holds it alone.
static SIMULATOR: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The simulator's cluster: three ESXi hosts.
const CLUSTER_HOSTS: [&str; 3] = ["DC0_C0_H0", "DC0_C0_H1", "DC0_C0_H2"];

/// A session of the test's own, apart from vmlet's.
async fn session(h: &Harness) -> Session {
    Session::connect(h.config()).await.expect("a session with the simulator")
}

/// The VMs of the whole vCenter that carry `vmlet.io.uid` = `uid`.
async fn vms_with(session: &Session, uid: &str) -> Vec<Vm> {
    list_vms(session).await.expect("list the simulator's VMs").into_iter().filter(|vm| vm.uid == uid).collect()
}

/// The ESXi host with reference `vm.host`.
async fn host_of(session: &Session, vm: &Vm) -> Host {
    let hosts = list_hosts(session).await.expect("list the simulator's hosts");
    hosts.into_iter().find(|h| Some(&h.moref) == vm.host.as_ref()).unwrap_or_else(|| panic!("no host of {vm:?}"))
}

/// Wait until the one VM carrying `uid` is in `power`; returns it.
async fn wait_power(env: &TestEnv, session: &Session, uid: &str, power: PowerState) -> Vm {
    env.wait_for(&format!("vSphere to show the VM {power:?}"), || async {
        let mut vms = vms_with(session, uid).await;
        assert!(vms.len() <= 1, "more than one VM carries {uid}: {vms:?}");
        vms.pop().filter(|vm| vm.power_state == power)
    })
    .await
}

fn node_of(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.spec.as_ref().and_then(|s| s.node_name.clone()).expect("a bound pod")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_is_cloned_from_a_template_onto_an_esxi_node_powered_off_and_on_and_destroyed_with_kubectl() {
    let Some(h) = harness("a_vm_is_cloned_from_a_template_onto_an_esxi_node") else { return };
    let _shared = SIMULATOR.read().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vsphere").await;
    env.start_vmlet_on_vcenter(&CLUSTER_HOSTS, &["template-c0"], &VCenterTrust::ca_file_from_env());

    // Every ESXi host of the cluster is a node, Ready, with the host's cores
    // and memory as vSphere reports them, its datacenter and cluster.
    let hosts = list_hosts(&session).await.expect("hosts");
    for name in CLUSTER_HOSTS {
        let host = hosts.iter().find(|h| h.name == name).unwrap_or_else(|| panic!("the simulator has no {name}"));
        let node = env.wait_node_ready(&env.node(&node_name_of_host(name))).await;
        let capacity = node.status.as_ref().unwrap().capacity.as_ref().unwrap();
        let want = (host.cpu_cores.unwrap().to_string(), vmlet::quantity::format_bytes(host.memory_bytes.unwrap()));
        assert_eq!((capacity["cpu"].0.clone(), capacity["memory"].0.clone()), want, "{name}");
        let labels = node.metadata.labels.unwrap();
        assert_eq!(labels["vmlet.io/provider"], "vsphere");
        assert_eq!(labels["topology.kubernetes.io/region"], "DC0", "{name}");
        assert_eq!(labels["topology.kubernetes.io/zone"], "DC0_C0", "{name}");
    }
    let listed = env.kubectl(&["get", "nodes", "-l", &format!("vmlet.io/test={}", env.ns), "-o", "name"]);
    assert_eq!(listed.lines().count(), CLUSTER_HOSTS.len(), "{listed}");

    // A VirtualMachine becomes a clone of the template, powered on, on the
    // ESXi host of the node the scheduler chose, carrying the VM's UID.
    env.apply_vm("web", json!({"image": "template-c0", "resources": {"cpu": 1, "memory": "256Mi"}}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let pod = env.vm_pod("web").await;
    let node = node_of(&pod);
    let clone = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    let host = host_of(&session, &clone).await;
    assert_eq!(env.node(&node_name_of_host(&host.name)), node, "the clone is on the pod's node's host");
    assert_eq!(clone.name, format!("{}_web", env.ns));
    assert_eq!((clone.cpus, clone.memory_bytes), (Some(1), Some(256 << 20)), "the spec's size");

    // Scale 0: powered off, the same VM; resized while off; scale 1:
    // powered on again with the new size (a ReconfigVM_Task before the
    // power-on), on the same host, and still the only VM with the UID.
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    let off = wait_power(&env, &session, &uid, PowerState::PoweredOff).await;
    assert_eq!((off.moref.value.as_str(), off.host.as_ref()), (clone.moref.value.as_str(), clone.host.as_ref()));
    env.kubectl(&["patch", "vm/web", "--type=merge", "-p", r#"{"spec":{"resources":{"cpu":2,"memory":"512Mi"}}}"#]);
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let on = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!((on.moref.value.as_str(), on.host.as_ref()), (clone.moref.value.as_str(), clone.host.as_ref()));
    assert_eq!((on.cpus, on.memory_bytes), (Some(2), Some(512 << 20)), "the size given while it was off");
    assert_eq!(node_of(&env.vm_pod("web").await), node, "the pod is back on the VM's host");
    assert_eq!(vms_with(&session, &uid).await.len(), 1, "no second clone");

    // kill -9 and a restart: the running VM is adopted, not cloned again nor
    // powered off. The new process has acted once it renewed the node's
    // Lease and the VM is Running under it.
    env.kill_vmlet();
    let restarted_at = k8s_openapi::jiff::Timestamp::now();
    env.restart_vmlet();
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(env.client.clone(), "kube-node-lease");
    env.wait_for("the restarted vmlet to renew its node's Lease", || {
        let (leases, node) = (leases.clone(), node.clone());
        async move {
            let renewed = leases.get(&node).await.ok()?.spec?.renew_time?;
            (renewed.0 > restarted_at).then_some(())
        }
    })
    .await;
    env.wait_vm_phase("web", "Running").await;
    let adopted = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!(adopted.moref.value, clone.moref.value, "the same VM after the restart");
    assert_eq!(vms_with(&session, &uid).await.len(), 1, "no second clone after the restart");

    // kubectl delete (deletionPolicy Delete, the default) destroys the clone.
    env.kubectl(&["delete", "vm/web", "--wait=true", "--timeout=120s"]);
    env.wait_for("the clone to be gone from vSphere", || async {
        vms_with(&session, &uid).await.is_empty().then_some(())
    })
    .await;
    let others = list_vms(&session).await.unwrap();
    assert!(others.iter().all(|vm| vm.name != clone.name), "a VM named {} is left: {others:?}", clone.name);
}

/// vmlet started on the cluster's hosts, their nodes Ready, and VM `web`
/// (a clone of `template-c0`) Running: its UID and the clone, powered on.
async fn running_web(env: &mut TestEnv, session: &Session) -> (String, Vm) {
    env.start_vmlet_on_vcenter(&CLUSTER_HOSTS, &["template-c0"], &VCenterTrust::ca_file_from_env());
    for name in CLUSTER_HOSTS {
        env.wait_node_ready(&env.node(&node_name_of_host(name))).await;
    }
    env.apply_vm("web", json!({"image": "template-c0", "resources": {"cpu": 1, "memory": "256Mi"}}));
    let uid = env.wait_vm_phase("web", "Running").await.metadata.uid.unwrap();
    let clone = wait_power(env, session, &uid, PowerState::PoweredOn).await;
    (uid, clone)
}

/// The node VM `web` of `env` runs on once it is Running on a node other
/// than `not`.
async fn running_elsewhere(env: &TestEnv, not: &str) -> String {
    let vms = env.vms();
    env.wait_for(&format!("VM web to run on a node other than {not}"), || {
        let (vms, not) = (vms.clone(), not.to_owned());
        async move {
            let status = vms.get("web").await.ok()?.status?;
            let running = serde_json::to_value(status.phase?).ok()? == "Running";
            status.node_name.filter(|node| running && *node != not)
        }
    })
    .await
}

/// `kubectl drain` of an ESXi node moves its running VM by vMotion
/// (`RelocateVM_Task`) to the host of the node the scheduler picked: the
/// same VM (MoRef), powered on throughout, and no VM pod is left on the
/// drained node. Then a relocation made by a client of its own, as DRS or
/// an administrator makes one, is followed: the VM's pod moves to the new
/// host's node, and the VM stays the same one, running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_moves_a_vm_between_esxi_nodes_and_a_relocation_outside_vmlet_is_followed() {
    let Some(h) = harness("drain_moves_a_vm_between_esxi_nodes") else { return };
    let _shared = SIMULATOR.read().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vsdrain").await;
    let (uid, before) = running_web(&mut env, &session).await;
    let source = node_of(&env.vm_pod("web").await);

    let drained = env.kubectl_output(&["drain", &source, "--ignore-daemonsets", "--timeout=170s"]);
    assert!(drained.status.success(), "drain failed: {}", String::from_utf8_lossy(&drained.stderr));
    let target = running_elsewhere(&env, &source).await;
    let migration = env.vms().get("web").await.unwrap().status.unwrap().migration.expect("a migration record");
    assert_eq!(migration.mode.as_deref(), Some("Live"), "{migration:?}");
    let moved = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!(moved.moref, before.moref, "the same VM, not a new clone");
    assert_eq!(env.node(&node_name_of_host(&host_of(&session, &moved).await.name)), target, "on the target's host");
    assert_eq!(node_of(&env.vm_pod("web").await), target);
    env.kubectl(&["uncordon", &source]);

    // Moved behind vmlet's back to the third host: followed, not restarted.
    let hosts = list_hosts(&session).await.unwrap();
    let third = hosts
        .iter()
        .find(|h| {
            let node = env.node(&node_name_of_host(&h.name));
            CLUSTER_HOSTS.contains(&h.name.as_str()) && node != source && node != target
        })
        .expect("a third host in the cluster");
    let pool = third.resource_pool.as_ref().expect("the host's pool");
    relocate_vm(&session, &moved.moref, &third.moref, pool, std::time::Duration::from_secs(60)).await.unwrap();
    let third_node = env.node(&node_name_of_host(&third.name));
    let followed = running_elsewhere(&env, &target).await;
    assert_eq!(followed, third_node, "the VM's node is its new host's");
    let (vms, pods) = (env.vms(), env.pods());
    env.wait_for("the VM's pod on the new host's node", || {
        let (vms, pods, third_node) = (vms.clone(), pods.clone(), third_node.clone());
        async move {
            let name = vms.get("web").await.ok()?.status?.pod_name?;
            pods.get(&name).await.ok()?.spec?.node_name.filter(|n| *n == third_node)
        }
    })
    .await;
    let after = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!(after.moref, before.moref, "the same VM after the outside move");
    assert_eq!(vms_with(&session, &uid).await.len(), 1, "no second clone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_clone_a_template_or_vm_the_administrator_did_not_list() {
    let Some(h) = harness("a_tenant_cannot_clone_a_template_or_vm_the_administrator_did_not_list") else { return };
    let _shared = SIMULATOR.read().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vspheredeny").await;
    env.start_vmlet_on_vcenter(&CLUSTER_HOSTS, &["template-c0"], &VCenterTrust::thumbprint_from_env());
    // A template the config leaves out, and a VM (vmlet's user could clone
    // either).
    for (vm, image) in [("other", "template-h0"), ("copy", "DC0_C0_RP0_VM1")] {
        env.apply_vm(vm, json!({"image": image}));
        let message = env.wait_waiting(vm, "InvalidSpec").await;
        assert!(message.contains("spec.image") && message.contains(&format!("{image:?}")), "{vm}: {message}");
        assert!(message.contains("allowed: [template-c0]"), "{vm}: {message}");
        let condition = env
            .wait_for(&format!("{vm}'s Ready condition to say why"), || async {
                let status = env.vms().get(vm).await.ok()?.status?;
                status.conditions.into_iter().find(|c| c.type_ == "Ready" && c.reason == "InvalidSpec")
            })
            .await;
        assert!(condition.message.contains("spec.image"), "{vm}: {condition:?}");
        let uid = env.vms().get(vm).await.unwrap().metadata.uid.unwrap();
        assert!(vms_with(&session, &uid).await.is_empty(), "{vm}: a VM was cloned");
        let named = format!("{}_{vm}", env.ns);
        let all = list_vms(&session).await.unwrap();
        assert!(all.iter().all(|v| v.name != named), "{vm}: a VM named {named} exists");
    }
}

/// The Ready condition of node `name`: (status, reason, message).
async fn ready_of(env: &TestEnv, name: &str) -> Option<(String, String, String)> {
    let node = env.nodes_api().get(name).await.ok()?;
    let c = node.status?.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
    Some((c.status, c.reason.unwrap_or_default(), c.message.unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_turns_the_nodes_not_ready_and_a_wrong_thumbprint_stops_vmlet_naming_the_field() {
    let Some(h) = harness("a_refused_password_turns_the_nodes_not_ready") else { return };
    let _shared = SIMULATOR.read().await;
    let mut env = TestEnv::new("vspherefail").await;
    let hosts = &CLUSTER_HOSTS[..1];
    env.start_vmlet_on_vcenter(hosts, &["template-c0"], &VCenterTrust::thumbprint_from_env());
    let node = env.node(&node_name_of_host(hosts[0]));
    env.wait_node_ready(&node).await;

    // vSphere refuses the password: the node goes NotReady saying so, and
    // the password never reaches its status.
    let wrong = "not-the-vsphere-password";
    env.kill_vmlet();
    std::fs::write(env.vcenter_password_file(), wrong).unwrap();
    env.restart_vmlet();
    let message = env
        .wait_for(&format!("node {node} NotReady with reason PermissionDenied"), || async {
            let (status, reason, message) = ready_of(&env, &node).await?;
            (status == "False" && reason == "PermissionDenied").then_some(message)
        })
        .await;
    assert!(!message.contains(wrong) && !message.contains(&h.password), "a password reached the node: {message}");

    // The right password again: Ready again.
    env.kill_vmlet();
    std::fs::write(env.vcenter_password_file(), format!("{}\n", h.password)).unwrap();
    env.restart_vmlet();
    env.wait_for(&format!("node {node} Ready again"), || async {
        (ready_of(&env, &node).await?.0 == "True").then_some(())
    })
    .await;

    // A certificate that is not the configured one: vmlet refuses at start,
    // naming the entry and the field, and sends no password.
    let other = "AB:".repeat(31) + "AB";
    env.write_vmlet_on_vcenter(hosts, &["template-c0"], &VCenterTrust::Thumbprint(other));
    let (status, log) = env.run_vmlet_to_exit();
    assert!(!status.success(), "vmlet ran with a wrong thumbprint:\n{log}");
    assert!(log.contains("vcenters[0]") && log.contains("thumbprint"), "{log}");
    assert!(!log.contains(&h.password), "the password reached the log:\n{log}");
}

/// The simulator's process stopped (SIGSTOP) while this lives, continued
/// (SIGCONT) when it is dropped, whatever the test's outcome.
struct Stopped(String);

impl Stopped {
    fn new() -> Stopped {
        let file = std::env::var("VMLET_VSPHERE_PID_FILE").expect("VMLET_VSPHERE_PID_FILE (hack/vsphere.sh env)");
        let pid = std::fs::read_to_string(&file).unwrap().trim().to_owned();
        signal(&pid, "STOP");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(&self.0, "CONT");
    }
}

fn signal(pid: &str, signal: &str) {
    let mut kill = std::process::Command::new("kill");
    kill.args([&format!("-{signal}"), pid]);
    let sent = common::deadline::output_within(&mut kill, std::time::Duration::from_secs(10));
    assert!(sent.status.success() || std::thread::panicking(), "kill -{signal} {pid}: {sent:?}");
}

/// The vCenter stops answering for over a minute (its process stopped, as a
/// hung server or a silent network leaves vmlet's requests waiting): each
/// ESXi node says NotReady, reason `HostNotResponding`, while vmlet keeps
/// renewing its Lease (the node lifecycle controller never marks it
/// Unknown), and nothing is done to the VM. When the vCenter answers again
/// the nodes are Ready, and the VM is the same one, running, under the same
/// pod, never restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vcenter_that_stops_answering_turns_the_nodes_not_ready_and_touches_no_vm() {
    let Some(h) = harness("a_vcenter_that_stops_answering") else { return };
    let _alone = SIMULATOR.write().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vshang").await;
    let (uid, before) = running_web(&mut env, &session).await;
    let pod = env.vm_pod("web").await;
    let node = node_of(&pod);

    let stopped = Stopped::new();
    let stopped_at = k8s_openapi::jiff::Timestamp::now();
    let (status, reason, message) = env
        .wait_for("the node NotReady, the host not responding", || async {
            ready_of(&env, &node).await.filter(|(status, reason, _)| status == "False" && reason == "HostNotResponding")
        })
        .await;
    assert!(message.contains("did not answer") || message.contains("vsphere"), "{status} {reason}: {message}");
    // Over a minute of silence, and the Lease renewed all along.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(env.client.clone(), "kube-node-lease");
    let renewed = env
        .wait_for("the node's Lease renewed a minute into the outage", || {
            let (leases, node) = (leases.clone(), node.clone());
            async move {
                let renewed = leases.get(&node).await.ok()?.spec?.renew_time?.0;
                (renewed.duration_since(stopped_at).as_secs() >= 60).then_some(renewed)
            }
        })
        .await;
    let (status, reason, _) = ready_of(&env, &node).await.expect("a Ready condition");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "HostNotResponding"), "at {renewed}");
    drop(stopped);

    for name in CLUSTER_HOSTS {
        env.wait_node_ready(&env.node(&node_name_of_host(name))).await;
    }
    env.wait_vm_phase("web", "Running").await;
    let after = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!((after.moref.value.as_str(), after.host.as_ref()), (before.moref.value.as_str(), before.host.as_ref()));
    let now = env.vm_pod("web").await;
    assert_eq!(now.metadata.uid, pod.metadata.uid, "the same pod");
    let restarts = now.status.and_then(|s| s.container_statuses).map(|c| c[0].restart_count);
    assert_eq!(restarts, Some(0), "the VM was never restarted");
}
