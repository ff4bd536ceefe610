//! Data disks from PersistentVolumeClaims, through the real API server,
//! kube-scheduler's volume binding, kube-controller-manager's PV and
//! pvc-protection controllers, vmlet and a real QEMU guest on libvirtd.
//!
//! A local PersistentVolume on the QEMU host (a directory under its storage
//! root) and a StorageClass with `WaitForFirstConsumer`: the VM must start on
//! that host although a second host has room, its writes must survive a stop
//! and start, and deleting the claim while the VM runs must be held.

mod common;

use common::{guest_accelerator, guest_for, guest_vm_spec, storage_root, test_driver_uri, Host, TestEnv};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, PostParams};
use kube::ResourceExt;
use serde_json::json;

/// Cluster-scoped objects of the test (a StorageClass and a
/// PersistentVolume named after the namespace), deleted on drop with kubectl
/// under its deadline (the test's kube client cannot be used from Drop).
struct ClusterObjects {
    name: String,
}

impl Drop for ClusterObjects {
    fn drop(&mut self) {
        let cluster = common::cluster();
        let mut kubectl = std::process::Command::new(cluster.bin.join("kubectl"));
        kubectl.env("KUBECONFIG", &cluster.kubeconfig).args([
            "delete",
            &format!("persistentvolume/{}", self.name),
            &format!("storageclass/{}", self.name),
            "--ignore-not-found",
            "--wait=false",
        ]);
        let _ = common::deadline::output_within(&mut kubectl, common::kubectl_deadline(&["delete"]));
    }
}

async fn exec_stdout(env: &TestEnv, pod: &str, script: &str) -> String {
    env.wait_for(&format!("the guest of {pod} to run {script:?}"), || {
        let out = env.kubectl_output(&["exec", pod, "--", "sh", "-c", script]);
        async move { out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()) }
    })
    .await
}

#[tokio::test]
async fn a_vm_with_a_claim_starts_where_its_volume_is_keeps_its_writes_and_holds_the_claim() {
    let mut env = TestEnv::new("volumes").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[
        Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") },
        Host::new("t", test_driver_uri("host-a.xml")),
    ]);
    let qemu_node = env.node("q");
    env.wait_node_ready(&qemu_node).await;
    env.wait_node_ready(&env.node("t")).await;

    let dir = storage_root(&env).join("vol-1");
    std::fs::create_dir_all(&dir).unwrap();
    let objects = ClusterObjects { name: env.ns.clone() };
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": objects.name},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "WaitForFirstConsumer",
    }))
    .unwrap();
    Api::<StorageClass>::all(env.client.clone()).create(&PostParams::default(), &class).await.unwrap();
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": objects.name},
        "spec": {
            "capacity": {"storage": "64Mi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": objects.name,
            "local": {"path": dir},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [qemu_node]}]}]}},
        },
    }))
    .unwrap();
    Api::<PersistentVolume>::all(env.client.clone()).create(&PostParams::default(), &volume).await.unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data"},
        "spec": {"storageClassName": objects.name, "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "64Mi"}}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();

    let mut spec = guest_vm_spec(&guest);
    spec["disks"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    env.apply_vm("web", spec);
    let vm = env.wait_vm_phase("web", "Running").await;
    assert_eq!(vm.status.unwrap().node_name.as_deref(), Some(qemu_node.as_str()), "the VM runs where its volume is");
    let image = dir.join("disk.img");
    assert_eq!(std::fs::metadata(&image).map(|m| m.len()).ok(), Some(64 << 20), "a 64 MiB image in the volume");

    let pod = env.pod_of("web").await;
    let mark = format!("kept-{}", env.ns);
    let write = format!("printf '%s\\n' {mark} | dd of=/dev/vdb bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok");
    assert_eq!(exec_stdout(&env, &pod, &write).await, "ok");

    // Stop and start: the disk keeps what was written.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let read = "dd if=/dev/vdb bs=512 count=1 2>/dev/null | head -n 1";
    assert_eq!(exec_stdout(&env, &pod, read).await, mark);

    // Deleting the claim while the VM runs is held by Kubernetes.
    claims.delete("data", &DeleteParams::default()).await.expect("delete the claim");
    let held = claims.get("data").await.expect("the claim still exists while the VM uses it");
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(held.finalizers().iter().any(|f| f == "kubernetes.io/pvc-protection"), "{:?}", held.finalizers());
    env.wait_vm_phase("web", "Running").await;
    assert_eq!(exec_stdout(&env, &pod, read).await, mark, "the VM runs on with its disk");

    // Once the VM stops, the claim goes.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.wait_for("the claim to be gone once no pod uses it", || {
        let claims = claims.clone();
        async move { claims.get_opt("data").await.ok()?.is_none().then_some(()) }
    })
    .await;
    drop(objects);
}
