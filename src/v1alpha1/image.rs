//! `VirtualMachineImage` (group `vmlet.io`, version `v1alpha1`): the image
//! catalogue, cluster-scoped.
//!
//! An administrator says once where an image lives on each back end; a
//! tenant boots it by name (`spec.image: debian-12`) and never names a host
//! file. The node agent reads the entry right before it defines the VM, so
//! what a tenant may boot is what the catalogue holds (tenants may read it,
//! not write it: `deploy/rbac.yaml`). The entry's files still lie under the
//! host's storage roots, and their format follows vmlet's rule (a name
//! ending in `.qcow2` is qcow2 with a backing chain vmlet pins, any other is
//! raw), never a probe of the file.

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// An image VMs may boot by name, per back end.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "vmlet.io",
    version = "v1alpha1",
    kind = "VirtualMachineImage",
    shortname = "vmimage",
    shortname = "vmimg",
    doc = "An image of the catalogue that VirtualMachines boot by name (spec.image: <name>); administrators create them, tenants read them.",
    printcolumn(name = "Libvirt", type_ = "string", json_path = ".spec.libvirt.path"),
    printcolumn(name = "Nova", type_ = "string", json_path = ".spec.nova.image"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("has(self.spec.libvirt) || has(self.spec.nova)")
        .message("spec names no back end: set spec.libvirt.path (a file under the hosts' storage roots) or spec.nova.image (a Glance image)"),
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineImageSpec {
    /// The image on libvirt hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libvirt: Option<LibvirtImage>,
    /// The image on Nova (OpenStack) nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nova: Option<NovaImage>,
}

/// Where an image is on libvirt hosts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LibvirtImage {
    /// Absolute path of the disk image on every host that serves it, under
    /// the host's storage roots, e.g. `/var/lib/libvirt/images/debian-12.qcow2`.
    /// A name ending in `.qcow2` is qcow2 (each VM gets the image through a
    /// backing chain vmlet pins), any other raw. The VM gets it as its boot
    /// disk (`vda`) as the path form of `spec.image` does.
    #[schemars(length(min = 2, max = 4096), regex(pattern = r"^/[^\x00-\x1f\x7f]*$"))]
    pub path: String,
    /// A kernel to boot directly, with its initrd and command line (paths on
    /// the host, under its storage roots), for VMs that name none themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<super::KernelBoot>,
}

/// Where an image is on Nova nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NovaImage {
    /// The Glance image's id or name; the cloud's `images` list in vmlet's
    /// config still bounds what a VM may boot.
    #[schemars(length(min = 1, max = 255))]
    pub image: String,
}

/// Whether `image` (a VirtualMachine's `spec.image`) names a catalogue
/// entry rather than a host path: it does not start with `/`.
pub fn is_catalogue_name(image: &str) -> bool {
    !image.starts_with('/')
}

impl VirtualMachineImageSpec {
    /// The image on hosts of back-end kind `kind` (`libvirt`, `nova`): its
    /// reference (a host path, a Glance image) and, for libvirt, the kernel
    /// to boot directly; `None` when the entry has none for that kind.
    pub fn for_backend(&self, kind: &str) -> Option<(&str, Option<&super::KernelBoot>)> {
        match kind {
            "libvirt" => self.libvirt.as_ref().map(|l| (l.path.as_str(), l.kernel_boot.as_ref())),
            "nova" => self.nova.as_ref().map(|n| (n.image.as_str(), None)),
            _ => None,
        }
    }
}
