//! `VirtualMachineBackup` and `VirtualMachineRestore` (group `vmlet.io`,
//! version `v1alpha1`).
//!
//! A backup runs as a Kubernetes Job whose one pod the scheduler places on the
//! VM's node (required pod affinity to `vmlet.io/vm=<name>` over
//! `kubernetes.io/hostname`); that node's agent copies the VM's disk to a file
//! on the host and ends the pod Succeeded or Failed, so the Job's status is the
//! backup's. A restore runs the same way on the backup's node: its pod makes a
//! new disk from the backup file, then the controller creates the new
//! VirtualMachine on that node.

use super::VirtualMachineSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Annotation on a backup Job's pod (template) naming its VirtualMachineBackup
/// in the same namespace.
pub const BACKUP_ANNOTATION: &str = "vmlet.io/backup";
/// Annotation on a restore Job's pod (template) naming its
/// VirtualMachineRestore in the same namespace.
pub const RESTORE_ANNOTATION: &str = "vmlet.io/restore";
/// Annotation on a PersistentVolumeClaim whose `dataSourceRef` names a
/// VirtualMachineBackup: the data disk (`spec.disks[].name` of the backed-up
/// VM, one of the backup's `status.dataDisks`) whose file fills the claim.
/// Absent: the backup's boot disk file. The disk is looked up in that
/// backup's status only, so the annotation cannot reach another file.
pub const BACKUP_DISK_ANNOTATION: &str = "vmlet.io/backup-disk";

/// A copy of a VirtualMachine's disk, taken on its host by a Job's pod.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "vmlet.io",
    version = "v1alpha1",
    kind = "VirtualMachineBackup",
    namespaced,
    status = "VirtualMachineBackupStatus",
    shortname = "vmbackup",
    category = "all",
    doc = "A copy of a VirtualMachine's disk to a file on its host, taken by a Job pinned next to the VM.",
    printcolumn(name = "VM", type_ = "string", json_path = ".spec.virtualMachine"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Bytes", type_ = "integer", json_path = ".status.bytes"),
    printcolumn(name = "Consistency", type_ = "string", json_path = ".status.consistency"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 52")
        .message("metadata.name must be at most 52 characters: the backup's Job is named <name>-backup and its pod adds a suffix; choose a shorter name"),
    validation = Rule::new("self.spec == oldSelf.spec")
        .message("spec is immutable: a backup is taken once; create a new VirtualMachineBackup instead"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineBackupSpec {
    /// Name of the VirtualMachine to back up, in this namespace.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub virtual_machine: String,
    /// Where the copy goes. Default: the VM host's first backup root.
    #[serde(default)]
    pub target: BackupTarget,
    /// Freeze the guest's filesystems through its guest agent while the
    /// backup begins (milliseconds), so the copy holds what the guest wrote.
    /// Without an agent the backup goes on crash-consistent and
    /// `status.consistency` says so. Default true.
    #[serde(default = "default_true")]
    pub quiesce: bool,
    /// `Full` copies the whole disk. `Incremental` copies only what changed
    /// since the newest backup of this VM on its host that left a checkpoint
    /// (`status.checkpoint`), into a file whose backing file is that backup's
    /// (a restore reads the whole chain); back ends that cannot do it refuse
    /// it with a message in `status`.
    #[serde(default)]
    pub mode: BackupMode,
    /// Leave a checkpoint on the VM (libvirt: a persistent dirty bitmap in
    /// its disk), so the next `Incremental` backup copies only what changed
    /// since this one; it replaces the VM's previous checkpoint. Always done
    /// for `Incremental`. Only a running VM can take one. While a VM carries a
    /// checkpoint, libvirt refuses snapshots and reverts of it when stopped.
    /// Default false.
    #[serde(default)]
    pub checkpoint: bool,
    /// Seconds the copy may take before it is aborted (the VM runs on) and the
    /// backup fails; also the Job's `activeDeadlineSeconds`. Default 3600.
    #[serde(default = "default_backup_deadline")]
    #[schemars(range(min = 10, max = 604800))]
    pub active_deadline_seconds: i64,
}

fn default_true() -> bool {
    true
}

fn default_backup_deadline() -> i64 {
    3600
}

/// Where a backup is written: a host directory or a claim, at most one.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("!(has(self.hostPath) && has(self.persistentVolumeClaim))")
    .message("name at most one of hostPath and persistentVolumeClaim"))]
pub struct BackupTarget {
    /// A directory on the VM's host, which must be one of the host's backup
    /// roots or lie under one (vmlet's config, `backupRoots`). The file is
    /// `<directory>/<namespace>_<backup name>_<backup uid>.qcow2`: its name is
    /// vmlet's, never the tenant's. Default: the host's first backup root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096), regex(pattern = r"^/[^\x00-\x1f\x7f]*$"))]
    pub host_path: Option<String>,
    /// A PersistentVolumeClaim of this namespace: the backup's pod mounts it
    /// (so the claim is bound next to the VM, and cannot be deleted while the
    /// backup runs), and the file goes into its volume's directory. On libvirt
    /// the volume must be a `local` or `hostPath` PersistentVolume on the VM's
    /// host whose directory lies under the host's backup roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<super::ClaimSource>,
}

/// How much a backup copies.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackupMode {
    /// The whole disk.
    #[default]
    Full,
    /// Only the blocks changed since the previous backup (where the back end
    /// tracks them).
    Incremental,
}

/// Where a backup or restore stands.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperationPhase {
    /// Its Job's pod waits for the scheduler or the agent.
    Pending,
    /// The agent copies.
    Running,
    /// Done; the Job completed.
    Succeeded,
    /// Failed for good: `message` says why; the Job failed.
    Failed,
}

/// Observed state of a VirtualMachineBackup, written by the agent that runs it
/// (and by the controller for what happens before a pod exists).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineBackupStatus {
    /// Where it stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<OperationPhase>,
    /// The Job that runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// The pod that runs (or ran) the copy: only this pod writes the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// UID of that pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The host (node) that holds the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The boot disk's file on that host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// The VM's data disks (`spec.disks`, in order) and their files on that
    /// host: each is copied at the same point in time as the boot disk.
    /// Written when the copy begins (names, claims, files) and completed
    /// (sizes) when it succeeded. Empty for a VM without data disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_disks: Vec<BackupDataDisk>,
    /// Bytes of disk data copied so far, all disks together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<i64>,
    /// Bytes of disk data in all, all disks together (for a full backup,
    /// their virtual sizes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<i64>,
    /// Size of the boot disk's file in bytes (zero blocks are not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_bytes: Option<i64>,
    /// `Quiesced` (filesystems frozen), `CrashConsistent` (see
    /// `consistencyReason`) or `Offline` (the VM was not running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<String>,
    /// Why the backup is only crash-consistent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency_reason: Option<String>,
    /// When the copy began (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// When it ended (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    /// What went wrong, or the last progress line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The checkpoint this backup left on the VM, which a later
    /// `Incremental` backup builds on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// For an `Incremental` backup: the backup it builds on (its file is the
    /// backing file of this one's; keep it while this one may be restored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_backup: Option<String>,
    /// The VirtualMachine's spec when the backup began: what a restore gives
    /// the new VM (its disk then comes from the backup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_spec: Option<VirtualMachineSpec>,
    /// `Complete` or `Failed` (as a Job's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One data disk in a backup ([`VirtualMachineBackupStatus::data_disks`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BackupDataDisk {
    /// The disk's name in the VirtualMachine (`spec.disks[].name`): its
    /// serial in the guest (`/dev/disk/by-id/virtio-<name>`).
    #[schemars(length(min = 1, max = 20), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// The PersistentVolumeClaim that held the disk (`None` for a
    /// `hostImage` disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    /// That claim's StorageClass when the backup began: a restore to a new
    /// VM makes the disk's new claim in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// The disk's file on the backup's host
    /// ([`backup_data_file_name`] in the boot file's directory).
    pub location: String,
    /// Size of the file in bytes (zero blocks are not stored); once the
    /// backup succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_bytes: Option<i64>,
    /// The disk's virtual size in bytes, what the guest saw (the least a
    /// claim restored from it asks for); once the backup succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_bytes: Option<i64>,
}

/// A VirtualMachine's disk made from a backup (a new VM, or a stopped VM put
/// back in place), or a stopped VM reverted to a snapshot.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "vmlet.io",
    version = "v1alpha1",
    kind = "VirtualMachineRestore",
    namespaced,
    status = "VirtualMachineRestoreStatus",
    shortname = "vmrestore",
    category = "all",
    doc = "A new VirtualMachine whose disk is made from a VirtualMachineBackup or a VirtualMachineSnapshot on its host, or a stopped VirtualMachine put back in place from a backup or a snapshot.",
    printcolumn(name = "Backup", type_ = "string", json_path = ".spec.source.backup"),
    printcolumn(name = "Snapshot", type_ = "string", json_path = ".spec.source.snapshot"),
    printcolumn(name = "VM", type_ = "string", json_path = ".spec.target.virtualMachine"),
    printcolumn(name = "InPlace", type_ = "boolean", json_path = ".spec.target.inPlace"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 52")
        .message("metadata.name must be at most 52 characters: the restore's Job is named <name>-restore and its pod adds a suffix; choose a shorter name"),
    validation = Rule::new("self.spec == oldSelf.spec")
        .message("spec is immutable: create a new VirtualMachineRestore instead"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineRestoreSpec {
    /// What to restore from.
    pub source: RestoreSource,
    /// What to restore to.
    pub target: RestoreTarget,
}

/// The backup or snapshot a restore reads: exactly one.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("has(self.backup) != has(self.snapshot)")
    .message("name exactly one of backup and snapshot"))]
pub struct RestoreSource {
    /// Name of a Succeeded VirtualMachineBackup in this namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub backup: Option<String>,
    /// Name of a ready VirtualMachineSnapshot in this namespace: with
    /// `target.inPlace`, one of the target VM; without, the new VM's disk is
    /// the snapshot's boot disk (its memory is not used: the new VM boots as
    /// after a power cut when the snapshot was taken).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub snapshot: Option<String>,
}

/// The VM a restore makes or puts back.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestoreTarget {
    /// Name of the VirtualMachine in this namespace. Without `inPlace` it
    /// must not exist (a restore never writes over a VM): it is made with the
    /// spec the source recorded, its disk made from the source, pinned to the
    /// source's host. With `inPlace` it must exist and be stopped.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub virtual_machine: String,
    /// Put this existing, stopped VM (`spec.replicas: 0`) back as the source
    /// holds it: a backup's disk replaces its disk (the old disk is kept
    /// beside it as `<disk>.before-<restore uid>`), or its disks go back to
    /// the snapshot. The VM stays stopped while the restore runs; scale it
    /// up afterwards. Default false.
    #[serde(default)]
    pub in_place: bool,
}

/// Observed state of a VirtualMachineRestore.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineRestoreStatus {
    /// Where it stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<OperationPhase>,
    /// The Job that makes the disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// The host (node) of the backup, the new disk and the new VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The new disk, once made (in place: the VM's disk, once written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
    /// In place from a backup: where the VM's previous disk was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_disk: Option<String>,
    /// In place from a backup: the VM's data disks put back, and where
    /// each one's previous content was kept. A new VM from a backup: its
    /// data disks' claims, filled from the backup.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_disks: Vec<RestoredDataDisk>,
    /// UID of the pod that runs it: only that pod writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// Bytes of disk data copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<i64>,
    /// UID of the VirtualMachine this restore created (or put back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_uid: Option<String>,
    /// What went wrong, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `Complete` or `Failed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One data disk a restore made or put back
/// ([`VirtualMachineRestoreStatus::data_disks`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RestoredDataDisk {
    /// The disk's name in the VirtualMachine (`spec.disks[].name`).
    pub name: String,
    /// In place: the disk's file, now holding the backup's data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
    /// In place: where the disk's previous content was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_disk: Option<String>,
    /// A new VM: the claim filled from the backup's file of this disk
    /// ([`restored_data_claim_name`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
}

/// Why backup `backup_name`, which holds data disks `data_disks`, is not
/// restored to a new VM whose boot disk is a host file (the backed-up VM had
/// no `spec.rootDisk`): that path makes the boot disk only, and the new VM
/// would lack the data disks (or share the original's claims). The message
/// names `spec.source.backup` and the two ways that work.
pub fn boot_only_restore_refusal<'a>(backup_name: &str, data_disks: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<&str> = data_disks.into_iter().collect();
    format!(
        "spec.source.backup: VirtualMachineBackup {backup_name} holds data disks [{}] of a VM that booted a host \
         file (no spec.rootDisk); a new VM is made from such a backup with its boot disk only: restore it in place \
         instead (spec.target.inPlace: true, onto the stopped VM), or back up a VM with spec.rootDisk, whose \
         restore fills a claim per disk",
        names.join(", ")
    )
}

/// The file name of backup `name` (UID `uid`) of `namespace`:
/// `<namespace>_<name>_<uid>.qcow2`. Neither a namespace nor an object name
/// may contain `_` or `/`, so the name says whose backup it is and cannot
/// reach another directory.
pub fn backup_file_name(namespace: &str, name: &str, uid: &str) -> String {
    format!("{namespace}_{name}_{uid}.qcow2")
}

/// The file name of data disk `disk` (`spec.disks[].name`) in backup
/// `name` (UID `uid`) of `namespace`: `<namespace>_<name>_<uid>.<disk>.qcow2`,
/// beside the boot disk's [`backup_file_name`]. `None` when `disk` is no
/// disk name ([`super::is_disk_name`]: a DNS label of at most 20, so no `/`,
/// `.` or `_`): the name then neither leaves its directory nor matches
/// another backup's or disk's file.
pub fn backup_data_file_name(namespace: &str, name: &str, uid: &str, disk: &str) -> Option<String> {
    super::is_disk_name(disk).then(|| format!("{namespace}_{name}_{uid}.{disk}.qcow2"))
}

/// The name of the PersistentVolumeClaim a restore makes for data disk
/// `disk` of the new VM `vm`: `<vm>-disk-<disk>` (never the root disk's
/// `<vm>-root`, whatever the disk is called). At most 63 + 6 + 20
/// characters, a valid claim name for a VM name and a disk name.
pub fn restored_data_claim_name(vm: &str, disk: &str) -> String {
    format!("{vm}-disk-{disk}")
}

/// The file name of the disk restore `uid` makes for VM `vm` of `namespace`:
/// `<namespace>_<vm>_restored_<uid>.qcow2` (the image name
/// [`vmlet_provider::restored_image_name`] gives, as a qcow2 file).
pub fn restored_disk_name(namespace: &str, vm: &str, uid: &str) -> String {
    format!("{}.qcow2", vmlet_provider::restored_image_name(namespace, vm, uid))
}

/// The name of the checkpoint backup `uid` leaves on its VM: `vmlet-<uid>`
/// (libvirt checkpoint names: at most 128 of letters, digits, `-_.`).
pub fn backup_checkpoint_name(uid: &str) -> String {
    format!("vmlet-{uid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_disks_file_sits_beside_the_boot_file_and_names_backup_and_disk() {
        let boot = backup_file_name("team-a", "nightly", "u-1");
        let data = backup_data_file_name("team-a", "nightly", "u-1", "data").unwrap();
        assert_eq!(boot, "team-a_nightly_u-1.qcow2");
        assert_eq!(data, "team-a_nightly_u-1.data.qcow2");
        assert_ne!(backup_data_file_name("team-a", "nightly", "u-1", "logs").unwrap(), data);
    }

    #[test]
    fn a_data_file_name_is_refused_for_a_disk_name_that_could_leave_its_directory() {
        for hostile in ["", "../../etc/passwd", "a/b", "..", "x.qcow2", "a_b", "Data", "-x", "d".repeat(21).as_str()] {
            assert_eq!(backup_data_file_name("team-a", "nightly", "u-1", hostile), None, "{hostile:?}");
        }
    }

    #[test]
    fn a_restored_data_claim_is_never_the_root_disk_claim() {
        assert_eq!(restored_data_claim_name("web", "data"), "web-disk-data");
        assert_ne!(restored_data_claim_name("web", "root"), crate::v1alpha1::root_claim_name("web"));
    }

    #[test]
    fn a_backups_data_disks_round_trip_through_its_status() {
        let status: VirtualMachineBackupStatus = serde_json::from_value(serde_json::json!({
            "location": "/b/ns_n_u.qcow2",
            "dataDisks": [{"name": "data", "claimName": "web-data", "storageClassName": "vmlet-local",
                           "location": "/b/ns_n_u.data.qcow2", "fileBytes": 4096, "virtualBytes": 1073741824}],
        }))
        .unwrap();
        assert_eq!(
            status.data_disks,
            vec![BackupDataDisk {
                name: "data".into(),
                claim_name: Some("web-data".into()),
                storage_class_name: Some("vmlet-local".into()),
                location: "/b/ns_n_u.data.qcow2".into(),
                file_bytes: Some(4096),
                virtual_bytes: Some(1 << 30),
            }]
        );
        let without: VirtualMachineBackupStatus = serde_json::from_value(serde_json::json!({})).unwrap();
        assert!(without.data_disks.is_empty());
        assert_eq!(serde_json::to_value(&without).unwrap(), serde_json::json!({}), "no empty list is written");
    }
}
