//! A backup Job's pod: copy the VM's disks (the boot disk and each data disk
//! of `spec.disks`, at one point in time) to files under the host's backup
//! roots through the provider's [`vmlet_provider::Backup`], report progress in
//! the pod's log and the VirtualMachineBackup's status (`location`,
//! `dataDisks`), end the pod.
//!
//! Only one pod ever writes a backup's files: the first to claim the backup
//! (`status.podUid`, written with the object's resourceVersion as
//! precondition). The files' names are vmlet's (namespace, backup name and
//! UID, and the data disk's name: [`backup_data_file_name`]), all in one
//! directory, which must lie under the host's backup roots.

use super::backup_files::{checked_files, BackupFiles};
use super::{end, log_line, mib, now, Outcome, STATUS_EVERY};
use crate::conditions::new_condition;
use crate::node::pods::Error;
use crate::node::volumes::{claim_directory, ClaimError};
use crate::node::Agent;
use crate::storage::check_host_file;
use crate::v1alpha1::{
    backup_checkpoint_name, backup_data_file_name, backup_file_name, BackupDataDisk, BackupMode, OperationPhase,
    VirtualMachine, VirtualMachineBackup, VirtualMachineBackupStatus,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};
use vmlet_provider::{
    BackupOutcome, BackupProgress, BackupRequest, Consistency, DataDiskFile, ErrorKind, IncrementalBase, VmId,
};

/// How often a running backup's pod is looked at (its task writes the rest).
const WHILE_RUNNING: Duration = Duration::from_secs(30);

pub(super) async fn sync(pod: &Pod, agent: &Arc<Agent>, name: &str, job: &Job) -> Result<Action, Error> {
    let pod_uid = pod.uid().unwrap_or_default();
    if agent.task_running(&pod_uid) {
        return Ok(Action::requeue(WHILE_RUNNING));
    }
    let namespace = pod.namespace().unwrap_or_default();
    let backups: Api<VirtualMachineBackup> = Api::namespaced(agent.client.clone(), &namespace);
    let kube = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let Some(backup) = backups.get_opt(name).await.map_err(kube("read the VirtualMachineBackup of"))? else {
        let message = format!("namespace {namespace} has no VirtualMachineBackup {name} (annotation vmlet.io/backup)");
        return fail(pod, agent, None, "BackupNotFound", &message).await;
    };
    let status = backup.status.clone().unwrap_or_default();
    let claimed_by = status.pod_uid.as_deref();
    match (status.phase, claimed_by) {
        // Ended while this vmlet was down, before the pod was told.
        (Some(OperationPhase::Succeeded), Some(uid)) if uid == pod_uid => {
            let message = status.message.unwrap_or_else(|| "backup complete".to_owned());
            end(pod, agent, Outcome::Succeeded { message: &message }).await?;
            return Ok(Action::await_change());
        }
        (Some(OperationPhase::Failed), Some(uid)) if uid == pod_uid => {
            let message = status.message.unwrap_or_else(|| "backup failed".to_owned());
            end(pod, agent, Outcome::Failed { reason: "BackupFailed", message: &message }).await?;
            return Ok(Action::await_change());
        }
        (_, Some(uid)) if uid != pod_uid => {
            let message = format!(
                "VirtualMachineBackup {name} is taken by pod {} ({uid}); a backup is written once, by one pod: \
                 create a new VirtualMachineBackup to back up again",
                status.pod_name.as_deref().unwrap_or("?")
            );
            return fail(pod, agent, None, "BackupTakenByAnotherPod", &message).await;
        }
        (Some(OperationPhase::Succeeded | OperationPhase::Failed), None) => {
            let message = format!("VirtualMachineBackup {name} has ended already; create a new one to back up again");
            return fail(pod, agent, None, "BackupEnded", &message).await;
        }
        _ => {}
    }
    let resumed = claimed_by == Some(pod_uid.as_str());
    // Only the backup's own Job (or the pod that claimed it) ends it.
    let mine = super::job_is_objects(job, super::TaskKind::Backup, name) || resumed;
    let refuse = |reason: &'static str, message: String| (reason, message);
    let plan = async {
        let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
        let vm_name = &backup.spec.virtual_machine;
        let vm = match vms.get_opt(vm_name).await {
            Ok(Some(vm)) => vm,
            Ok(None) => {
                return Err(refuse(
                    "VirtualMachineNotFound",
                    format!("spec.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}"),
                ))
            }
            Err(e) => return Err(refuse("", e.to_string())),
        };
        let id = VmId(vm.uid().unwrap_or_default());
        if agent.provider.backup().is_none() {
            return Err(refuse(
                "BackupNotSupported",
                format!(
                    "host {} ({}) has no backup capability; back up VMs of hosts whose back end has one",
                    agent.host.name,
                    agent.host.describe(agent.provider.kind())
                ),
            ));
        }
        match agent.provider.get(&id).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                let recorded = crate::node::placement::recorded_node(&vm).unwrap_or("no host").to_owned();
                return Err(refuse(
                    "VirtualMachineNotOnThisHost",
                    format!(
                        "VirtualMachine {vm_name} is not on host {} (its placement record names {recorded}); the \
                         backup's pod must run on the VM's node: give it required pod affinity to vmlet.io/vm={vm_name} \
                         over kubernetes.io/hostname",
                        agent.host.name
                    ),
                ));
            }
            Err(e) if e.kind == ErrorKind::Transient => return Err(refuse("", e.to_string())),
            Err(e) => return Err(refuse("ProviderFailed", e.to_string())),
        }
        let roots = agent.host.effective_backup_roots();
        let (field, dir) = match (&backup.spec.target.persistent_volume_claim, &backup.spec.target.host_path) {
            (Some(claim), _) => {
                let field = "spec.target.persistentVolumeClaim";
                match claim_directory(&agent.client, &namespace, &claim.claim_name, &agent.host.name).await {
                    Ok(found) => (field, found.dir.trim_end_matches('/').to_owned()),
                    Err(ClaimError::Waiting(why) | ClaimError::Unusable(why)) => {
                        return Err(refuse(
                            "TargetNotAllowed",
                            format!("{field}: PersistentVolumeClaim {} {why}", claim.claim_name),
                        ))
                    }
                    Err(e @ ClaimError::Kube { .. }) => return Err(refuse("", e.to_string())),
                }
            }
            (None, Some(dir)) => ("spec.target.hostPath", dir.trim_end_matches('/').to_owned()),
            (None, None) => match roots.first() {
                Some(dir) => ("backupRoots", dir.trim_end_matches('/').to_owned()),
                None => {
                    return Err(refuse(
                        "NoBackupRoots",
                        format!(
                            "host {} allows no backups (its backupRoots in vmlet's config is empty)",
                            agent.host.name
                        ),
                    ))
                }
            },
        };
        let uid = backup.uid().unwrap_or_default();
        let path = format!("{dir}/{}", backup_file_name(&namespace, name, &uid));
        let data_disks = match data_disk_targets(&vm, &namespace, name, &uid, &dir) {
            Ok(disks) => disks,
            Err(message) => return Err(refuse("InvalidDiskName", message)),
        };
        let files = std::iter::once(path.as_str()).chain(data_disks.iter().map(|d| d.location.as_str()));
        for file in files {
            if let Err(why) = check_host_file(&roots, agent.storage.resolves_links(), file).await {
                return Err(refuse(
                    "TargetNotAllowed",
                    format!(
                        "{field} {dir:?}: the backup file {file:?} {why}; host {} writes backups only under its \
                         backupRoots [{}]: name one of them or a directory under one",
                        agent.host.name,
                        roots.join(", ")
                    ),
                ));
            }
        }
        let data_disks = match with_storage_classes(agent, &namespace, data_disks).await {
            Ok(disks) => disks,
            Err(e) => return Err(refuse("", e.to_string())),
        };
        let base = match backup.spec.mode {
            BackupMode::Full => None,
            BackupMode::Incremental => match incremental_base(agent, &backups, &backup, &data_disks).await {
                Ok(Ok(base)) => Some(base),
                Ok(Err(message)) => return Err(refuse("NoIncrementalBase", message)),
                Err(e) => return Err(refuse("", e.to_string())),
            },
        };
        Ok((vm, id, dir, path, data_disks, base))
    };
    let (vm, id, dir, path, data_disks, base) = match plan.await {
        Ok(plan) => plan,
        // Reading failed: retry with the pod's backoff.
        Err(("", message)) => {
            return Err(Error::Provider(vmlet_provider::Error::new("prepare backup", ErrorKind::Transient, message)))
        }
        Err((reason, message)) => return fail(pod, agent, mine.then_some((&backups, name)), reason, &message).await,
    };

    // Claim the backup for this pod (guarded by its resourceVersion), so no
    // second pod writes the same file.
    if !resumed {
        let claim = serde_json::json!({
            "metadata": {"resourceVersion": backup.resource_version()},
            "status": VirtualMachineBackupStatus {
                phase: Some(OperationPhase::Running),
                job_name: Some(job.name_any()),
                pod_name: Some(pod.name_any()),
                pod_uid: Some(pod_uid.clone()),
                node_name: Some(agent.host.name.clone()),
                location: Some(path.clone()),
                data_disks: data_disks.clone(),
                start_time: Some(now()),
                message: Some(format!("backing up VirtualMachine {} to {path}", vm.name_any())),
                virtual_machine_spec: Some(vm.spec.clone()),
                base_backup: base.as_ref().map(|(name, _)| name.clone()),
                ..status.clone()
            },
        });
        match backups.patch_status(name, &PatchParams::default(), &Patch::Merge(&claim)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Action::requeue(Duration::from_secs(1))),
            Err(e) => return Err(kube("claim the VirtualMachineBackup of")(e)),
        }
    }
    if agent.storage.resolves_links() {
        if let Err(e) = tokio::fs::create_dir_all(&dir).await {
            let message = format!("{dir:?}: cannot create the backup directory on the host: {e}");
            return fail(pod, agent, mine.then_some((&backups, name)), "TargetNotWritable", &message).await;
        }
    }

    // A resumed backup passes the same target: the provider follows, answers
    // from or replaces what the interrupted attempt left (`Backup::backup`).
    let request = BackupRequest {
        data_disks: data_disks
            .iter()
            .map(|d| DataDiskFile { disk: d.name.clone(), path: d.location.clone() })
            .collect(),
        target: path.clone(),
        quiesce: backup.spec.quiesce,
        timeout: Duration::from_secs(backup.spec.active_deadline_seconds.max(10) as u64),
        checkpoint: (backup.spec.checkpoint || base.is_some())
            .then(|| backup_checkpoint_name(&backup.uid().unwrap_or_default())),
        incremental: base.as_ref().map(|(_, base)| base.clone()),
    };
    // Running on the pod first: if that write fails, this pass fails and the
    // next one starts the copy (nothing is marked running before).
    end(pod, agent, Outcome::Running).await?;
    agent.task_started(&pod_uid);
    log_line(
        agent,
        &pod_uid,
        &format!("backing up VirtualMachine {} ({}) on host {} to {path}", vm.name_any(), id, agent.host.name),
    );
    for disk in &data_disks {
        log_line(agent, &pod_uid, &format!("data disk {}: to {}", disk.name, disk.location));
    }
    if let Some((base_name, base)) = &base {
        let line = format!(
            "incremental: only what changed since VirtualMachineBackup {base_name} (checkpoint {}, file {})",
            base.checkpoint, base.backing_file
        );
        log_line(agent, &pod_uid, &line);
    }
    tokio::spawn(run(Arc::clone(agent), pod.clone(), backups, name.to_owned(), id, request, data_disks));
    Ok(Action::requeue(WHILE_RUNNING))
}

/// The copy itself, in a task of its own: progress to the log and (every
/// [`STATUS_EVERY`]) to the backup's status; then the outcome to both and to
/// the pod.
async fn run(
    agent: Arc<Agent>,
    pod: Pod,
    backups: Api<VirtualMachineBackup>,
    name: String,
    id: VmId,
    request: BackupRequest,
    data_disks: Vec<BackupDataDisk>,
) {
    let pod_uid = pod.uid().unwrap_or_default();
    let latest = Arc::new(Mutex::new(BackupProgress::default()));
    let last_logged = Mutex::new((Timestamp::now(), u64::MAX));
    let progress = |p: BackupProgress| {
        *latest.lock().expect("progress poisoned") = p;
        let percent = (p.processed_bytes * 100).checked_div(p.total_bytes).unwrap_or(0);
        let mut last = last_logged.lock().expect("progress poisoned");
        let quiet = Timestamp::now().duration_since(last.0).as_secs() < 2 && last.1 / 10 == percent / 10;
        if !quiet || last.1 == u64::MAX {
            *last = (Timestamp::now(), percent);
            log_line(&agent, &pod_uid, &format!("{} of {} ({percent}%)", mib(p.processed_bytes), mib(p.total_bytes)));
        }
    };
    let capability = agent.provider.backup().expect("checked before the task started");
    let copy = capability.backup(&id, &request, &progress);
    tokio::pin!(copy);
    let result = loop {
        tokio::select! {
            result = &mut copy => break result,
            _ = tokio::time::sleep(STATUS_EVERY) => {
                let p = *latest.lock().expect("progress poisoned");
                let patch = serde_json::json!({"status": {
                    "bytes": p.processed_bytes, "totalBytes": p.total_bytes,
                    "message": format!("{} of {} copied", mib(p.processed_bytes), mib(p.total_bytes)),
                }});
                if let Err(e) = backups.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    warn!(backup = %name, error = %e, "could not write backup progress");
                }
            }
        }
    };
    let (status, outcome_message, failed) = match result {
        Ok(outcome) => {
            let message = done_message(&outcome);
            info!(backup = %name, path = %outcome.path, bytes = outcome.bytes, "backup complete");
            (finished(&outcome, &data_disks, &message), message, false)
        }
        Err(e) => {
            warn!(backup = %name, error = %e, "backup failed");
            let message = format!("backup failed; the VM runs on: {e}");
            let mut status = terminal(OperationPhase::Failed, "BackupFailed", &message);
            status["location"] = serde_json::Value::Null;
            status["dataDisks"] = serde_json::Value::Null;
            (status, message, true)
        }
    };
    log_line(&agent, &pod_uid, &outcome_message);
    for attempt in 0..5 {
        match backups
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({"status": status})))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                warn!(backup = %name, attempt, error = %e, "could not write the backup's outcome; retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    let outcome = if failed {
        Outcome::Failed { reason: "BackupFailed", message: &outcome_message }
    } else {
        Outcome::Succeeded { message: &outcome_message }
    };
    if let Err(e) = end(&pod, &agent, outcome).await {
        warn!(backup = %name, error = %e, "could not end the backup's pod; its next pass will");
    }
    agent.task_ended(&pod_uid);
}

/// Each data disk of `vm` (`spec.disks`, in order) and its file in
/// directory `dir` for backup `backup_name` (UID `uid`) of `namespace`
/// ([`backup_data_file_name`]), with the claim that holds it; the claims'
/// classes are [`with_storage_classes`]'s. `Err(why)` naming the field for a
/// disk name the CRD's rule would have refused (an object that bypassed
/// admission).
fn data_disk_targets(
    vm: &VirtualMachine,
    namespace: &str,
    backup_name: &str,
    uid: &str,
    dir: &str,
) -> Result<Vec<BackupDataDisk>, String> {
    vm.spec
        .disks
        .iter()
        .enumerate()
        .map(|(at, disk)| {
            let Some(file) = backup_data_file_name(namespace, backup_name, uid, &disk.name) else {
                return Err(format!(
                    "spec.disks[{at}].name {:?} of VirtualMachine {}: not a data disk's name (a DNS label of at most \
                     20 characters); rename the disk",
                    disk.name,
                    vm.name_any()
                ));
            };
            Ok(BackupDataDisk {
                name: disk.name.clone(),
                claim_name: disk.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone()),
                location: format!("{dir}/{file}"),
                ..BackupDataDisk::default()
            })
        })
        .collect()
}

/// `disks` with each claim's StorageClass (read from the claim of
/// `namespace`; none for a claim that is gone or names none), so that a
/// restore can make the disk's new claim in the same class.
async fn with_storage_classes(
    agent: &Agent,
    namespace: &str,
    mut disks: Vec<BackupDataDisk>,
) -> Result<Vec<BackupDataDisk>, kube::Error> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(agent.client.clone(), namespace);
    for disk in &mut disks {
        if let Some(claim_name) = &disk.claim_name {
            let claim = claims.get_opt(claim_name).await?;
            disk.storage_class_name = claim.and_then(|c| c.spec?.storage_class_name);
        }
    }
    Ok(disks)
}

/// The backup an `Incremental` backup builds on: the newest Succeeded
/// backup of the same VM on this host that left a checkpoint, whose files
/// are vmlet's under this host's backup roots ([`checked_files`]) and which
/// holds a copy of each of `data_disks` (the VM's data disks now).
/// `Ok(Err(why))` when there is none.
async fn incremental_base(
    agent: &Agent,
    backups: &Api<VirtualMachineBackup>,
    backup: &VirtualMachineBackup,
    data_disks: &[BackupDataDisk],
) -> Result<Result<(String, IncrementalBase), String>, kube::Error> {
    let namespace = backup.namespace().unwrap_or_default();
    let vm_name = &backup.spec.virtual_machine;
    let newest = backups
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|b| b.spec.virtual_machine == *vm_name && b.uid() != backup.uid())
        .filter_map(|b| {
            let status = b.status.clone()?;
            let done = status.phase == Some(OperationPhase::Succeeded)
                && status.node_name.as_deref() == Some(agent.host.name.as_str());
            Some((status.completion_time.clone()?, status.checkpoint.clone()?, b)).filter(|_| done)
        })
        .max_by(|a, b| a.0.cmp(&b.0));
    let Some((_, checkpoint, base)) = newest else {
        return Ok(Err(format!(
            "spec.mode Incremental: VirtualMachine {vm_name} has no earlier backup on host {} that left a checkpoint; \
             take a Full backup with checkpoint: true first",
            agent.host.name
        )));
    };
    let base_name = base.name_any();
    let roots = agent.host.effective_backup_roots();
    let files = match checked_files(&namespace, &base, &agent.host.name, &roots, agent.storage.resolves_links()).await {
        Ok(files) => files,
        Err(why) => return Ok(Err(format!("spec.mode Incremental: the base {why}; take a Full backup"))),
    };
    let data_backing_files = match data_backing_files(&base_name, &files, data_disks) {
        Ok(files) => files,
        Err(why) => return Ok(Err(why)),
    };
    Ok(Ok((base_name, IncrementalBase { checkpoint, backing_file: files.boot, data_backing_files })))
}

/// For each of `data_disks` (the VM's data disks now), the file base backup
/// `base_name` wrote for it (`base`): the new data file's backing file.
/// `Err(why)` asking for a full backup when the base holds no copy of a
/// disk (one added since). Disks the base holds and the VM no longer has are
/// left out.
fn data_backing_files(
    base_name: &str,
    base: &BackupFiles,
    data_disks: &[BackupDataDisk],
) -> Result<Vec<DataDiskFile>, String> {
    data_disks
        .iter()
        .map(|disk| match base.file_of(base_name, Some(&disk.name)) {
            Ok(path) => Ok(DataDiskFile { disk: disk.name.clone(), path: path.to_owned() }),
            Err(_) => Err(format!(
                "spec.mode Incremental: the base VirtualMachineBackup {base_name} holds no copy of data disk {} \
                 (spec.disks[{}], added to the VM since); an incremental backup copies only what changed since its \
                 base: take a Full backup (with checkpoint: true) first",
                disk.name, disk.name
            )),
        })
        .collect()
}

/// Stop the copy that pod `pod` runs for backup `name` (its pod is being
/// deleted): the back end aborts that job only (the VM runs on) and removes
/// the partial file; the copy's task then ends the backup Failed. Best
/// effort: what cannot be read or aborted is logged, and the copy ends by its
/// own deadline.
pub(super) async fn abort(pod: &Pod, agent: &Agent, name: &str) {
    let namespace = pod.namespace().unwrap_or_default();
    let backups: Api<VirtualMachineBackup> = Api::namespaced(agent.client.clone(), &namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let backup = match backups.get_opt(name).await {
        Ok(Some(backup)) => backup,
        Ok(None) => return,
        Err(e) => return warn!(backup = %name, error = %e, "cannot read the backup to abort its copy"),
    };
    let status = backup.status.clone().unwrap_or_default();
    let (Some(target), true) = (status.location, status.pod_uid == pod.uid()) else { return };
    let vm = match vms.get_opt(&backup.spec.virtual_machine).await {
        Ok(Some(vm)) => vm,
        Ok(None) => return,
        Err(e) => return warn!(backup = %name, error = %e, "cannot read the VM to abort its backup"),
    };
    let Some(capability) = agent.provider.backup() else { return };
    let id = VmId(vm.uid().unwrap_or_default());
    match capability.abort_backup(&id, &target).await {
        Ok(aborted) => {
            info!(backup = %name, vm.uid = %id, aborted, "backup pod deleted; its copy was stopped");
            log_line(agent, &pod.uid().unwrap_or_default(), "the pod was deleted: the copy was stopped");
        }
        Err(e) => {
            warn!(backup = %name, vm.uid = %id, error = %e, "could not abort the backup; it ends by its deadline")
        }
    }
}

/// The pod's and the backup's message for a finished backup: the bytes
/// copied (all disks together), the boot disk's file, each data disk's file
/// and how consistent the copy is.
fn done_message(outcome: &BackupOutcome) -> String {
    let consistency = match &outcome.consistency {
        Consistency::Quiesced { filesystems } => format!("quiesced ({filesystems} filesystems frozen)"),
        Consistency::CrashConsistent { reason } => format!("crash-consistent: {reason}"),
        Consistency::Offline => "offline (the VM was not running)".to_owned(),
    };
    let data = match outcome.data_disks.as_slice() {
        [] => String::new(),
        disks => {
            let each: Vec<String> =
                disks.iter().map(|d| format!("{} in {} ({} on disk)", d.disk, d.path, mib(d.file_bytes))).collect();
            format!(", data disk{} {}", if disks.len() == 1 { "" } else { "s" }, each.join(", "))
        }
    };
    format!(
        "backup complete: {} of disk data, boot disk in {} ({} on disk){data}, {consistency}",
        mib(outcome.bytes),
        outcome.path,
        mib(outcome.file_bytes)
    )
}

/// The status patch of a finished backup: `planned` (the data disks as the
/// backup recorded them when it began) completed with their sizes from
/// `outcome`.
fn finished(outcome: &BackupOutcome, planned: &[BackupDataDisk], message: &str) -> serde_json::Value {
    let (consistency, reason) = match &outcome.consistency {
        Consistency::Quiesced { .. } => ("Quiesced", None),
        Consistency::CrashConsistent { reason } => ("CrashConsistent", Some(reason.clone())),
        Consistency::Offline => ("Offline", None),
    };
    let bytes = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let data_disks: Vec<BackupDataDisk> = planned
        .iter()
        .map(|disk| {
            let copy = outcome.data_disks.iter().find(|c| c.disk == disk.name);
            BackupDataDisk {
                location: copy.map_or_else(|| disk.location.clone(), |c| c.path.clone()),
                file_bytes: copy.map(|c| bytes(c.file_bytes)),
                virtual_bytes: copy.map(|c| bytes(c.virtual_bytes)).filter(|n| *n > 0),
                ..disk.clone()
            }
        })
        .collect();
    let mut status = terminal(OperationPhase::Succeeded, "BackupComplete", message);
    status["bytes"] = outcome.bytes.into();
    status["totalBytes"] = outcome.bytes.into();
    status["fileBytes"] = outcome.file_bytes.into();
    status["location"] = outcome.path.clone().into();
    status["dataDisks"] = serde_json::to_value(data_disks).expect("data disks serialize");
    status["checkpoint"] = outcome.checkpoint.clone().into();
    status["consistency"] = consistency.into();
    status["consistencyReason"] = reason.into();
    status
}

/// The status patch of an ended backup: phase, completion time, message and
/// its condition (`Complete` or `Failed`, as a Job's).
fn terminal(phase: OperationPhase, reason: &str, message: &str) -> serde_json::Value {
    let type_ = if phase == OperationPhase::Succeeded { "Complete" } else { "Failed" };
    let condition = new_condition(type_, true, reason, message, None);
    serde_json::json!({
        "phase": phase,
        "completionTime": now(),
        "message": message,
        "conditions": [condition],
    })
}

/// Fail the pod (and the backup, when given and this pod may end it) with
/// `reason` and `message`; nothing was written on the host.
async fn fail(
    pod: &Pod,
    agent: &Agent,
    backup: Option<(&Api<VirtualMachineBackup>, &str)>,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    agent.events.publish(pod, crate::events::Reason::ProviderFailed, message);
    if let Some((backups, name)) = backup {
        let patch = serde_json::json!({"status": terminal(OperationPhase::Failed, reason, message)});
        backups.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(|source| {
            Error::Kube { action: "write the VirtualMachineBackup status of", pod: pod.name_any(), source }
        })?;
    }
    end(pod, agent, Outcome::Failed { reason, message }).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::VmBuilder;
    use vmlet_provider::DataDiskCopy;

    fn planned() -> Vec<BackupDataDisk> {
        let vm = VmBuilder::new("web").disks(&[("data", "web-data"), ("logs", "/images/logs.qcow2")]).build();
        data_disk_targets(&vm, "team-a", "nightly", "u-1", "/backups").unwrap()
    }

    #[test]
    fn each_data_disk_gets_a_file_beside_the_boot_file_in_spec_order() {
        assert_eq!(
            planned(),
            vec![
                BackupDataDisk {
                    name: "data".into(),
                    claim_name: Some("web-data".into()),
                    location: "/backups/team-a_nightly_u-1.data.qcow2".into(),
                    ..BackupDataDisk::default()
                },
                BackupDataDisk {
                    name: "logs".into(),
                    claim_name: None,
                    location: "/backups/team-a_nightly_u-1.logs.qcow2".into(),
                    ..BackupDataDisk::default()
                },
            ]
        );
        let without = VmBuilder::new("web").build();
        assert_eq!(data_disk_targets(&without, "team-a", "nightly", "u-1", "/backups"), Ok(Vec::new()));
    }

    #[test]
    fn a_disk_name_that_bypassed_admission_is_refused_naming_the_field() {
        let mut vm = VmBuilder::new("web").disks(&[("data", "web-data")]).build();
        vm.spec.disks[0].name = "../../etc".into();
        let why = data_disk_targets(&vm, "team-a", "nightly", "u-1", "/backups").unwrap_err();
        assert_eq!(
            why,
            "spec.disks[0].name \"../../etc\" of VirtualMachine web: not a data disk's name (a DNS label of at most \
             20 characters); rename the disk"
        );
    }

    #[test]
    fn an_incremental_backup_builds_each_data_disk_on_the_bases_copy_and_needs_one_for_every_disk() {
        let base = BackupFiles {
            boot: "/backups/team-a_full_u-0.qcow2".into(),
            data_disks: vec![
                DataDiskFile { disk: "data".into(), path: "/backups/team-a_full_u-0.data.qcow2".into() },
                DataDiskFile { disk: "gone".into(), path: "/backups/team-a_full_u-0.gone.qcow2".into() },
            ],
        };
        let data = &planned()[..1];
        assert_eq!(
            data_backing_files("full", &base, data),
            Ok(vec![DataDiskFile { disk: "data".into(), path: "/backups/team-a_full_u-0.data.qcow2".into() }]),
            "a disk the VM no longer has is left out"
        );
        let why = data_backing_files("full", &base, &planned()).unwrap_err();
        assert!(why
            .starts_with("spec.mode Incremental: the base VirtualMachineBackup full holds no copy of data disk logs"));
        assert!(why.ends_with("take a Full backup (with checkpoint: true) first"), "{why}");
    }

    fn outcome() -> BackupOutcome {
        BackupOutcome {
            path: "/backups/team-a_nightly_u-1.qcow2".into(),
            data_disks: vec![
                DataDiskCopy {
                    disk: "data".into(),
                    path: "/backups/team-a_nightly_u-1.data.qcow2".into(),
                    virtual_bytes: 1 << 30,
                    file_bytes: 1 << 20,
                },
                DataDiskCopy {
                    disk: "logs".into(),
                    path: "/backups/team-a_nightly_u-1.logs.qcow2".into(),
                    virtual_bytes: 0,
                    file_bytes: 2 << 20,
                },
            ],
            bytes: (1 << 30) + (128 << 20),
            file_bytes: 3 << 20,
            consistency: Consistency::Offline,
            checkpoint: None,
        }
    }

    #[test]
    fn a_finished_backups_status_records_each_data_disks_file_and_sizes() {
        let status = finished(&outcome(), &planned(), "done");
        assert_eq!(
            status["dataDisks"],
            serde_json::json!([
                {"name": "data", "claimName": "web-data", "location": "/backups/team-a_nightly_u-1.data.qcow2",
                 "fileBytes": 1 << 20, "virtualBytes": 1 << 30},
                {"name": "logs", "location": "/backups/team-a_nightly_u-1.logs.qcow2", "fileBytes": 2 << 20},
            ]),
            "an unknown virtual size (0) is not written"
        );
        assert_eq!(status["bytes"], (1u64 << 30) + (128 << 20), "all disks together");
        assert_eq!(status["location"], "/backups/team-a_nightly_u-1.qcow2");
        let parsed: VirtualMachineBackupStatus = serde_json::from_value(status).unwrap();
        assert_eq!(parsed.data_disks.len(), 2);
    }

    #[test]
    fn the_done_message_names_every_disks_file() {
        assert_eq!(
            done_message(&outcome()),
            "backup complete: 1152.0 MiB of disk data, boot disk in /backups/team-a_nightly_u-1.qcow2 (3.0 MiB on \
             disk), data disks data in /backups/team-a_nightly_u-1.data.qcow2 (1.0 MiB on disk), logs in \
             /backups/team-a_nightly_u-1.logs.qcow2 (2.0 MiB on disk), offline (the VM was not running)"
        );
        let boot_only = BackupOutcome { data_disks: Vec::new(), ..outcome() };
        assert!(!done_message(&boot_only).contains("data disk"));
    }
}
