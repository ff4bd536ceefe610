//! `VirtualMachineSnapshot` (group `vmlet.io`, version `v1alpha1`).
//!
//! A snapshot is kept by the back end beside the VM's disk (libvirt: an
//! internal snapshot inside the qcow2 file, with the VM's memory when it
//! runs). Taking one and deleting one are Jobs like backups: the pod lands on
//! the VM's node and that node's agent asks the back end. Going back to a
//! snapshot is a `VirtualMachineRestore` with `source.snapshot` and
//! `target.inPlace: true`, for a stopped VM; the same restore without
//! `inPlace` makes a new VM whose disk is the snapshot's (a clone).

use super::OperationPhase;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Annotation on a snapshot Job's pod (template) naming its
/// VirtualMachineSnapshot in the same namespace. The pod takes the snapshot,
/// or deletes it when the VirtualMachineSnapshot is being deleted.
pub const SNAPSHOT_ANNOTATION: &str = "vmlet.io/snapshot";

/// Finalizer on a VirtualMachineSnapshot whose back-end snapshot may exist:
/// removed once it was deleted on the host (or its VM is gone).
pub const SNAPSHOT_FINALIZER: &str = "snapshots.vmlet.io";

/// A named point in time of a VirtualMachine, kept by its back end.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "vmlet.io",
    version = "v1alpha1",
    kind = "VirtualMachineSnapshot",
    namespaced,
    status = "VirtualMachineSnapshotStatus",
    shortname = "vmsnapshot",
    shortname = "vmsnap",
    category = "all",
    doc = "A snapshot of a VirtualMachine kept by its back end on the VM's host (libvirt: inside the VM's qcow2 disk); revert to it with a VirtualMachineRestore in place.",
    printcolumn(name = "VM", type_ = "string", json_path = ".spec.virtualMachine"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Memory", type_ = "boolean", json_path = ".status.memory"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 52")
        .message("metadata.name must be at most 52 characters: the snapshot's Jobs are named <name>-snapshot and <name>-delete; choose a shorter name"),
    validation = Rule::new("self.spec == oldSelf.spec")
        .message("spec is immutable: a snapshot is taken once; create a new VirtualMachineSnapshot instead"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotSpec {
    /// Name of the VirtualMachine, in this namespace.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub virtual_machine: String,
    /// Whether the snapshot holds the VM's memory, so that a revert could
    /// resume the guest where it was. Unset: what the back end does for the
    /// VM's state (libvirt: with memory when the VM runs, which pauses the
    /// guest while its memory is written; disk only when stopped). libvirt
    /// refuses `false` for a running VM (its internal snapshots of a running
    /// VM always hold memory) and `true` for a stopped one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
    /// Seconds taking (or deleting) the snapshot may take; also its Job's
    /// `activeDeadlineSeconds`. Default 600.
    #[serde(default = "default_snapshot_deadline")]
    #[schemars(range(min = 10, max = 86400))]
    pub active_deadline_seconds: i64,
}

fn default_snapshot_deadline() -> i64 {
    600
}

/// Observed state of a VirtualMachineSnapshot, written by the agent that
/// takes it (and by the controller for what happens before a pod exists).
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSnapshotStatus {
    /// Where it stands: `Succeeded` means the snapshot exists on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<OperationPhase>,
    /// Whether it can be reverted to (`phase` Succeeded and not deleted).
    #[serde(default)]
    pub ready_to_use: bool,
    /// The Job that takes it (later: the one that deletes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// UID of the pod that took it: only that pod creates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The host (node) that holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// UID of the VirtualMachine it belongs to: a VM of the same name made
    /// later is another VM, and cannot be reverted to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_uid: Option<String>,
    /// The snapshot's name on the back end, `<namespace>_<name>_<uid>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_name: Option<String>,
    /// Whether it holds the VM's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
    /// Whether the VM was running when it was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_was_running: Option<bool>,
    /// The VM's spec when it was taken: what a restore to a new VM is made
    /// with (its `image` then the new disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_spec: Option<super::VirtualMachineSpec>,
    /// When the back end took it (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    /// What went wrong, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `Complete` or `Failed` (as a Job's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The back end's name for snapshot `name` (UID `uid`) of `namespace`:
/// `<namespace>_<name>_<uid>`. Neither a namespace nor an object name may
/// contain `_`, so the name says whose snapshot it is.
pub fn snapshot_backend_name(namespace: &str, name: &str, uid: &str) -> String {
    format!("{namespace}_{name}_{uid}")
}
