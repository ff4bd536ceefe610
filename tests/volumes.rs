//! Data disks from PersistentVolumeClaims, through the real API server,
//! kube-scheduler's volume binding, kube-controller-manager's PV and
//! pvc-protection controllers, vmlet and a real QEMU guest on libvirtd.
//!
//! A local PersistentVolume on the QEMU host (a directory under its storage
//! root) and a StorageClass with `WaitForFirstConsumer`: the VM must start on
//! that host although a second host has room, its writes must survive a stop
//! and start, and deleting the claim while the VM runs must be held.

mod common;

use common::disk::wait_backup_ended;
use common::{guest_accelerator, guest_for, guest_vm_spec, storage_root, test_driver_uri, Host, TestEnv};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::path::Path;
use vmlet::v1alpha1::OperationPhase;

/// Cluster-scoped objects of the test: a StorageClass named after the
/// namespace and PersistentVolumes `<namespace>`, `<namespace>-<suffix>`…
/// of it, deleted on drop with kubectl under its deadline (the test's kube
/// client cannot be used from Drop).
struct ClusterObjects {
    name: String,
    volumes: Vec<String>,
}

impl ClusterObjects {
    /// The StorageClass (`WaitForFirstConsumer`, no provisioner).
    async fn new(env: &TestEnv) -> ClusterObjects {
        let objects = ClusterObjects { name: env.ns.clone(), volumes: Vec::new() };
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": objects.name},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        }))
        .unwrap();
        Api::<StorageClass>::all(env.client.clone()).create(&PostParams::default(), &class).await.unwrap();
        objects
    }

    /// A 64 MiB local PersistentVolume of the class at `dir` on `node`, reserved
    /// for (`claimRef`) a claim `claim` of the test's namespace, and that claim.
    async fn volume_and_claim(&mut self, env: &TestEnv, suffix: &str, dir: &Path, node: &str, claim: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let name = if suffix.is_empty() { self.name.clone() } else { format!("{}-{suffix}", self.name) };
        self.volumes.push(name.clone());
        let volume: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "64Mi"}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": self.name,
                // Reserved for its claim: two volumes of one class and size
                // would otherwise go to whichever claim binds first.
                "claimRef": {"namespace": env.ns, "name": claim},
                "local": {"path": dir},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}},
            },
        }))
        .unwrap();
        Api::<PersistentVolume>::all(env.client.clone()).create(&PostParams::default(), &volume).await.unwrap();
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": claim},
            "spec": {"storageClassName": self.name, "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "64Mi"}}},
        }))
        .unwrap();
        claims.create(&PostParams::default(), &claim).await.unwrap();
    }
}

impl Drop for ClusterObjects {
    fn drop(&mut self) {
        let cluster = common::cluster();
        let mut kubectl = std::process::Command::new(cluster.bin.join("kubectl"));
        kubectl.env("KUBECONFIG", &cluster.kubeconfig).arg("delete");
        kubectl.args(self.volumes.iter().map(|v| format!("persistentvolume/{v}")));
        kubectl.args([&format!("storageclass/{}", self.name), "--ignore-not-found", "--wait=false"]);
        let _ = common::deadline::output_within(&mut kubectl, common::kubectl_deadline(&["delete"]));
    }
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
    let mut objects = ClusterObjects::new(&env).await;
    objects.volume_and_claim(&env, "", &dir, &qemu_node, "data").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);

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
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");

    // Stop and start: the disk keeps what was written.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let read = "dd if=/dev/vdb bs=512 count=1 2>/dev/null | head -n 1";
    assert_eq!(env.exec_stdout(&pod, read).await, mark);

    // Deleting the claim while the VM runs is held by Kubernetes.
    claims.delete("data", &DeleteParams::default()).await.expect("delete the claim");
    let held = claims.get("data").await.expect("the claim still exists while the VM uses it");
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(held.finalizers().iter().any(|f| f == "kubernetes.io/pvc-protection"), "{:?}", held.finalizers());
    env.wait_vm_phase("web", "Running").await;
    assert_eq!(env.exec_stdout(&pod, read).await, mark, "the VM runs on with its disk");

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

#[tokio::test]
async fn a_backup_to_a_claim_binds_it_next_to_the_vm_and_writes_only_under_the_backup_roots() {
    let mut env = TestEnv::new("backup-claim").await;
    let guest = guest_for(&env);
    let backup_root = storage_root(&env).join("backups");
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }
        .with("backupRoots", json!([backup_root]))]);
    let node = env.node("q");
    env.wait_node_ready(&node).await;
    let mut objects = ClusterObjects::new(&env).await;
    let inside = backup_root.join("vol-nightly");
    objects.volume_and_claim(&env, "in", &inside, &node, "nightly-target").await;
    // A volume outside the backup roots (under the storage root, where VM disks are).
    let outside = storage_root(&env).join("vol-elsewhere");
    objects.volume_and_claim(&env, "out", &outside, &node, "elsewhere").await;
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;

    let backup = |name: &str, claim: &str| {
        json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineBackup",
            "metadata": {"name": name, "namespace": env.ns},
            "spec": {"virtualMachine": "web", "target": {"persistentVolumeClaim": {"claimName": claim}}}})
        .to_string()
    };
    assert!(env.apply(&backup("nightly", "nightly-target")).status.success());
    let done = wait_backup_ended(&env, "nightly").await;
    let status = done.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    let file = inside.join(format!("{}_nightly_{}.qcow2", env.ns, done.metadata.uid.unwrap()));
    assert_eq!(status.location.as_deref(), file.to_str());
    assert!(file.is_file(), "the backup is in the claim's directory");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let bound = claims.get("nightly-target").await.unwrap();
    assert_eq!(bound.status.and_then(|s| s.phase).as_deref(), Some("Bound"), "the backup's pod bound the claim");

    assert!(env.apply(&backup("stray", "elsewhere")).status.success());
    let refused = wait_backup_ended(&env, "stray").await.status.unwrap();
    assert_eq!(refused.phase, Some(OperationPhase::Failed));
    let message = refused.message.unwrap_or_default();
    assert!(message.contains("spec.target.persistentVolumeClaim") && message.contains("backupRoots"), "{message}");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing written outside the backup roots");
    drop(objects);
}
