//! The VirtualMachineRestore controller: a new VirtualMachine from a backup,
//! or (with `spec.target.inPlace`) a stopped VM put back from its backup or
//! snapshot ([`in_place`]).
//!
//! A new VM from a backup of a VM with a root disk ([`onto_root_claim`]):
//! its root disk claim is filled from the backup by vmlet's provisioner, so
//! no host file is named and no Job runs.
//!
//! A new VM otherwise:
//! 1. The backup must have succeeded (or the snapshot be ready to use, of a
//!    VM without data disks) and the target VM must not exist (a restore
//!    never writes over a VM).
//! 2. A Job on the source's host makes the new disk ([`crate::node::tasks`]);
//!    the agent writes `status.disk`.
//! 3. This controller creates the VirtualMachine: the spec the source
//!    recorded (`status.virtualMachineSpec`), its `image` the new disk,
//!    pinned to the host by `nodeSelector`, labelled
//!    `vmlet.io/restored-from=<backup>` or
//!    `vmlet.io/restored-from-snapshot=<snapshot>`; then the restore is
//!    `Succeeded`.

use super::task_jobs::{job_failure, run_job_owner, task_job, TaskJob, TaskPlacement};
use crate::conditions::new_condition;
use crate::v1alpha1::{
    boot_only_restore_refusal, is_disk_name, restored_data_claim_name, BackupDataDisk, ClaimSource, OperationPhase,
    RestoredDataDisk, VirtualMachine, VirtualMachineBackup, VirtualMachineRestore, VirtualMachineRestoreStatus,
    VirtualMachineSnapshot, VirtualMachineSpec, VmDisk, VmPhase, BACKUP_DISK_ANNOTATION, RESTORE_ANNOTATION,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument};

/// Label on a VirtualMachine a restore created, naming the backup.
pub const RESTORED_FROM_LABEL: &str = "vmlet.io/restored-from";

/// Label on a VirtualMachine a restore created from a snapshot, naming the
/// VirtualMachineSnapshot.
pub const RESTORED_FROM_SNAPSHOT_LABEL: &str = "vmlet.io/restored-from-snapshot";

/// Annotation on a VirtualMachine a restore created: the restore's UID.
pub const RESTORED_BY_ANNOTATION: &str = "vmlet.io/restored-by";

/// Seconds a restore's Job may run.
const JOB_DEADLINE_SECONDS: i64 = 3600 + 120;

/// Why a pass failed; it is retried.
#[derive(Debug, thiserror::Error)]
#[error("{action} of VirtualMachineRestore {object}: {source}")]
pub struct Error {
    action: &'static str,
    object: String,
    #[source]
    source: kube::Error,
}

struct Context {
    client: Client,
    scope: String,
}

/// Run the controller over the VirtualMachineRestores of `namespace` (all when
/// `None`) and their Jobs until `shutdown`.
pub async fn run(client: Client, namespace: Option<String>, scope: String, shutdown: CancellationToken) {
    info!("VirtualMachineRestore controller starting");
    let ctx = Arc::new(Context { client: client.clone(), scope });
    run_job_owner::<VirtualMachineRestore, _, Error, _>(
        client,
        namespace.as_deref(),
        RESTORE_ANNOTATION,
        reconcile,
        ctx,
        shutdown,
    )
    .await;
}

#[instrument(skip_all, fields(restore.namespace = restore.namespace().unwrap_or_default(), restore.name = %restore.name_any()))]
async fn reconcile(restore: Arc<VirtualMachineRestore>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let name = restore.name_any();
    let err = errors(&namespace, &name);
    let status = restore.status.clone().unwrap_or_default();
    if matches!(status.phase, Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let restores: Api<VirtualMachineRestore> = Api::namespaced(ctx.client.clone(), &namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let fail = |message: String| fail_restore(restores.clone(), name.clone(), message);

    if restore.spec.target.in_place {
        return in_place(&restore, &ctx, &status).await;
    }
    let source = match new_vm_source(&restore, &ctx.client).await.map_err(err("read the source"))? {
        Verdict::Go(source) => *source,
        Verdict::Fail(message) => return fail(message).await.map_err(err("write status")),
        Verdict::Wait(message) => {
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "message": message}});
            restores
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(err("write status"))?;
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
    };
    let NewVmSource { node, mut spec, label, what, disk_bytes, data_disks } = source;
    if restore.spec.source.backup.is_some() && spec.root_disk.is_some() {
        return onto_root_claim(&restore, &ctx, spec, &node, label, disk_bytes, &data_disks).await;
    }
    if let (Some(backup), false) = (&restore.spec.source.backup, data_disks.is_empty()) {
        let message = boot_only_restore_refusal(backup, data_disks.iter().map(|d| d.name.as_str()));
        return fail(message).await.map_err(err("write status"));
    }
    // The new disk is a host file this restore makes: the VM boots it as its
    // image, not a root disk claim.
    spec.root_disk = None;
    let vm_name = &restore.spec.target.virtual_machine;
    if let Some(existing) = vms.get_opt(vm_name).await.map_err(err("read the target VM"))? {
        let made_by_this_restore = existing.annotations().get(RESTORED_BY_ANNOTATION) == restore.uid().as_ref();
        if made_by_this_restore {
            // Created by an earlier pass whose status write did not land.
            let message = format!("VirtualMachine {vm_name} created from {what}");
            return end(&restores, &name, OperationPhase::Succeeded, &message, existing.uid())
                .await
                .map_err(err("write status"));
        }
        return fail(format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} exists; a restore never writes over a VM: name one \
             that does not exist"
        ))
        .await
        .map_err(err("write status"));
    }

    let Some(disk) = status.disk.clone() else {
        // Step 2: the Job that makes the disk on the source's host.
        let tolerations = spec.tolerations.clone().unwrap_or_default();
        if let Err(message) = ensure_job(&restore, &ctx, &node, tolerations).await.map_err(err("run the Job"))? {
            return fail(message).await.map_err(err("write status"));
        }
        return Ok(Action::requeue(Duration::from_secs(30)));
    };

    // Step 3: the VirtualMachine, on the disk's host.
    spec.image = Some(disk.clone());
    let vm = restored_vm(&restore, spec, &node, label);
    let created = match vms.create(&PostParams::default(), &vm).await {
        Ok(created) => created,
        // The recorded spec is no longer valid (the CRD's rules changed since
        // the backup): retrying will not help. The disk stays for a VM made
        // by hand.
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
            return fail(format!(
                "the API server refused VirtualMachine {vm_name} with the spec {what} recorded: {}; the restored \
                 disk {disk} is kept on host {node}: create a VirtualMachine with it as spec.image",
                s.message
            ))
            .await
            .map_err(err("write status"));
        }
        Err(e) => return Err(err("create the VirtualMachine")(e)),
    };
    info!(vm = %vm_name, disk = %disk, node = %node, "VirtualMachine restored");
    let message = format!("VirtualMachine {vm_name} created on host {node} with disk {disk}");
    end(&restores, &name, OperationPhase::Succeeded, &message, created.uid()).await.map_err(err("write status"))
}

/// The VirtualMachine `restore` makes: `spec` (the source's, its disk
/// already set), started, pinned to `node` by `nodeSelector`, labelled
/// with `label` (the source) and annotated with the restore's UID.
fn restored_vm(
    restore: &VirtualMachineRestore,
    mut spec: VirtualMachineSpec,
    node: &str,
    label: (String, String),
) -> VirtualMachine {
    spec.replicas = 1;
    spec.node_selector.get_or_insert_with(BTreeMap::new).insert("kubernetes.io/hostname".to_owned(), node.to_owned());
    VirtualMachine {
        metadata: ObjectMeta {
            name: Some(restore.spec.target.virtual_machine.clone()),
            namespace: restore.namespace(),
            labels: Some(BTreeMap::from([label])),
            annotations: Some(BTreeMap::from([(RESTORED_BY_ANNOTATION.to_owned(), restore.uid().unwrap_or_default())])),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// A new VM from a backup of a VM with a root disk (`spec.rootDisk`): its
/// root disk claim `<vm>-root` is filled from the backup by vmlet's
/// provisioner (`dataSourceRef` to the VirtualMachineBackup: an independent
/// copy, made on the backup's host, in the recorded root disk's class), so
/// the new VM, like the old one, boots a volume of its own and names no host
/// file: this works in any namespace. No Job runs.
///
/// 1. The claim: the recorded `rootDisk`'s class and size (at least the
///    backup's disk size), labelled with the VM and the backup, annotated
///    with the restore's UID. A claim of that name this restore did not
///    make fails the restore (it is the namespace's own).
/// 2. One claim per data disk the backup holds (`status.dataDisks`,
///    [`data_claim`]): `<vm>-disk-<disk>`, filled from that disk's file
///    (annotation [`BACKUP_DISK_ANNOTATION`]), in the class the original
///    claim had (else the root disk's), of the disk's size; the new VM's
///    `spec.disks` name these claims ([`restored_disks`]). They stay when
///    the VM is deleted, as data claims do.
/// 3. The VirtualMachine ([`restored_vm`]), whose controller uses the root
///    claim; with `deletionPolicy: Delete` it then owns that claim.
/// 4. `Succeeded` once every claim is bound (its volume made); until then
///    `Running`, naming the claims whose Events say what they wait for.
async fn onto_root_claim(
    restore: &VirtualMachineRestore,
    ctx: &Context,
    spec: VirtualMachineSpec,
    node: &str,
    label: (String, String),
    disk_bytes: Option<u64>,
    data_disks: &[BackupDataDisk],
) -> Result<Action, Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let name = restore.name_any();
    let err = errors(&namespace, &name);
    let restores: Api<VirtualMachineRestore> = Api::namespaced(ctx.client.clone(), &namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let vm_name = &restore.spec.target.virtual_machine;
    let claim_name = crate::v1alpha1::root_claim_name(vm_name);
    let backup = restore.spec.source.backup.clone().unwrap_or_default();
    let uid = restore.uid().unwrap_or_default();
    let made_here =
        |meta: &ObjectMeta| meta.annotations.as_ref().and_then(|a| a.get(RESTORED_BY_ANNOTATION)) == Some(&uid);
    let fail = |message: String| fail_restore(restores.clone(), name.clone(), message);

    let existing_vm = vms.get_opt(vm_name).await.map_err(err("read the target VM"))?;
    if existing_vm.as_ref().is_some_and(|vm| !made_here(&vm.metadata)) {
        return fail(format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} exists; a restore never writes over a VM: name one \
             that does not exist"
        ))
        .await
        .map_err(err("write status"));
    }
    let root = spec.root_disk.clone().expect("the caller checked spec.rootDisk");
    // Everything that can refuse the restore before anything is made.
    let mut spec = spec;
    let planned = restored_disks(vm_name, &spec.disks, data_disks, &backup).and_then(|disks| {
        spec.disks = disks;
        data_disks
            .iter()
            .map(|disk| data_claim(vm_name, &backup, &uid, disk, root.storage_class_name.as_deref()))
            .collect::<Result<Vec<_>, String>>()
    });
    let planned = match planned {
        Ok(planned) => planned,
        Err(message) => return fail(message).await.map_err(err("write status")),
    };
    let claim = match claims.get_opt(&claim_name).await.map_err(err("read the root disk claim"))? {
        Some(claim) if made_here(&claim.metadata) => claim,
        Some(_) => {
            return fail(format!(
                "spec.target.virtualMachine: claim {claim_name} exists; the restored VM's root disk claim is made by \
                 the restore: delete that claim or name another VM"
            ))
            .await
            .map_err(err("write status"));
        }
        None if existing_vm.is_some() => {
            return fail(format!(
                "claim {claim_name} of VirtualMachine {vm_name}, made by this restore, is gone; delete the VM and \
                 restore again"
            ))
            .await
            .map_err(err("write status"));
        }
        None => {
            let asked = crate::quantity::parse_bytes(&root.size.0).unwrap_or(0);
            let size = match disk_bytes.filter(|bytes| *bytes > asked) {
                Some(bytes) => Quantity(bytes.to_string()),
                None => root.size.clone(),
            };
            let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": claim_name,
                    "labels": {crate::v1alpha1::VM_LABEL: vm_name, RESTORED_FROM_LABEL: backup},
                    "annotations": {RESTORED_BY_ANNOTATION: uid},
                },
                "spec": {
                    "storageClassName": root.storage_class_name,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": size}},
                    "dataSourceRef": {"apiGroup": crate::v1alpha1::GROUP, "kind": "VirtualMachineBackup", "name": backup},
                },
            }))
            .expect("a claim serializes");
            let created =
                claims.create(&PostParams::default(), &claim).await.map_err(err("create the root disk claim"))?;
            info!(claim = %claim_name, size = %size.0, backup = %backup, "root disk claim to fill from the backup created");
            let message = format!("filling claim {claim_name} from VirtualMachineBackup {backup}");
            running(&restores, &name, node, &message).await.map_err(err("write status"))?;
            created
        }
    };

    let mut data_claims = Vec::with_capacity(planned.len());
    for wanted in planned {
        let data_claim_name = wanted.name_any();
        match claims.get_opt(&data_claim_name).await.map_err(err("read a data disk claim"))? {
            Some(claim) if made_here(&claim.metadata) => data_claims.push(claim),
            Some(_) => {
                return fail(format!(
                    "spec.target.virtualMachine: claim {data_claim_name} exists; the restored VM's data disk claims \
                     are made by the restore: delete that claim or name another VM"
                ))
                .await
                .map_err(err("write status"));
            }
            None if existing_vm.is_some() => {
                return fail(format!(
                    "claim {data_claim_name} of VirtualMachine {vm_name}, made by this restore, is gone; delete the VM \
                     and its claims, and restore again"
                ))
                .await
                .map_err(err("write status"));
            }
            None => {
                let created =
                    claims.create(&PostParams::default(), &wanted).await.map_err(err("create a data disk claim"))?;
                info!(claim = %data_claim_name, backup = %backup, "data disk claim to fill from the backup created");
                data_claims.push(created);
            }
        }
    }
    let recorded: Vec<RestoredDataDisk> = data_claims
        .iter()
        .map(|claim| RestoredDataDisk {
            name: claim.annotations().get(BACKUP_DISK_ANNOTATION).cloned().unwrap_or_default(),
            claim_name: Some(claim.name_any()),
            ..RestoredDataDisk::default()
        })
        .collect();
    if restore.status.as_ref().map(|s| &s.data_disks) != Some(&recorded) {
        let patch = serde_json::json!({"status": {"dataDisks": recorded}});
        restores
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(err("write status"))?;
    }

    let vm = match existing_vm {
        Some(vm) => vm,
        None => {
            let vm = restored_vm(restore, spec, node, label);
            match vms.create(&PostParams::default(), &vm).await {
                Ok(created) => {
                    info!(vm = %vm_name, claim = %claim_name, node = %node, "VirtualMachine restored onto its root disk claim");
                    created
                }
                Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
                    return fail(format!(
                        "the API server refused VirtualMachine {vm_name} with the spec VirtualMachineBackup {backup} \
                         recorded: {}; claim {claim_name} (and the data disks' claims [{}]) are kept: create a \
                         VirtualMachine with it as its root disk",
                        s.message,
                        data_claims.iter().map(|c| c.name_any()).collect::<Vec<_>>().join(", ")
                    ))
                    .await
                    .map_err(err("write status"));
                }
                Err(e) => return Err(err("create the VirtualMachine")(e)),
            }
        }
    };
    let owned = claim.metadata.owner_references.as_ref().is_some_and(|refs| !refs.is_empty());
    if vm.spec.deletion_policy == crate::v1alpha1::DeletionPolicy::Delete && !owned {
        // Like the claim the VM controller makes: it goes with the VM.
        let patch = serde_json::json!({"metadata": {"ownerReferences": [{
            "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "name": vm_name, "uid": vm.uid(),
            "controller": true, "blockOwnerDeletion": true}]}});
        claims
            .patch(&claim_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(err("give the root disk claim to its VM"))?;
    }
    let bound = |claim: &PersistentVolumeClaim| claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let waiting: Vec<String> =
        std::iter::once(&claim).chain(&data_claims).filter(|c| !bound(c)).map(|c| c.name_any()).collect();
    if !waiting.is_empty() {
        let message = format!(
            "VirtualMachine {vm_name} created on host {node}; waiting for claim{} {} to be filled from \
             VirtualMachineBackup {backup} (kubectl describe pvc {})",
            if waiting.len() == 1 { "" } else { "s" },
            waiting.join(", "),
            waiting.join(" ")
        );
        if restore.status.as_ref().and_then(|s| s.message.as_deref()) != Some(message.as_str()) {
            running(&restores, &name, node, &message).await.map_err(err("write status"))?;
        }
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let data = match data_claims.as_slice() {
        [] => String::new(),
        claims => format!(
            " and data disk claim{} {}",
            if claims.len() == 1 { "" } else { "s" },
            claims.iter().map(|c| c.name_any()).collect::<Vec<_>>().join(", ")
        ),
    };
    let message = format!(
        "VirtualMachine {vm_name} created on host {node} with claim {claim_name}{data} filled from VirtualMachineBackup \
         {backup}"
    );
    end(&restores, &name, OperationPhase::Succeeded, &message, vm.uid()).await.map_err(err("write status"))
}

/// The new VM `vm`'s `spec.disks` from the recorded ones (`recorded`, the
/// backed-up VM's) and the data disks backup `backup` holds: each disk,
/// whatever it was (a claim, a host image), becomes the claim the restore
/// fills from its copy ([`restored_data_claim_name`]), under its name (its
/// serial in the guest), in its place. `Err(why)` when the two lists do not
/// name the same disks (a backup holds every disk of its VM: an edited
/// status).
fn restored_disks(
    vm: &str,
    recorded: &[VmDisk],
    data_disks: &[BackupDataDisk],
    backup: &str,
) -> Result<Vec<VmDisk>, String> {
    let names = |names: Vec<&str>| names.join(", ");
    let same =
        recorded.len() == data_disks.len() && recorded.iter().all(|d| data_disks.iter().any(|b| b.name == d.name));
    if !same {
        return Err(format!(
            "VirtualMachineBackup {backup}'s status.dataDisks [{}] are not the disks of its \
             status.virtualMachineSpec.disks [{}]; it cannot be restored to a new VM: take a new backup",
            names(data_disks.iter().map(|d| d.name.as_str()).collect()),
            names(recorded.iter().map(|d| d.name.as_str()).collect())
        ));
    }
    Ok(recorded
        .iter()
        .map(|disk| VmDisk {
            name: disk.name.clone(),
            persistent_volume_claim: Some(ClaimSource { claim_name: restored_data_claim_name(vm, &disk.name) }),
            host_image: None,
        })
        .collect())
}

/// The claim restore `restore_uid` makes for data disk `disk` of backup
/// `backup`, for the new VM `vm`: `<vm>-disk-<disk>`
/// ([`restored_data_claim_name`]), filled from the backup
/// (`dataSourceRef`) with that disk's file (annotation
/// [`BACKUP_DISK_ANNOTATION`]), in the original claim's class (else
/// `root_class`, the root disk's), asking for the disk's virtual size,
/// `ReadWriteOnce`, labelled with the VM and the backup, annotated with the
/// restore's UID. `Err(why)` when the backup records no size for the disk
/// or no valid disk name.
fn data_claim(
    vm: &str,
    backup: &str,
    restore_uid: &str,
    disk: &BackupDataDisk,
    root_class: Option<&str>,
) -> Result<PersistentVolumeClaim, String> {
    if !is_disk_name(&disk.name) {
        return Err(format!(
            "VirtualMachineBackup {backup}'s status.dataDisks names {:?}, which is no data disk's name; take a new \
             backup",
            disk.name
        ));
    }
    let Some(bytes) = disk.virtual_bytes.filter(|bytes| *bytes > 0) else {
        return Err(format!(
            "VirtualMachineBackup {backup}'s status.dataDisks[{}] records no virtualBytes, so the size of the disk's \
             new claim is not known; restore it in place (spec.target.inPlace), or take a new backup",
            disk.name
        ));
    };
    let class = disk.storage_class_name.as_deref().or(root_class);
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": restored_data_claim_name(vm, &disk.name),
            "labels": {crate::v1alpha1::VM_LABEL: vm, RESTORED_FROM_LABEL: backup},
            "annotations": {RESTORED_BY_ANNOTATION: restore_uid, BACKUP_DISK_ANNOTATION: disk.name},
        },
        "spec": {
            "storageClassName": class,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": bytes.to_string()}},
            "dataSourceRef": {"apiGroup": crate::v1alpha1::GROUP, "kind": "VirtualMachineBackup", "name": backup},
        },
    }))
    .expect("a claim serializes"))
}

/// What a new VM is made from ([`new_vm_source`]).
struct NewVmSource {
    /// The host that holds the source, where the new disk is made.
    node: String,
    /// The VM's spec the source recorded.
    spec: VirtualMachineSpec,
    /// The label the new VM carries, naming the source.
    label: (String, String),
    /// The source, for messages: `VirtualMachineBackup <name>`.
    what: String,
    /// Bytes of boot disk data the source holds (a backup's
    /// `status.totalBytes` less its data disks' `virtualBytes`), when known:
    /// the least a new root disk claim asks for.
    disk_bytes: Option<u64>,
    /// The data disks the source holds (a backup's `status.dataDisks`).
    data_disks: Vec<BackupDataDisk>,
}

/// Whether a restore to a new VM can go on from its source.
enum Verdict {
    /// It can, from this.
    Go(Box<NewVmSource>),
    /// Not yet: the source is still being made.
    Wait(String),
    /// Never: the message says why, naming the field.
    Fail(String),
}

/// The source of a restore to a new VM: a Succeeded backup, or a snapshot
/// ready to use whose VM had no data disks (the new VM gets the boot disk
/// only, and would otherwise share the data disks' claims or files).
async fn new_vm_source(restore: &VirtualMachineRestore, client: &Client) -> Result<Verdict, kube::Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let mut disk_bytes = None;
    let mut data_disks = Vec::new();
    let (recorded, what, label) = match (&restore.spec.source.backup, &restore.spec.source.snapshot) {
        (Some(backup_name), _) => {
            let backups: Api<VirtualMachineBackup> = Api::namespaced(client.clone(), &namespace);
            let Some(backup) = backups.get_opt(backup_name).await? else {
                let message =
                    format!("spec.source.backup: namespace {namespace} has no VirtualMachineBackup {backup_name}");
                return Ok(Verdict::Fail(message));
            };
            let status = backup.status.unwrap_or_default();
            match status.phase {
                Some(OperationPhase::Succeeded) => {}
                Some(OperationPhase::Failed) => {
                    let message =
                        format!("spec.source.backup: VirtualMachineBackup {backup_name} failed; restore from another");
                    return Ok(Verdict::Fail(message));
                }
                _ => return Ok(Verdict::Wait(format!("waiting for VirtualMachineBackup {backup_name} to succeed"))),
            }
            let label = (RESTORED_FROM_LABEL.to_owned(), backup_name.clone());
            // totalBytes counts all disks together.
            let data_bytes: i64 = status.data_disks.iter().filter_map(|d| d.virtual_bytes).sum();
            disk_bytes = status.total_bytes.and_then(|bytes| u64::try_from(bytes.saturating_sub(data_bytes)).ok());
            data_disks = status.data_disks.clone();
            ((status.node_name, status.virtual_machine_spec), format!("VirtualMachineBackup {backup_name}"), label)
        }
        (None, Some(snapshot_name)) => {
            let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(client.clone(), &namespace);
            let Some(snapshot) = snapshots.get_opt(snapshot_name).await? else {
                let message = format!(
                    "spec.source.snapshot: namespace {namespace} has no VirtualMachineSnapshot {snapshot_name}"
                );
                return Ok(Verdict::Fail(message));
            };
            let deleting = snapshot.metadata.deletion_timestamp.is_some();
            let status = snapshot.status.unwrap_or_default();
            match status.phase {
                Some(OperationPhase::Succeeded) if status.ready_to_use && !deleting => {}
                Some(OperationPhase::Succeeded) => {
                    return Ok(Verdict::Fail(format!(
                        "spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is not ready to use ({})",
                        status.message.as_deref().unwrap_or("being deleted")
                    )));
                }
                Some(OperationPhase::Failed) => {
                    let message = format!("spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} failed");
                    return Ok(Verdict::Fail(message));
                }
                _ => {
                    return Ok(Verdict::Wait(format!(
                        "waiting for VirtualMachineSnapshot {snapshot_name} to be taken"
                    )));
                }
            }
            if status.virtual_machine_spec.as_ref().is_some_and(|spec| !spec.disks.is_empty()) {
                return Ok(Verdict::Fail(format!(
                    "spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is of a VM with data disks \
                     (spec.disks); a new VM gets the snapshot's boot disk only and would share the data disks with \
                     the original: restore it in place instead (spec.target.inPlace)"
                )));
            }
            let label = (RESTORED_FROM_SNAPSHOT_LABEL.to_owned(), snapshot_name.clone());
            ((status.node_name, status.virtual_machine_spec), format!("VirtualMachineSnapshot {snapshot_name}"), label)
        }
        (None, None) => return Ok(Verdict::Fail("spec.source: name a backup or a snapshot".to_owned())),
    };
    match recorded {
        (Some(node), Some(spec)) => {
            Ok(Verdict::Go(Box::new(NewVmSource { node, spec, label, what, disk_bytes, data_disks })))
        }
        _ => Ok(Verdict::Fail(format!("{what} records no host or VM spec; it cannot be restored to a new VM"))),
    }
}

/// A restore in place (`spec.target.inPlace`): the VM must exist, be the
/// source's, and be stopped; then the Job runs on the VM's host, whose agent
/// puts the disk back and ends the restore
/// ([`crate::node::tasks`]). This pass only starts it and reports what
/// happens before the agent claimed it.
async fn in_place(
    restore: &VirtualMachineRestore,
    ctx: &Context,
    status: &VirtualMachineRestoreStatus,
) -> Result<Action, Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let name = restore.name_any();
    let err = errors(&namespace, &name);
    let restores: Api<VirtualMachineRestore> = Api::namespaced(ctx.client.clone(), &namespace);
    let fail = |message: String| fail_restore(restores.clone(), name.clone(), message);
    let wait = |message: String| {
        let (restores, name) = (restores.clone(), name.clone());
        async move {
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "message": message}});
            restores.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            Ok::<_, kube::Error>(Action::requeue(Duration::from_secs(5)))
        }
    };
    if status.pod_uid.is_some() {
        // The agent runs it and ends it; only a Job that failed around it is ours to report.
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
        let job = jobs.get_opt(&format!("{name}-restore")).await.map_err(err("read the Job"))?;
        if let Some(message) = job.as_ref().and_then(job_failure) {
            return fail(message).await.map_err(err("write status"));
        }
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let vm_name = &restore.spec.target.virtual_machine;
    let Some(vm) = vms.get_opt(vm_name).await.map_err(err("read the target VM"))? else {
        return fail(format!(
            "spec.target.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name} to restore in place; \
             to make a new VM, leave spec.target.inPlace unset"
        ))
        .await
        .map_err(err("write status"));
    };
    let source_node = match (&restore.spec.source.backup, &restore.spec.source.snapshot) {
        (Some(backup_name), _) => {
            let backups: Api<VirtualMachineBackup> = Api::namespaced(ctx.client.clone(), &namespace);
            let Some(backup) = backups.get_opt(backup_name).await.map_err(err("read the backup"))? else {
                let message =
                    format!("spec.source.backup: namespace {namespace} has no VirtualMachineBackup {backup_name}");
                return fail(message).await.map_err(err("write status"));
            };
            if backup.spec.virtual_machine != *vm_name {
                return fail(format!(
                    "spec.source.backup: VirtualMachineBackup {backup_name} is of VirtualMachine {}, not {vm_name}; \
                     in place, a VM is restored from its own backups only (to make a new VM from it, leave \
                     spec.target.inPlace unset)",
                    backup.spec.virtual_machine
                ))
                .await
                .map_err(err("write status"));
            }
            let backup_status = backup.status.unwrap_or_default();
            match backup_status.phase {
                Some(OperationPhase::Succeeded) => backup_status.node_name,
                Some(OperationPhase::Failed) => {
                    let message = format!("spec.source.backup: VirtualMachineBackup {backup_name} failed");
                    return fail(message).await.map_err(err("write status"));
                }
                _ => {
                    let message = format!("waiting for VirtualMachineBackup {backup_name} to succeed");
                    return wait(message).await.map_err(err("write status"));
                }
            }
        }
        (None, Some(snapshot_name)) => {
            let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(ctx.client.clone(), &namespace);
            let Some(snapshot) = snapshots.get_opt(snapshot_name).await.map_err(err("read the snapshot"))? else {
                let message = format!(
                    "spec.source.snapshot: namespace {namespace} has no VirtualMachineSnapshot {snapshot_name}"
                );
                return fail(message).await.map_err(err("write status"));
            };
            let snapshot_status = snapshot.status.clone().unwrap_or_default();
            if snapshot.spec.virtual_machine != *vm_name || snapshot_status.virtual_machine_uid != vm.uid() {
                return fail(format!(
                    "spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is not a snapshot of this \
                     VirtualMachine {vm_name}; a VM reverts only to its own snapshots"
                ))
                .await
                .map_err(err("write status"));
            }
            match snapshot_status.phase {
                Some(OperationPhase::Succeeded)
                    if snapshot.metadata.deletion_timestamp.is_none() && snapshot_status.ready_to_use =>
                {
                    snapshot_status.node_name
                }
                Some(OperationPhase::Succeeded) => {
                    let message = format!(
                        "spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} is not ready to use ({})",
                        snapshot_status.message.as_deref().unwrap_or("being deleted")
                    );
                    return fail(message).await.map_err(err("write status"));
                }
                Some(OperationPhase::Failed) => {
                    let message = format!("spec.source.snapshot: VirtualMachineSnapshot {snapshot_name} failed");
                    return fail(message).await.map_err(err("write status"));
                }
                _ => {
                    let message = format!("waiting for VirtualMachineSnapshot {snapshot_name} to be taken");
                    return wait(message).await.map_err(err("write status"));
                }
            }
        }
        (None, None) => {
            return fail("spec.source: name a backup or a snapshot".to_owned()).await.map_err(err("write status"));
        }
    };
    if vm.spec.replicas != 0 {
        return fail(format!(
            "spec.target.virtualMachine: VirtualMachine {vm_name} has spec.replicas {}; a restore in place never \
             writes under a running VM: stop it (kubectl scale vm/{vm_name} --replicas=0), then create the restore \
             again",
            vm.spec.replicas
        ))
        .await
        .map_err(err("write status"));
    }
    let vm_status = vm.status.clone().unwrap_or_default();
    if vm_status.phase != Some(VmPhase::Stopped) || vm_status.pod_name.is_some() {
        return wait(format!("waiting for VirtualMachine {vm_name} to stop")).await.map_err(err("write status"));
    }
    let Some(node) = crate::node::placement::recorded_node(&vm).map(str::to_owned) else {
        let message = format!("VirtualMachine {vm_name} has never been defined on a host: there is nothing to restore");
        return fail(message).await.map_err(err("write status"));
    };
    if source_node.as_deref() != Some(node.as_str()) {
        return fail(format!(
            "the source is on host {} and VirtualMachine {vm_name} on host {node}: a restore in place runs where \
             both are; to make a new VM on the backup's host, leave spec.target.inPlace unset",
            source_node.as_deref().unwrap_or("(none)")
        ))
        .await
        .map_err(err("write status"));
    }
    let tolerations = vm.spec.tolerations.clone().unwrap_or_default();
    if let Err(message) = ensure_job(restore, ctx, &node, tolerations).await.map_err(err("run the Job"))? {
        return fail(message).await.map_err(err("write status"));
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// Make sure the restore's Job `<name>-restore` exists on `node` (status:
/// Pending, its name and node); `Ok(Err(message))` when it cannot be this
/// restore's: another object's Job of that name, or it failed.
async fn ensure_job(
    restore: &VirtualMachineRestore,
    ctx: &Context,
    node: &str,
    tolerations: Vec<Toleration>,
) -> Result<Result<(), String>, kube::Error> {
    let namespace = restore.namespace().unwrap_or_default();
    let name = restore.name_any();
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &namespace);
    let job_name = format!("{name}-restore");
    if let Some(job) = jobs.get_opt(&job_name).await? {
        let ours = job.owner_references().iter().any(|r| Some(&r.uid) == restore.meta().uid.as_ref());
        if !ours {
            return Ok(Err(format!(
                "Job {job_name} exists and is not this restore's; delete it or rename the restore"
            )));
        }
        return Ok(job_failure(&job).map_or(Ok(()), Err));
    }
    let owner = restore.controller_owner_ref(&()).expect("a stored object has a name and UID");
    let job = task_job(&TaskJob {
        name: job_name.clone(),
        namespace: &namespace,
        owner,
        annotation: (RESTORE_ANNOTATION, &name),
        container: "restore",
        placement: TaskPlacement::OnNode(node.to_owned()),
        deadline_seconds: JOB_DEADLINE_SECONDS,
        scope: &ctx.scope,
        tolerations,
        claim: None,
    });
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => info!(job = %job_name, node = %node, "restore Job created"),
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e),
    }
    let restores: Api<VirtualMachineRestore> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch =
        serde_json::json!({"status": {"phase": OperationPhase::Pending, "jobName": job_name, "nodeName": node}});
    restores.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Ok(()))
}

/// The maker of a pass's [`Error`]s for VirtualMachineRestore
/// `namespace/name`: given what was being done, it wraps the API error.
fn errors(namespace: &str, name: &str) -> impl Fn(&'static str) -> Box<dyn FnOnce(kube::Error) -> Error + Send> {
    let object = format!("{namespace}/{name}");
    move |action| {
        let object = object.clone();
        Box::new(move |source| Error { action, object, source })
    }
}

/// Say restore `name` runs on `node`, with `message`.
async fn running(
    restores: &Api<VirtualMachineRestore>,
    name: &str,
    node: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({"status": {"phase": OperationPhase::Running, "nodeName": node, "message": message}});
    restores.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
}

/// End restore `name` `Failed` with `message` ([`end`]).
async fn fail_restore(
    restores: Api<VirtualMachineRestore>,
    name: String,
    message: String,
) -> Result<Action, kube::Error> {
    end(&restores, &name, OperationPhase::Failed, &message, None).await
}

/// End the restore with `phase` and `message` (condition `Complete` or `Failed`).
async fn end(
    restores: &Api<VirtualMachineRestore>,
    name: &str,
    phase: OperationPhase,
    message: &str,
    vm_uid: Option<String>,
) -> Result<Action, kube::Error> {
    let (type_, reason) = match phase {
        OperationPhase::Succeeded => ("Complete", "Restored"),
        _ => ("Failed", "RestoreFailed"),
    };
    let condition = new_condition(type_, true, reason, message, None);
    let mut status = serde_json::json!({"phase": phase, "message": message, "conditions": [condition]});
    if let Some(uid) = vm_uid {
        status["virtualMachineUid"] = uid.into();
    }
    restores.patch_status(name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({"status": status}))).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::VmBuilder;

    fn backed_up(name: &str, class: Option<&str>, virtual_bytes: Option<i64>) -> BackupDataDisk {
        BackupDataDisk {
            name: name.into(),
            claim_name: class.map(|_| format!("web-{name}")),
            storage_class_name: class.map(str::to_owned),
            location: format!("/backups/team-a_nightly_u-1.{name}.qcow2"),
            file_bytes: Some(4096),
            virtual_bytes,
        }
    }

    #[test]
    fn every_data_disk_of_the_new_vm_is_a_claim_of_its_own_under_the_disks_name() {
        let recorded = VmBuilder::new("web").disks(&[("data", "web-data"), ("logs", "/images/logs.qcow2")]).build();
        let data = [backed_up("logs", None, Some(1 << 30)), backed_up("data", Some("vmlet-local"), Some(1 << 30))];
        let disks = restored_disks("copy", &recorded.spec.disks, &data, "nightly").unwrap();
        assert_eq!(
            serde_json::to_value(disks).unwrap(),
            serde_json::json!([
                {"name": "data", "persistentVolumeClaim": {"claimName": "copy-disk-data"}},
                {"name": "logs", "persistentVolumeClaim": {"claimName": "copy-disk-logs"}},
            ]),
            "spec order, names (the guest's serials) kept, a host image becomes a claim too"
        );
    }

    #[test]
    fn a_backup_whose_disks_are_not_its_specs_is_not_restored_to_a_new_vm() {
        let recorded = VmBuilder::new("web").disks(&[("data", "web-data")]).build();
        let why = restored_disks("copy", &recorded.spec.disks, &[], "nightly").unwrap_err();
        assert_eq!(
            why,
            "VirtualMachineBackup nightly's status.dataDisks [] are not the disks of its \
             status.virtualMachineSpec.disks [data]; it cannot be restored to a new VM: take a new backup"
        );
        let other = [backed_up("other", None, Some(1))];
        assert!(restored_disks("copy", &recorded.spec.disks, &other, "nightly").is_err());
        assert_eq!(restored_disks("copy", &[], &[], "nightly"), Ok(Vec::new()));
    }

    #[test]
    fn a_data_claim_is_filled_from_its_disks_file_in_the_original_class_at_the_disks_size() {
        let claim = data_claim("copy", "nightly", "r-1", &backed_up("data", Some("vmlet-local"), Some(1 << 30)), None);
        let json = serde_json::to_value(claim.unwrap()).unwrap();
        assert_eq!(json["metadata"]["name"], "copy-disk-data");
        assert_eq!(
            json["metadata"]["annotations"],
            serde_json::json!({BACKUP_DISK_ANNOTATION: "data", RESTORED_BY_ANNOTATION: "r-1"})
        );
        assert_eq!(
            json["metadata"]["labels"],
            serde_json::json!({"vmlet.io/vm": "copy", RESTORED_FROM_LABEL: "nightly"})
        );
        assert_eq!(
            json["spec"],
            serde_json::json!({
                "storageClassName": "vmlet-local", "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1073741824"}},
                "dataSourceRef": {"apiGroup": "vmlet.io", "kind": "VirtualMachineBackup", "name": "nightly"},
            })
        );
        // A host image disk had no claim: the root disk's class.
        let image = data_claim("copy", "nightly", "r-1", &backed_up("logs", None, Some(1 << 20)), Some("root-class"));
        assert_eq!(serde_json::to_value(image.unwrap()).unwrap()["spec"]["storageClassName"], "root-class");
    }

    #[test]
    fn a_data_claim_needs_the_disks_size_and_a_disk_name() {
        let no_size = data_claim("copy", "nightly", "r-1", &backed_up("data", None, None), None).unwrap_err();
        assert!(no_size.contains("status.dataDisks[data] records no virtualBytes"), "{no_size}");
        let hostile = data_claim("copy", "nightly", "r-1", &backed_up("../x", None, Some(1)), None).unwrap_err();
        assert!(hostile.contains("\"../x\", which is no data disk's name"), "{hostile}");
    }
}
