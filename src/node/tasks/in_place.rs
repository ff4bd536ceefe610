//! A restore Job's pod for `spec.target.inPlace`: put a stopped VM of this
//! host back as its backup holds it ([`vmlet_provider::Backup::restore_in_place`]:
//! the boot disk and every data disk from their files in the backup, the old
//! disks kept beside them; a VM whose data disks are not the backup's is
//! refused by the back end, naming the disk) or revert it to its snapshot
//! ([`vmlet_provider::Snapshots::revert_to_snapshot`]), then end the restore.
//!
//! Safety: the VM is the target named in the pod's own namespace, the source
//! must be that VM's own (a backup of that VM name whose file is vmlet's name
//! for it under the backup roots; a snapshot whose recorded VM UID is the
//! VM's), the VM must have `spec.replicas: 0` and be inactive on this host.
//! While the restore runs the agent does not start the VM
//! ([`super::super::Agent::restoring`]); the back end refuses an active VM
//! on its own as well. Only the pod that claimed the restore
//! (`status.podUid`, guarded by resourceVersion) writes.

use super::restore::{backup_files, fail, source_name};
use super::{end, log_line, mib, Outcome};
use crate::conditions::new_condition;
use crate::node::pods::Error;
use crate::node::Agent;
use crate::v1alpha1::{
    OperationPhase, RestoredDataDisk, VirtualMachine, VirtualMachineRestore, VirtualMachineRestoreStatus,
    VirtualMachineSnapshot,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};
use vmlet_provider::{DataDiskFile, InPlaceRestore, VmId};

/// How long putting a disk back may take.
const DEADLINE: Duration = Duration::from_secs(3600);

/// What the restore puts back.
enum Source {
    /// A backup's files on this host: the boot disk's and each data disk's.
    Backup { path: String, data_disks: Vec<DataDiskFile> },
    /// A snapshot's name on the back end.
    Snapshot { backend_name: String },
}

pub(super) async fn sync(
    pod: &Pod,
    agent: &Arc<Agent>,
    restores: &Api<VirtualMachineRestore>,
    restore: &VirtualMachineRestore,
    job: &Job,
) -> Result<Action, Error> {
    let pod_uid = pod.uid().unwrap_or_default();
    let name = restore.name_any();
    let status = restore.status.clone().unwrap_or_default();
    match (status.phase, status.pod_uid.as_deref()) {
        (Some(OperationPhase::Succeeded | OperationPhase::Failed), Some(uid)) if uid == pod_uid => {
            // Ended while this vmlet was down, before the pod was told.
            let message = status.message.clone().unwrap_or_default();
            let outcome = if status.phase == Some(OperationPhase::Succeeded) {
                Outcome::Succeeded { message: &message }
            } else {
                Outcome::Failed { reason: "RestoreFailed", message: &message }
            };
            end(pod, agent, outcome).await?;
            return Ok(Action::await_change());
        }
        (_, Some(uid)) if uid != pod_uid => {
            let message = format!("VirtualMachineRestore {name} is run by pod UID {uid}; a restore runs once");
            return fail(pod, agent, None, &message).await;
        }
        (Some(OperationPhase::Succeeded | OperationPhase::Failed), None) => {
            let message = format!("VirtualMachineRestore {name} has ended already");
            return fail(pod, agent, None, &message).await;
        }
        _ => {}
    }
    let namespace = pod.namespace().unwrap_or_default();
    let name_ref = name.as_str();
    // Only the restore's own Job (or the pod that claimed it) ends it.
    let mine = super::job_is_objects(job, super::TaskKind::Restore, &name) || status.pod_uid == Some(pod_uid.clone());
    let refuse =
        |message: String| async move { fail(pod, agent, mine.then_some((restores, name_ref)), &message).await };
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let vm_name = &restore.spec.target.virtual_machine;
    let vm = vms.get_opt(vm_name).await.map_err(|source| Error::Kube {
        action: "read the target VirtualMachine of",
        pod: pod.name_any(),
        source,
    })?;
    let Some(vm) = vm else {
        return refuse(format!("spec.target.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}"))
            .await;
    };
    if vm.spec.replicas != 0 {
        return refuse(format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} has spec.replicas {}; a restore in place never \
             writes under a running VM: stop it first, then create the restore again",
            vm.spec.replicas
        ))
        .await;
    }
    let id = VmId(vm.uid().unwrap_or_default());
    let source = match (&restore.spec.source.backup, &restore.spec.source.snapshot) {
        (Some(backup_name), _) => match backup_files(agent, &namespace, backup_name).await? {
            Ok(files) if agent.provider.backup().is_some() => {
                Source::Backup { path: files.boot, data_disks: files.data_disks }
            }
            Ok(_) => {
                let backend = agent.host.describe(agent.provider.kind());
                return refuse(format!(
                    "host {} ({backend}) has no backup capability to restore disks with",
                    agent.host.name
                ))
                .await;
            }
            Err(message) => return refuse(message).await,
        },
        (None, Some(snapshot_name)) => {
            let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(agent.client.clone(), &namespace);
            let snapshot = snapshots.get_opt(snapshot_name).await.map_err(|source| Error::Kube {
                action: "read the VirtualMachineSnapshot of",
                pod: pod.name_any(),
                source,
            })?;
            let snapshot_status = snapshot.as_ref().and_then(|s| s.status.clone()).unwrap_or_default();
            let usable = snapshot
                .as_ref()
                .is_some_and(|s| s.spec.virtual_machine == *vm_name && s.metadata.deletion_timestamp.is_none())
                && snapshot_status.phase == Some(OperationPhase::Succeeded)
                && snapshot_status.ready_to_use
                && snapshot_status.virtual_machine_uid.as_deref() == Some(id.0.as_str())
                && snapshot_status.node_name.as_deref() == Some(agent.host.name.as_str());
            match snapshot_status.snapshot_name {
                Some(backend_name) if usable && agent.provider.snapshots().is_some() => {
                    Source::Snapshot { backend_name }
                }
                _ => {
                    return refuse(format!(
                        "spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is not a ready snapshot of \
                         VirtualMachine {vm_name} on host {}",
                        agent.host.name
                    ))
                    .await
                }
            }
        }
        (None, None) => return refuse("spec.source: name a backup or a snapshot".to_owned()).await,
    };

    // From here on this agent does not start the VM; then it must be inactive here.
    let Some(lock) = agent.lock_for_restore(&id, &name) else {
        return Ok(Action::requeue(Duration::from_secs(10)));
    };
    match agent.provider.get(&id).await? {
        None => {
            let recorded = crate::node::placement::recorded_node(&vm).unwrap_or("no host");
            return refuse(format!(
                "VirtualMachine {vm_name} is not on host {} (its placement record names {recorded})",
                agent.host.name
            ))
            .await;
        }
        Some(on_host) if on_host.power.is_active() => {
            return refuse(format!(
                "VirtualMachine {vm_name} is still active on host {} ({:?}); a restore in place never writes under \
                 a running VM: wait until it stopped, then create the restore again",
                agent.host.name, on_host.power
            ))
            .await;
        }
        Some(_) => {}
    }
    if status.pod_uid.is_none() {
        let claim = serde_json::json!({
            "metadata": {"resourceVersion": restore.resource_version()},
            "status": VirtualMachineRestoreStatus {
                phase: Some(OperationPhase::Running),
                job_name: Some(job.name_any()),
                node_name: Some(agent.host.name.clone()),
                pod_uid: Some(pod_uid.clone()),
                virtual_machine_uid: Some(id.0.clone()),
                message: Some(format!("putting VirtualMachine {vm_name} back from {}", source_name(restore))),
                ..status.clone()
            },
        });
        match restores.patch_status(&name, &PatchParams::default(), &Patch::Merge(&claim)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Action::requeue(Duration::from_secs(1))),
            Err(source) => {
                return Err(Error::Kube { action: "claim the VirtualMachineRestore of", pod: pod.name_any(), source })
            }
        }
    }
    end(pod, agent, Outcome::Running).await?;
    agent.task_started(&pod_uid);
    log_line(agent, &pod_uid, &format!("putting VirtualMachine {vm_name} ({id}) back from {}", source_name(restore)));
    let (agent, pod, restores, tag) =
        (Arc::clone(agent), pod.clone(), restores.clone(), restore.uid().unwrap_or_default());
    tokio::spawn(async move {
        let result = match &source {
            Source::Backup { path, data_disks } => {
                let capability = agent.provider.backup().expect("checked before the task started");
                capability
                    .restore_in_place(&id, path, data_disks, &tag, DEADLINE)
                    .await
                    .map(|done| (put_back_status(&done), put_back_message(&done, path)))
            }
            Source::Snapshot { backend_name } => {
                let capability = agent.provider.snapshots().expect("checked before the task started");
                capability.revert_to_snapshot(&id, backend_name).await.map(|done| {
                    let memory = if done.memory_restored {
                        "with its memory"
                    } else {
                        "disks only: the VM stays stopped and boots from them as after a power cut"
                    };
                    (serde_json::json!({}), format!("reverted to snapshot {backend_name}, {memory}"))
                })
            }
        };
        let (mut status, message, failed) = match result {
            Ok((status, message)) => {
                info!(restore = %name, vm.uid = %id, %message, "restored in place");
                if let Source::Backup { .. } = &source {
                    let kept = status["previousDisk"].as_str().unwrap_or_default().to_owned();
                    retire_snapshots(&agent, &pod.namespace().unwrap_or_default(), &id, &name, &kept).await;
                }
                (status, message, false)
            }
            Err(e) => {
                warn!(restore = %name, vm.uid = %id, error = %e, "restore in place failed");
                (serde_json::json!({}), format!("restore in place failed: {e}"), true)
            }
        };
        let (phase, type_, reason) = if failed {
            (OperationPhase::Failed, "Failed", "RestoreFailed")
        } else {
            (OperationPhase::Succeeded, "Complete", "Restored")
        };
        status["phase"] = serde_json::to_value(phase).expect("a phase serialises");
        status["message"] = message.clone().into();
        status["conditions"] = serde_json::json!([new_condition(type_, true, reason, &message, None)]);
        log_line(&agent, &pod.uid().unwrap_or_default(), &message);
        drop(lock);
        for attempt in 0..5 {
            let patch = serde_json::json!({ "status": status });
            match restores.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => break,
                Err(e) => {
                    warn!(restore = %name, attempt, error = %e, "could not write the restore's outcome; retrying");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
        let outcome = if failed {
            Outcome::Failed { reason, message: &message }
        } else {
            Outcome::Succeeded { message: &message }
        };
        if let Err(e) = end(&pod, &agent, outcome).await {
            warn!(restore = %name, error = %e, "could not end the restore's pod; its next pass will");
        }
        agent.task_ended(&pod.uid().unwrap_or_default());
    });
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// The restore's status fields for what [`Backup::restore_in_place`] did:
/// the boot disk (`disk`, `previousDisk`), all disks' bytes together, and
/// each data disk (`dataDisks`).
///
/// [`Backup::restore_in_place`]: vmlet_provider::Backup::restore_in_place
fn put_back_status(done: &InPlaceRestore) -> serde_json::Value {
    let data_disks: Vec<RestoredDataDisk> = done
        .data_disks
        .iter()
        .map(|d| RestoredDataDisk {
            name: d.name.clone(),
            disk: Some(d.disk.clone()),
            previous_disk: Some(d.kept_as.clone()),
            claim_name: None,
        })
        .collect();
    let bytes = done.bytes + done.data_disks.iter().map(|d| d.bytes).sum::<u64>();
    let mut status = serde_json::json!({"disk": done.disk, "previousDisk": done.kept_as, "bytes": bytes});
    if !data_disks.is_empty() {
        status["dataDisks"] = serde_json::to_value(data_disks).expect("data disks serialize");
    }
    status
}

/// The restore's message for what [`Backup::restore_in_place`] did from
/// backup file `path`: each disk put back and where its old content is.
///
/// [`Backup::restore_in_place`]: vmlet_provider::Backup::restore_in_place
fn put_back_message(done: &InPlaceRestore, path: &str) -> String {
    let mut message = format!(
        "disk {} put back from {path} ({}); its previous content is kept as {}",
        done.disk,
        mib(done.bytes),
        done.kept_as
    );
    for data in &done.data_disks {
        message.push_str(&format!(
            "; data disk {} ({}) put back ({}), its previous content kept as {}",
            data.name,
            data.disk,
            mib(data.bytes),
            data.kept_as
        ));
    }
    message
}

/// After a backup replaced VM `id`'s disk, the snapshots that lived in the
/// old disk are no longer the VM's (the back end dropped them; their data is
/// in `kept`): their objects say so and are no longer ready to use. Best
/// effort: a revert to one fails cleanly on the back end anyway.
async fn retire_snapshots(agent: &Agent, namespace: &str, id: &VmId, restore: &str, kept: &str) {
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(agent.client.clone(), namespace);
    let list = match snapshots.list(&Default::default()).await {
        Ok(list) => list,
        Err(e) => {
            warn!(vm.uid = %id, error = %e, "could not list the VM's snapshots to retire them");
            return;
        }
    };
    let of_this_vm = list.items.into_iter().filter(|s| {
        let status = s.status.clone().unwrap_or_default();
        status.ready_to_use && status.virtual_machine_uid.as_deref() == Some(id.0.as_str())
    });
    for snapshot in of_this_vm {
        let message = format!(
            "no longer usable: VirtualMachineRestore {restore} replaced the VM's disk; this snapshot stays in the \
             previous disk {kept}"
        );
        let patch = serde_json::json!({"status": {"readyToUse": false, "message": message}});
        if let Err(e) =
            snapshots.patch_status(&snapshot.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await
        {
            warn!(snapshot = %snapshot.name_any(), error = %e, "could not mark a snapshot no longer usable");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::RestoredDataDisk as PutBack;

    #[test]
    fn a_put_back_backup_reports_every_disk_and_where_its_old_content_is() {
        let done = InPlaceRestore {
            disk: "/vms/web.qcow2".into(),
            kept_as: "/vms/web.qcow2.before-r1".into(),
            bytes: 128 << 20,
            data_disks: vec![PutBack {
                name: "data".into(),
                disk: "/pool/data".into(),
                kept_as: "/pool/data.before-r1".into(),
                bytes: 1 << 30,
            }],
        };
        assert_eq!(
            put_back_status(&done),
            serde_json::json!({"disk": "/vms/web.qcow2", "previousDisk": "/vms/web.qcow2.before-r1",
                "bytes": (1u64 << 30) + (128 << 20),
                "dataDisks": [{"name": "data", "disk": "/pool/data", "previousDisk": "/pool/data.before-r1"}]})
        );
        assert_eq!(
            put_back_message(&done, "/b/f.qcow2"),
            "disk /vms/web.qcow2 put back from /b/f.qcow2 (128.0 MiB); its previous content is kept as \
             /vms/web.qcow2.before-r1; data disk data (/pool/data) put back (1024.0 MiB), its previous content kept \
             as /pool/data.before-r1"
        );
        let boot_only = InPlaceRestore { data_disks: Vec::new(), ..done };
        assert_eq!(put_back_status(&boot_only).get("dataDisks"), None);
    }
}
