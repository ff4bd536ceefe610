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

    // vSphere gives vmlet no serial console or guest agent: kubectl logs,
    // exec and attach are refused at once (501 with the reason), never hang.
    let pod_name = pod.metadata.name.clone().unwrap();
    for (args, lacking) in [
        (vec!["logs", pod_name.as_str()], "has no serial console, so it keeps no console log"),
        (vec!["exec", pod_name.as_str(), "--", "true"], "has no guest agent to run commands in the guest"),
        (vec!["attach", pod_name.as_str()], "has no serial console to attach to"),
    ] {
        let out = env.kubectl_output(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "kubectl {args:?} succeeded: {out:?}");
        let reason = format!("the vsphere provider of host {node} {lacking}");
        assert!(stderr.contains(&reason), "kubectl {args:?}: want {reason:?} in {stderr}");
    }

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

/// The vCenter entry's `networks` and `datastore(s)` bound what a tenant
/// may name, as `templates` does: a network or datastore not offered is
/// refused with a condition naming the field and the allowed names, and
/// nothing is cloned; an offered network backs the clone's network card.
/// A VM with ceilings above its size is cloned with CPU and memory hot-add
/// and grows live when its spec.resources grow within them: the same VM
/// (MoRef), powered on throughout, its pod never restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_joins_only_offered_networks_and_datastores_and_a_vm_grows_live_within_its_ceilings() {
    let Some(h) = harness("a_tenant_joins_only_offered_networks_and_datastores") else { return };
    let _shared = SIMULATOR.read().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vsphereoffer").await;
    let offered = json!({"datastore": "LocalDS_0", "networks": [{"name": "lan", "network": "VM Network"}]});
    env.start_vmlet_on_vcenter_with(&CLUSTER_HOSTS, &["template-c0"], &VCenterTrust::thumbprint_from_env(), offered);
    for name in CLUSTER_HOSTS {
        env.wait_node_ready(&env.node(&node_name_of_host(name))).await;
    }
    let refused = [
        ("dmz", json!({"image": "template-c0", "networks": [{"name": "dmz"}]}), "spec.networks[0].name", "[lan]"),
        (
            "tenantds",
            json!({"image": "template-c0", "providerOptions": {"datastore": "DC0_tenant_DS"}}),
            "spec.providerOptions.datastore",
            "[LocalDS_0]",
        ),
    ];
    for (vm, spec, field, allowed) in refused {
        env.apply_vm(vm, spec);
        let message = env.wait_waiting(vm, "InvalidSpec").await;
        assert!(message.contains(field) && message.contains(&format!("allowed: {allowed}")), "{vm}: {message}");
        let condition = env
            .wait_for(&format!("{vm}'s Ready condition to say why"), || async {
                let status = env.vms().get(vm).await.ok()?.status?;
                status.conditions.into_iter().find(|c| c.type_ == "Ready" && c.reason == "InvalidSpec")
            })
            .await;
        assert!(condition.message.contains(field), "{vm}: {condition:?}");
        let uid = env.vms().get(vm).await.unwrap().metadata.uid.unwrap();
        assert!(vms_with(&session, &uid).await.is_empty(), "{vm}: a VM was cloned");
    }

    let resources = json!({"cpu": 1, "memory": "256Mi", "maxCpu": 2, "maxMemory": "512Mi"});
    env.apply_vm("web", json!({"image": "template-c0", "networks": [{"name": "lan"}], "resources": resources}));
    let uid = env.wait_vm_phase("web", "Running").await.metadata.uid.unwrap();
    let clone = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    let nics = vmlet_vsphere::read_template(&session, &clone.moref).await.expect("the clone's cards").nics;
    assert_eq!(nics.first().and_then(|n| n.backing.as_deref()), Some("VM Network"), "{nics:?}");
    assert!(clone.sizing.cpu_hot_add && clone.sizing.memory_hot_add, "{:?}", clone.sizing);
    let pod = env.vm_pod("web").await;

    env.kubectl(&["patch", "vm/web", "--type=merge", "-p", r#"{"spec":{"resources":{"cpu":2,"memory":"512Mi"}}}"#]);
    let grown = env
        .wait_for("vSphere to show the VM grown to 2 vCPUs and 512 MiB", || async {
            let mut vms = vms_with(&session, &uid).await;
            vms.pop().filter(|vm| (vm.cpus, vm.memory_bytes) == (Some(2), Some(512 << 20)))
        })
        .await;
    assert_eq!((&grown.moref, &grown.power_state), (&clone.moref, &PowerState::PoweredOn), "the same VM, never off");
    let now = env.vm_pod("web").await;
    assert_eq!(now.metadata.uid, pod.metadata.uid, "the same pod");
    let restarts = now.status.and_then(|s| s.container_statuses).map(|c| c[0].restart_count);
    assert_eq!(restarts, Some(0), "the VM was never restarted");

    // Beyond maxMemory (the simulator's hosts have 2 cores, so not beyond
    // maxCpu): RestartRequired, as on the other back ends; the running VM
    // keeps its size until it is started again, then has the new one.
    env.kubectl(&["patch", "vm/web", "--type=merge", "-p", r#"{"spec":{"resources":{"memory":"768Mi"}}}"#]);
    let vms = env.vms();
    let message = env
        .wait_for("ResourcesSynced False, reason RestartRequired", || async {
            let status = vms.get("web").await.ok()?.status?;
            let c = status.conditions.into_iter().find(|c| c.type_ == "ResourcesSynced")?;
            (c.status == "False" && c.reason == "RestartRequired").then_some(c.message)
        })
        .await;
    assert!(message.contains("next start"), "{message}");
    let waiting = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    let kept = (waiting.moref.value.as_str(), waiting.memory_bytes);
    assert_eq!(kept, (grown.moref.value.as_str(), Some(512 << 20)), "kept its size");
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let restarted = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    let now = (restarted.moref.value.as_str(), restarted.cpus, restarted.memory_bytes);
    assert_eq!(now, (grown.moref.value.as_str(), Some(2), Some(768 << 20)), "the same VM, with the new size");
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

/// Snapshots on vSphere, through kubectl: a VirtualMachineSnapshot of the
/// running VM is a vSphere snapshot with its memory (`CreateSnapshot_Task`),
/// a restore in place reverts the stopped VM to it (`RevertToSnapshot_Task`)
/// and the same VM starts again; a restore to a new VM clones the snapshot
/// into a template of the namespace's (`CloneVM_Task` with
/// `spec.snapshot`), and the new VM, a clone of it, runs as a distinct VM
/// with its own UID; a VirtualMachineBackup fails at once saying vSphere
/// has no backups; deleting the snapshot removes it from vSphere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_is_reverted_in_place_and_restored_as_a_new_vm_and_a_backup_is_refused_at_once() {
    use vmlet::v1alpha1::{OperationPhase, VirtualMachineBackup, VirtualMachineRestore, VirtualMachineSnapshot};
    use vmlet_vsphere::{list_templates, snapshots_of};

    let Some(h) = harness("a_snapshot_is_reverted_in_place_and_restored_as_a_new_vm") else { return };
    let _shared = SIMULATOR.read().await;
    let session = session(&h).await;
    let mut env = TestEnv::new("vssnap").await;
    let (uid, clone) = running_web(&mut env, &session).await;
    let node = node_of(&env.vm_pod("web").await);

    // The snapshot of the running VM: with its memory, on the VM's node, a
    // vSphere snapshot of vmlet's name on the same VM.
    apply_object(&env, "VirtualMachineSnapshot", "before", json!({"virtualMachine": "web"}));
    let snapshots: kube::Api<VirtualMachineSnapshot> = kube::Api::namespaced(env.client.clone(), &env.ns);
    let snapshot = env
        .wait_for("VirtualMachineSnapshot before to end", || async {
            let snapshot = snapshots.get_opt("before").await.ok()??;
            let phase = snapshot.status.as_ref()?.phase?;
            matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(snapshot)
        })
        .await;
    let status = snapshot.status.clone().unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    assert!(status.ready_to_use);
    assert_eq!((status.memory, status.virtual_machine_was_running), (Some(true), Some(true)));
    assert_eq!(status.node_name.as_deref(), Some(node.as_str()));
    assert_eq!(status.virtual_machine_uid.as_deref(), Some(uid.as_str()));
    let backend_name = format!("{}_before_{}", env.ns, snapshot.metadata.uid.clone().unwrap());
    assert_eq!(status.snapshot_name.as_deref(), Some(backend_name.as_str()));
    let held = snapshots_of(&session, &clone.moref).await.expect("the VM's snapshots");
    let held: Vec<(String, PowerState)> = held.into_iter().map(|s| (s.name, s.state)).collect();
    assert_eq!(held, vec![(backend_name.clone(), PowerState::PoweredOn)], "one snapshot, with memory");
    wait_power(&env, &session, &uid, PowerState::PoweredOn).await;

    // Stopped, reverted in place, started again: the same VM.
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    wait_power(&env, &session, &uid, PowerState::PoweredOff).await;
    apply_object(
        &env,
        "VirtualMachineRestore",
        "back",
        json!({"source": {"snapshot": "before"}, "target": {"virtualMachine": "web", "inPlace": true}}),
    );
    let restores: kube::Api<VirtualMachineRestore> = kube::Api::namespaced(env.client.clone(), &env.ns);
    let ended = |name: &'static str| {
        let restores = restores.clone();
        move || {
            let restores = restores.clone();
            async move {
                let restore = restores.get_opt(name).await.ok()??;
                let phase = restore.status.as_ref()?.phase?;
                matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(restore)
            }
        }
    };
    let back = env.wait_for("VirtualMachineRestore back to end", ended("back")).await;
    let back_status = back.status.clone().unwrap();
    assert_eq!(back_status.phase, Some(OperationPhase::Succeeded), "{:?}", back_status.message);
    let reverted = wait_power(&env, &session, &uid, PowerState::PoweredOff).await;
    assert_eq!(reverted.moref, clone.moref, "the same VM, reverted");
    let kept = snapshots_of(&session, &clone.moref).await.unwrap();
    assert_eq!(kept.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec![backend_name.as_str()], "kept");
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let started = wait_power(&env, &session, &uid, PowerState::PoweredOn).await;
    assert_eq!(started.moref, clone.moref, "the same VM runs again");

    // A new VM from the snapshot: a template of vmlet's name in the
    // namespace's, then a clone of it on the snapshot's host, running, with
    // a UID of its own; the original VM is untouched.
    apply_object(
        &env,
        "VirtualMachineRestore",
        "as-new",
        json!({"source": {"snapshot": "before"}, "target": {"virtualMachine": "web2"}}),
    );
    let as_new = env.wait_for("VirtualMachineRestore as-new to end", ended("as-new")).await;
    let as_new_status = as_new.status.clone().unwrap();
    assert_eq!(as_new_status.phase, Some(OperationPhase::Succeeded), "{:?}", as_new_status.message);
    let template = format!("{}_web2_restored_{}", env.ns, as_new.metadata.uid.clone().unwrap());
    assert_eq!(as_new_status.disk.as_deref(), Some(template.as_str()));
    let templates = list_templates(&session).await.expect("templates");
    assert_eq!(templates.iter().filter(|t| t.name == template).count(), 1, "the template: {templates:?}");
    let web2 = env.wait_vm_phase("web2", "Running").await;
    let uid2 = web2.metadata.uid.clone().unwrap();
    assert_ne!(uid2, uid);
    assert_eq!(web2.spec.image.as_deref(), Some(template.as_str()));
    assert_eq!(web2.metadata.labels.unwrap()["vmlet.io/restored-from-snapshot"], "before");
    let restored = wait_power(&env, &session, &uid2, PowerState::PoweredOn).await;
    assert_ne!(restored.moref, clone.moref, "a distinct VM");
    assert_eq!(restored.name, format!("{}_web2", env.ns));
    assert_eq!(node_of(&env.vm_pod("web2").await), node, "on the snapshot's host");
    assert_eq!(host_of(&session, &restored).await.moref, host_of(&session, &started).await.moref);
    let original = vms_with(&session, &uid).await;
    assert_eq!(original.len(), 1, "the template carries no UID: {original:?}");
    assert_eq!((&original[0].moref, &original[0].power_state), (&clone.moref, &PowerState::PoweredOn));

    // A backup: vSphere has none; the backup fails at once, saying so.
    apply_object(
        &env,
        "VirtualMachineBackup",
        "nightly",
        json!({"virtualMachine": "web", "target": {"hostPath": "/var/lib/vmlet/backups"}}),
    );
    let backups: kube::Api<VirtualMachineBackup> = kube::Api::namespaced(env.client.clone(), &env.ns);
    // "At once": well within the 60 s a backup Job's pod would take to be
    // scheduled, started and time out; a deadline, not a timed assertion.
    let failed = env.wait_for("VirtualMachineBackup nightly to fail", || async {
        let backup = backups.get_opt("nightly").await.ok()??;
        let status = backup.status?;
        (status.phase == Some(OperationPhase::Failed)).then_some(status)
    });
    let backup = tokio::time::timeout(std::time::Duration::from_secs(60), failed)
        .await
        .expect("the backup of a vSphere VM did not fail within 60 s");
    let message = backup.message.unwrap_or_default();
    assert!(message.contains("has no backup capability"), "{message}");

    // Deleting the snapshot removes it from vSphere; the object goes.
    env.kubectl(&["delete", "virtualmachinesnapshot/before", "--wait=false"]);
    env.wait_for("VirtualMachineSnapshot before to be gone", || async {
        snapshots.get_opt("before").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(snapshots_of(&session, &clone.moref).await.unwrap().is_empty(), "the snapshot is gone from vSphere");
}

/// `kubectl apply` of a vmlet.io/v1alpha1 object `kind` named `name` in
/// `env`'s namespace.
fn apply_object(env: &TestEnv, kind: &str, name: &str, spec: serde_json::Value) {
    let object = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": kind,
        "metadata": {"name": name, "namespace": env.ns}, "spec": spec});
    let out = env.apply(&object.to_string());
    assert!(out.status.success(), "apply {kind} {name}: {}", String::from_utf8_lossy(&out.stderr));
}
