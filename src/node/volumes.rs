//! Data disks from PersistentVolumeClaims: the claim named by the VM's pod
//! volume → the PersistentVolume bound to it → a directory on this host →
//! the disk image `disk.img` in it (raw: vmlet makes it so, and never reads
//! a format from it). [`super::disks`] puts them in the VM's disk order.
//!
//! Every hop is checked against what a tenant cannot forge: the claim is read
//! from the pod's namespace; the volume must name that very claim (its
//! `claimRef` UID); it must be a `local` or `hostPath` volume (made by the
//! cluster's administrators) whose node affinity, if any, includes this host;
//! and the image must lie under the host's storage roots. A claim that is not
//! bound yet only waits.

use crate::storage::check_host_file;
use k8s_openapi::api::core::v1::{CSIPersistentVolumeSource, PersistentVolume, PersistentVolumeClaim};
use kube::{Api, Client, ResourceExt};
use vmlet_provider::{BackingFile, DataDisk, DiskFormat, Provider};

/// The image file in a volume's directory (as KubeVirt names it).
pub const DISK_IMAGE: &str = "disk.img";

/// Why the disks cannot be used (yet): the pod's waiting reason and message.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// The claim is not bound yet, or does not exist (it may be created
    /// later): wait.
    #[error("spec.disks[{disk}]: PersistentVolumeClaim {claim} {why}")]
    Waiting {
        /// The disk's name.
        disk: String,
        /// The claim's name.
        claim: String,
        /// What it waits for.
        why: String,
    },
    /// The volume cannot be a disk here: the message names it and the fix.
    #[error("spec.disks[{disk}]: {why}")]
    Unusable {
        /// The disk's name.
        disk: String,
        /// Why.
        why: String,
    },
    /// Reading the API failed.
    #[error("spec.disks: reading {what}: {source}")]
    Kube {
        /// The object.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl NotReady {
    /// The pod's waiting reason.
    pub fn reason(&self) -> &'static str {
        match self {
            NotReady::Waiting { .. } | NotReady::Kube { .. } => "VolumeNotReady",
            NotReady::Unusable { .. } => "VolumeNotUsable",
        }
    }
}

/// The data disk `disk` of a VM of `namespace` that claim `claim_name` holds,
/// on the host of `agent`. A volume vmlet's provisioner made for the host's
/// back end ([`super::provisioner`]) is the back end's volume in its pool,
/// in the format it was made in; any other is the image in the claim's
/// directory, raw, which must lie under the host's storage roots. The
/// caller made sure the claim is a volume of the VM's pod ([`super::disks`]).
pub(super) async fn claim_disk(
    agent: &super::Agent,
    namespace: &str,
    disk: &str,
    claim_name: &str,
) -> Result<DataDisk, NotReady> {
    let (client, provider, node) = (&agent.client, agent.provider.as_ref(), agent.host.name.as_str());
    let (roots, local) = (agent.storage.roots(), agent.storage.resolves_links());
    let claim_error = |e| match e {
        ClaimError::Waiting(why) => NotReady::Waiting { disk: disk.to_owned(), claim: claim_name.to_owned(), why },
        ClaimError::Unusable(why) => NotReady::Unusable { disk: disk.to_owned(), why },
        ClaimError::Kube { what, source } => NotReady::Kube { what, source },
    };
    let bound = bound_volume(client, namespace, claim_name, node).await.map_err(claim_error)?;
    let provisioner = super::provisioner::provisioner_name(provider.kind());
    if let Some(csi) = bound.pv.spec.as_ref().and_then(|s| s.csi.as_ref()).filter(|csi| csi.driver == provisioner) {
        let mut found = provisioned_disk(provider, disk, &bound.name, csi, node).await?;
        if let Some(base) = stated_base(csi) {
            found.backing_chain = base_chain(agent, disk, &bound.name, base).await?;
        }
        return Ok(found);
    }
    let found = directory_of(bound).map_err(claim_error)?;
    let path = format!("{}/{DISK_IMAGE}", found.dir.trim_end_matches('/'));
    if let Err(why) = check_host_file(roots, local, &path).await {
        return Err(NotReady::Unusable {
            disk: disk.to_owned(),
            why: format!(
                "PersistentVolume {}'s disk {path:?} {why}; host {node} keeps VM disks only under its storage \
                 roots [{}]: make the volume's path a directory under one",
                found.volume,
                roots.join(", ")
            ),
        });
    }
    Ok(DataDisk {
        name: disk.to_owned(),
        path,
        format: DiskFormat::Raw,
        create_bytes: found.capacity_bytes,
        backing_chain: Vec::new(),
    })
}

/// The disk `disk` from the provisioned PersistentVolume `pv_name`, whose
/// CSI source `csi` names the volume (`volumeHandle`
/// `<node>/<pool>/<volume>`) and the format vmlet's provisioner made it in
/// (`volumeAttributes.format`): the volume's file, in that format, standing
/// alone. A volume of a shared pool ([`super::provisioner::SHARED_ATTRIBUTE`])
/// is looked up in this host's pool of that name; any other must be this
/// host's. The pool's own idea of the format is never used: libvirt probes
/// it from the file, which the guest writes.
async fn provisioned_disk(
    provider: &dyn Provider,
    disk: &str,
    pv_name: &str,
    csi: &CSIPersistentVolumeSource,
    node: &str,
) -> Result<DataDisk, NotReady> {
    let unusable = |why: String| NotReady::Unusable { disk: disk.to_owned(), why };
    let handle = csi.volume_handle.as_str();
    let Some((on, pool, name)) = super::provisioner::parse_handle(handle) else {
        return Err(unusable(format!(
            "PersistentVolume {pv_name}: volumeHandle {handle:?} is no <node>/<pool>/<volume>"
        )));
    };
    let stated = csi.volume_attributes.as_ref().and_then(|a| a.get(super::provisioner::FORMAT_ATTRIBUTE));
    let Some(format) = stated.and_then(|f| DiskFormat::from_name(f)) else {
        return Err(unusable(format!(
            "PersistentVolume {pv_name} states no format vmlet attaches (csi.volumeAttributes.format: {stated:?})"
        )));
    };
    let shared = csi.volume_attributes.as_ref().and_then(|a| a.get(super::provisioner::SHARED_ATTRIBUTE));
    if on != node && shared.map(String::as_str) != Some("true") {
        return Err(unusable(format!("PersistentVolume {pv_name}'s volume lives on host {on}, not {node}")));
    }
    let Some(volumes) = provider.volumes() else {
        return Err(unusable(format!("the {} back end of host {node} has no volumes", provider.kind())));
    };
    match volumes.volume(pool, name).await {
        Ok(Some(volume)) => Ok(DataDisk {
            name: disk.to_owned(),
            path: volume.path,
            format,
            create_bytes: None,
            backing_chain: Vec::new(),
        }),
        Ok(None) => {
            Err(unusable(format!("PersistentVolume {pv_name}'s volume {name} is not in pool {pool} on {node}")))
        }
        Err(e) => Err(unusable(format!("PersistentVolume {pv_name}: {e}"))),
    }
}

/// The catalogue image a provisioned volume is an overlay on, as its
/// PersistentVolume states it (`volumeAttributes` `backingFile` and
/// `backingFormat`); `None` for a volume that stands alone.
fn stated_base(csi: &CSIPersistentVolumeSource) -> Option<BackingFile> {
    let attributes = csi.volume_attributes.as_ref()?;
    let path = attributes.get(super::provisioner::BACKING_FILE_ATTRIBUTE)?;
    let format = attributes.get(super::provisioner::BACKING_FORMAT_ATTRIBUTE).and_then(|f| DiskFormat::from_name(f));
    // A format other than the file name's rule is refused below.
    Some(BackingFile { path: path.clone(), format: format.unwrap_or(DiskFormat::Raw) })
}

/// The chain a provisioned overlay volume is pinned to: its base (a
/// catalogue image, which must lie under the host's storage roots) and the
/// base's own chain, checked as a boot image's is
/// ([`super::host_images::boot_image_chain`]). Errors: `Unusable`, naming
/// why (outside the roots, a format the file name contradicts, a chain that
/// is not allowed, or a host whose files vmlet cannot read to pin it).
async fn base_chain(
    agent: &super::Agent,
    disk: &str,
    pv_name: &str,
    base: BackingFile,
) -> Result<Vec<BackingFile>, NotReady> {
    let unusable = |why: String| NotReady::Unusable { disk: disk.to_owned(), why };
    let (roots, local, node) = (agent.storage.roots(), agent.storage.resolves_links(), agent.host.name.as_str());
    if base.format != DiskFormat::of_image_path(&base.path) {
        return Err(unusable(format!(
            "PersistentVolume {pv_name} states base {:?} as {}, which its name does not make it",
            base.path, base.format
        )));
    }
    if let Err(why) = check_host_file(roots, local, &base.path).await {
        return Err(unusable(format!(
            "PersistentVolume {pv_name}'s base image {:?} {why}; host {node} allows images only under its storage \
             roots [{}]",
            base.path,
            roots.join(", ")
        )));
    }
    let field = crate::storage::StorageField::ClaimBase { disk: disk.to_owned() };
    let below =
        super::host_images::boot_image_chain(agent.provider.as_ref(), &agent.storage, node, field, &base.path).await;
    match below {
        Ok(Some(below)) => Ok(std::iter::once(base).chain(below).collect()),
        Ok(None) => Err(unusable(format!(
            "host {node}'s files cannot be read by vmlet, so the chain of PersistentVolume {pv_name}'s overlay cannot \
             be pinned; run vmlet on the host"
        ))),
        Err(super::host_images::Unavailable::NotReady(not_ready)) => Err(unusable(not_ready.to_string())),
        Err(super::host_images::Unavailable::Refused(refusal)) => Err(unusable(refusal.to_string())),
        Err(super::host_images::Unavailable::Provider(e)) => Err(unusable(e.to_string())),
    }
}

/// A claim's directory on a host ([`claim_directory`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimDirectory {
    /// The PersistentVolume's name.
    pub volume: String,
    /// Its `local.path` or `hostPath.path` (not yet checked against any root).
    pub dir: String,
    /// The claim's capacity in bytes, when known.
    pub capacity_bytes: Option<u64>,
}

/// Why a claim gives no directory ([`claim_directory`]).
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Not bound yet, or it does not exist (yet): wait.
    #[error("{0}")]
    Waiting(String),
    /// It cannot be a directory here: the message names why and the fix.
    #[error("{0}")]
    Unusable(String),
    /// The API server could not be asked.
    #[error("reading {what}: {source}")]
    Kube {
        /// What was read.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// The PersistentVolume bound to a claim ([`bound_volume`]).
pub struct BoundVolume {
    /// The PersistentVolume's name.
    pub name: String,
    /// The PersistentVolume.
    pub pv: PersistentVolume,
    /// The claim's capacity in bytes, when known.
    pub capacity_bytes: Option<u64>,
}

/// The PersistentVolume bound to claim `claim_name` of `namespace`, usable on
/// host `node`: it must name that very claim (its `claimRef` UID), and its
/// node affinity (if any) must include `node`.
pub async fn bound_volume(
    client: &Client,
    namespace: &str,
    claim_name: &str,
    node: &str,
) -> Result<BoundVolume, ClaimError> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let kube = |what: String| move |source| ClaimError::Kube { what, source };
    let claim = claims.get_opt(claim_name).await.map_err(kube(format!("PersistentVolumeClaim {claim_name}")))?;
    let Some(claim) = claim else {
        return Err(ClaimError::Waiting(format!("does not exist in namespace {namespace}")));
    };
    let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let Some(volume_name) = claim.spec.as_ref().and_then(|s| s.volume_name.clone()).filter(|_| bound) else {
        return Err(ClaimError::Waiting("is not bound to a PersistentVolume yet".to_owned()));
    };
    let pv = volumes.get_opt(&volume_name).await.map_err(kube(format!("PersistentVolume {volume_name}")))?;
    let Some(pv) = pv else {
        return Err(ClaimError::Waiting(format!("is bound to {volume_name}, which does not exist")));
    };
    let spec = pv.spec.clone().unwrap_or_default();
    let claim_ref_uid = spec.claim_ref.as_ref().and_then(|r| r.uid.clone());
    if claim_ref_uid.is_none() || claim_ref_uid != claim.uid() {
        return Err(ClaimError::Unusable(format!(
            "PersistentVolume {volume_name} is not bound to claim {namespace}/{claim_name} (its claimRef names another)"
        )));
    }
    if !affinity_allows(&pv, node) {
        return Err(ClaimError::Unusable(format!(
            "PersistentVolume {volume_name} is on another host (its node affinity does not include {node})"
        )));
    }
    let capacity_bytes = claim
        .status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"))
        .or_else(|| spec.capacity.as_ref().and_then(|c| c.get("storage")))
        .and_then(|q| crate::quantity::parse_bytes(&q.0).ok());
    Ok(BoundVolume { name: volume_name, pv, capacity_bytes })
}

/// The directory of a bound volume: a Filesystem `local` or `hostPath`
/// volume (made by the cluster's administrators). The caller checks it
/// against its roots.
fn directory_of(bound: BoundVolume) -> Result<ClaimDirectory, ClaimError> {
    let BoundVolume { name, pv, capacity_bytes } = bound;
    let spec = pv.spec.unwrap_or_default();
    if spec.volume_mode.as_deref() == Some("Block") {
        return Err(ClaimError::Unusable(format!(
            "PersistentVolume {name} has volumeMode Block; vmlet uses Filesystem volumes (a directory) on libvirt"
        )));
    }
    let dir = match (spec.local, spec.host_path) {
        (Some(local), _) => local.path,
        (None, Some(host_path)) => host_path.path,
        _ => {
            return Err(ClaimError::Unusable(format!(
                "PersistentVolume {name} is neither local nor hostPath nor made by vmlet's provisioner for this \
                 host's back end: use a StorageClass of provisioner <back end>.vmlet.io (libvirt.vmlet.io, \
                 openstack.vmlet.io), or on libvirt a local PersistentVolume"
            )))
        }
    };
    Ok(ClaimDirectory { volume: name, dir, capacity_bytes })
}

/// The directory on host `node` of claim `claim_name` of `namespace`
/// ([`bound_volume`], then a `local` or `hostPath` volume). The caller
/// checks the directory against its roots.
pub async fn claim_directory(
    client: &Client,
    namespace: &str,
    claim_name: &str,
    node: &str,
) -> Result<ClaimDirectory, ClaimError> {
    directory_of(bound_volume(client, namespace, claim_name, node).await?)
}

/// Whether `pv`'s required node affinity (if any) selects node `node` by its
/// `kubernetes.io/hostname` label (the only label vmlet can match here
/// without reading the Node).
fn affinity_allows(pv: &PersistentVolume, node: &str) -> bool {
    let Some(required) = pv.spec.as_ref().and_then(|s| s.node_affinity.as_ref()).and_then(|a| a.required.as_ref())
    else {
        return true;
    };
    required.node_selector_terms.iter().any(|term| {
        term.match_expressions.iter().flatten().all(|e| {
            e.key == "kubernetes.io/hostname"
                && e.operator == "In"
                && e.values.as_ref().is_some_and(|v| v.iter().any(|v| v == node))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pv(affinity: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vol-1"},
            "spec": {"local": {"path": "/srv/vols/1"}, "nodeAffinity": affinity},
        }))
        .unwrap()
    }

    #[test]
    fn a_local_volume_is_usable_only_on_the_hosts_its_affinity_names() {
        let on = |host: &str| {
            pv(serde_json::json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [host]}]}]}}))
        };
        assert!(affinity_allows(&on("host-a"), "host-a"));
        assert!(!affinity_allows(&on("host-a"), "host-b"));
        let other_label = pv(serde_json::json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["host-a"]}]}]}}));
        assert!(!affinity_allows(&other_label, "host-a"), "only the hostname label can be matched here");
        assert!(affinity_allows(&pv(serde_json::Value::Null), "host-b"), "no affinity: anywhere");
    }
}
