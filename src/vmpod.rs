//! How a VirtualMachine is written into its pod, and read back by the node agent.
//!
//! This is the contract between the VirtualMachine controller (which builds the
//! pod) and the node agent (which reads it to drive the provider). The pod carries
//! everything the agent needs, so the agent acts on the pod alone:
//!
//! - `metadata.name` = `<vm>-<suffix>` ([`new_pod_name`]), recorded in the VM's
//!   `status.podName` before the pod is created; label `vmlet.io/vm=<name>`, a
//!   controller ownerReference to the VM;
//! - annotation `vmlet.io/vm-uid` = the VM's UID, the provider identity;
//! - annotations `vmlet.io/image`, `vmlet.io/kernel-boot`, `vmlet.io/provider-options`,
//!   `vmlet.io/power-off-mode`;
//! - one container `vm` whose requests and limits are the VM's cpu and memory;
//! - `terminationGracePeriodSeconds` = `spec.shutdownTimeoutSeconds`.

use crate::quantity;
use crate::v1alpha1::{
    DiskSource, EvictionStrategy, PowerOffMode, ResizePolicy, RestartPolicy, VirtualMachine, VM_LABEL,
};
use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerResizePolicy, ContainerState, NodeAffinity, NodeSelectorRequirement,
    NodeSelectorTerm, PersistentVolumeClaimVolumeSource, Pod, PodSpec, ResourceRequirements, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;
use vmlet_provider::{VmId, VmSpec};

/// Annotation holding the VirtualMachine's UID.
pub const UID_ANNOTATION: &str = "vmlet.io/vm-uid";
/// Annotation holding `spec.image`.
pub const IMAGE_ANNOTATION: &str = "vmlet.io/image";
/// Annotation holding `spec.kernelBoot` as JSON.
pub const KERNEL_BOOT_ANNOTATION: &str = "vmlet.io/kernel-boot";
/// Annotation holding `spec.providerOptions` as a JSON object.
pub const PROVIDER_OPTIONS_ANNOTATION: &str = "vmlet.io/provider-options";
/// Pod annotation: the VM's `spec.cloudInit` as JSON (where the data is,
/// never the data itself).
pub const CLOUD_INIT_ANNOTATION: &str = "vmlet.io/cloud-init";
/// Annotation holding `spec.powerOffMode`.
pub const POWER_OFF_ANNOTATION: &str = "vmlet.io/power-off-mode";
/// Annotation: the VM's vCPU hot-plug ceiling (`spec.resources.maxCpu`).
pub const MAX_CPU_ANNOTATION: &str = "vmlet.io/max-cpu";
/// Annotation: the VM's memory hot-plug ceiling (`spec.resources.maxMemory`).
pub const MAX_MEMORY_ANNOTATION: &str = "vmlet.io/max-memory";
/// Annotation: the VM's `spec.evictionStrategy`.
pub const EVICTION_STRATEGY_ANNOTATION: &str = "vmlet.io/eviction-strategy";
/// Annotation on a migration's target pod: the host the VM leaves (a hint for
/// readers; the agent follows `status.migration`).
pub const MIGRATION_SOURCE_ANNOTATION: &str = "vmlet.io/migration-source";
/// Annotation: the VM's `spec.resizePolicy`.
pub const RESIZE_POLICY_ANNOTATION: &str = "vmlet.io/resize-policy";
/// Name of the single container that stands for the VM.
pub const CONTAINER_NAME: &str = "vm";
/// Image name shown for the VM's container; never pulled.
pub const CONTAINER_IMAGE: &str = "vmlet.io/virtual-machine";
/// Node label every virtual node carries; VM pods select it.
pub const VIRTUAL_NODE_LABEL: (&str, &str) = ("type", "virtual-kubelet");
/// Taint key of virtual nodes that VM pods tolerate (any value, effect NoSchedule).
pub const VIRTUAL_NODE_TAINT_KEY: &str = crate::config::DEFAULT_TAINT_KEY;

/// A fresh name for a pod of VM `vm`: `<vm>-<suffix>`, the suffix five
/// characters of Kubernetes' generateName alphabet (no vowels, no look-alikes),
/// random per call, so `kubectl get pods` lists a VM's pods under its name and
/// an old pod still terminating never blocks the name of its successor.
pub fn new_pod_name(vm: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write(vm.as_bytes());
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    let mut bits = hasher.finish();
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char;
            bits /= ALPHABET.len() as u64;
            c
        })
        .collect();
    format!("{vm}-{suffix}")
}

/// The labels of a VM's pod: the VirtualMachine's own labels, so that a
/// Service (or a PodDisruptionBudget, or pod affinity) selects VM pods as it
/// selects any pods, and `vmlet.io/vm=<name>`. Labels in vmlet's and
/// Kubernetes' own domains (`vmlet.io`, `kubernetes.io`, `k8s.io` and their
/// subdomains) are not copied, as vmlet and Kubernetes' controllers read
/// those on pods, except the recommended application labels
/// (`app.kubernetes.io/*`), which Services commonly select on. Taken when
/// the pod is made; a label change applies to the VM's next pod.
fn pod_labels(vm: &VirtualMachine, name: String) -> BTreeMap<String, String> {
    let reserved = |key: &str| {
        key.split_once('/').is_some_and(|(prefix, _)| {
            prefix != "app.kubernetes.io"
                && ["vmlet.io", "kubernetes.io", "k8s.io"]
                    .iter()
                    .any(|domain| prefix == *domain || prefix.ends_with(&format!(".{domain}")))
        })
    };
    let mut labels: BTreeMap<String, String> =
        vm.labels().iter().filter(|(key, _)| !reserved(key)).map(|(k, v)| (k.clone(), v.clone())).collect();
    labels.insert(VM_LABEL.to_owned(), name);
    labels
}

/// The pod named `pod_name` that a VirtualMachine runs through. `scope` is the controller's
/// [`crate::config::Config::scope`]: the pod selects nodes of that scope only.
/// `home` is the host where its domain is already defined (`status.nodeName` of
/// a stopped VM): the pod is pinned there so that a start powers on the same
/// domain instead of defining a new one elsewhere.
///
/// Errors: `spec.resources.memory` does not parse (the API server's pattern should
/// have refused it already).
pub fn pod_for_vm(
    vm: &VirtualMachine,
    pod_name: &str,
    scope: &str,
    home: Option<&str>,
) -> Result<Pod, quantity::QuantityError> {
    let spec = &vm.spec;
    quantity::parse_bytes(&spec.resources.memory)?;
    let name = vm.name_any();
    let amounts = vm_amounts(vm);

    let mut annotations = BTreeMap::from([
        (UID_ANNOTATION.to_owned(), vm.uid().unwrap_or_default()),
        (POWER_OFF_ANNOTATION.to_owned(), power_off_mode_name(spec.power_off_mode).to_owned()),
    ]);
    annotations.extend(resize_annotations(vm));
    annotations.insert(EVICTION_STRATEGY_ANNOTATION.to_owned(), spec.eviction_strategy.as_str().to_owned());
    if let Some(image) = &spec.image {
        annotations.insert(IMAGE_ANNOTATION.to_owned(), image.clone());
    }
    if let Some(boot) = &spec.kernel_boot {
        annotations
            .insert(KERNEL_BOOT_ANNOTATION.to_owned(), serde_json::to_string(boot).expect("KernelBoot serializes"));
    }
    if let Some(cloud_init) = &spec.cloud_init {
        let json = serde_json::to_string(cloud_init).expect("CloudInitSpec serializes");
        annotations.insert(CLOUD_INIT_ANNOTATION.to_owned(), json);
    }
    if !spec.provider_options.is_empty() {
        let options = serde_json::to_string(&spec.provider_options).expect("a string map serializes");
        annotations.insert(PROVIDER_OPTIONS_ANNOTATION.to_owned(), options);
    }

    let mut node_selector = spec.node_selector.clone().unwrap_or_default();
    node_selector.insert(VIRTUAL_NODE_LABEL.0.to_owned(), VIRTUAL_NODE_LABEL.1.to_owned());
    node_selector.insert(crate::config::SCOPE_LABEL.to_owned(), scope.to_owned());
    if let Some(home) = home {
        node_selector.insert("kubernetes.io/hostname".to_owned(), home.to_owned());
    }

    let mut tolerations = spec.tolerations.clone().unwrap_or_default();
    tolerations.extend(vm_pod_tolerations());

    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name.to_owned()),
            namespace: vm.namespace(),
            labels: Some(pod_labels(vm, name)),
            annotations: Some(annotations),
            owner_references: vm.controller_owner_ref(&()).map(|r| vec![r]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: CONTAINER_NAME.to_owned(),
                image: Some(CONTAINER_IMAGE.to_owned()),
                // The serial console is a terminal: `kubectl attach -it` then puts
                // the local terminal in raw mode, so Ctrl-C and editors reach the guest.
                stdin: Some(true),
                tty: Some(true),
                resources: Some(ResourceRequirements {
                    requests: Some(amounts.clone()),
                    limits: Some(amounts),
                    ..ResourceRequirements::default()
                }),
                // A resize never restarts the container by itself: the agent
                // hot-plugs, or reports that the VM needs a restart.
                resize_policy: Some(
                    ["cpu", "memory"]
                        .map(|resource| ContainerResizePolicy {
                            resource_name: resource.to_owned(),
                            restart_policy: "NotRequired".to_owned(),
                        })
                        .to_vec(),
                ),
                ..Container::default()
            }],
            restart_policy: Some(spec.restart_policy.as_str().to_owned()),
            termination_grace_period_seconds: Some(spec.shutdown_timeout_seconds),
            node_selector: Some(node_selector),
            affinity: spec.affinity.clone(),
            tolerations: Some(tolerations),
            priority_class_name: spec.priority_class_name.clone(),
            volumes: claim_volumes(vm),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// The name of the pod volume of a VM's root disk claim
/// ([`crate::v1alpha1::VirtualMachineSpec::root_disk`]): longer than any
/// disk name may be, so it never meets a data disk's volume.
pub const ROOT_DISK_VOLUME: &str = "vmlet-root-disk-claim";

/// The pod volumes of `vm`'s root disk claim ([`ROOT_DISK_VOLUME`]) and of
/// its data disks that are PersistentVolumeClaims, in spec order, each named
/// after its disk: the scheduler places the pod where the claims' volumes
/// are, and Kubernetes keeps a claim in use while the pod exists. Host
/// images are no volumes (the agent reads them from the VirtualMachine).
/// `None` when there are none.
fn claim_volumes(vm: &VirtualMachine) -> Option<Vec<Volume>> {
    let root = vm.spec.root_disk.as_ref().map(|_| Volume {
        name: ROOT_DISK_VOLUME.to_owned(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: crate::v1alpha1::root_claim_name(&vm.name_any()),
            read_only: None,
        }),
        ..Volume::default()
    });
    let volumes: Vec<Volume> = root
        .into_iter()
        .chain(vm.spec.disks.iter().filter_map(|disk| match disk.source()? {
            DiskSource::Claim(claim) => Some(Volume {
                name: disk.name.clone(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.claim_name.clone(),
                    read_only: None,
                }),
                ..Volume::default()
            }),
            DiskSource::HostImage(_) => None,
        }))
        .collect();
    (!volumes.is_empty()).then_some(volumes)
}

/// The tolerations vmlet gives every VM pod beside the VM's own: of the
/// virtual-node taint ([`virtual_node_toleration`]), and of the NoExecute
/// `node.kubernetes.io/not-ready` and `unreachable` taints (a VM outlives
/// vmlet outages: without them, the taint manager would evict the pod 300 s
/// after the node goes NotReady, and the returning agent would read the
/// deletion as a stop).
pub fn vm_pod_tolerations() -> Vec<Toleration> {
    let mut tolerations = vec![virtual_node_toleration()];
    for key in ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"] {
        tolerations.push(Toleration {
            key: Some(key.to_owned()),
            operator: Some("Exists".to_owned()),
            effect: Some("NoExecute".to_owned()),
            ..Toleration::default()
        });
    }
    tolerations
}

/// The toleration of vmlet's virtual-node taint
/// (`virtual-kubelet.io/provider=vmlet:NoSchedule`): vmlet's own value only,
/// since other virtual-kubelet providers use the same key. VM pods and task
/// pods carry it.
pub fn virtual_node_toleration() -> Toleration {
    Toleration {
        key: Some(VIRTUAL_NODE_TAINT_KEY.to_owned()),
        operator: Some("Equal".to_owned()),
        value: Some(crate::config::DEFAULT_TAINT_VALUE.to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    }
}

/// The VM pod's container requests and limits (equal: the pod is Guaranteed):
/// `cpu` in whole CPUs and `memory` as written in `spec.resources`.
pub fn vm_amounts(vm: &VirtualMachine) -> BTreeMap<String, Quantity> {
    BTreeMap::from([
        ("cpu".to_owned(), Quantity(vm.spec.resources.cpu.to_string())),
        ("memory".to_owned(), Quantity(vm.spec.resources.memory.clone())),
    ])
}

/// The annotations that carry the VM's hot-plug ceilings and resize policy to
/// its pod ([`MAX_CPU_ANNOTATION`], [`MAX_MEMORY_ANNOTATION`],
/// [`RESIZE_POLICY_ANNOTATION`]); a ceiling not set is absent.
pub fn resize_annotations(vm: &VirtualMachine) -> BTreeMap<String, String> {
    let resources = &vm.spec.resources;
    let mut annotations =
        BTreeMap::from([(RESIZE_POLICY_ANNOTATION.to_owned(), vm.spec.resize_policy.as_str().to_owned())]);
    if let Some(max) = resources.max_cpu {
        annotations.insert(MAX_CPU_ANNOTATION.to_owned(), max.to_string());
    }
    if let Some(max) = &resources.max_memory {
        annotations.insert(MAX_MEMORY_ANNOTATION.to_owned(), max.clone());
    }
    annotations
}

/// What a live VM pod must change to match its VirtualMachine's size:
/// `resources` when its container's limits differ from `spec.resources`
/// (compared as quantities: `1` and `1000m` agree), `annotations` when the
/// ceilings or the resize policy it carries differ. `None` when both agree.
pub fn resize_needed(vm: &VirtualMachine, pod: &Pod) -> Option<ResizeNeeded> {
    let limits = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref());
    let cpu = limits.and_then(|l| l.get("cpu")).and_then(|q| quantity::parse_millicores(&q.0).ok());
    let memory = limits.and_then(|l| l.get("memory")).and_then(|q| quantity::parse_bytes(&q.0).ok());
    let wanted_memory = vm.memory_bytes().ok();
    let resources = cpu != Some(u64::from(vm.spec.resources.cpu.unsigned_abs()) * 1000) || memory != wanted_memory;
    let wanted = resize_annotations(vm);
    let carried = pod.annotations();
    let annotations = [RESIZE_POLICY_ANNOTATION, MAX_CPU_ANNOTATION, MAX_MEMORY_ANNOTATION]
        .iter()
        .any(|key| wanted.get(*key) != carried.get(*key));
    (resources || annotations).then_some(ResizeNeeded { resources, annotations })
}

/// What [`resize_needed`] found out of date on a VM pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizeNeeded {
    /// The container's requests and limits.
    pub resources: bool,
    /// The ceiling and resize-policy annotations.
    pub annotations: bool,
}

fn power_off_mode_name(mode: PowerOffMode) -> &'static str {
    match mode {
        PowerOffMode::Hard => "Hard",
        PowerOffMode::Soft => "Soft",
        PowerOffMode::TrySoft => "TrySoft",
    }
}

/// What the node agent reads from a VM pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodVm {
    /// The provider-facing definition.
    pub spec: VmSpec,
    /// How to power the VM off when the pod is deleted.
    pub power_off_mode: PowerOffMode,
    /// What to do when the VM stops by itself (the pod's `restartPolicy`).
    pub restart_policy: RestartPolicy,
    /// How a resize reaches the running VM ([`RESIZE_POLICY_ANNOTATION`]).
    pub resize_policy: ResizePolicy,
    /// What an eviction of the pod does ([`EVICTION_STRATEGY_ANNOTATION`]).
    pub eviction_strategy: EvictionStrategy,
    /// Where the VM's cloud-init data is ([`CLOUD_INIT_ANNOTATION`]); the
    /// agent reads it into `spec.cloud_init` before it defines the VM.
    pub cloud_init: Option<crate::v1alpha1::CloudInitSpec>,
    /// Whether the pod is the VM's current pod or a migration's target pod
    /// (set by [`crate::identity::verify`]; [`vm_from_pod`] says `Current`).
    pub role: PodRole,
    /// The claim that holds the VM's root disk (the pod's volume
    /// [`ROOT_DISK_VOLUME`]); `None`: the VM boots `spec.image` itself.
    pub root_claim: Option<String>,
}

/// What a VM pod is to its VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodRole {
    /// The VM's current pod (`status.podName`): it runs and stops the VM.
    Current,
    /// The target pod of the VM's active migration (`status.migration`): its
    /// agent moves the VM to its host, and does nothing else.
    MigrationTarget,
}

/// The target pod of a migration of `vm` away from host `source`: the VM's
/// pod ([`pod_for_vm`], not pinned to a host) with a required node affinity
/// that keeps it off `source`, added to every node selector term of the VM's
/// own affinity, and the [`MIGRATION_SOURCE_ANNOTATION`].
///
/// Errors: as [`pod_for_vm`].
pub fn migration_target_pod(
    vm: &VirtualMachine,
    pod_name: &str,
    scope: &str,
    source: &str,
) -> Result<Pod, quantity::QuantityError> {
    let mut pod = pod_for_vm(vm, pod_name, scope, None)?;
    pod.annotations_mut().insert(MIGRATION_SOURCE_ANNOTATION.to_owned(), source.to_owned());
    let not_source = NodeSelectorRequirement {
        key: "kubernetes.io/hostname".to_owned(),
        operator: "NotIn".to_owned(),
        values: Some(vec![source.to_owned()]),
    };
    let spec = pod.spec.as_mut().expect("pod_for_vm gives a spec");
    let affinity = spec.affinity.get_or_insert_with(Affinity::default);
    let node_affinity = affinity.node_affinity.get_or_insert_with(NodeAffinity::default);
    let required =
        node_affinity.required_during_scheduling_ignored_during_execution.get_or_insert_with(Default::default);
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(NodeSelectorTerm::default());
    }
    for term in &mut required.node_selector_terms {
        term.match_expressions.get_or_insert_with(Vec::new).push(not_source.clone());
    }
    Ok(pod)
}

/// Why a pod cannot be read as a VM pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodVmError {
    /// The pod has no `vmlet.io/vm-uid` annotation: it was not made by vmlet.
    #[error("pod has no {UID_ANNOTATION} annotation: it is not a vmlet VirtualMachine pod; only VirtualMachines run on vmlet's nodes")]
    NotAVmPod,
    /// A field is missing or malformed; names the field.
    #[error("{field}: {message}")]
    Invalid {
        /// The pod field, e.g. `spec.containers[0].resources.limits.memory`.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// The state of the VM pod's one container (the VM, [`CONTAINER_NAME`]) as
/// the agent last wrote it; `None` before the first status.
pub fn vm_container_state(pod: &Pod) -> Option<&ContainerState> {
    pod.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()
}

/// The reason the VM pod's container is waiting (`PlacedOnAnotherHost`,
/// `StorageNotAllowed`, ...), with its message; `None` when it is not waiting.
pub fn waiting_reason(pod: &Pod) -> Option<(&str, Option<&str>)> {
    let waiting = vm_container_state(pod)?.waiting.as_ref()?;
    Some((waiting.reason.as_deref()?, waiting.message.as_deref()))
}

/// Whether the pod's status shows its VM running (the container state
/// `running`), as the agent last wrote it.
pub fn was_running(pod: &Pod) -> bool {
    vm_container_state(pod).is_some_and(|s| s.running.is_some())
}

/// Read the VM a pod stands for. Errors: [`PodVmError`], naming the field.
pub fn vm_from_pod(pod: &Pod) -> Result<PodVm, PodVmError> {
    let annotations = pod.annotations();
    let uid = annotations.get(UID_ANNOTATION).filter(|u| !u.is_empty()).ok_or(PodVmError::NotAVmPod)?;
    let name = pod.labels().get(VM_LABEL).cloned().unwrap_or_else(|| pod.name_any());
    let limits = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.clone().or_else(|| r.requests.clone()))
        .unwrap_or_default();
    let cpu = limits
        .get("cpu")
        .ok_or(PodVmError::Invalid { field: "spec.containers[0].resources.limits.cpu", message: "missing".into() })?;
    let millicores = quantity::parse_millicores(&cpu.0).map_err(|e| PodVmError::Invalid {
        field: "spec.containers[0].resources.limits.cpu",
        message: e.to_string(),
    })?;
    let memory = limits.get("memory").ok_or(PodVmError::Invalid {
        field: "spec.containers[0].resources.limits.memory",
        message: "missing".into(),
    })?;
    let memory_bytes = quantity::parse_bytes(&memory.0).map_err(|e| PodVmError::Invalid {
        field: "spec.containers[0].resources.limits.memory",
        message: e.to_string(),
    })?;
    let kernel_boot = match annotations.get(KERNEL_BOOT_ANNOTATION) {
        None => None,
        Some(json) => {
            let boot: crate::v1alpha1::KernelBoot = serde_json::from_str(json).map_err(|e| PodVmError::Invalid {
                field: "metadata.annotations[vmlet.io/kernel-boot]",
                message: e.to_string(),
            })?;
            Some(vmlet_provider::KernelBoot { kernel: boot.kernel, initrd: boot.initrd, cmdline: boot.cmdline })
        }
    };
    let power_off_mode = match annotations.get(POWER_OFF_ANNOTATION).map(String::as_str) {
        Some("Hard") => PowerOffMode::Hard,
        Some("Soft") => PowerOffMode::Soft,
        _ => PowerOffMode::TrySoft,
    };
    let max_cpus = match annotations.get(MAX_CPU_ANNOTATION) {
        None => None,
        Some(max) => Some(max.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| PodVmError::Invalid {
            field: "metadata.annotations[vmlet.io/max-cpu]",
            message: format!("{max:?} is not a whole number of CPUs from 1"),
        })?),
    };
    let max_memory_bytes = match annotations.get(MAX_MEMORY_ANNOTATION) {
        None => None,
        Some(max) => Some(quantity::parse_bytes(max).map_err(|e| PodVmError::Invalid {
            field: "metadata.annotations[vmlet.io/max-memory]",
            message: e.to_string(),
        })?),
    };
    let options = match annotations.get(PROVIDER_OPTIONS_ANNOTATION) {
        None => BTreeMap::new(),
        Some(json) => serde_json::from_str(json).map_err(|e| PodVmError::Invalid {
            field: "metadata.annotations[vmlet.io/provider-options]",
            message: e.to_string(),
        })?,
    };
    let cloud_init = match annotations.get(CLOUD_INIT_ANNOTATION) {
        None => None,
        Some(json) => Some(serde_json::from_str(json).map_err(|e| PodVmError::Invalid {
            field: "metadata.annotations[vmlet.io/cloud-init]",
            message: e.to_string(),
        })?),
    };
    Ok(PodVm {
        cloud_init,
        spec: VmSpec {
            options,
            id: VmId(uid.clone()),
            namespace: pod.namespace().unwrap_or_default(),
            name,
            cpus: millicores.div_ceil(1000).max(1) as u32,
            memory_bytes,
            max_cpus,
            max_memory_bytes,
            image: annotations.get(IMAGE_ANNOTATION).cloned(),
            image_backing_chain: None,
            kernel_boot,
            cloud_init: None,
            disks: vec![],
            networks: vec![],
        },
        power_off_mode,
        restart_policy: match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
            Some("OnFailure") => RestartPolicy::OnFailure,
            Some("Never") => RestartPolicy::Never,
            _ => RestartPolicy::Always,
        },
        resize_policy: ResizePolicy::from_name(
            annotations.get(RESIZE_POLICY_ANNOTATION).map(String::as_str).unwrap_or_default(),
        ),
        eviction_strategy: EvictionStrategy::from_name(
            annotations.get(EVICTION_STRATEGY_ANNOTATION).map(String::as_str).unwrap_or_default(),
        ),
        role: PodRole::Current,
        root_claim: pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .and_then(|volumes| volumes.iter().find(|v| v.name == ROOT_DISK_VOLUME))
            .and_then(|v| v.persistent_volume_claim.as_ref())
            .map(|claim| claim.claim_name.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::VmBuilder;

    #[test]
    fn provider_options_reach_the_host_as_written_and_a_mangled_annotation_names_itself() {
        let mut vm = VmBuilder::new("db").build();
        vm.spec.provider_options =
            BTreeMap::from([("flavor".to_owned(), "c2-m1024".to_owned()), ("networks".to_owned(), "auto".to_owned())]);
        let mut pod = pod_for_vm(&vm, "db-b8r2x", "team-a", None).unwrap();
        assert_eq!(vm_from_pod(&pod).unwrap().spec.options, vm.spec.provider_options);

        pod.annotations_mut().insert(PROVIDER_OPTIONS_ANNOTATION.to_owned(), "[\"flavor\"]".to_owned());
        let error = vm_from_pod(&pod).unwrap_err().to_string();
        assert!(error.contains("metadata.annotations[vmlet.io/provider-options]"), "{error}");
    }

    #[test]
    fn the_pod_names_where_cloud_init_data_is_and_never_carries_it() {
        let mut vm = VmBuilder::new("web").build();
        let source: crate::v1alpha1::CloudInitSpec = serde_json::from_value(serde_json::json!({
            "userData": {"secretKeyRef": {"name": "web-init", "key": "user-data"}},
            "hostname": "web-1",
        }))
        .unwrap();
        vm.spec.cloud_init = Some(source.clone());
        let pod = pod_for_vm(&vm, "web-x2k9p", "team-a", None).unwrap();
        let back = vm_from_pod(&pod).unwrap();
        assert_eq!(back.cloud_init, Some(source));
        assert_eq!(back.spec.cloud_init, None, "the data is read by the agent, not carried by the pod");
        assert_eq!(
            pod.annotations()[CLOUD_INIT_ANNOTATION],
            r#"{"userData":{"secretKeyRef":{"name":"web-init","key":"user-data"}},"hostname":"web-1"}"#
        );
    }

    #[test]
    fn the_pod_carries_the_vms_labels_but_none_in_vmlets_or_kubernetes_domains() {
        let mut vm = VmBuilder::new("web").build();
        vm.metadata.labels = Some(BTreeMap::from(
            [
                ("app", "shop"),
                ("example.com/tier", "front"),
                ("vmlet.io/vm", "someone-else"),
                ("vmlet.io/backup", "x"),
                ("node-role.kubernetes.io/control-plane", ""),
                ("k8s.io/x", "y"),
                ("app.kubernetes.io/name", "shop"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
        ));
        let pod = pod_for_vm(&vm, "web-x7k2p", "team-a", None).unwrap();
        let labels: Vec<(&str, &str)> = pod.labels().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            labels,
            [
                ("app", "shop"),
                ("app.kubernetes.io/name", "shop"),
                ("example.com/tier", "front"),
                ("vmlet.io/vm", "web")
            ]
        );
    }

    #[test]
    fn pod_carries_the_vm_and_round_trips_to_the_same_spec() {
        let vm = VmBuilder::new("web")
            .cpu(2)
            .memory("1Gi")
            .image("/img/web.qcow2")
            .kernel_boot("/boot/vmlinuz", "/boot/initrd.img", "console=ttyS0")
            .build();
        let pod = pod_for_vm(&vm, "web-x7k2p", "team-a", None).unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("web-x7k2p"));
        assert_eq!(pod.labels().get(VM_LABEL).map(String::as_str), Some("web"));
        let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("VirtualMachine", Some(true)));
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_selector.as_ref().unwrap().get("type").map(String::as_str), Some("virtual-kubelet"));
        assert_eq!(spec.node_selector.as_ref().unwrap().get("vmlet.io/scope").map(String::as_str), Some("team-a"));
        assert_eq!(spec.termination_grace_period_seconds, Some(30));
        let requests = spec.containers[0].resources.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(requests["cpu"].0, "2");
        assert_eq!(requests["memory"].0, "1Gi");

        let read = vm_from_pod(&pod).unwrap();
        assert!(read.spec.options.is_empty(), "no providerOptions: none read back");
        assert_eq!(read.spec.id, VmId(vm.uid().unwrap()));
        assert_eq!((read.spec.namespace.as_str(), read.spec.name.as_str()), ("default", "web"));
        assert_eq!(read.spec.cpus, 2);
        assert_eq!(read.spec.memory_bytes, 1 << 30);
        assert_eq!(read.spec.image.as_deref(), Some("/img/web.qcow2"));
        assert_eq!(read.power_off_mode, PowerOffMode::TrySoft);
        assert_eq!(read.restart_policy, RestartPolicy::Always);
        let boot = read.spec.kernel_boot.unwrap();
        assert_eq!((boot.kernel.as_str(), boot.initrd.as_deref()), ("/boot/vmlinuz", Some("/boot/initrd.img")));
        assert_eq!(boot.cmdline.as_deref(), Some("console=ttyS0"));
    }

    #[test]
    fn only_claims_become_pod_volumes_and_host_images_stay_with_the_vm() {
        let mut vm = VmBuilder::new("web").build();
        vm.spec.disks = serde_json::from_value(serde_json::json!([
            {"name": "logs", "hostImage": {"path": "/var/lib/libvirt/images/logs.qcow2"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "web-data"}},
        ]))
        .unwrap();
        let pod = pod_for_vm(&vm, "web-x7k2p", "AllNamespaces", None).unwrap();
        let volumes = pod.spec.unwrap().volumes.unwrap();
        let names: Vec<_> = volumes.iter().map(|v| (v.name.as_str(), &v.persistent_volume_claim)).collect();
        let claim = PersistentVolumeClaimVolumeSource { claim_name: "web-data".into(), read_only: None };
        assert_eq!(names, [("data", &Some(claim))]);
        assert!(!pod.metadata.annotations.unwrap().values().any(|v| v.contains("logs.qcow2")), "nor an annotation");

        vm.spec.disks.remove(1);
        let pod = pod_for_vm(&vm, "web-x7k2p", "AllNamespaces", None).unwrap();
        assert_eq!(pod.spec.unwrap().volumes, None, "host images alone: no volumes");
    }

    #[test]
    fn a_root_disk_is_the_pods_first_claim_volume_and_reads_back() {
        let mut vm = VmBuilder::new("web").image("debian-12").build();
        vm.spec.root_disk = Some(crate::v1alpha1::RootDisk {
            size: k8s_openapi::apimachinery::pkg::api::resource::Quantity("20Gi".into()),
            storage_class_name: Some("vmlet-local".into()),
        });
        let pod = pod_for_vm(&vm, "web-x7k2p", "AllNamespaces", None).unwrap();
        let volumes = pod.spec.as_ref().unwrap().volumes.clone().unwrap();
        assert_eq!(volumes[0].name, ROOT_DISK_VOLUME);
        assert_eq!(volumes[0].persistent_volume_claim.as_ref().unwrap().claim_name, "web-root");
        assert!(ROOT_DISK_VOLUME.len() > 20, "longer than any disk name: no data disk's volume meets it");
        assert_eq!(vm_from_pod(&pod).unwrap().root_claim.as_deref(), Some("web-root"));
        let plain = pod_for_vm(&VmBuilder::new("web").build(), "web-x7k2p", "AllNamespaces", None).unwrap();
        assert_eq!(vm_from_pod(&plain).unwrap().root_claim, None);
    }

    #[test]
    fn pod_tolerates_the_virtual_node_taint_and_outages_forever() {
        let pod = pod_for_vm(&VmBuilder::new("web").build(), "web-x7k2p", "AllNamespaces", None).unwrap();
        let tolerations = pod.spec.unwrap().tolerations.unwrap();
        let keys: Vec<_> = tolerations.iter().map(|t| (t.key.clone().unwrap(), t.toleration_seconds)).collect();
        assert!(keys.contains(&("virtual-kubelet.io/provider".into(), None)));
        assert!(keys.contains(&("node.kubernetes.io/unreachable".into(), None)));
        assert!(keys.contains(&("node.kubernetes.io/not-ready".into(), None)));
    }

    #[test]
    fn a_stopped_vm_starts_again_on_its_home_host() {
        let pod = pod_for_vm(&VmBuilder::new("web").build(), "web-x7k2p", "AllNamespaces", Some("host-b")).unwrap();
        let selector = pod.spec.unwrap().node_selector.unwrap();
        assert_eq!(selector.get("kubernetes.io/hostname").map(String::as_str), Some("host-b"));
    }

    #[test]
    fn pod_names_start_with_the_vm_name_and_differ_each_time() {
        let names: std::collections::HashSet<String> = (0..50).map(|_| new_pod_name("web")).collect();
        assert_eq!(names.len(), 50);
        for name in names {
            let suffix = name.strip_prefix("web-").expect("the VM name comes first");
            assert_eq!(suffix.len(), 5);
            assert!(suffix.bytes().all(|c| b"bcdfghjklmnpqrstvwxz2456789".contains(&c)), "{name}");
        }
    }

    #[test]
    fn a_plain_pod_is_not_a_vm_pod() {
        let pod =
            Pod { metadata: ObjectMeta { name: Some("nginx".into()), ..Default::default() }, ..Default::default() };
        assert_eq!(vm_from_pod(&pod), Err(PodVmError::NotAVmPod));
    }
}
