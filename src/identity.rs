//! Which VirtualMachine a pod belongs to, decided only from what a tenant cannot
//! forge.
//!
//! Anyone who may create pods in a namespace can give a pod any labels,
//! annotations and ownerReferences, and bind it to a vmlet node with
//! `spec.nodeName`. What they cannot do is make a VirtualMachine of another
//! namespace appear in theirs, or change a VirtualMachine's UID. So a pod leads
//! to a VM only when:
//!
//! 1. its controlling ownerReference names a `VirtualMachine` of API group
//!    `vmlet.io` (name `N`, UID `U`);
//! 2. the VirtualMachine `N` exists **in the pod's namespace** with UID `U`
//!    (read from the API server or its watch cache, never from the pod);
//! 3. the pod's hints agree: annotation `vmlet.io/vm-uid` is `U` and label
//!    `vmlet.io/vm` is `N`;
//! 4. it is a pod the controller designated for the VM: its name is the
//!    VirtualMachine's `status.podName`, which the controller writes before it
//!    creates the pod (so a second, hand-made pod of the same namespace claiming
//!    the VM, or an earlier pod still terminating, drives nothing), or the
//!    `targetPod` of the VM's active `status.migration`, written the same way
//!    (such a pod only moves the VM to its host: [`PodRole::MigrationTarget`]).
//!
//! Every access path uses this one check, on every use (nothing is cached per
//! pod, so an edited annotation or ownerReference is seen at once): the pod
//! sync, the kubelet API (logs, exec, attach, stats) and the console recorder.
//! A pod that fails it is never acted on; the kubelet API answers it 403.

use crate::cache::Cache;
use crate::v1alpha1::{VirtualMachine, VM_LABEL};
use crate::vmpod::{vm_from_pod, PodRole, PodVm, PodVmError, UID_ANNOTATION};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt};

/// Why a pod does not lead to a VM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No controlling ownerReference of kind VirtualMachine (group vmlet.io).
    #[error("pod {pod} is not a VirtualMachine's pod: it has no controlling ownerReference of kind VirtualMachine (vmlet.io)")]
    NoVmOwner {
        /// `namespace/name` of the pod.
        pod: String,
    },
    /// The owner names a VirtualMachine that does not exist in the pod's
    /// namespace (a forged or stale ownerReference).
    #[error(
        "pod {pod} names VirtualMachine {name} as its owner, and its namespace has no VirtualMachine of that name"
    )]
    OwnerNotFound {
        /// `namespace/name` of the pod.
        pod: String,
        /// The VirtualMachine name the ownerReference gives.
        name: String,
    },
    /// The VirtualMachine of that name has another UID.
    #[error("pod {pod} names VirtualMachine {name} with UID {claimed}, but that VirtualMachine's UID is {actual}")]
    OwnerUidMismatch {
        /// `namespace/name` of the pod.
        pod: String,
        /// The VirtualMachine name.
        name: String,
        /// The UID the ownerReference gives.
        claimed: String,
        /// The VirtualMachine's UID.
        actual: String,
    },
    /// An annotation or label of the pod disagrees with its owner.
    #[error("pod {pod}: {field} is {found:?}, but its owner VirtualMachine says {expected:?}")]
    HintDisagrees {
        /// `namespace/name` of the pod.
        pod: String,
        /// The annotation or label, e.g. `metadata.annotations[vmlet.io/vm-uid]`.
        field: &'static str,
        /// Its value on the pod (empty when missing).
        found: String,
        /// What the owner says it must be.
        expected: String,
    },
    /// The pod claims a VM whose current pod is another one (or none).
    #[error("pod {pod} claims VirtualMachine {name}, whose current pod is {current}: only that pod drives the VM")]
    NotTheVmsPod {
        /// `namespace/name` of the pod.
        pod: String,
        /// The VirtualMachine name.
        name: String,
        /// The VirtualMachine's `status.podName` (`none` when unset).
        current: String,
    },
    /// The pod is its VM's own, but its VM description cannot be read.
    #[error("pod {pod}: {source}")]
    InvalidPod {
        /// `namespace/name` of the pod.
        pod: String,
        /// What is wrong with it.
        #[source]
        source: PodVmError,
    },
}

/// A failed resolution: refused, or the VirtualMachine could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The pod does not lead to a VM.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Reading the VirtualMachine from the API server failed (retry later).
    #[error("reading VirtualMachine {name} of pod {pod}: {source}")]
    Kube {
        /// `namespace/name` of the pod.
        pod: String,
        /// The VirtualMachine name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// The pod's controlling ownerReference if it is a VirtualMachine of group
/// `vmlet.io`.
pub fn vm_owner(pod: &Pod) -> Option<&OwnerReference> {
    pod.owner_references().iter().find(|o| {
        o.controller == Some(true)
            && o.kind == "VirtualMachine"
            && o.api_version.split('/').next() == Some(crate::v1alpha1::GROUP)
    })
}

/// Decide whether `pod` is the pod of `vm`, the VirtualMachine of the pod's
/// namespace named by the pod's controlling owner (`None`: no such object), and
/// if so read its VM. Pure: the caller fetched `vm`.
///
/// Errors: the [`Refusal`] that applies, in the order of the module docs.
pub fn verify(pod: &Pod, vm: Option<&VirtualMachine>) -> Result<PodVm, Refusal> {
    let name = || format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    let owner = vm_owner(pod).ok_or_else(|| Refusal::NoVmOwner { pod: name() })?;
    let vm = vm.ok_or_else(|| Refusal::OwnerNotFound { pod: name(), name: owner.name.clone() })?;
    let actual = vm.uid().unwrap_or_default();
    if vm.name_any() != owner.name || vm.namespace() != pod.namespace() {
        return Err(Refusal::OwnerNotFound { pod: name(), name: owner.name.clone() });
    }
    if actual != owner.uid {
        return Err(Refusal::OwnerUidMismatch {
            pod: name(),
            name: owner.name.clone(),
            claimed: owner.uid.clone(),
            actual,
        });
    }
    let hint = |field, found: Option<&String>, expected: &str| match found {
        Some(found) if found == expected => Ok(()),
        found => Err(Refusal::HintDisagrees {
            pod: name(),
            field,
            found: found.cloned().unwrap_or_default(),
            expected: expected.to_owned(),
        }),
    };
    hint("metadata.annotations[vmlet.io/vm-uid]", pod.annotations().get(UID_ANNOTATION), &actual)?;
    hint("metadata.labels[vmlet.io/vm]", pod.labels().get(VM_LABEL), &owner.name)?;
    let current = vm.status.as_ref().and_then(|s| s.pod_name.as_deref());
    let migration_target =
        vm.status.as_ref().and_then(|s| s.migration.as_ref()).filter(|m| m.is_active()).map(|m| m.target_pod.as_str());
    let role = if current == Some(pod.name_any().as_str()) {
        PodRole::Current
    } else if migration_target == Some(pod.name_any().as_str()) {
        PodRole::MigrationTarget
    } else {
        return Err(Refusal::NotTheVmsPod {
            pod: name(),
            name: owner.name.clone(),
            current: current.unwrap_or("none").to_owned(),
        });
    };
    let mut resolved = vm_from_pod(pod).map_err(|source| Refusal::InvalidPod { pod: name(), source })?;
    resolved.role = role;
    debug_assert_eq!(resolved.spec.id.0, actual);
    Ok(resolved)
}

/// Resolve `pod` to its VM from `vms`, a watch cache of VirtualMachines: no
/// API call. A VirtualMachine the cache does not hold (yet) counts as absent.
///
/// Errors: the [`Refusal`] that applies.
pub fn resolve_cached(pod: &Pod, vms: &Cache<VirtualMachine>) -> Result<PodVm, Refusal> {
    let owner = vm_owner(pod).map(|o| o.name.clone()).unwrap_or_default();
    let vm = vms.get(&ObjectRef::new(&owner).within(&pod.namespace().unwrap_or_default()));
    verify(pod, vm.as_deref())
}

/// Resolve `pod` to its VM: from `vms` when it holds the owner, else from a
/// fresh read through `client` (a VirtualMachine created a moment ago may not
/// have reached the cache).
///
/// Errors: [`ResolveError::Refused`] when the pod does not lead to a VM;
/// [`ResolveError::Kube`] when the VirtualMachine could not be read.
pub async fn resolve(pod: &Pod, vms: &Cache<VirtualMachine>, client: &Client) -> Result<PodVm, ResolveError> {
    let Some(owner) = vm_owner(pod) else {
        return Err(verify(pod, None).expect_err("no owner is refused").into());
    };
    let namespace = pod.namespace().unwrap_or_default();
    // The cache may lag (a VM created or a pod designated a moment ago): only
    // its "yes" is final; any "no" is checked against a fresh read.
    if let Some(vm) = vms.get(&ObjectRef::new(&owner.name).within(&namespace)) {
        if let Ok(resolved) = verify(pod, Some(&vm)) {
            return Ok(resolved);
        }
    }
    let api: Api<VirtualMachine> = Api::namespaced(client.clone(), &namespace);
    let vm = api.get_opt(&owner.name).await.map_err(|source| ResolveError::Kube {
        pod: format!("{namespace}/{}", pod.name_any()),
        name: owner.name.clone(),
        source,
    })?;
    Ok(verify(pod, vm.as_ref())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::vm_and_pod;

    fn refusal(pod: &Pod, vm: Option<&VirtualMachine>) -> Refusal {
        verify(pod, vm).expect_err("refused")
    }

    #[test]
    fn a_vms_own_pod_leads_to_the_vm() {
        let (vm, pod) = vm_and_pod("team-a", "web");
        let resolved = verify(&pod, Some(&vm)).expect("its own pod");
        assert_eq!(resolved.spec.id.0, vm.uid().unwrap());
        assert_eq!((resolved.spec.namespace.as_str(), resolved.spec.name.as_str()), ("team-a", "web"));
    }

    #[test]
    fn a_pod_without_a_vm_owner_is_refused_whatever_its_annotations_say() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.metadata.owner_references = None;
        assert!(matches!(refusal(&pod, Some(&vm)), Refusal::NoVmOwner { .. }));
    }

    #[test]
    fn a_copy_of_another_namespaces_pod_finds_no_vm_in_its_own_namespace() {
        let (victim_vm, victim_pod) = vm_and_pod("victim", "web");
        let mut forged = victim_pod.clone();
        forged.metadata.namespace = Some("attacker".into());
        // The attacker's namespace has no VirtualMachine "web" ...
        assert!(matches!(refusal(&forged, None), Refusal::OwnerNotFound { .. }));
        // ... and the victim's object is not one of the attacker's namespace.
        assert!(matches!(refusal(&forged, Some(&victim_vm)), Refusal::OwnerNotFound { .. }));
    }

    #[test]
    fn an_owner_reference_with_another_uid_is_refused() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.metadata.owner_references.as_mut().unwrap()[0].uid = "6f1a0c9e-0000-4000-8000-000000000001".into();
        assert!(matches!(refusal(&pod, Some(&vm)), Refusal::OwnerUidMismatch { .. }));
    }

    #[test]
    fn an_annotation_edited_to_another_vms_uid_is_refused() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        let (other, _) = vm_and_pod("team-a", "db");
        pod.annotations_mut().insert(UID_ANNOTATION.into(), other.uid().unwrap());
        match refusal(&pod, Some(&vm)) {
            Refusal::HintDisagrees { field, .. } => assert_eq!(field, "metadata.annotations[vmlet.io/vm-uid]"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_label_naming_another_vm_is_refused() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.labels_mut().insert(VM_LABEL.into(), "db".into());
        match refusal(&pod, Some(&vm)) {
            Refusal::HintDisagrees { field, .. } => assert_eq!(field, "metadata.labels[vmlet.io/vm]"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_second_pod_of_the_same_namespace_claiming_the_vm_is_refused() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.metadata.name = Some("web-evil1".into());
        assert!(matches!(refusal(&pod, Some(&vm)), Refusal::NotTheVmsPod { .. }));
    }

    #[test]
    fn an_earlier_pod_of_the_vm_no_longer_drives_it() {
        let (mut vm, pod) = vm_and_pod("team-a", "web");
        vm.status.as_mut().unwrap().pod_name = Some("web-b2c4d".into());
        match refusal(&pod, Some(&vm)) {
            Refusal::NotTheVmsPod { current, .. } => assert_eq!(current, "web-b2c4d"),
            other => panic!("{other:?}"),
        }
        vm.status.as_mut().unwrap().pod_name = None;
        match refusal(&pod, Some(&vm)) {
            Refusal::NotTheVmsPod { current, .. } => assert_eq!(current, "none"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_owner_of_another_api_group_or_not_controlling_is_no_vm_owner() {
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.metadata.owner_references.as_mut().unwrap()[0].api_version = "evil.example/v1".into();
        assert!(matches!(refusal(&pod, Some(&vm)), Refusal::NoVmOwner { .. }));
        let (vm, mut pod) = vm_and_pod("team-a", "web");
        pod.metadata.owner_references.as_mut().unwrap()[0].controller = Some(false);
        assert!(matches!(refusal(&pod, Some(&vm)), Refusal::NoVmOwner { .. }));
    }
}
