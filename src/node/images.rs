//! The image catalogue on the node: a VM whose `spec.image` names a
//! `VirtualMachineImage` ([`crate::v1alpha1::VirtualMachineImage`]) gets
//! that entry's image for this host's back end, read right before the
//! define. The resolved files are then checked against the host's storage
//! roots like any other ([`crate::storage`]); that the VM's namespace may
//! name host files itself is decided before, from the VM's own spec
//! ([`crate::storage::StorageRoots::check_trust`]).

use crate::v1alpha1::{is_catalogue_name, VirtualMachineImage};
use kube::api::Api;
use kube::Client;
use std::time::Duration;
use vmlet_provider::{ImageReference, KernelBoot, VmSpec};

/// Why a VM's catalogue image cannot be used now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// No `VirtualMachineImage` of that name (yet).
    #[error(
        "spec.image {name:?}: no VirtualMachineImage of that name; an administrator creates it (kubectl get \
         virtualmachineimages lists the catalogue), and the VM starts once it exists"
    )]
    NotFound {
        /// The name the VM gives.
        name: String,
    },
    /// The entry names no image for this host's back end.
    #[error(
        "spec.image {name:?}: VirtualMachineImage {name} names no image for {kind} hosts (spec.{kind}); pick an \
         image that has one, or ask an administrator to add it"
    )]
    NoImageForBackend {
        /// The entry's name.
        name: String,
        /// The host's back-end kind, e.g. `libvirt`.
        kind: String,
    },
}

impl NotReady {
    /// The pod's waiting reason.
    pub fn reason(&self) -> &'static str {
        match self {
            NotReady::NotFound { .. } => "ImageNotFound",
            NotReady::NoImageForBackend { .. } => "ImageNotUsable",
        }
    }

    /// When to look again (a change of the VM or its pod comes sooner).
    pub fn recheck(&self) -> Duration {
        match self {
            NotReady::NotFound { .. } => Duration::from_secs(10),
            NotReady::NoImageForBackend { .. } => Duration::from_secs(60),
        }
    }
}

/// Why [`resolve`] gave no spec.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The catalogue entry is missing or unusable here.
    #[error(transparent)]
    NotReady(#[from] NotReady),
    /// Reading the catalogue failed (the pass retries).
    #[error("read VirtualMachineImage {name}: {source}")]
    Kube {
        /// The entry's name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// `spec` with a catalogue name in `spec.image` replaced by the entry's
/// image for back-end kind `kind` (and the entry's kernel boot, when the VM
/// names none); unchanged when `spec.image` is a host path or unset. On a
/// back end whose images are its own catalogue's (`reference` =
/// [`ImageReference::Catalog`], e.g. Nova's Glance), a name with no entry
/// is the back end's to resolve and stays as it is.
/// Errors: [`Error::NotReady`] for a missing entry (on host-path back ends)
/// or one without an image for `kind`; [`Error::Kube`] when the read failed.
pub async fn resolve(client: &Client, kind: &str, reference: ImageReference, spec: &VmSpec) -> Result<VmSpec, Error> {
    let Some(name) = spec.image.as_deref().filter(|image| is_catalogue_name(image)) else {
        return Ok(spec.clone());
    };
    let images: Api<VirtualMachineImage> = Api::all(client.clone());
    let entry = images.get_opt(name).await.map_err(|source| Error::Kube { name: name.to_owned(), source })?;
    let entry = match (entry, reference) {
        (Some(entry), _) => entry,
        (None, ImageReference::Catalog) => return Ok(spec.clone()),
        (None, ImageReference::HostPath) => return Err(NotReady::NotFound { name: name.to_owned() }.into()),
    };
    apply(spec, name, &entry, kind).map_err(Error::NotReady)
}

/// `spec` booting `entry` (named `name`) on a host of kind `kind`.
fn apply(spec: &VmSpec, name: &str, entry: &VirtualMachineImage, kind: &str) -> Result<VmSpec, NotReady> {
    let Some((image, kernel_boot)) = entry.spec.for_backend(kind) else {
        return Err(NotReady::NoImageForBackend { name: name.to_owned(), kind: kind.to_owned() });
    };
    let mut resolved = spec.clone();
    resolved.image = Some(image.to_owned());
    if resolved.kernel_boot.is_none() {
        resolved.kernel_boot = kernel_boot.map(|boot| KernelBoot {
            kernel: boot.kernel.clone(),
            initrd: boot.initrd.clone(),
            cmdline: boot.cmdline.clone(),
        });
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(json: serde_json::Value) -> VirtualMachineImage {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineImage",
            "metadata": {"name": "debian-12"}, "spec": json,
        }))
        .unwrap()
    }

    fn spec(image: &str) -> VmSpec {
        let mut vm = crate::testing::VmBuilder::new("web").image(image).build();
        vm.spec.kernel_boot = None;
        crate::vmpod::pod_for_vm(&vm, "web-x7k2p", "AllNamespaces", None)
            .ok()
            .and_then(|pod| crate::vmpod::vm_from_pod(&pod).ok())
            .expect("the VM's pod reads back")
            .spec
    }

    #[test]
    fn a_catalogue_name_becomes_the_entrys_file_and_kernel_on_its_back_end() {
        let debian = entry(serde_json::json!({
            "libvirt": {"path": "/var/lib/libvirt/images/debian-12.qcow2",
                        "kernelBoot": {"kernel": "/var/lib/libvirt/images/vmlinuz", "cmdline": "console=ttyS0"}},
            "nova": {"image": "debian-12-glance"},
        }));
        let libvirt = apply(&spec("debian-12"), "debian-12", &debian, "libvirt").unwrap();
        assert_eq!(libvirt.image.as_deref(), Some("/var/lib/libvirt/images/debian-12.qcow2"));
        let boot = libvirt.kernel_boot.expect("the entry's kernel");
        assert_eq!(
            (boot.kernel.as_str(), boot.cmdline.as_deref()),
            ("/var/lib/libvirt/images/vmlinuz", Some("console=ttyS0"))
        );
        let nova = apply(&spec("debian-12"), "debian-12", &debian, "nova").unwrap();
        assert_eq!((nova.image.as_deref(), nova.kernel_boot), (Some("debian-12-glance"), None));
    }

    #[test]
    fn an_entry_without_this_back_end_names_the_field_to_add() {
        let nova_only = entry(serde_json::json!({"nova": {"image": "x"}}));
        let err = apply(&spec("debian-12"), "debian-12", &nova_only, "libvirt").unwrap_err();
        assert_eq!(err.reason(), "ImageNotUsable");
        assert!(err.to_string().contains("names no image for libvirt hosts (spec.libvirt)"), "{err}");
    }
}
