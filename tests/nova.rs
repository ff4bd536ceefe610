//! vmlet on the real Nova API (`hack/nova.sh`: Keystone, Placement and Nova's
//! API, conductor, scheduler and three fake compute hosts), driven through
//! the real control plane and kubectl, with vmlet configured as a user would:
//! a `clouds` entry naming a clouds.yaml and the compute hosts.
//!
//! What Nova did is checked through its own API (the provider crate as a
//! client, on a session of its own). Needs `hack/test.sh` (which starts the
//! harness and exports `OS_*` / `VMLET_NOVA_*`); fails saying how to start
//! it otherwise, unless `VMLET_SKIP_NOVA=1`.

mod common;

#[path = "../providers/openstack/tests/common/mod.rs"]
mod nova_harness; // (allows dead code itself: the provider's tests use more of it)

use common::TestEnv;
use nova_harness::{harness, Harness};
use serde_json::json;
use vmlet_openstack::OpenStackProvider;
use vmlet_provider::{PowerState, Provider, VmId, VmStatus};

/// What Nova reports about the VM with UID `uid`: the compute host that has
/// it and its status there. `None` when no host has it.
async fn nova_view(h: &Harness, uid: &str) -> Option<(String, VmStatus)> {
    let cloud = h.cloud().await;
    let id = VmId(uid.to_owned());
    let mut found = None;
    for host in &h.hosts {
        if let Some(status) = OpenStackProvider::new(cloud.clone(), host).get(&id).await.expect("get") {
            assert!(found.is_none(), "the VM is on two hosts: {found:?} and {host}");
            found = Some((host.clone(), status));
        }
    }
    found
}

/// The harness's image and network as the only ones VMs may name; the
/// network offered by name (`lan`), so by UUID too.
fn allowed(h: &Harness) -> serde_json::Value {
    json!({"images": [h.image], "networks": [{"name": "lan", "uuid": h.network}]})
}

/// Servers of the whole cloud that carry the VM's UID.
async fn servers_with(h: &Harness, uid: &str) -> usize {
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    nova_harness::count_everywhere(&providers, &VmId(uid.to_owned())).await
}

fn node_of(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.spec.as_ref().and_then(|s| s.node_name.clone()).expect("a bound pod")
}

/// Wait until Nova shows the VM with `power` (on any host); its host and status.
async fn wait_nova(env: &TestEnv, h: &Harness, uid: &str, power: PowerState) -> (String, VmStatus) {
    env.wait_for(&format!("Nova to show the server {power:?}"), || async move {
        nova_view(h, uid).await.filter(|(_, s)| s.power == power)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_on_nova_starts_stops_resizes_moves_on_drain_and_is_adopted_after_a_crash() {
    let Some(h) = harness("a_vm_on_nova_starts_stops_resizes_moves_on_drain_and_is_adopted_after_a_crash") else {
        return;
    };
    let mut env = TestEnv::new("nova").await;
    env.start_vmlet_on_cloud(&h.clouds_yaml, &h.cloud_name, &h.hosts, allowed(&h));

    // Every compute host is a node, with the fake hosts' capacity and its zone.
    for host in &h.hosts {
        let name = env.node(host);
        let node = env.wait_node_ready(&name).await;
        let capacity = node.status.as_ref().unwrap().capacity.as_ref().unwrap();
        assert_eq!((capacity["cpu"].0.as_str(), capacity["memory"].0.as_str()), ("8", "16Gi"), "{name}");
        let labels = node.metadata.labels.unwrap();
        assert_eq!(labels["vmlet.io/provider"], "openstack");
        assert!(labels["topology.kubernetes.io/zone"].starts_with("az"), "{name}: {labels:?}");
    }
    let listed = env.kubectl(&["get", "nodes", "-l", &format!("vmlet.io/test={}", env.ns), "-o", "name"]);
    assert_eq!(listed.lines().count(), h.hosts.len(), "{listed}");

    // A VirtualMachine becomes an ACTIVE server on the host its pod went to.
    env.apply_vm("web", json!({"image": h.image, "networks": [{"name": "lan"}], "evictionStrategy": "LiveMigrate"}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let pod = env.pod_of("web").await;
    let first_node = node_of(&env.pods().get(&pod).await.unwrap());
    let (host, server) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    assert_eq!(env.node(&host), first_node, "the server is on the pod's node's compute host");
    // spec.networks' `lan` is the server's port; its fixed IP the pod's IP.
    let fixed_ip = server.addresses.first().expect("the server's fixed IP on lan").to_string();
    env.wait_for("the pod's IP to be the server's fixed IP", || {
        let (pods, pod, fixed_ip) = (env.pods(), pod.clone(), fixed_ip.clone());
        async move {
            let ip = pods.get(&pod).await.ok()?.status?.pod_ip?;
            (ip == fixed_ip).then_some(())
        }
    })
    .await;
    assert_eq!(
        vm.status.as_ref().and_then(|s| s.placement.as_ref()).map(|p| p.node_name.clone()),
        Some(first_node.clone())
    );

    // kubectl logs shows the server's console output.
    let logs = env.kubectl(&["logs", &pod]);
    assert!(!logs.trim().is_empty(), "kubectl logs printed nothing");

    // Scale 0: SHUTOFF; scale 1: ACTIVE again, the same server.
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    let (_, stopped) = wait_nova(&env, &h, &uid, PowerState::Off).await;
    assert_eq!(stopped.backend_id, server.backend_id);
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let (_, again) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    assert_eq!(again.backend_id, server.backend_id, "the same server");

    // A resize: Nova changes the flavor, which takes a restart.
    env.kubectl(&["patch", "vm/web", "--type=merge", "-p", r#"{"spec":{"resources":{"cpu":2,"memory":"1Gi"}}}"#]);
    env.wait_for("the VM to say its resize waits for a restart", || {
        let vms = env.vms();
        async move {
            let vm = vms.get("web").await.ok()?;
            let c = vm.status?.conditions.into_iter().find(|c| c.type_ == "ResourcesSynced")?;
            (c.status == "False" && c.reason == "RestartRequired").then_some(())
        }
    })
    .await;
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let (_, resized) = env
        .wait_for("Nova to run the server with 2 vCPUs", || async {
            nova_view(&h, &uid).await.filter(|(_, s)| s.power == PowerState::Running && s.cpus == 2)
        })
        .await;
    assert!(resized.memory_bytes >= 1 << 30, "{resized:?}");
    assert_eq!(resized.backend_id, server.backend_id);

    // kubectl drain moves it live to another compute host; the pod follows.
    let pod = env.pod_of("web").await;
    let from = node_of(&env.pods().get(&pod).await.unwrap());
    let drained = env.kubectl_output(&["drain", &from, "--ignore-daemonsets", "--timeout=300s"]);
    assert!(drained.status.success(), "drain: {}", String::from_utf8_lossy(&drained.stderr));
    env.kubectl(&["uncordon", &from]);
    let vm = env.wait_vm_phase("web", "Running").await;
    let (moved_to, moved) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    assert_ne!(env.node(&moved_to), from, "the server left the drained host");
    assert_eq!(moved.backend_id, server.backend_id, "moved, not recreated");
    let now = env.pod_of("web").await;
    assert_eq!(node_of(&env.pods().get(&now).await.unwrap()), env.node(&moved_to), "the pod followed");
    let migration = vm.status.unwrap().migration.expect("a migration record");
    assert_eq!(format!("{:?}", migration.phase), "Succeeded");

    // kill -9 and a restart: every server adopted, none created. The new
    // process has acted once it renewed the node's Lease and the pod shows
    // the server running.
    env.kill_vmlet();
    let restarted_at = k8s_openapi::jiff::Timestamp::now();
    env.restart_vmlet();
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(env.client.clone(), "kube-node-lease");
    let node = env.node(&moved_to);
    env.wait_for("the restarted vmlet to renew its node's Lease", || {
        let (leases, node) = (leases.clone(), node.clone());
        async move {
            let renewed = leases.get(&node).await.ok()?.spec?.renew_time?;
            (renewed.0 > restarted_at).then_some(())
        }
    })
    .await;
    env.wait_for("the VM to be Running under the new vmlet, on the same server", || async {
        let vm = env.vms().get("web").await.ok()?;
        let running = vm.status.as_ref()?.phase == Some(vmlet::v1alpha1::VmPhase::Running);
        let view = nova_view(&h, &uid).await?;
        (running && view.1.backend_id == server.backend_id && view.1.power == PowerState::Running).then_some(())
    })
    .await;
    assert_eq!(env.pod_of("web").await, now, "the same pod");
    assert_eq!(servers_with(&h, &uid).await, 1, "no second server");
}

/// The Ready condition of node `name`: (status, reason, message).
async fn ready_of(env: &TestEnv, name: &str) -> Option<(String, String, String)> {
    let node = env.nodes_api().get(name).await.ok()?;
    let c = node.status?.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
    Some((c.status, c.reason.unwrap_or_default(), c.message.unwrap_or_default()))
}

/// Restart vmlet with `clouds_yaml` as its clouds.yaml, then wait until node
/// `name` is NotReady with `reason` and a message containing `says`.
async fn restart_with(env: &mut TestEnv, clouds_yaml: &str, name: &str, reason: &str, says: &str) -> String {
    env.kill_vmlet();
    std::fs::write(env.dir.join("clouds.yaml"), clouds_yaml).unwrap();
    env.restart_vmlet();
    env.wait_for(&format!("node {name} NotReady with reason {reason}"), || async {
        let (status, why, message) = ready_of(env, name).await?;
        (status == "False" && why == reason && message.contains(says)).then_some(message)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_or_an_unreachable_cloud_turn_the_nodes_not_ready_saying_which_and_touch_no_server() {
    let Some(h) = harness("refused_credentials_or_an_unreachable_cloud") else { return };
    let mut env = TestEnv::new("novafail").await;
    env.start_vmlet_on_cloud(&h.clouds_yaml, &h.cloud_name, &h.hosts, allowed(&h));
    env.apply_vm("db", json!({"image": h.image, "providerOptions": {"networks": "none"}}));
    let vm = env.wait_vm_phase("db", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let (host, server) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    let node = env.node(&host);

    let password = std::env::var("OS_PASSWORD").expect("OS_PASSWORD from hack/nova.sh env");
    let quoted = format!("{password:?}");
    assert!(h.clouds_yaml.contains(&quoted), "the harness's clouds.yaml carries the password quoted");
    let refused = h.clouds_yaml.replace(&quoted, "\"not-the-password\"");
    let message = restart_with(&mut env, &refused, &node, "PermissionDenied", "Keystone").await;
    assert!(!message.contains("not-the-password"), "a secret reached the node's status: {message}");

    let auth_url = std::env::var("OS_AUTH_URL").expect("OS_AUTH_URL");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let unreachable = h.clouds_yaml.replace(&auth_url, &format!("http://127.0.0.1:{closed}/v3"));
    restart_with(&mut env, &unreachable, &node, "HostNotResponding", &format!("127.0.0.1:{closed}")).await;

    // Nothing happened to the server meanwhile; with the right clouds.yaml
    // the nodes are Ready again and the VM is adopted as it was.
    let (still, same) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    assert_eq!((still.as_str(), same.backend_id.as_str()), (host.as_str(), server.backend_id.as_str()));
    env.kill_vmlet();
    std::fs::write(env.dir.join("clouds.yaml"), &h.clouds_yaml).unwrap();
    env.restart_vmlet();
    env.wait_for(&format!("node {node} Ready again"), || async {
        (ready_of(&env, &node).await?.0 == "True").then_some(())
    })
    .await;
    env.wait_vm_phase("db", "Running").await;
    assert_eq!(servers_with(&h, &uid).await, 1, "no second server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_nova_moves_by_itself_is_followed_by_its_pod_and_never_duplicated() {
    let Some(h) = harness("a_server_nova_moves_by_itself") else { return };
    let mut env = TestEnv::new("novamove").await;
    env.start_vmlet_on_cloud(&h.clouds_yaml, &h.cloud_name, &h.hosts, allowed(&h));
    env.apply_vm("app", json!({"image": h.image, "providerOptions": {"networks": "none"}}));
    let vm = env.wait_vm_phase("app", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let (from, server) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    let to = h.hosts.iter().find(|other| **other != from).unwrap().clone();

    // An administrator live-migrates the server, behind vmlet's back.
    nova_harness::nova_action_behind_vmlet(
        &server.backend_id,
        json!({"os-migrateLive": {"host": to, "block_migration": "auto"}}),
    )
    .await;
    let (now_on, moved) = env
        .wait_for("Nova to run the server on the other host", || async {
            nova_view(&h, &uid).await.filter(|(host, s)| *host == to && s.power == PowerState::Running)
        })
        .await;
    assert_eq!((now_on.as_str(), moved.backend_id.as_str()), (to.as_str(), server.backend_id.as_str()));

    // The record moves and the VM's pod follows to the node of that host.
    let target = env.node(&to);
    let (vms, pods) = (env.vms(), env.pods());
    env.wait_for(&format!("the VM's record and its running pod on {target}"), || {
        let (vms, pods, target) = (vms.clone(), pods.clone(), target.clone());
        async move {
            let vm = vms.get("app").await.ok()?;
            let status = vm.status?;
            let recorded = status.placement?.node_name == target;
            let pod = pods.get(status.pod_name.as_deref()?).await.ok()?;
            let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
            (recorded && running && node_of(&pod) == target).then_some(())
        }
    })
    .await;
    let (still, same) = wait_nova(&env, &h, &uid, PowerState::Running).await;
    assert_eq!((still.as_str(), same.backend_id.as_str()), (to.as_str(), server.backend_id.as_str()));
    assert_eq!(servers_with(&h, &uid).await, 1, "no second server");
}

/// The waiting reason and message of the VM's current pod's container.
async fn waiting_of(env: &TestEnv, vm: &str) -> Option<(String, String)> {
    let pod = env.vm_pod(vm).await;
    let state = pod.status?.container_statuses?.into_iter().next()?.state?;
    let waiting = state.waiting?;
    Some((waiting.reason.unwrap_or_default(), waiting.message.unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_boot_an_image_or_join_a_network_the_administrator_did_not_list() {
    let Some(h) = harness("a_tenant_cannot_boot_an_image_or_join_a_network") else { return };
    let mut env = TestEnv::new("novadeny").await;
    env.start_vmlet_on_cloud(&h.clouds_yaml, &h.cloud_name, &h.hosts, allowed(&h));
    // Another project's private image and network, as far as this tenant
    // knows their ids (vmlet's admin user could use them).
    let other_image = "0b4ab3f9-0000-4000-8000-0000000000aa";
    let other_network = "0b4ab3f9-0000-4000-8000-0000000000bb";
    env.apply_vm("img", json!({"image": other_image}));
    env.apply_vm("net", json!({"image": h.image, "providerOptions": {"networks": other_network}}));
    env.apply_vm("wan", json!({"image": h.image, "networks": [{"name": "lan"}, {"name": "wan"}]}));
    for (vm, field, named) in [
        ("img", "spec.image", other_image),
        ("net", "spec.providerOptions.networks", other_network),
        ("wan", "spec.networks[1].name", "\"wan\""),
    ] {
        let (reason, message) = env
            .wait_for(&format!("{vm}'s pod to be refused naming {field}"), || async {
                waiting_of(&env, vm).await.filter(|(reason, _)| reason == "InvalidSpec")
            })
            .await;
        assert!(message.contains(field) && message.contains(named), "{vm}: {reason}: {message}");
        let uid = env.vms().get(vm).await.unwrap().metadata.uid.unwrap();
        assert_eq!(servers_with(&h, &uid).await, 0, "{vm}: no server was created");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_nova_node_is_a_cinder_volume_attached_to_the_server_grown_and_deleted_with_the_claim() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use reqwest::Method;
    let Some(h) = harness("a_claim_on_a_nova_node_is_a_cinder_volume") else { return };
    let mut env = TestEnv::new("novacinder").await;
    env.start_vmlet_on_cloud(&h.clouds_yaml, &h.cloud_name, &h.hosts, allowed(&h));
    // A class of Cinder's default volume type: its volumes attach on any
    // compute host, so its PersistentVolumes are tied to no node.
    let class = format!("{}-cinder", env.ns);
    let applied = env.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": class},
            "provisioner": "openstack.vmlet.io", "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Delete", "allowVolumeExpansion": true,
            "parameters": {"pool": "__DEFAULT__", "shared": "true"}})
        .to_string(),
    );
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
    env.apply(
        &json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data", "namespace": env.ns},
            "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}}}})
        .to_string(),
    );
    env.apply_vm(
        "db",
        json!({"image": h.image, "networks": [{"name": "lan"}],
            "disks": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}),
    );
    let vm = env.wait_vm_phase("db", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let (_, server) = wait_nova(&env, &h, &uid, PowerState::Running).await;

    // The claim is bound to vmlet's PersistentVolume for a Cinder volume of
    // vmlet's name, attached to the VM's server.
    let claims: kube::Api<PersistentVolumeClaim> = kube::Api::namespaced(env.client.clone(), &env.ns);
    let claim = claims.get("data").await.unwrap();
    let claim_uid = claim.metadata.uid.clone().unwrap();
    let pv_name = format!("pvc-{claim_uid}");
    assert_eq!(claim.spec.as_ref().unwrap().volume_name.as_deref(), Some(pv_name.as_str()));
    let pvs: kube::Api<PersistentVolume> = kube::Api::all(env.client.clone());
    let pv = pvs.get(&pv_name).await.unwrap();
    let csi = pv.spec.as_ref().unwrap().csi.clone().unwrap();
    let volume_name = format!("{}_data_{claim_uid}", env.ns);
    assert_eq!(csi.driver, "openstack.vmlet.io");
    assert!(csi.volume_handle.ends_with(&format!("/__DEFAULT__/{volume_name}")), "{}", csi.volume_handle);
    assert!(pv.spec.as_ref().unwrap().node_affinity.is_none(), "a Cinder volume is tied to no host: {pv:?}");
    let cinder = |path: String| async move { nova_harness::cinder_behind_vmlet(Method::GET, &path, None).await };
    let (status, listed) = cinder(format!("/volumes/detail?name={volume_name}")).await;
    assert_eq!(status, 200, "{listed}");
    let volume = listed["volumes"][0].clone();
    let volume_id = volume["id"].as_str().expect("a Cinder volume of the claim's name").to_owned();
    assert_eq!((volume["size"].as_u64(), volume["status"].as_str()), (Some(1), Some("in-use")), "{volume}");
    assert_eq!(volume["attachments"][0]["server_id"].as_str(), Some(server.backend_id.as_str()), "{volume}");

    // The tenant grows the claim: Cinder extends the attached volume.
    env.kubectl(&[
        "patch",
        "pvc/data",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}"#,
    ]);
    env.wait_for("Cinder to report 2 GiB and the claim to show it", || async {
        let (_, v) = cinder(format!("/volumes/{volume_id}")).await;
        let capacity = claims.get("data").await.ok()?.status?.capacity?.get("storage")?.0.clone();
        (v["volume"]["size"] == 2 && capacity == (2u64 << 30).to_string()).then_some(())
    })
    .await;

    // The VM goes: Nova detaches the volume and keeps it; the claim goes:
    // vmlet deletes the volume and the PersistentVolume.
    env.kubectl(&["delete", "vm/db", "--wait=true", "--timeout=180s"]);
    env.wait_for("the server to be gone", || async { (servers_with(&h, &uid).await == 0).then_some(()) }).await;
    let (_, v) = cinder(format!("/volumes/{volume_id}")).await;
    assert!(matches!(v["volume"]["status"].as_str(), Some("available" | "detaching")), "kept: {v}");
    env.kubectl(&["delete", "pvc/data", "--wait=true", "--timeout=180s"]);
    env.wait_for("the PersistentVolume and the Cinder volume to be gone", || async {
        let (status, _) = cinder(format!("/volumes/{volume_id}")).await;
        (pvs.get_opt(&pv_name).await.ok()?.is_none() && status == 404).then_some(())
    })
    .await;
    env.kubectl(&["delete", "storageclass", &class]);
}
