//! A VM's data disks as its define gets them: `spec.disks` of its
//! VirtualMachine, in that order (virtio `vdb`, `vdc`, ... on libvirt),
//! whichever their source, each named after its disk (the guest's serial).
//!
//! [`plan`] (pure) lines the disks up with their sources: a claim must be a
//! volume of the VM's pod under the disk's name (so the scheduler placed the
//! pod where the volume is, and Kubernetes holds the claim while the pod
//! exists); a host image is read from the VirtualMachine alone (it is no pod
//! volume). [`data_disks`] then resolves each, in order: claims through
//! [`super::volumes`], host images through [`super::host_images`].

use super::host_images::{self, host_image_disk};
use super::volumes::{self, claim_disk};
use super::Agent;
use crate::storage::StorageRefusal;
use crate::v1alpha1::{DiskSource, VmDisk};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use std::time::Duration;
use vmlet_provider::{BackingFile, DataDisk, DiskFormat, ImageReference, VmSpec};

/// One disk of [`plan`], with where it comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned<'a> {
    /// A claim, a volume of the pod under the disk's name.
    Claim {
        /// The disk's name.
        disk: &'a str,
        /// The claim's name.
        claim: &'a str,
    },
    /// A host image.
    HostImage {
        /// The disk's name.
        disk: &'a str,
        /// Its path on the host, as the VM gives it.
        path: &'a str,
    },
}

/// Why a VM's disks cannot be attached (yet): the pod's waiting reason and
/// message, naming the disk.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// A claim's disk.
    #[error(transparent)]
    Claim(#[from] volumes::NotReady),
    /// A host image.
    #[error(transparent)]
    HostImage(#[from] host_images::NotReady),
    /// The catalogue image `spec.image` names.
    #[error(transparent)]
    Image(#[from] super::images::NotReady),
    /// The disk does not match the VM's pod (it was added or changed after
    /// the pod was made), or names both sources or none (only an object that
    /// bypassed the API server's rule).
    #[error("spec.disks[{disk}]: {why}")]
    Mismatch {
        /// The disk's name.
        disk: String,
        /// What does not match, and the fix.
        why: String,
    },
}

impl NotReady {
    /// The pod's waiting reason.
    pub fn reason(&self) -> &'static str {
        match self {
            NotReady::Claim(not_ready) => not_ready.reason(),
            NotReady::HostImage(not_ready) => not_ready.reason(),
            NotReady::Image(not_ready) => not_ready.reason(),
            NotReady::Mismatch { .. } => "VolumeNotUsable",
        }
    }

    /// When to look again.
    pub fn recheck(&self) -> Duration {
        match self {
            NotReady::HostImage(not_ready) => not_ready.recheck(),
            NotReady::Image(not_ready) => not_ready.recheck(),
            NotReady::Claim(_) => Duration::from_secs(5),
            NotReady::Mismatch { .. } => Duration::from_secs(60),
        }
    }
}

/// Why [`data_disks`] gave no disks.
#[derive(Debug)]
pub enum Unavailable {
    /// A disk waits or cannot be used.
    NotReady(NotReady),
    /// A host image's backing file lies outside the storage roots.
    Refused(Box<StorageRefusal>),
    /// The back end did not answer in time.
    Provider(vmlet_provider::Error),
}

impl From<NotReady> for Unavailable {
    fn from(not_ready: NotReady) -> Self {
        Unavailable::NotReady(not_ready)
    }
}

impl From<host_images::Unavailable> for Unavailable {
    fn from(unavailable: host_images::Unavailable) -> Self {
        match unavailable {
            host_images::Unavailable::NotReady(not_ready) => Unavailable::NotReady(not_ready.into()),
            host_images::Unavailable::Refused(refusal) => Unavailable::Refused(refusal),
            host_images::Unavailable::Provider(e) => Unavailable::Provider(e),
        }
    }
}

/// `disks` (a VirtualMachine's `spec.disks`) in order, each with its source,
/// checked against the volumes of the VM's pod `pod`. Errors: the first disk
/// that names both sources or none, or a claim that is not the pod's volume
/// of the disk's name.
pub fn plan<'a>(disks: &'a [VmDisk], pod: &'a Pod) -> Result<Vec<Planned<'a>>, NotReady> {
    let volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_deref()).unwrap_or_default();
    let mismatch = |disk: &VmDisk, why: String| NotReady::Mismatch { disk: disk.name.clone(), why };
    disks
        .iter()
        .map(|disk| match disk.source() {
            Some(DiskSource::HostImage(image)) => Ok(Planned::HostImage { disk: &disk.name, path: &image.path }),
            Some(DiskSource::Claim(claim)) => {
                let volume = volumes.iter().find(|v| v.name == disk.name);
                let pods_claim = volume.and_then(|v| v.persistent_volume_claim.as_ref()).map(|c| c.claim_name.as_str());
                if pods_claim == Some(claim.claim_name.as_str()) {
                    Ok(Planned::Claim { disk: &disk.name, claim: &claim.claim_name })
                } else {
                    Err(mismatch(
                        disk,
                        format!(
                            "PersistentVolumeClaim {} is not volume {} of pod {} (the disk was added or changed \
                             after the pod was made); delete the pod so that it is made again",
                            claim.claim_name,
                            disk.name,
                            pod.name_any()
                        ),
                    ))
                }
            }
            None => Err(mismatch(
                disk,
                "names both persistentVolumeClaim and hostImage, or neither; name exactly one".to_owned(),
            )),
        })
        .collect()
}

/// The boot image's backing chain ([`host_images::boot_image_chain`], when
/// `boot` is given and names a host path; `None` for a VM booting its root
/// disk, whose chain [`root_disk`] resolved) and the data disks
/// ([`data_disks`]) of `pod`'s VM, whose VirtualMachine names `disks`: what
/// the define pins.
pub async fn chains(
    agent: &Agent,
    pod: &Pod,
    boot: Option<&VmSpec>,
    disks: &[VmDisk],
) -> Result<(Option<Vec<BackingFile>>, Vec<DataDisk>), Unavailable> {
    let image_chain = match boot.and_then(|spec| spec.image.as_ref()) {
        Some(image) if agent.provider.image_reference() == ImageReference::HostPath => host_images::boot_image_chain(
            agent.provider.as_ref(),
            &agent.storage,
            &agent.host.name,
            crate::storage::StorageField::Image,
            image,
        )
        .await
        .map_err(Unavailable::from)?,
        _ => None,
    };
    Ok((image_chain, data_disks(agent, pod, disks).await?))
}

/// The name the root disk goes by in messages (`spec.disks[root]`-style).
pub const ROOT_DISK: &str = "root";

/// The boot volume of VM `vm` (its pod's view) whose VirtualMachine is
/// `cached`, when the VM has a root disk (`spec.rootDisk`): the claim
/// `<vm>-root`, resolved as a data disk's claim ([`volumes::claim_disk`]),
/// its chain pinned. `None` when the VM boots its image itself.
/// Errors: [`NotReady::Mismatch`] when the pod does not hold that claim as
/// its root disk volume (the root disk was added after the pod was made),
/// and what a claim's disk may give.
pub async fn root_disk(
    agent: &Agent,
    vm: &crate::vmpod::PodVm,
    cached: &crate::v1alpha1::VirtualMachine,
) -> Result<Option<DataDisk>, NotReady> {
    if cached.spec.root_disk.is_none() {
        return Ok(None);
    }
    let claim = crate::v1alpha1::root_claim_name(&vm.spec.name);
    if vm.root_claim.as_deref() != Some(claim.as_str()) {
        return Err(NotReady::Mismatch {
            disk: ROOT_DISK.to_owned(),
            why: format!(
                "the pod does not hold claim {claim} (spec.rootDisk was added after the pod was made); delete the \
                 pod so that it is made again"
            ),
        });
    }
    let disk = volumes::claim_disk(agent, &vm.spec.namespace, ROOT_DISK, &claim).await?;
    // The boot disk is attached in the format its file name gives
    // (vmlet's rule); a volume whose name says otherwise cannot boot.
    if DiskFormat::of_image_path(&disk.path) != disk.format {
        return Err(NotReady::Mismatch {
            disk: ROOT_DISK.to_owned(),
            why: format!(
                "claim {claim}'s volume {} is {}, which its name does not say; make the claim anew",
                disk.path, disk.format
            ),
        });
    }
    Ok(Some(disk))
}

/// The data disks of `pod`'s VM, whose VirtualMachine names `disks`, on the
/// agent's host, in order ([`plan`]), each resolved and checked.
pub async fn data_disks(agent: &Agent, pod: &Pod, disks: &[VmDisk]) -> Result<Vec<DataDisk>, Unavailable> {
    let namespace = pod.namespace().unwrap_or_default();
    let node = agent.host.name.as_str();
    let mut resolved = Vec::with_capacity(disks.len());
    for planned in plan(disks, pod)? {
        let disk = match planned {
            Planned::Claim { disk, claim } => {
                claim_disk(agent, &namespace, disk, claim).await.map_err(|e| Unavailable::NotReady(e.into()))?
            }
            Planned::HostImage { disk, path } => {
                host_image_disk(agent.provider.as_ref(), &agent.storage, node, disk, path).await?
            }
        };
        resolved.push(disk);
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    fn disks(json: serde_json::Value) -> Vec<VmDisk> {
        serde_json::from_value(json).unwrap()
    }

    /// The pod the controller makes for a VM with `disks`.
    fn pod_for(disks: &[VmDisk]) -> Pod {
        let mut vm = VmBuilder::new("web").build();
        vm.spec.disks = disks.to_vec();
        crate::vmpod::pod_for_vm(&vm, "web-x7k2p", "AllNamespaces", None).unwrap()
    }

    #[test]
    fn claims_and_host_images_keep_the_vms_order() {
        let disks = disks(serde_json::json!([
            {"name": "logs", "hostImage": {"path": "/var/lib/libvirt/images/logs.qcow2"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "web-data"}},
            {"name": "scratch", "hostImage": {"path": "/var/lib/libvirt/images/scratch.raw"}},
        ]));
        let pod = pod_for(&disks);
        assert_eq!(
            plan(&disks, &pod).unwrap(),
            [
                Planned::HostImage { disk: "logs", path: "/var/lib/libvirt/images/logs.qcow2" },
                Planned::Claim { disk: "data", claim: "web-data" },
                Planned::HostImage { disk: "scratch", path: "/var/lib/libvirt/images/scratch.raw" },
            ]
        );
    }

    #[test]
    fn a_claim_added_or_changed_after_the_pod_was_made_waits_for_a_new_pod() {
        let made_with = disks(serde_json::json!([{"name": "data", "persistentVolumeClaim": {"claimName": "a"}}]));
        let pod = pod_for(&made_with);
        for now in [
            serde_json::json!([{"name": "data", "persistentVolumeClaim": {"claimName": "b"}}]),
            serde_json::json!([{"name": "more", "persistentVolumeClaim": {"claimName": "a"}}]),
        ] {
            let now = disks(now);
            let err = plan(&now, &pod).unwrap_err();
            assert_eq!(err.reason(), "VolumeNotUsable");
            assert!(err.to_string().contains("delete the pod so that it is made again"), "{err}");
        }
        // A host image needs nothing of the pod.
        let image = disks(serde_json::json!([{"name": "data", "hostImage": {"path": "/img/d.raw"}}]));
        assert!(plan(&image, &PodBuilder::for_vm(&VmBuilder::new("web").build()).build()).is_ok());
    }

    #[test]
    fn a_disk_with_both_sources_or_none_is_named() {
        let pod = pod_for(&[]);
        for disk in [
            serde_json::json!({"name": "data"}),
            serde_json::json!({"name": "data", "hostImage": {"path": "/img/d.raw"},
                               "persistentVolumeClaim": {"claimName": "a"}}),
        ] {
            let disks = disks(serde_json::json!([disk]));
            let err = plan(&disks, &pod).unwrap_err().to_string();
            assert!(err.starts_with("spec.disks[data]: names both"), "{err}");
        }
    }
}
