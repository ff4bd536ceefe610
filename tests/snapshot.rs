//! Snapshots, reverting a stopped VM to one, and restoring a stopped VM in
//! place from its backup, through the real API server, kube-scheduler, the
//! Job controller, vmlet and a real QEMU guest on libvirtd (`hack/test.sh`
//! starts them).
//!
//! The guest's disk is `/dev/vda`; markers go to its first sector
//! ([`common::disk`]): what the disk held at the snapshot (or backup) must
//! come back, and what was written after must not.

mod common;

use common::deadline::{output_within, VIRSH};
use common::disk::{domstate, read_marker, wait_backup_ended, wait_job_condition, write_marker};
use common::tenant::tenant;
use common::{guest_accelerator, guest_for, guest_vm_spec, qemu_uri, storage_root, Host, TestEnv};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::process::Command;
use vmlet::v1alpha1::{OperationPhase, VirtualMachineRestore, VirtualMachineSnapshot};

fn apply(env: &TestEnv, kind: &str, name: &str, spec: serde_json::Value) {
    let object = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": kind,
        "metadata": {"name": name, "namespace": env.ns}, "spec": spec});
    let out = env.apply(&object.to_string());
    assert!(out.status.success(), "apply {kind} {name}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Wait until snapshot `name` has ended (Succeeded or Failed); returns it.
async fn wait_snapshot_ended(env: &TestEnv, name: &str) -> VirtualMachineSnapshot {
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for(&format!("VirtualMachineSnapshot {name} to end"), || {
        let snapshots = snapshots.clone();
        async move {
            let snapshot = snapshots.get_opt(name).await.ok()??;
            let phase = snapshot.status.as_ref()?.phase?;
            matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(snapshot)
        }
    })
    .await
}

/// Wait until restore `name` has ended; returns it.
async fn wait_restore_ended(env: &TestEnv, name: &str) -> VirtualMachineRestore {
    let restores: Api<VirtualMachineRestore> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for(&format!("VirtualMachineRestore {name} to end"), || {
        let restores = restores.clone();
        async move {
            let restore = restores.get_opt(name).await.ok()??;
            let phase = restore.status.as_ref()?.phase?;
            matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(restore)
        }
    })
    .await
}

/// The names of the snapshots libvirt holds of VM `vm`'s domain.
fn libvirt_snapshots(env: &TestEnv, vm: &str) -> Vec<String> {
    let out = output_within(
        Command::new("virsh").arg("-c").arg(qemu_uri()).args(["snapshot-list", "--name", &format!("{}_{vm}", env.ns)]),
        VIRSH,
    );
    assert!(out.status.success(), "virsh snapshot-list: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect()
}

async fn stop(env: &TestEnv, vm: &str) {
    env.kubectl(&["scale", &format!("virtualmachine/{vm}"), "--replicas=0"]);
    env.wait_vm_phase(vm, "Stopped").await;
    env.wait_vm_pods_gone(vm).await;
}

async fn start(env: &TestEnv, vm: &str) -> String {
    env.kubectl(&["scale", &format!("virtualmachine/{vm}"), "--replicas=1"]);
    env.wait_vm_phase(vm, "Running").await;
    env.pod_of(vm).await
}

#[tokio::test]
async fn a_stopped_vm_goes_back_to_its_snapshot_and_to_its_backup_in_place() {
    let mut env = TestEnv::new("snapshot").await;
    let guest = guest_for(&env);
    let backups_dir = storage_root(&env).join("backups");
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }
        .with("backupRoots", json!([backups_dir]))]);
    env.apply_vm("web", guest_vm_spec(&guest));
    let vm = env.wait_vm_phase("web", "Running").await;
    let node = vm.status.as_ref().and_then(|s| s.node_name.clone()).unwrap();
    let pod = env.pod_of("web").await;
    write_marker(&env, &pod, "at-snapshot").await;

    // A snapshot of the running VM: a Job on its node; with memory; it runs on.
    apply(&env, "VirtualMachineSnapshot", "before-upgrade", json!({"virtualMachine": "web"}));
    wait_job_condition(&env, "before-upgrade-snapshot", "Complete").await;
    let snapshot = wait_snapshot_ended(&env, "before-upgrade").await;
    let status = snapshot.status.clone().unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    assert!(status.ready_to_use);
    assert_eq!(status.memory, Some(true), "a running VM's internal snapshot holds its memory");
    assert_eq!(status.virtual_machine_was_running, Some(true));
    assert_eq!(status.node_name.as_deref(), Some(node.as_str()));
    assert_eq!(status.virtual_machine_uid, vm.metadata.uid);
    let backend_name = status.snapshot_name.clone().unwrap();
    assert_eq!(backend_name, format!("{}_before-upgrade_{}", env.ns, snapshot.metadata.uid.clone().unwrap()));
    assert_eq!(libvirt_snapshots(&env, "web"), vec![backend_name.clone()]);
    assert_eq!(domstate(&env, "web"), "running");
    let log = env.kubectl(&["logs", "job/before-upgrade-snapshot"]);
    assert!(log.contains(&format!("snapshot {backend_name} taken, with the VM's memory")), "{log}");

    // A tenant of another namespace, through the API with only its own
    // rights, names this namespace's snapshot from a Job pod bound to the
    // VM's node, and asks to revert this namespace's VM: neither reaches it.
    let attacker = format!("{}-x", env.ns);
    let rules = json!([
        {"apiGroups": ["", "batch"], "resources": ["pods", "pods/log", "jobs"], "verbs": ["*"]},
        {"apiGroups": ["vmlet.io"], "resources": ["virtualmachinesnapshots", "virtualmachinerestores"], "verbs": ["*"]},
    ]);
    let tenant = tenant(&env, &attacker, rules).await;
    let their_jobs: Api<Job> = Api::namespaced(tenant.client.clone(), &attacker);
    let their_pods: Api<Pod> = Api::namespaced(tenant.client.clone(), &attacker);
    // A Job of theirs whose pod carries `annotation` (naming `object`) and is
    // bound to the VM's node; the pod's failure message once it failed.
    let grab = |job_name: &'static str, annotation: &'static str, object: &'static str| {
        let (their_jobs, their_pods, node) = (their_jobs.clone(), their_pods.clone(), node.clone());
        let env = &env;
        async move {
            let job: Job = serde_json::from_value(json!({
                "metadata": {"name": job_name},
                "spec": {"backoffLimit": 0, "template": {
                    "metadata": {"annotations": {annotation: object}},
                    "spec": {"nodeName": node, "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
                        "containers": [{"name": "task", "image": "vmlet.io/virtual-machine"}]}}},
            }))
            .unwrap();
            their_jobs.create(&PostParams::default(), &job).await.expect("the tenant may create Jobs in its namespace");
            let selector = format!("job-name={job_name}");
            let (pod, message) = env
                .wait_for(&format!("the tenant's Job {job_name}'s pod to fail"), || {
                    let (their_pods, selector) = (their_pods.clone(), selector.clone());
                    async move {
                        let pods = their_pods.list(&ListParams::default().labels(&selector)).await.ok()?;
                        let pod = pods.items.first()?.clone();
                        let status = pod.status.clone()?;
                        (status.phase.as_deref() == Some("Failed"))
                            .then(|| (pod.name_any(), status.message.unwrap_or_default()))
                    }
                })
                .await;
            let log = their_pods.logs(&pod, &LogParams::default()).await.unwrap_or_default();
            (message, log)
        }
    };
    let (grabbed, log) = grab("grab", "vmlet.io/snapshot", "before-upgrade").await;
    assert!(grabbed.contains(&format!("this vmlet serves namespace {} only", env.ns)), "{grabbed}");
    assert!(!log.contains(&backend_name), "the tenant's pod log shows the victim's snapshot: {log}");
    // Their own restore "in place" of a VM named like the victim's, run by a
    // Job pod on the VM's node: refused as well.
    let revert: VirtualMachineRestore = serde_json::from_value(json!({
        "metadata": {"name": "revert-theirs"},
        "spec": {"source": {"snapshot": "before-upgrade"}, "target": {"virtualMachine": "web", "inPlace": true}},
    }))
    .unwrap();
    let their_restores: Api<VirtualMachineRestore> = Api::namespaced(tenant.client.clone(), &attacker);
    their_restores.create(&PostParams::default(), &revert).await.expect("the tenant may create restores");
    let (refused, _) = grab("revert", "vmlet.io/restore", "revert-theirs").await;
    assert!(refused.contains(&format!("this vmlet serves namespace {} only", env.ns)), "{refused}");
    assert_eq!(libvirt_snapshots(&env, "web"), vec![backend_name.clone()]);
    assert_eq!(domstate(&env, "web"), "running");
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let _ = namespaces.delete(&attacker, &DeleteParams::default()).await;

    // A disk-only snapshot of a running VM cannot be had on libvirt: it says why.
    apply(&env, "VirtualMachineSnapshot", "disk-only", json!({"virtualMachine": "web", "memory": false}));
    let refused = wait_snapshot_ended(&env, "disk-only").await.status.unwrap();
    assert_eq!(refused.phase, Some(OperationPhase::Failed));
    assert!(refused.message.clone().unwrap_or_default().contains("memory"), "{:?}", refused.message);
    assert_eq!(domstate(&env, "web"), "running");

    // The backup holds what was written after the snapshot.
    write_marker(&env, &pod, "at-backup").await;
    apply(&env, "VirtualMachineBackup", "nightly", json!({"virtualMachine": "web"}));
    let backup = wait_backup_ended(&env, "nightly").await.status.unwrap();
    assert_eq!(backup.phase, Some(OperationPhase::Succeeded), "{:?}", backup.message);
    write_marker(&env, &pod, "after-both").await;

    // In place is never under a running VM.
    apply(
        &env,
        "VirtualMachineRestore",
        "too-early",
        json!({"source": {"snapshot": "before-upgrade"}, "target": {"virtualMachine": "web", "inPlace": true}}),
    );
    let early = wait_restore_ended(&env, "too-early").await.status.unwrap();
    assert_eq!(early.phase, Some(OperationPhase::Failed));
    assert!(early.message.clone().unwrap_or_default().contains("--replicas=0"), "{:?}", early.message);
    assert_eq!(domstate(&env, "web"), "running");
    assert_eq!(read_marker(&env, &pod).await, "after-both");

    // A snapshot names its VM: it cannot revert another one.
    let mut other = guest_vm_spec(&guest);
    other["replicas"] = json!(0);
    env.apply_vm("other", other);
    apply(
        &env,
        "VirtualMachineRestore",
        "wrong-vm",
        json!({"source": {"snapshot": "before-upgrade"}, "target": {"virtualMachine": "other", "inPlace": true}}),
    );
    let wrong = wait_restore_ended(&env, "wrong-vm").await.status.unwrap();
    assert_eq!(wrong.phase, Some(OperationPhase::Failed));
    assert!(wrong.message.clone().unwrap_or_default().contains("not a snapshot of this"), "{:?}", wrong.message);

    // A new VM from the snapshot while the VM runs on: its disk is the
    // snapshot's, on the same host; the original is untouched.
    apply(
        &env,
        "VirtualMachineRestore",
        "clone",
        json!({"source": {"snapshot": "before-upgrade"}, "target": {"virtualMachine": "copy"}}),
    );
    wait_job_condition(&env, "clone-restore", "Complete").await;
    let cloned = wait_restore_ended(&env, "clone").await;
    let status = cloned.status.clone().unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    let disk = status.disk.clone().expect("the new disk is recorded");
    let expected = format!("{}_copy_restored_{}.qcow2", env.ns, cloned.metadata.uid.clone().unwrap());
    assert!(disk.ends_with(&format!("/{expected}")), "{disk}");
    assert!(std::path::Path::new(&disk).is_file(), "{disk} on the host");
    let copy = env.wait_vm_phase("copy", "Running").await;
    assert_eq!(copy.status.as_ref().and_then(|s| s.node_name.clone()), Some(node.clone()));
    assert_eq!(copy.labels().get("vmlet.io/restored-from-snapshot").map(String::as_str), Some("before-upgrade"));
    assert_eq!(copy.spec.image.as_deref(), Some(disk.as_str()));
    assert_eq!(status.virtual_machine_uid, copy.metadata.uid);
    let copy_pod = env.pod_of("copy").await;
    assert_eq!(read_marker(&env, &copy_pod).await, "at-snapshot", "the new VM's disk is the snapshot's");
    assert_eq!(read_marker(&env, &pod).await, "after-both", "the original VM runs on with its own disk");
    assert_eq!(domstate(&env, "web"), "running");
    assert_eq!(libvirt_snapshots(&env, "web"), vec![backend_name.clone()], "the snapshot is kept");
    env.kubectl(&["delete", "virtualmachine/copy", "--wait=false"]);

    // Revert the stopped VM to the snapshot.
    stop(&env, "web").await;
    apply(
        &env,
        "VirtualMachineRestore",
        "revert",
        json!({"source": {"snapshot": "before-upgrade"}, "target": {"virtualMachine": "web", "inPlace": true}}),
    );
    wait_job_condition(&env, "revert-restore", "Complete").await;
    let reverted = wait_restore_ended(&env, "revert").await.status.unwrap();
    assert_eq!(reverted.phase, Some(OperationPhase::Succeeded), "{:?}", reverted.message);
    assert_eq!(reverted.virtual_machine_uid, vm.metadata.uid);
    assert_eq!(domstate(&env, "web"), "shut off", "a revert leaves the VM stopped");
    let pod = start(&env, "web").await;
    assert_eq!(read_marker(&env, &pod).await, "at-snapshot");

    // Put the stopped VM back as its backup holds it; the old disk is kept.
    write_marker(&env, &pod, "replaced").await;
    stop(&env, "web").await;
    apply(
        &env,
        "VirtualMachineRestore",
        "from-backup",
        json!({"source": {"backup": "nightly"}, "target": {"virtualMachine": "web", "inPlace": true}}),
    );
    let restored = wait_restore_ended(&env, "from-backup").await;
    let status = restored.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    let kept = status.previous_disk.clone().expect("the previous disk is recorded");
    assert!(kept.ends_with(&format!(".before-{}", restored.metadata.uid.unwrap())), "{kept}");
    assert!(std::path::Path::new(&kept).is_file(), "{kept} kept on the host");
    assert_eq!(status.disk.as_deref(), guest_vm_spec(&guest)["image"].as_str());
    let pod = start(&env, "web").await;
    assert_eq!(read_marker(&env, &pod).await, "at-backup");
    // The snapshot lived in the replaced disk: it is no longer the VM's.
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(env.client.clone(), &env.ns);
    let retired = snapshots.get("before-upgrade").await.unwrap().status.unwrap();
    assert!(!retired.ready_to_use);
    assert!(retired.message.clone().unwrap_or_default().contains(&kept), "{:?}", retired.message);

    // Deleting the snapshot removes it from the host through a Job.
    snapshots.delete("before-upgrade", &DeleteParams::default()).await.expect("delete the snapshot");
    env.wait_for("the snapshot object to be gone", || {
        let snapshots = snapshots.clone();
        async move { snapshots.get_opt("before-upgrade").await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert!(libvirt_snapshots(&env, "web").is_empty(), "{:?}", libvirt_snapshots(&env, "web"));
    assert_eq!(domstate(&env, "web"), "running");
}
