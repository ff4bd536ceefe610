//! A restore Job's pod: make the new VM's disk from a backup file on this
//! host (an independent copy, [`vmlet_provider::Backup::restore_disk`]) or
//! from a snapshot's boot disk
//! ([`vmlet_provider::Snapshots::export_snapshot_disk`]), and say where it is
//! in the VirtualMachineRestore's status; the controller then creates the
//! VirtualMachine.
//!
//! The backup file is found from the VirtualMachineBackup of the pod's own
//! namespace, and only when its recorded location is exactly the name vmlet
//! gives that backup (namespace, name, UID) under the host's backup roots: an
//! edited status cannot point a restore at another namespace's backup. A
//! snapshot likewise: its back-end name is the one vmlet gives it, and its VM
//! the one of the pod's namespace it names, by UID. The
//! new disk goes under the host's first storage root, named after the
//! namespace, the new VM and the restore's UID; on a back end whose images
//! are its own catalog's ([`vmlet_provider::ImageReference::Catalog`]: a
//! vSphere template) the snapshot becomes an image of that name there
//! ([`vmlet_provider::Snapshots::export_snapshot_image`]), which the back end
//! lets only that namespace's VMs boot.

use super::backup_files::{checked_files, BackupFiles};
use super::{end, log_line, mib, Outcome};
use crate::node::pods::Error;
use crate::node::Agent;
use crate::storage::check_host_file;
use crate::v1alpha1::{
    boot_only_restore_refusal, restored_disk_name, snapshot_backend_name, OperationPhase, VirtualMachine,
    VirtualMachineBackup, VirtualMachineRestore, VirtualMachineSnapshot,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};
use vmlet_provider::{restored_image_name, ImageReference, VmId};

/// How long making a disk may take.
const RESTORE_DEADLINE: Duration = Duration::from_secs(3600);

pub(super) async fn sync(pod: &Pod, agent: &Arc<Agent>, name: &str, job: &Job) -> Result<Action, Error> {
    let pod_uid = pod.uid().unwrap_or_default();
    if agent.task_running(&pod_uid) {
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    let namespace = pod.namespace().unwrap_or_default();
    let kube = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let restores: Api<VirtualMachineRestore> = Api::namespaced(agent.client.clone(), &namespace);
    let Some(restore) = restores.get_opt(name).await.map_err(kube("read the VirtualMachineRestore of"))? else {
        let message =
            format!("namespace {namespace} has no VirtualMachineRestore {name} (annotation vmlet.io/restore)");
        return fail(pod, agent, None, &message).await;
    };
    if restore.spec.target.in_place {
        return super::in_place::sync(pod, agent, &restores, &restore, job).await;
    }
    let status = restore.status.clone().unwrap_or_default();
    // Only the restore's own Job ends it.
    let mine = super::job_is_objects(job, super::TaskKind::Restore, name);
    if let Some(disk) = &status.disk {
        // Made already (this vmlet restarted before it ended the pod).
        let message = format!("disk {disk} made from {}", source_name(&restore));
        end(pod, agent, Outcome::Succeeded { message: &message }).await?;
        return Ok(Action::await_change());
    }
    if matches!(status.phase, Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        let message = format!("VirtualMachineRestore {name} has ended already");
        return fail(pod, agent, None, &message).await;
    }
    let source = match (&restore.spec.source.backup, &restore.spec.source.snapshot) {
        (Some(backup_name), _) => backup_files(agent, &namespace, backup_name).await?.and_then(|files| {
            // The controller refuses these before it runs a Job; this pod
            // never makes a VM that would lack the backup's data disks.
            match files.data_disks.is_empty() {
                true => Ok(DiskSource::Backup(files.boot)),
                false => Err(boot_only_restore_refusal(backup_name, files.data_disks.iter().map(|f| f.disk.as_str()))),
            }
        }),
        (None, Some(snapshot_name)) => snapshot_disk(agent, &namespace, snapshot_name).await?,
        (None, None) => Err("spec.source: name a backup or a snapshot".to_owned()),
    };
    let source = match source {
        Ok(source) => source,
        Err(message) => return fail(pod, agent, mine.then_some((&restores, name)), &message).await,
    };
    let vm_name = &restore.spec.target.virtual_machine;
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    if vms.get_opt(vm_name).await.map_err(kube("read the target VirtualMachine of"))?.is_some() {
        let message = format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} exists; a restore makes a new VM and never writes \
             over one: name a VM that does not exist"
        );
        return fail(pod, agent, mine.then_some((&restores, name)), &message).await;
    }
    let capable = match source {
        DiskSource::Backup(_) => agent.provider.backup().is_some(),
        DiskSource::Snapshot { .. } => agent.provider.snapshots().is_some(),
    };
    if !capable {
        let message = format!(
            "host {} ({}) cannot make disks from {}",
            agent.host.name,
            agent.host.describe(agent.provider.kind()),
            source_name(&restore)
        );
        return fail(pod, agent, mine.then_some((&restores, name)), &message).await;
    }
    // Where the back end's images are its own catalog's (a vSphere
    // template), the new VM's image is made there under vmlet's name, and no
    // host file is written.
    let catalog = agent.provider.image_reference() == ImageReference::Catalog;
    let restore_uid = restore.uid().unwrap_or_default();
    let target = match (&source, catalog) {
        (DiskSource::Snapshot { .. }, true) => restored_image_name(&namespace, vm_name, &restore_uid),
        (DiskSource::Backup(_), true) => {
            let message = format!(
                "host {} ({}) keeps images in its back end's catalog and cannot make a disk from a backup file",
                agent.host.name,
                agent.host.describe(agent.provider.kind())
            );
            return fail(pod, agent, mine.then_some((&restores, name)), &message).await;
        }
        (_, false) => {
            let Some(root) = agent.storage.roots().first().cloned() else {
                let message = format!("host {} has no storage roots to put the restored disk in", agent.host.name);
                return fail(pod, agent, mine.then_some((&restores, name)), &message).await;
            };
            let target =
                format!("{}/{}", root.trim_end_matches('/'), restored_disk_name(&namespace, vm_name, &restore_uid));
            if let Err(why) = check_host_file(agent.storage.roots(), agent.storage.resolves_links(), &target).await {
                let message =
                    format!("the restored disk {target:?} {why}; check host {}'s storageRoots", agent.host.name);
                return fail(pod, agent, mine.then_some((&restores, name)), &message).await;
            }
            target
        }
    };
    let made = if catalog { "image" } else { "disk" };
    let claim = serde_json::json!({"status": {
        "phase": OperationPhase::Running,
        "jobName": job.name_any(),
        "nodeName": agent.host.name,
        "message": format!("making {made} {target} from {}", source_name(&restore)),
    }});
    restores
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&claim))
        .await
        .map_err(kube("write the VirtualMachineRestore status of"))?;
    end(pod, agent, Outcome::Running).await?;
    agent.task_started(&pod_uid);
    log_line(agent, &pod_uid, &format!("restoring {} ({source}) to {made} {target}", source_name(&restore)));
    let agent = Arc::clone(agent);
    let pod = pod.clone();
    let name = name.to_owned();
    tokio::spawn(async move {
        // The bytes of a disk file made; none for a catalog's image.
        let result = match &source {
            DiskSource::Backup(file) => {
                let capability = agent.provider.backup().expect("checked before the task started");
                capability.restore_disk(file, &target, RESTORE_DEADLINE).await.map(Some)
            }
            DiskSource::Snapshot { vm, name } if catalog => {
                let capability = agent.provider.snapshots().expect("checked before the task started");
                capability.export_snapshot_image(vm, name, &target, RESTORE_DEADLINE).await.map(|()| None)
            }
            DiskSource::Snapshot { vm, name } => {
                let capability = agent.provider.snapshots().expect("checked before the task started");
                capability.export_snapshot_disk(vm, name, &target, RESTORE_DEADLINE).await.map(Some)
            }
        };
        let (patch, message, ok) = match result {
            Ok(Some(bytes)) => {
                info!(restore = %name, disk = %target, bytes, "restored disk made");
                let message = format!("disk {target} made from {source}: {}", mib(bytes));
                (serde_json::json!({"status": {"disk": target, "bytes": bytes, "message": message}}), message, true)
            }
            Ok(None) => {
                info!(restore = %name, image = %target, "restored image made");
                let message = format!("image {target} made from {source}");
                (serde_json::json!({"status": {"disk": target, "message": message}}), message, true)
            }
            Err(e) => {
                warn!(restore = %name, error = %e, "restore failed");
                let message = format!("making {made} {target} failed: {e}");
                (serde_json::json!({"status": {"phase": OperationPhase::Failed, "message": message}}), message, false)
            }
        };
        log_line(&agent, &pod.uid().unwrap_or_default(), &message);
        for attempt in 0..5 {
            match restores.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => break,
                Err(e) => {
                    warn!(restore = %name, attempt, error = %e, "could not write the restore's outcome; retrying");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
        let outcome = if ok {
            Outcome::Succeeded { message: &message }
        } else {
            Outcome::Failed { reason: "RestoreFailed", message: &message }
        };
        if let Err(e) = end(&pod, &agent, outcome).await {
            warn!(restore = %name, error = %e, "could not end the restore's pod; its next pass will");
        }
        agent.task_ended(&pod.uid().unwrap_or_default());
    });
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// What a new disk is made from on this host.
#[derive(Clone, Debug)]
enum DiskSource {
    /// A backup file ([`backup_file`]).
    Backup(String),
    /// An internal snapshot `name` (the back end's) of VM `vm`
    /// ([`snapshot_disk`]).
    Snapshot { vm: VmId, name: String },
}

impl std::fmt::Display for DiskSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskSource::Backup(file) => write!(f, "{file}"),
            DiskSource::Snapshot { vm, name } => write!(f, "snapshot {name} of VM {vm}"),
        }
    }
}

/// The snapshot VirtualMachineSnapshot `snapshot_name` of `namespace` holds
/// on this host: `Ok(Err(why))` unless it is ready to use here, its back-end
/// name is the one vmlet gives it (namespace, name, UID), and its VM is the
/// VirtualMachine of that namespace it names, by UID (an edited status cannot
/// point a restore at another namespace's VM or snapshot).
async fn snapshot_disk(
    agent: &Agent,
    namespace: &str,
    snapshot_name: &str,
) -> Result<Result<DiskSource, String>, Error> {
    let kube = |action| move |source| Error::Kube { action, pod: snapshot_name.to_owned(), source };
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(agent.client.clone(), namespace);
    let Some(snapshot) = snapshots.get_opt(snapshot_name).await.map_err(kube("read the snapshot of restore"))? else {
        return Ok(Err(format!(
            "spec.source.snapshot: namespace {namespace} has no VirtualMachineSnapshot {snapshot_name}"
        )));
    };
    let status = snapshot.status.clone().unwrap_or_default();
    let ready = status.phase == Some(OperationPhase::Succeeded)
        && status.ready_to_use
        && snapshot.metadata.deletion_timestamp.is_none();
    if !ready {
        return Ok(Err(format!("spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is not ready to use")));
    }
    if status.node_name.as_deref() != Some(agent.host.name.as_str()) {
        return Ok(Err(format!(
            "VirtualMachineSnapshot {snapshot_name} is on host {}, not {}: the restore's pod must run there",
            status.node_name.as_deref().unwrap_or("(none)"),
            agent.host.name
        )));
    }
    let expected = snapshot_backend_name(namespace, snapshot_name, &snapshot.uid().unwrap_or_default());
    if status.snapshot_name.as_deref() != Some(expected.as_str()) {
        return Ok(Err(format!(
            "VirtualMachineSnapshot {snapshot_name}'s status.snapshotName is not its own ({expected}); refusing to \
             read it"
        )));
    }
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), namespace);
    let vm_name = &snapshot.spec.virtual_machine;
    let vm = vms.get_opt(vm_name).await.map_err(kube("read the VirtualMachine of the snapshot of restore"))?;
    match vm.and_then(|vm| vm.uid()) {
        Some(uid) if Some(&uid) == status.virtual_machine_uid.as_ref() => {
            Ok(Ok(DiskSource::Snapshot { vm: VmId(uid), name: expected }))
        }
        _ => Ok(Err(format!(
            "VirtualMachineSnapshot {snapshot_name}'s VirtualMachine {vm_name} is not the VM it was taken of; \
             refusing to read it"
        ))),
    }
}

/// What a restore reads, for messages: `VirtualMachineBackup <name>` or
/// `VirtualMachineSnapshot <name>`.
pub(super) fn source_name(restore: &VirtualMachineRestore) -> String {
    match (&restore.spec.source.backup, &restore.spec.source.snapshot) {
        (Some(backup), _) => format!("VirtualMachineBackup {backup}"),
        (None, Some(snapshot)) => format!("VirtualMachineSnapshot {snapshot}"),
        (None, None) => "nothing".to_owned(),
    }
}

/// The files of VirtualMachineBackup `backup_name` of `namespace` on this
/// agent's host ([`locate_backup`]), `Err` naming `spec.source.backup`.
pub(super) async fn backup_files(
    agent: &Agent,
    namespace: &str,
    backup_name: &str,
) -> Result<Result<BackupFiles, String>, Error> {
    let roots = agent.host.effective_backup_roots();
    let found =
        locate_backup(&agent.client, namespace, backup_name, &agent.host.name, &roots, agent.storage.resolves_links())
            .await
            .map_err(|source| Error::Kube {
                action: "read the VirtualMachineBackup of restore",
                pod: backup_name.to_owned(),
                source,
            })?;
    Ok(found.map_err(|why| format!("spec.source.backup: {why}")))
}

/// The files (absolute paths of the qcow2 files, each the newest of an
/// incremental chain: the boot disk's and one per data disk) of
/// VirtualMachineBackup `backup_name` of `namespace` on host `host`, whose
/// backup roots are `backup_roots` (symbolic links resolved when
/// `resolves_links`, as [`check_host_file`] does): only a backup that
/// succeeded, on that host, whose recorded files are exactly the names vmlet
/// gives them ([`backup_file_name`], [`backup_data_file_name`]: namespace,
/// name, UID, disk) under those roots ([`super::backup_files`]). An edited
/// status cannot point a reader at another namespace's file or at any other
/// file. `Ok(Err)`: why not, naming the field (for a status message or an
/// Event). Errors: reading the backup failed.
///
/// [`backup_file_name`]: crate::v1alpha1::backup_file_name
/// [`backup_data_file_name`]: crate::v1alpha1::backup_data_file_name
/// [`check_host_file`]: crate::storage::check_host_file
pub(crate) async fn locate_backup(
    client: &kube::Client,
    namespace: &str,
    backup_name: &str,
    host: &str,
    backup_roots: &[String],
    resolves_links: bool,
) -> Result<Result<BackupFiles, String>, kube::Error> {
    let backups: Api<VirtualMachineBackup> = Api::namespaced(client.clone(), namespace);
    let Some(backup) = backups.get_opt(backup_name).await? else {
        return Ok(Err(format!("namespace {namespace} has no VirtualMachineBackup {backup_name}")));
    };
    let backup_status = backup.status.clone().unwrap_or_default();
    if backup_status.phase != Some(OperationPhase::Succeeded) {
        return Ok(Err(format!("VirtualMachineBackup {backup_name} has not succeeded")));
    }
    if backup_status.node_name.as_deref() != Some(host) {
        return Ok(Err(format!(
            "VirtualMachineBackup {backup_name} is on host {}, not {host}: its disk can be made only there",
            backup_status.node_name.as_deref().unwrap_or("(none)"),
        )));
    }
    Ok(checked_files(namespace, &backup, host, backup_roots, resolves_links).await)
}

/// Fail the pod (and the restore, when given) with `message`.
pub(super) async fn fail(
    pod: &Pod,
    agent: &Agent,
    restore: Option<(&Api<VirtualMachineRestore>, &str)>,
    message: &str,
) -> Result<Action, Error> {
    agent.events.publish(pod, crate::events::Reason::ProviderFailed, message);
    if let Some((restores, name)) = restore {
        let patch = serde_json::json!({"status": {"phase": OperationPhase::Failed, "message": message}});
        restores.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(|source| {
            Error::Kube { action: "write the VirtualMachineRestore status of", pod: pod.name_any(), source }
        })?;
    }
    end(pod, agent, Outcome::Failed { reason: "RestoreFailed", message }).await?;
    Ok(Action::await_change())
}
