//! vmlet's custom resources, group `vmlet.io`, version `v1alpha1`:
//! `VirtualMachine` (here), `VirtualMachineBackup` and `VirtualMachineRestore`
//! ([`backup`]).
//!
//! The CRD in `crds/` is generated from these types (`vmlet crd`); validation lives
//! in the schema (ranges, patterns) and CEL rules so that `kubectl apply` of a bad
//! object fails at the API server with a message naming the field.

mod backup;
mod image;
mod snapshot;
pub use backup::*;
pub use image::*;
pub use snapshot::*;

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// API group of vmlet's resources.
pub const GROUP: &str = "vmlet.io";
/// Label on a VM's pod naming its VirtualMachine (`vmlet.io/vm=<name>`).
pub const VM_LABEL: &str = "vmlet.io/vm";
/// Finalizer that keeps a VirtualMachine until its IaaS VM is removed or released.
pub const FINALIZER: &str = "virtualmachines.vmlet.io";

/// A virtual machine on one of vmlet's hypervisor hosts, run through a pod that
/// the scheduler binds to the host's virtual node.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "vmlet.io",
    version = "v1alpha1",
    kind = "VirtualMachine",
    namespaced,
    status = "VirtualMachineStatus",
    shortname = "vm",
    shortname = "vms",
    category = "all",
    doc = "A virtual machine on a hypervisor host, run through a pod bound to the host's virtual node.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(name = "IP", type_ = "string", json_path = ".status.addresses[0]"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 63")
        .message("metadata.name must be at most 63 characters, because it becomes the vmlet.io/vm label value of the VM's pod; choose a shorter name"),
    validation = Rule::new("!has(self.spec.rootDisk) || (has(self.spec.image) && !self.spec.image.startsWith('/'))")
        .message("spec.rootDisk is made from a VirtualMachineImage: set spec.image to the image's name"),
    validation = Rule::new("!has(self.spec.rootDisk) || !has(self.spec.disks) || self.spec.disks.all(d, !has(d.persistentVolumeClaim) || d.persistentVolumeClaim.claimName != self.metadata.name + '-root')")
        .message("spec.disks[].persistentVolumeClaim names <vm>-root, the root disk's claim: a disk is attached once; name another claim"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSpec {
    /// 1 runs the VM, 0 stops it (keeping its definition and disks). Changed with
    /// `kubectl scale virtualmachine/<name> --replicas=0|1`.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 1))]
    pub replicas: i32,

    /// CPU and memory of the VM; they become the pod's requests and limits, so the
    /// scheduler places the VM on a host with room for it. Changing `cpu` or
    /// `memory` resizes the VM: its pod is resized in place (`pods/resize`) and
    /// the agent applies the new size as `resizePolicy` says.
    #[serde(default)]
    pub resources: VmResources,

    /// How a change of `spec.resources` reaches a running VM: `Live` only
    /// hot-plugs (vCPUs, memory balloon) within `maxCpu`/`maxMemory`, and
    /// reports a resize beyond them as infeasible; `LiveOrRestart` (default)
    /// hot-plugs where it can, else changes the definition for the next start
    /// and reports `ResourcesSynced=False` (reason `RestartRequired`); `Restart`
    /// never hot-plugs (always the next start).
    #[serde(default)]
    pub resize_policy: ResizePolicy,

    /// Boot disk: the name of a `VirtualMachineImage` of the catalogue
    /// (`debian-12`), or on Nova a Glance image the cloud's `images` allow.
    /// A host path (`/var/lib/libvirt/images/web.qcow2`) only in namespaces
    /// listed in vmlet's `trustedNamespaces`. Without it the VM boots with
    /// no disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096), regex(pattern = r"^[^\x00-\x1f\x7f]+$"))]
    pub image: Option<String>,

    /// The VM's own boot volume, made from `image` (a `VirtualMachineImage`)
    /// by a StorageClass of vmlet's provisioner (`format: qcow2`): a
    /// PersistentVolumeClaim `<vm>-root` that the controller creates, a qcow2
    /// overlay on the image in a pool of the host the scheduler picks. The
    /// guest boots from it (`vda`) and writes only into it. Without it the
    /// VM boots the image file itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_disk: Option<RootDisk>,

    /// Boot a kernel directly (paths on the host) instead of from the disk's boot
    /// loader. Backends that cannot do this refuse the VM with a clear error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<KernelBoot>,

    /// Settings that only the host's back end reads, as strings: for OpenStack
    /// `flavor` (a flavor name or id; default: the smallest flavor that fits
    /// `resources`) and `networks` (comma-separated network ids, or `auto` /
    /// `none`). A back end refuses keys it does not know, naming the key, and
    /// libvirt reads none. Passed to the host on the VM's pod; changes apply
    /// to the next pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub provider_options: BTreeMap<String, String>,

    /// Copied onto the VM's pod: only hosts whose node has these labels qualify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,

    /// Copied onto the VM's pod: node and pod (anti-)affinity for host selection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// Copied onto the VM's pod, beside the toleration for the virtual-node taint.
    /// Checked at admission as the pod would be: operator `Exists` or `Equal`,
    /// effect `NoSchedule`, `PreferNoSchedule` or `NoExecute`, an empty key
    /// only with `Exists`, no value with `Exists`; at most 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(
        validation = Rule::new("self.all(t, !has(t.operator) || t.operator in ['Exists', 'Equal'])")
            .message("spec.tolerations[].operator must be Exists or Equal (empty means Equal)"),
        validation = Rule::new("self.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])")
            .message("spec.tolerations[].effect must be NoSchedule, PreferNoSchedule or NoExecute (empty matches all)"),
        validation = Rule::new("self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))")
            .message("spec.tolerations[].key may be empty only with operator Exists"),
        validation = Rule::new("self.all(t, !has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == '')")
            .message("spec.tolerations[].value must be empty with operator Exists"),
    )]
    pub tolerations: Option<Vec<Toleration>>,

    /// Copied onto the VM's pod: the priority class used for scheduling and preemption.
    /// A DNS subdomain (lower-case letters, digits, `-` and `.`), as Kubernetes
    /// requires of PriorityClass names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub priority_class_name: Option<String>,

    /// What happens when the VM stops by itself, as a pod's restartPolicy:
    /// `Always` (default) starts it again; `OnFailure` starts it again after a
    /// crash or a power-off from the host (`virsh destroy`), and leaves it off
    /// after the guest powered itself off; `Never` leaves it off either way.
    /// A VM left off reads phase `Stopped` with the reason; `spec.replicas`
    /// stays 1 (vmlet never writes the spec): start it again with
    /// `kubectl scale vm/<name> --replicas=0`, then `--replicas=1`.
    #[serde(default)]
    pub restart_policy: RestartPolicy,

    /// How a stop powers the VM off: `Soft` asks the guest (ACPI) and waits,
    /// `Hard` cuts power at once, `TrySoft` asks the guest and cuts power after
    /// `shutdownTimeoutSeconds`.
    #[serde(default)]
    pub power_off_mode: PowerOffMode,

    /// Seconds a soft stop waits for the guest before `TrySoft` cuts power; also the
    /// pod's `terminationGracePeriodSeconds`. Default 30.
    #[serde(default = "default_shutdown_timeout")]
    #[schemars(range(min = 0, max = 86400))]
    pub shutdown_timeout_seconds: i64,

    /// Whether deleting this object deletes the IaaS VM (`Delete`) or leaves it
    /// defined on its host (`Retain`).
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,

    /// What an eviction of the VM's pod (`kubectl drain`, the eviction API)
    /// does: `LiveMigrate` (default) moves the running VM to another host
    /// without a restart (cold where the back end cannot move it live);
    /// `ColdMigrate` shuts it down, moves its definition and starts it on the
    /// other host; `None` stops it, as a deleted pod does.
    #[serde(default)]
    pub eviction_strategy: EvictionStrategy,

    /// cloud-init data the guest reads at its first boot (the NoCloud data
    /// source on libvirt, Nova's user data on OpenStack): `userData` and
    /// `networkData` from a key of a Secret or ConfigMap of this namespace,
    /// read by vmlet when it defines the VM (a VM defined already keeps what
    /// it got), and the guest's hostname (default: the VM's name). vmlet
    /// needs `get` on that Secret or ConfigMap; their contents never reach a
    /// log or an Event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInitSpec>,

    /// Data disks after the boot disk (`image`), in order (virtio `vdb`,
    /// `vdc`, ...), each from exactly one source:
    ///
    /// - `persistentVolumeClaim`: a claim of this namespace, which becomes a
    ///   volume of the VM's pod, so the scheduler places the VM where its
    ///   volumes are (a local PersistentVolume's node affinity; a
    ///   StorageClass with `volumeBindingMode: WaitForFirstConsumer` binds
    ///   the claim there) and Kubernetes holds a claim's deletion while the
    ///   VM's pod uses it (`kubernetes.io/pvc-protection`). On libvirt the
    ///   volume is a directory on the host (a `local` or `hostPath`
    ///   PersistentVolume under the host's storage roots) and the disk is its
    ///   `disk.img`, made (raw, sparse, the claim's capacity) at the VM's
    ///   first start.
    /// - `hostImage`: an image file that already exists on the VM's host,
    ///   under the host's storage roots (vmlet never makes one); its format
    ///   (raw or qcow2) is read from the file. It is no pod volume: place the
    ///   VM on a host that has the file (`nodeSelector`, `affinity`).
    ///
    /// Read when the VM is defined. At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(
        validation = Rule::new("self.all(d, self.exists_one(e, e.name == d.name))")
            .message("spec.disks[].name must be unique"),
        validation = Rule::new("self.all(d, !has(d.persistentVolumeClaim) || self.exists_one(e, has(e.persistentVolumeClaim) && e.persistentVolumeClaim.claimName == d.persistentVolumeClaim.claimName))")
            .message("spec.disks[].persistentVolumeClaim.claimName must be unique: a claim is attached once"),
    )]
    pub disks: Vec<VmDisk>,

    /// The VM's network interfaces, in order (the guest's first NIC first),
    /// each on a network its host offers by name. The host's administrator
    /// lists the networks in vmlet's config (libvirt: a libvirt network, a
    /// bridge or macvtap per name, optionally only for some namespaces; Nova:
    /// a Neutron network per name), so one manifest runs on every back end.
    /// Empty or absent: the first network the host offers this namespace
    /// (Nova: `auto` where the cloud offers it none, or
    /// `providerOptions.networks`, which cannot be combined with this).
    /// A name the host does not offer leaves the pod waiting (`InvalidSpec`,
    /// naming `spec.networks[<i>].name` and the names it does offer) and
    /// nothing is defined. Read when the VM is defined. At most 8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(validation = Rule::new("self.all(n, !has(n.macAddress) || self.exists_one(m, has(m.macAddress) && m.macAddress == n.macAddress))")
        .message("spec.networks[].macAddress must be unique"))]
    pub networks: Vec<VmNetwork>,

    /// Selector-less Services of this namespace whose EndpointSlice lists
    /// this VM: vmlet keeps one EndpointSlice per such Service
    /// (`<service>-vmlet`, managed by `vmlet.io`) with the addresses of the
    /// running pods of the VMs that name it, ready while the VM is Ready.
    /// A Service with a selector is left to Kubernetes' EndpointSlice
    /// controller (give the VM a label the selector matches instead: a VM's
    /// pod carries its labels). At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub services: Vec<VmService>,
}

/// One of [`VirtualMachineSpec::services`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmService {
    /// The Service's name, in the VM's namespace.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
}

/// One of [`VirtualMachineSpec::networks`]: a network interface of the VM.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmNetwork {
    /// The network's name as the host offers it (a DNS label, e.g. `lan`).
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// A fixed MAC address for the interface, six lower-case hex octets
    /// separated by colons, unicast (the first octet even), e.g.
    /// `52:54:00:12:34:56`. Absent: the back end picks one when the VM is
    /// defined and keeps it for the VM's life (migrations included). Nova
    /// refuses it (Neutron picks a port's MAC address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 17, max = 17), regex(pattern = r"^[0-9a-f][02468ace](:[0-9a-f]{2}){5}$"))]
    pub mac_address: Option<String>,
}

/// One of [`VirtualMachineSpec::disks`]: a name and exactly one source.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("has(self.persistentVolumeClaim) != has(self.hostImage)")
    .message("spec.disks[]: name exactly one of persistentVolumeClaim and hostImage"))]
pub struct VmDisk {
    /// The disk's name: the disk's serial in the guest
    /// (`/dev/disk/by-id/virtio-<name>`), and for a claim the pod volume's
    /// name. A DNS label.
    #[schemars(length(min = 1, max = 20), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// The PersistentVolumeClaim that holds the disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimSource>,
    /// An image file on the VM's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_image: Option<HostImageSource>,
}

/// Whether `name` is a data disk's name as `spec.disks[].name` allows it
/// (the CRD's rule): a DNS label of 1 to 20 lower-case letters, digits and
/// `-`, starting and ending with a letter or digit. Such a name holds no `/`,
/// `.` or `_`, so a file name built from it stays in its directory and says
/// whose it is. vmlet checks it again wherever a name comes from a status or
/// an annotation, which the API server does not hold to the spec's rule.
pub fn is_disk_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let inner = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    (1..=20).contains(&bytes.len())
        && bytes.first().is_some_and(inner)
        && bytes.last().is_some_and(inner)
        && bytes.iter().all(|b| inner(b) || *b == b'-')
}

/// Where a [`VmDisk`] comes from ([`VmDisk::source`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskSource<'a> {
    /// A PersistentVolumeClaim of the VM's namespace.
    Claim(&'a ClaimSource),
    /// An image file on the VM's host.
    HostImage(&'a HostImageSource),
}

impl VmNetwork {
    /// The provider contract's form of this interface.
    pub fn request(&self) -> vmlet_provider::NetworkRequest {
        vmlet_provider::NetworkRequest { name: self.name.clone(), mac: self.mac_address.clone() }
    }
}

impl VmDisk {
    /// The disk's one source. `None` when it names both or neither, which the
    /// API server refuses (the CRD's rule): only an object that bypassed
    /// admission gets here.
    pub fn source(&self) -> Option<DiskSource<'_>> {
        match (&self.persistent_volume_claim, &self.host_image) {
            (Some(claim), None) => Some(DiskSource::Claim(claim)),
            (None, Some(image)) => Some(DiskSource::HostImage(image)),
            _ => None,
        }
    }

    /// The path of the disk's host image, when it is one.
    pub fn host_image_path(&self) -> Option<&str> {
        match self.source() {
            Some(DiskSource::HostImage(image)) => Some(&image.path),
            _ => None,
        }
    }
}

/// A PersistentVolumeClaim of the VM's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimSource {
    /// The claim's name.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
}

/// An image file on the VM's host ([`VmDisk::host_image`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostImageSource {
    /// Absolute path of the image on the host, e.g.
    /// `/var/lib/libvirt/images/web-data.qcow2`, without control characters.
    /// It must lie under the host's storage roots (with symbolic links
    /// followed where vmlet sees the host's files), exist, and be a raw or
    /// qcow2 image; a qcow2 image's backing files must lie under the roots
    /// too. Otherwise the VM is not defined and its pod waits, naming this
    /// field: `StorageNotAllowed` (outside the roots), `HostImageNotFound`,
    /// `HostImageNotUsable`.
    #[schemars(length(min = 1, max = 4096), regex(pattern = r"^/[^\x00-\x1f\x7f]*$"))]
    pub path: String,
}

/// [`VirtualMachineSpec::cloud_init`].
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CloudInitSpec {
    /// Where the user data is (`#cloud-config` YAML, a `#!` script, ...).
    pub user_data: DataSource,
    /// Where the network config is (cloud-init's version 1 or 2), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<DataSource>,
    /// The guest's hostname (`local-hostname`); default: the VM's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub hostname: Option<String>,
}

/// A key of a Secret or of a ConfigMap in the VM's namespace: exactly one.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[x_kube(validation = Rule::new("has(self.secretKeyRef) != has(self.configMapKeyRef)")
    .message("name exactly one of secretKeyRef and configMapKeyRef"))]
pub struct DataSource {
    /// A key of a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<KeyRef>,
    /// A key of a ConfigMap (`data` or `binaryData`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_key_ref: Option<KeyRef>,
}

/// An object's name and one of its keys.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyRef {
    /// The Secret's or ConfigMap's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_replicas() -> i32 {
    1
}

fn default_shutdown_timeout() -> i64 {
    30
}

/// Size of a VM, and the ceilings a live resize may grow it to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmResources {
    /// Virtual CPUs, a whole number from 1. Default 1.
    #[serde(default = "default_cpu")]
    #[schemars(range(min = 1, max = 1024))]
    pub cpu: i32,

    /// Guest memory as a Kubernetes binary or decimal quantity, e.g. `512Mi`,
    /// `2Gi`, `1G`; from 1Mi to 64Ti. Default `512Mi`.
    #[serde(default = "default_memory")]
    #[schemars(length(max = 32), regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"))]
    #[x_kube(validation = Rule::new("!isQuantity(self) || (quantity(self).compareTo(quantity('1Mi')) >= 0 && quantity(self).compareTo(quantity('64Ti')) <= 0)").message(
        "spec.resources.memory must be from 1Mi to 64Ti, e.g. 512Mi"
    ))]
    pub memory: String,

    /// Hot-plug ceiling for vCPUs: a running VM may grow to this many without
    /// a restart. Fixed when the VM is defined; a change takes effect at its
    /// next start. Default: `cpu` (no live growth). A `cpu` above it is
    /// applied at the next start (or refused under `resizePolicy: Live`), and
    /// the ceiling is then at least `cpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_cpu: Option<i32>,

    /// Hot-plug ceiling for memory (a quantity, e.g. `2Gi`): the memory
    /// balloon may grow to it without a restart. Fixed when the VM is
    /// defined; a change takes effect at its next start. Default: `memory`;
    /// as for `maxCpu`, a `memory` above it waits for the next start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"))]
    #[x_kube(validation = Rule::new("!isQuantity(self) || (quantity(self).compareTo(quantity('1Mi')) >= 0 && quantity(self).compareTo(quantity('64Ti')) <= 0)").message(
        "spec.resources.maxMemory must be from 1Mi to 64Ti, e.g. 2Gi"
    ))]
    pub max_memory: Option<String>,
}

fn default_cpu() -> i32 {
    1
}

fn default_memory() -> String {
    "512Mi".to_owned()
}

impl Default for VmResources {
    fn default() -> Self {
        VmResources { cpu: default_cpu(), memory: default_memory(), max_cpu: None, max_memory: None }
    }
}

/// A VM's own boot volume ([`VirtualMachineSpec::root_disk`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RootDisk {
    /// The volume's size as the guest sees it, a quantity (`20Gi`), at
    /// least the image's disk size. Raising it grows the claim and so the
    /// volume (live on a running VM, when the class allows expansion); it
    /// never shrinks.
    pub size: k8s_openapi::apimachinery::pkg::api::resource::Quantity,
    /// The StorageClass of the claim (one of vmlet's provisioner: with
    /// `format: qcow2` for an overlay on the image, or `fromImage: copy` for
    /// a full copy of it); default: the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// The name of the PersistentVolumeClaim that holds VM `vm`'s root disk
/// ([`VirtualMachineSpec::root_disk`]).
pub fn root_claim_name(vm: &str) -> String {
    format!("{vm}-root")
}

/// Direct kernel boot: host paths of the kernel and initramfs, and the command line.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KernelBoot {
    /// Absolute path of the kernel image on the host, e.g. `/var/lib/vmlet/guest/vmlinuz`.
    #[schemars(length(min = 1, max = 4096), regex(pattern = r"^/[^\x00-\x1f\x7f]*$"))]
    pub kernel: String,
    /// Absolute path of the initramfs on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096), regex(pattern = r"^/[^\x00-\x1f\x7f]*$"))]
    pub initrd: Option<String>,
    /// Kernel command line, e.g. `console=ttyS0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub cmdline: Option<String>,
}

/// How a stop powers a VM off.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PowerOffMode {
    /// Cut power at once.
    Hard,
    /// Ask the guest to shut down and wait for it, however long it takes.
    Soft,
    /// Ask the guest, and cut power after `shutdownTimeoutSeconds`.
    #[default]
    TrySoft,
}

/// [`VirtualMachineSpec::restart_policy`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RestartPolicy {
    /// Start the VM again whenever it stops by itself.
    #[default]
    Always,
    /// Start it again after a crash or a power-off from the host; a guest
    /// that powered itself off stays off.
    OnFailure,
    /// Never start it again by itself.
    Never,
}

impl RestartPolicy {
    /// The name used in the CRD and in the pod's `restartPolicy`.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartPolicy::Always => "Always",
            RestartPolicy::OnFailure => "OnFailure",
            RestartPolicy::Never => "Never",
        }
    }
}

/// [`VirtualMachineSpec::resize_policy`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ResizePolicy {
    /// Only live; a resize beyond the ceilings is infeasible.
    Live,
    /// Live within the ceilings, else at the next start.
    #[default]
    LiveOrRestart,
    /// Always at the next start.
    Restart,
}

impl ResizePolicy {
    /// The name used in the CRD (and the pod annotation).
    pub fn as_str(self) -> &'static str {
        match self {
            ResizePolicy::Live => "Live",
            ResizePolicy::LiveOrRestart => "LiveOrRestart",
            ResizePolicy::Restart => "Restart",
        }
    }

    /// The policy named `name`; anything else is the default.
    pub fn from_name(name: &str) -> ResizePolicy {
        match name {
            "Live" => ResizePolicy::Live,
            "Restart" => ResizePolicy::Restart,
            _ => ResizePolicy::LiveOrRestart,
        }
    }
}

/// [`VirtualMachineSpec::eviction_strategy`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionStrategy {
    /// Move the running VM (cold where the back end cannot move it live).
    #[default]
    LiveMigrate,
    /// Shut it down, move it, start it on the other host.
    ColdMigrate,
    /// Stop it.
    None,
}

impl EvictionStrategy {
    /// The name used in the CRD (and the pod annotation).
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionStrategy::LiveMigrate => "LiveMigrate",
            EvictionStrategy::ColdMigrate => "ColdMigrate",
            EvictionStrategy::None => "None",
        }
    }

    /// The strategy named `name`; anything else is the default.
    pub fn from_name(name: &str) -> EvictionStrategy {
        match name {
            "ColdMigrate" => EvictionStrategy::ColdMigrate,
            "None" => EvictionStrategy::None,
            _ => EvictionStrategy::LiveMigrate,
        }
    }
}

/// What deleting a VirtualMachine does to its IaaS VM.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeletionPolicy {
    /// Power the VM off and remove its definition from the host.
    #[default]
    Delete,
    /// Leave the VM defined on its host (powered off).
    Retain,
}

/// Observed state of a VirtualMachine, mirrored from its pod by the controller.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// 1 while the VM has a pod, else 0 (the scale subresource's status replicas).
    #[serde(default)]
    pub replicas: i32,
    /// 1 while the VM's pod is Ready, else 0.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the VM's pod, `vmlet.io/vm=<name>` (for the scale subresource).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VmPhase>,
    /// The host (node) the VM runs on, or where its definition stays while stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Where the VM lives: the placement record, written by the node agent
    /// that defines the VM before it powers it on (see [`Placement`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// The VM's current pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// The backend's identity of the VM, `<provider>://<host>/<backend id>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
    /// Guest IP addresses, as far as the backend knows them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// The VM's current or last migration (see [`Migration`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<Migration>,
    /// The size the VM runs with now (it differs from `spec.resources` while a
    /// resize waits: see the `ResourcesSynced` condition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_resources: Option<CurrentResources>,
    /// Conditions: `Ready`, `Scheduled`, `ProviderError`, `ResourcesSynced`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A migration through scheduling: the VM's evicted pod on `sourceNode`
/// stays (terminating, its VM running) while the controller's target pod is
/// scheduled to another host, whose agent moves the VM there; the placement
/// record and `podName` move to the target when the move completed.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Migration {
    /// The host the VM leaves.
    pub source_node: String,
    /// The evicted pod on the source host.
    pub source_pod: String,
    /// The pod the controller created for the target host.
    pub target_pod: String,
    /// The host the scheduler chose, once the target pod is bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<String>,
    /// `Live` or `Cold`, once the move started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Where it stands.
    pub phase: MigrationPhase,
    /// When the move started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// When it ended, either way (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<String>,
    /// Bytes copied and still to copy, while a long copy runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<MigrationProgress>,
    /// Why it failed or was cancelled, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Migration {
    /// Still under way: the target pod drives it (Pending, Running, or
    /// Failed and being retried).
    pub fn is_active(&self) -> bool {
        matches!(self.phase, MigrationPhase::Pending | MigrationPhase::Running | MigrationPhase::Failed)
    }
}

/// [`Migration::phase`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MigrationPhase {
    /// The target pod waits for the scheduler.
    #[default]
    Pending,
    /// The target host's agent is moving the VM.
    Running,
    /// The last attempt failed; the VM runs on the source host, and the
    /// target host's agent tries again (with backoff) while the target pod
    /// exists.
    Failed,
    /// The VM runs on the target host.
    Succeeded,
    /// Ended before the move started: the source host became schedulable
    /// again (`kubectl uncordon`), or the VM was stopped or deleted.
    Cancelled,
}

/// [`Migration::progress`], from the back end's job statistics.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationProgress {
    /// Bytes copied so far.
    pub processed_bytes: i64,
    /// Bytes still to copy.
    pub remaining_bytes: i64,
    /// Bytes in all, as far as known.
    pub total_bytes: i64,
}

/// The size a VM runs with ([`VirtualMachineStatus::current_resources`]).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CurrentResources {
    /// Virtual CPUs.
    pub cpu: i32,
    /// Memory, as a quantity in Mi (e.g. `384Mi`).
    pub memory: String,
}

/// The placement record: the one authority on which host holds a VM.
///
/// Written by the agent that defines the VM, before it powers the VM on, and
/// guarded by the VirtualMachine's resourceVersion, so two agents never both
/// claim a VM. Every later pod of the VM is pinned to `nodeName`; an agent of
/// another host never defines it. Only a completed migration moves it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// The node (hypervisor host) that holds the VM's definition.
    pub node_name: String,
    /// The back end's id of the VM there (libvirt domain UUID, Nova server id,
    /// vSphere MoRef), once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<String>,
}

/// Lifecycle phase of a VirtualMachine.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmPhase {
    /// replicas is 0 and no pod runs.
    Stopped,
    /// The pod waits for the scheduler (see the `Scheduled` condition for why).
    Scheduling,
    /// Bound to a host; the VM is being defined or powered on.
    Starting,
    /// The VM runs and its pod is Ready.
    Running,
    /// The VM moves to another host (see `status.migration`).
    Migrating,
    /// The VM is shutting down.
    Stopping,
    /// The backend reports a failure (see the `ProviderError` condition).
    Failed,
    /// The VM's state cannot be read.
    Unknown,
}

impl VirtualMachine {
    /// Memory in bytes from `spec.resources.memory`. Errors name the field.
    pub fn memory_bytes(&self) -> Result<u64, crate::quantity::QuantityError> {
        crate::quantity::parse_bytes(&self.spec.resources.memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(json: serde_json::Value) -> Result<VmDisk, serde_json::Error> {
        serde_json::from_value(json)
    }

    #[test]
    fn a_disk_is_a_claim_or_a_host_image() {
        let claim = disk(serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": "web-data"}}));
        let claim = claim.unwrap();
        assert_eq!(claim.source(), Some(DiskSource::Claim(&ClaimSource { claim_name: "web-data".into() })));
        assert_eq!(claim.host_image_path(), None);
        let image = disk(serde_json::json!({"name": "data", "hostImage": {"path": "/img/web-data.qcow2"}})).unwrap();
        assert_eq!(image.host_image_path(), Some("/img/web-data.qcow2"));
        assert_eq!(
            serde_json::to_value(&image).unwrap(),
            serde_json::json!({"name": "data", "hostImage": {"path": "/img/web-data.qcow2"}}),
            "the other source is not written"
        );
    }

    #[test]
    fn a_disk_with_both_sources_or_none_has_no_source_and_unknown_fields_are_refused() {
        // The API server refuses both (the CRD's rule); serde alone cannot.
        let both = disk(serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": "c"},
                                           "hostImage": {"path": "/img/d.raw"}}));
        assert_eq!(both.unwrap().source(), None);
        assert_eq!(disk(serde_json::json!({"name": "data"})).unwrap().source(), None);
        let typo = disk(serde_json::json!({"name": "data", "hostImage": {"path": "/img/d.raw", "format": "qcow2"}}));
        assert!(typo.unwrap_err().to_string().contains("unknown field `format`"), "no format is taken from a VM");
        let typo = disk(serde_json::json!({"name": "data", "hostPath": {"path": "/img/d.raw"}}));
        assert!(typo.unwrap_err().to_string().contains("unknown field `hostPath`"));
    }

    #[test]
    fn disk_names_are_dns_labels_of_at_most_20_and_nothing_that_leaves_a_directory() {
        for good in ["data", "d", "logs-2", "0", "a".repeat(20).as_str()] {
            assert!(is_disk_name(good), "{good}");
        }
        for bad in
            ["", "Data", "-data", "data-", "..", "a/b", "../x", "a.b", "a_b", "a b", "a\0b", "a".repeat(21).as_str()]
        {
            assert!(!is_disk_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_crd_requires_one_disk_source_and_checks_host_image_paths_as_kernel_paths() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(VirtualMachine::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        let disk = &spec["disks"]["items"];
        let rules = disk["x-kubernetes-validations"].as_array().expect("rules on a disk");
        assert!(
            rules.iter().any(|r| r["rule"] == "has(self.persistentVolumeClaim) != has(self.hostImage)"
                && r["message"].as_str().unwrap().contains("persistentVolumeClaim and hostImage")),
            "{rules:?}"
        );
        let path = &disk["properties"]["hostImage"]["properties"]["path"];
        assert_eq!(path["pattern"], spec["kernelBoot"]["properties"]["kernel"]["pattern"], "absolute, no controls");
        assert_eq!(path["pattern"], r"^/[^\x00-\x1f\x7f]*$");
        assert_eq!(disk["properties"]["hostImage"]["required"], serde_json::json!(["path"]));
        // is_disk_name is the schema's rule for a disk's name.
        assert_eq!(disk["properties"]["name"]["pattern"], "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$");
        assert_eq!(disk["properties"]["name"]["maxLength"], 20);
    }
}
