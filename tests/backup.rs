//! Backups as Jobs pinned next to the VM, and restores from them, through the
//! real API server, kube-scheduler, the Job controller, vmlet and a real QEMU
//! guest on libvirtd (`hack/test.sh` starts them).
//!
//! The guest's disk is `/dev/vda` (64 MiB, raw blocks, no filesystem): a
//! marker written to its first sector before the backup must come back in a
//! VM restored from it, and one written after must not.

mod common;

use common::deadline::{output_within, VIRSH};
use common::disk::{domstate, fill_random, read_marker, wait_backup_ended, wait_job_condition, write_marker};
use common::pool::Pool;
use common::{device_named, guest_accelerator, guest_for, guest_vm_spec, qemu_uri, storage_root, Host, TestEnv};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use std::process::Command;
use std::time::Duration;
use vmlet::v1alpha1::{OperationPhase, VirtualMachineBackup, VirtualMachineRestore};

fn apply_backup(env: &TestEnv, name: &str, spec: serde_json::Value) {
    let object = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineBackup",
        "metadata": {"name": name, "namespace": env.ns}, "spec": spec});
    let out = env.apply(&object.to_string());
    assert!(out.status.success(), "apply backup {name}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A tmpfs of 1 MiB at `dir`, unmounted on drop.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(dir: std::path::PathBuf) -> SmallFs {
        std::fs::create_dir_all(&dir).unwrap();
        let out = output_within(
            Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m,mode=0777", "vmlet-full"]).arg(&dir),
            Duration::from_secs(30),
        );
        assert!(out.status.success(), "mount tmpfs: {}", String::from_utf8_lossy(&out.stderr));
        SmallFs(dir)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = output_within(Command::new("umount").arg("-l").arg(&self.0), Duration::from_secs(30));
    }
}

#[tokio::test]
async fn a_backup_job_runs_next_to_the_vm_and_a_restore_boots_what_it_held() {
    let mut env = TestEnv::new("backup").await;
    let guest = guest_for(&env);
    let backups_dir = storage_root(&env).join("backups");
    let full_dir = storage_root(&env).join("full");
    let _small = SmallFs::mount(full_dir.clone());
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }
        .with("backupRoots", json!([backups_dir, full_dir]))]);
    env.apply_vm("web", guest_vm_spec(&guest));
    let vm = env.wait_vm_phase("web", "Running").await;
    let node = vm.status.unwrap().node_name.unwrap();
    let pod = env.pod_of("web").await;
    // 4 MiB of data that does not compress to nothing, past the marker's
    // sector: too much for the 1 MiB target below.
    fill_random(&env, &pod, 4).await;
    let mark = format!("before-{}", env.ns);
    write_marker(&env, &pod, &mark).await;

    // The backup: a Job whose pod the scheduler puts on the VM's node.
    apply_backup(&env, "nightly", json!({"virtualMachine": "web"}));
    let job = wait_job_condition(&env, "nightly-backup", "Complete").await;
    assert_eq!(job.spec.unwrap().backoff_limit, Some(0));
    let backup = wait_backup_ended(&env, "nightly").await;
    let status = backup.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    assert_eq!(status.node_name.as_deref(), Some(node.as_str()));
    assert_eq!(status.total_bytes, Some(64 << 20), "the guest's disk is 64 MiB");
    assert_eq!(
        status.consistency.as_deref(),
        Some("Quiesced"),
        "the guest has an agent: {:?}",
        status.consistency_reason
    );
    let location = status.location.unwrap();
    assert!(location.starts_with(&backups_dir.display().to_string()), "{location}");
    assert!(location.ends_with(&format!("{}_nightly_{}.qcow2", env.ns, backup.metadata.uid.unwrap())), "{location}");
    assert!(std::fs::metadata(&location).is_ok_and(|m| m.len() > 0), "no backup file at {location}");
    let backup_pods: Vec<Pod> =
        env.pods().list(&kube::api::ListParams::default().labels("vmlet.io/backup=nightly")).await.unwrap().items;
    assert_eq!(backup_pods.len(), 1);
    let backup_pod = &backup_pods[0];
    assert_eq!(backup_pod.spec.as_ref().unwrap().node_name.as_deref(), Some(node.as_str()), "pinned next to the VM");
    assert_eq!(backup_pod.status.as_ref().unwrap().phase.as_deref(), Some("Succeeded"));
    let log = env.kubectl(&["logs", "job/nightly-backup"]);
    assert!(log.contains("MiB of 64.0 MiB") && log.contains("%)"), "no progress in the Job's log:\n{log}");
    assert!(log.contains("backup complete"), "{log}");
    assert_eq!(domstate(&env, "web"), "running", "the backup never stops the VM");

    // Written after the backup: must not come back.
    write_marker(&env, &pod, &format!("after-{}", env.ns)).await;

    // The restore: a new VM on the backup's host whose disk is the backup's.
    let restore = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "back", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web-restored"}}});
    let out = env.apply(&restore.to_string());
    assert!(out.status.success(), "apply restore: {}", String::from_utf8_lossy(&out.stderr));
    let restores: Api<VirtualMachineRestore> = Api::namespaced(env.client.clone(), &env.ns);
    let restored = env
        .wait_for("VirtualMachineRestore back to end", || {
            let restores = restores.clone();
            async move {
                let r = restores.get_opt("back").await.ok()??;
                let phase = r.status.as_ref()?.phase?;
                matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(r)
            }
        })
        .await;
    let restored_status = restored.status.unwrap();
    assert_eq!(restored_status.phase, Some(OperationPhase::Succeeded), "{:?}", restored_status.message);
    let vm = env.wait_vm_phase("web-restored", "Running").await;
    assert_eq!(vm.status.unwrap().node_name.as_deref(), Some(node.as_str()));
    let restored_pod = env.pod_of("web-restored").await;
    let first_sector = read_marker(&env, &restored_pod).await;
    assert_eq!(first_sector, mark, "the restored disk holds what was written before the backup, not after");

    // A restore never writes over a VM.
    let again = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "over", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web"}}});
    assert!(env.apply(&again.to_string()).status.success());
    let over = env
        .wait_for("VirtualMachineRestore over to fail", || {
            let restores = restores.clone();
            async move {
                let r = restores.get_opt("over").await.ok()??;
                (r.status.as_ref()?.phase? == OperationPhase::Failed).then_some(r)
            }
        })
        .await;
    assert!(over.status.unwrap().message.unwrap().contains("never writes over"));

    // A target without room: the Job fails with the reason, the VM runs on.
    apply_backup(&env, "no-room", json!({"virtualMachine": "web", "target": {"hostPath": full_dir}}));
    wait_job_condition(&env, "no-room-backup", "Failed").await;
    let failed = wait_backup_ended(&env, "no-room").await.status.unwrap();
    assert_eq!(failed.phase, Some(OperationPhase::Failed));
    let message = failed.message.unwrap();
    assert!(message.to_lowercase().contains("space"), "the message does not say the target is full: {message}");
    assert_eq!(domstate(&env, "web"), "running");
    assert_eq!(std::fs::read_dir(&full_dir).unwrap().count(), 0, "the partial file is removed");

    // A directory outside the host's backup roots: refused, nothing written.
    apply_backup(&env, "escape", json!({"virtualMachine": "web", "target": {"hostPath": "/etc"}}));
    let escape = wait_backup_ended(&env, "escape").await.status.unwrap();
    assert_eq!(escape.phase, Some(OperationPhase::Failed));
    assert!(escape.message.as_deref().unwrap_or_default().contains("backupRoots"), "{:?}", escape.message);
    assert!(!std::fs::read_dir("/etc").unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("escape")));

    // A tenant's hand-made pod naming the backup, bound to the node without
    // a Job: refused, nothing run, no log.
    let forged: Pod = serde_json::from_value(json!({
        "metadata": {"name": "forged", "annotations": {"vmlet.io/backup": "nightly"}},
        "spec": {"nodeName": node, "restartPolicy": "Never",
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "backup", "image": "vmlet.io/virtual-machine"}]},
    }))
    .unwrap();
    env.pods().create(&PostParams::default(), &forged).await.expect("create the forged pod");
    assert_eq!(env.wait_pod_failed(&env.pods(), "forged").await.as_deref(), Some("NotAVirtualMachineTask"));
    let forged_status = env.pods().get("forged").await.unwrap().status.unwrap();
    assert!(forged_status.message.unwrap().contains("not a Job's pod"));
    assert_eq!(env.kubectl(&["logs", "forged"]).trim(), "", "a refused pod has no log");

    // Another namespace's tenant: a Job of theirs whose pod names this
    // namespace's backup and is bound to the VM's node (pods are served by
    // node, from every namespace) reaches nothing here.
    let attacker = format!("{}-x", env.ns);
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client.clone());
    let ns_object = serde_json::from_value(json!({"metadata": {"name": attacker}})).unwrap();
    namespaces.create(&PostParams::default(), &ns_object).await.expect("create the attacker's namespace");
    let their_jobs: Api<Job> = Api::namespaced(env.client.clone(), &attacker);
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "grab"},
        "spec": {"backoffLimit": 0, "template": {
            "metadata": {"annotations": {"vmlet.io/backup": "nightly"}},
            "spec": {"nodeName": node, "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "backup", "image": "vmlet.io/virtual-machine"}]}}},
    }))
    .unwrap();
    their_jobs.create(&PostParams::default(), &job).await.expect("create the attacker's Job");
    let their_pods: Api<Pod> = Api::namespaced(env.client.clone(), &attacker);
    let grabbed = env
        .wait_for("the attacker's Job pod to fail", || {
            let their_pods = their_pods.clone();
            async move {
                let pods = their_pods.list(&kube::api::ListParams::default().labels("job-name=grab")).await.ok()?;
                let status = pods.items.first()?.status.clone()?;
                (status.phase.as_deref() == Some("Failed")).then(|| status.message.unwrap_or_default())
            }
        })
        .await;
    // This vmlet serves its namespace only: the pod is refused before anything is looked up.
    assert!(grabbed.contains(&format!("this vmlet serves namespace {} only", env.ns)), "{grabbed}");
    let victim_files = std::fs::read_dir(&backups_dir).unwrap().count();
    assert_eq!(victim_files, 1, "only the nightly backup is in the backup root");
    let _ = namespaces.delete(&attacker, &Default::default()).await;

    // A guest whose agent does not answer (stopped, as a hung one): the
    // backup still runs, crash-consistent, and says why.
    let stop_agent = "(sleep 1; killall -STOP qemu-ga) >/dev/null 2>&1 &";
    assert!(env.kubectl_output(&["exec", &pod, "--", "sh", "-c", stop_agent]).status.success());
    let domain = format!("{}_web", env.ns);
    env.wait_for("the guest agent to stop answering", || {
        let ping = output_within(
            Command::new("virsh").arg("-c").arg(qemu_uri()).args([
                "qemu-agent-command",
                &domain,
                r#"{"execute":"guest-ping"}"#,
                "--timeout",
                "2",
            ]),
            VIRSH,
        );
        async move { (!ping.status.success()).then_some(()) }
    })
    .await;
    apply_backup(&env, "no-agent", json!({"virtualMachine": "web"}));
    let no_agent = wait_backup_ended(&env, "no-agent").await.status.unwrap();
    assert_eq!(no_agent.phase, Some(OperationPhase::Succeeded), "{:?}", no_agent.message);
    assert_eq!(no_agent.consistency.as_deref(), Some("CrashConsistent"));
    let reason = no_agent.consistency_reason.unwrap_or_default();
    assert!(reason.contains("agent"), "the reason does not name the agent: {reason}");
    assert_eq!(domstate(&env, "web"), "running");
}

/// A test namespace `prefix-…` with the test guest and a vmlet serving one
/// QEMU host whose backup root is `<storage root>/backups`.
async fn vmlet_with_backups(prefix: &str) -> (TestEnv, std::path::PathBuf) {
    let mut env = TestEnv::new(prefix).await;
    let guest = guest_for(&env);
    let backups_dir = storage_root(&env).join("backups");
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }
        .with("backupRoots", json!([backups_dir]))]);
    (env, guest)
}

#[tokio::test]
async fn an_incremental_backup_copies_what_changed_and_a_restore_reads_its_chain() {
    let (env, guest) = vmlet_with_backups("incr").await;
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;

    // Without an earlier backup that left a checkpoint there is nothing to build on.
    apply_backup(&env, "too-soon", json!({"virtualMachine": "web", "mode": "Incremental"}));
    let refused = wait_backup_ended(&env, "too-soon").await.status.unwrap();
    assert_eq!(refused.phase, Some(OperationPhase::Failed));
    assert!(refused.message.clone().unwrap_or_default().contains("take a Full backup"), "{:?}", refused.message);

    fill_random(&env, &pod, 8).await;
    write_marker(&env, &pod, "in-the-full-one").await;
    apply_backup(&env, "sunday", json!({"virtualMachine": "web", "checkpoint": true}));
    let full = wait_backup_ended(&env, "sunday").await;
    let full_status = full.status.clone().unwrap();
    assert_eq!(full_status.phase, Some(OperationPhase::Succeeded), "{:?}", full_status.message);
    let checkpoint = format!("vmlet-{}", full.metadata.uid.clone().unwrap());
    assert_eq!(full_status.checkpoint.as_deref(), Some(checkpoint.as_str()));

    write_marker(&env, &pod, "in-the-increment").await;
    apply_backup(&env, "monday", json!({"virtualMachine": "web", "mode": "Incremental"}));
    let incremental = wait_backup_ended(&env, "monday").await.status.unwrap();
    assert_eq!(incremental.phase, Some(OperationPhase::Succeeded), "{:?}", incremental.message);
    assert_eq!(incremental.base_backup.as_deref(), Some("sunday"));
    let (full_bytes, incremental_bytes) = (full_status.bytes.unwrap(), incremental.bytes.unwrap());
    assert_eq!(full_bytes, 64 << 20, "the full backup copies the whole 64 MiB disk");
    assert!(incremental_bytes < 8 << 20, "only what changed is copied: {incremental_bytes} bytes");
    assert!(incremental.file_bytes.unwrap() < full_status.file_bytes.unwrap());
    let log = env.kubectl(&["logs", "job/monday-backup"]);
    assert!(log.contains("only what changed since VirtualMachineBackup sunday"), "{log}");

    // A VM restored from the increment has both: the chain is read whole.
    let restore = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "monday-back", "namespace": env.ns},
        "spec": {"source": {"backup": "monday"}, "target": {"virtualMachine": "web-monday"}}});
    assert!(env.apply(&restore.to_string()).status.success());
    env.wait_vm_phase("web-monday", "Running").await;
    let restored_pod = env.pod_of("web-monday").await;
    assert_eq!(read_marker(&env, &restored_pod).await, "in-the-increment");
    let same_fill = "dd if=/dev/vda bs=1M skip=1 count=8 2>/dev/null | md5sum | cut -d' ' -f1";
    let sum = |pod: String| {
        let out = env.kubectl_output(&["exec", &pod, "--", "sh", "-c", same_fill]);
        let sum = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert_eq!(sum.len(), 32, "md5sum in {pod}: {sum:?} {}", String::from_utf8_lossy(&out.stderr));
        sum
    };
    assert_eq!(sum(restored_pod.clone()), sum(pod.clone()), "the full backup's data came through the chain");
}

/// A ValidatingAdmissionPolicy (and its binding) named `name` that refuses
/// what `expression` rejects; deleted on drop with kubectl under its deadline.
struct AdmissionPolicy(String);

impl AdmissionPolicy {
    fn create(env: &TestEnv, name: &str, resource: &str, expression: &str) -> AdmissionPolicy {
        let objects = json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
             "metadata": {"name": name},
             "spec": {"failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{"apiGroups": ["vmlet.io"], "apiVersions": ["*"],
                    "operations": ["UPDATE"], "resources": [resource]}]},
                "validations": [{"expression": expression, "message": "refused by the test's admission policy"}]}},
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
             "metadata": {"name": name},
             "spec": {"policyName": name, "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": env.ns}}}}},
        ]});
        let out = env.apply(&objects.to_string());
        assert!(out.status.success(), "admission policy: {}", String::from_utf8_lossy(&out.stderr));
        AdmissionPolicy(name.to_owned())
    }
}

impl Drop for AdmissionPolicy {
    fn drop(&mut self) {
        let cluster = common::cluster();
        let mut kubectl = Command::new(cluster.bin.join("kubectl"));
        kubectl.env("KUBECONFIG", &cluster.kubeconfig).args([
            "delete",
            &format!("validatingadmissionpolicybinding/{}", self.0),
            &format!("validatingadmissionpolicy/{}", self.0),
            "--ignore-not-found",
            "--wait=false",
        ]);
        let _ = output_within(&mut kubectl, common::kubectl_deadline(&["delete"]));
    }
}

#[tokio::test]
async fn a_backup_whose_final_status_write_is_lost_ends_from_its_job() {
    let (env, guest) = vmlet_with_backups("lost").await;
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;
    // The agent's final write is the only one that sets fileBytes: refuse it,
    // as an API server that does not answer for its ~10 s of retries would.
    let _policy = AdmissionPolicy::create(
        &env,
        &format!("{}-lose-final", env.ns),
        "virtualmachinebackups/status",
        "!has(object.status) || !has(object.status.fileBytes)",
    );
    // The API server loads policies in the background: wait until a write
    // like the agent's final one (on a backup of no VM) is refused.
    apply_backup(&env, "probe", json!({"virtualMachine": "no-such-vm"}));
    let backups: Api<VirtualMachineBackup> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for("the admission policy to refuse a final status write", || {
        let backups = backups.clone();
        async move {
            let patch = kube::api::Patch::Merge(json!({"status": {"fileBytes": 1}}));
            let refused = backups.patch_status("probe", &Default::default(), &patch).await.is_err();
            refused.then_some(())
        }
    })
    .await;
    apply_backup(&env, "nightly", json!({"virtualMachine": "web"}));
    wait_job_condition(&env, "nightly-backup", "Complete").await;
    let backup = wait_backup_ended(&env, "nightly").await;
    let status = backup.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    let message = status.message.unwrap_or_default();
    assert!(message.contains("backup complete") && message.contains("final status was not written"), "{message}");
    assert_eq!(status.file_bytes, None, "the refused write never landed");
    let file = status.location.expect("the location claimed at the start");
    assert!(std::path::Path::new(&file).is_file(), "{file}");
}

/// A QMP command to VM `vm`'s QEMU (`virsh qemu-monitor-command`); its answer.
fn qmp(env: &TestEnv, vm: &str, command: serde_json::Value) -> serde_json::Value {
    let domain = format!("{}_{vm}", env.ns);
    let out = output_within(
        Command::new("virsh").arg("-c").arg(qemu_uri()).args(["qemu-monitor-command", &domain, &command.to_string()]),
        VIRSH,
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// Start VM `web` on a 1 GiB disk of random data (the guest boots from its
/// initrd), so that a backup lasts long enough to be paused in QEMU; the disk.
async fn start_big_vm(env: &TestEnv, guest: &std::path::Path) -> std::path::PathBuf {
    let disk = guest.join("big.qcow2");
    let raw = guest.join("big.raw");
    let mut dd = Command::new("dd");
    dd.arg("if=/dev/urandom").arg(format!("of={}", raw.display())).args(["bs=1M", "count=1024"]);
    assert!(output_within(&mut dd, Duration::from_secs(300)).status.success());
    let mut convert = Command::new("qemu-img");
    convert.args(["convert", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(&disk);
    assert!(output_within(&mut convert, Duration::from_secs(300)).status.success());
    std::fs::remove_file(&raw).unwrap();
    let mut spec = guest_vm_spec(guest);
    spec["image"] = json!(disk);
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    disk
}

/// Pause VM `web`'s backup job in QEMU (`job-pause`) as soon as it exists,
/// so that it stays a running job for as long as the test needs; its id.
async fn pause_backup_job(env: &TestEnv) -> String {
    // Polled every 20 ms (not the harness's 250 ms): the copy may end soon.
    let find_job = async {
        loop {
            let jobs = qmp(env, "web", json!({"execute": "query-jobs"}));
            let found = jobs["return"].as_array().and_then(|jobs| jobs.iter().find(|j| j["type"] == "backup")).cloned();
            if let Some(job) = found {
                return job["id"].as_str().unwrap().to_owned();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let job_id = tokio::time::timeout(common::DEADLINE, find_job)
        .await
        .unwrap_or_else(|_| panic!("no backup job in QEMU before the deadline\n{}", env.diagnostics()));
    let paused = qmp(env, "web", json!({"execute": "job-pause", "arguments": {"id": job_id}}));
    assert!(paused.get("error").is_none(), "pausing the copy ({paused}): it ended too soon");
    job_id
}

#[tokio::test]
async fn deleting_a_backups_job_stops_its_copy_and_the_vm_runs_on() {
    let (env, guest) = vmlet_with_backups("abort").await;
    let disk = start_big_vm(&env, &guest).await;
    apply_backup(&env, "nightly", json!({"virtualMachine": "web"}));
    pause_backup_job(&env).await;
    let backups: Api<VirtualMachineBackup> = Api::namespaced(env.client.clone(), &env.ns);
    let target = env
        .wait_for("the backup to be claimed", || {
            let backups = backups.clone();
            async move { backups.get_opt("nightly").await.ok()??.status?.location }
        })
        .await;

    // Deleting the Job deletes its pod; the agent stops the copy.
    env.kubectl(&["delete", "job/nightly-backup", "--wait=false"]);
    let ended = wait_backup_ended(&env, "nightly").await.status.unwrap();
    assert_eq!(ended.phase, Some(OperationPhase::Failed));
    assert!(ended.message.clone().unwrap_or_default().contains("cancel"), "{:?}", ended.message);
    // The deleted Job is not made again (its pod would be refused: the
    // backup is written once, by the pod that claimed it).
    let jobs: Api<Job> = Api::namespaced(env.client.clone(), &env.ns);
    assert!(jobs.get_opt("nightly-backup").await.unwrap().is_none(), "the deleted Job was created again");
    env.wait_for("QEMU's backup job to be gone", || {
        let jobs = qmp(&env, "web", json!({"execute": "query-jobs"}));
        let gone = jobs["return"].as_array().is_some_and(|jobs| jobs.iter().all(|j| j["type"] != "backup"));
        async move { gone.then_some(()) }
    })
    .await;
    assert!(!std::path::Path::new(&target).exists(), "the partial file {target} was removed");
    assert_eq!(domstate(&env, "web"), "running");
    // The running VM keeps its open disk; the gigabyte goes with it.
    std::fs::remove_file(&disk).unwrap();
}

#[tokio::test]
async fn a_vmlet_restarted_mid_backup_follows_the_copy_to_its_end() {
    let (mut env, guest) = vmlet_with_backups("adopt").await;
    let disk = start_big_vm(&env, &guest).await;
    apply_backup(&env, "nightly", json!({"virtualMachine": "web"}));
    let job_id = pause_backup_job(&env).await;
    let backups: Api<VirtualMachineBackup> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for("the backup to be claimed", || {
        let backups = backups.clone();
        async move { backups.get_opt("nightly").await.ok()??.status?.location }
    })
    .await;

    env.kill_vmlet();
    env.restart_vmlet();
    let resumed = qmp(&env, "web", json!({"execute": "job-resume", "arguments": {"id": job_id}}));
    assert!(resumed.get("error").is_none(), "resuming the copy: {resumed}");
    let ended = wait_backup_ended(&env, "nightly").await.status.unwrap();
    assert_eq!(ended.phase, Some(OperationPhase::Succeeded), "{:?}", ended.message);
    assert_eq!(ended.bytes, Some(1 << 30));
    assert_eq!(ended.consistency.as_deref(), Some("CrashConsistent"));
    assert!(ended.consistency_reason.unwrap_or_default().contains("restart of vmlet"));
    let file = ended.location.unwrap();
    let mut compare = Command::new("qemu-img");
    compare.args(["compare", "-U"]).arg(&disk).arg(&file);
    let same = output_within(&mut compare, Duration::from_secs(300));
    assert!(same.status.success(), "the backup differs from the disk: {}", String::from_utf8_lossy(&same.stdout));
    assert_eq!(domstate(&env, "web"), "running");
    std::fs::remove_file(&disk).unwrap();
    std::fs::remove_file(&file).unwrap();
}

/// A VM booting a host path (a trusted namespace) with a provisioned 1 GiB
/// data claim: its backup holds both disks; put back in place, the stopped
/// VM's boot and data disks hold again what they held at the backup (each
/// disk's later content kept beside it). Restoring that backup to a new VM
/// is refused before anything is made (it would get the boot disk only),
/// naming what to do instead.
#[tokio::test]
async fn a_vm_with_a_data_claim_is_put_back_in_place_with_it() {
    let (env, guest) = vmlet_with_backups("datainplace").await;
    let pool = Pool::new(&env);
    pool.class(&env, json!({"format": "raw"}), false);
    pool.claim(&env, "data", "1Gi").await;
    let mut spec = guest_vm_spec(&guest);
    spec["disks"] = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let write_data = |marker: &str| {
        format!(
            "dev=$({}) && printf '%s\\n' {marker} | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && \
             echo ok",
            device_named("data")
        )
    };
    let read_data = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", device_named("data"));
    let (boot_before, data_before) = (format!("boot-before-{}", env.ns), format!("data-before-{}", env.ns));
    write_marker(&env, &pod, &boot_before).await;
    assert_eq!(env.exec_stdout(&pod, &write_data(&data_before)).await, "ok");

    apply_backup(&env, "nightly", json!({"virtualMachine": "web"}));
    let status = wait_backup_ended(&env, "nightly").await.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    assert_eq!(status.data_disks.len(), 1, "{:?}", status.data_disks);
    assert_eq!(status.data_disks[0].virtual_bytes, Some(1 << 30));
    write_marker(&env, &pod, &format!("boot-after-{}", env.ns)).await;
    assert_eq!(env.exec_stdout(&pod, &write_data(&format!("data-after-{}", env.ns))).await, "ok");

    // To a new VM: refused by the controller, no Job, no VM.
    let copy = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "copy", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web-copy"}}});
    assert!(env.apply(&copy.to_string()).status.success());
    let refused = common::disk::wait_restore_ended(&env, "copy").await;
    assert_eq!(refused.phase, Some(OperationPhase::Failed));
    let message = refused.message.unwrap_or_default();
    assert!(message.contains("holds data disks [data]") && message.contains("spec.target.inPlace"), "{message}");
    let jobs: Api<Job> = Api::namespaced(env.client.clone(), &env.ns);
    assert!(jobs.get_opt("copy-restore").await.unwrap().is_none(), "refused before any Job");

    // In place: both disks come back.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    let in_place = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "back", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web", "inPlace": true}}});
    assert!(env.apply(&in_place.to_string()).status.success());
    let put_back = common::disk::wait_restore_ended(&env, "back").await;
    assert_eq!(put_back.phase, Some(OperationPhase::Succeeded), "{:?}", put_back.message);
    assert_eq!(put_back.data_disks.len(), 1, "{put_back:?}");
    assert_eq!(put_back.data_disks[0].name, "data");
    let kept = put_back.data_disks[0].previous_disk.clone().expect("the data disk's previous content");
    assert!(std::path::Path::new(&kept).exists(), "{kept}");
    assert!(put_back.message.unwrap_or_default().contains("data disk data"));
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    assert_eq!(read_marker(&env, &pod).await, boot_before, "the boot disk as it was at the backup");
    assert_eq!(env.exec_stdout(&pod, &read_data).await, data_before, "the data disk as it was at the backup");
}
