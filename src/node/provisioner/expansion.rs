//! Volume expansion: a bound claim of an `allowVolumeExpansion` class whose
//! tenant raised `spec.resources.requests.storage` gets its volume grown,
//! as sig-storage's external-resizer does it for a CSI driver
//! (<https://github.com/kubernetes-csi/external-resizer>,
//! <https://kubernetes.io/docs/concepts/storage/persistent-volumes/#expanding-persistent-volumes-claims>).
//!
//! The API server lets a claim grow only when its class allows expansion,
//! and kube-controller-manager hands CSI volumes to the driver's resizer
//! (annotation `volume.kubernetes.io/storage-resizer`). vmlet then grows the
//! volume through the host's back end ([`vmlet_provider::Volumes::resize_volume`]),
//! in the format the PersistentVolume states (never the pool's probe): on a
//! running VM live, so the guest sees the new size at once. A VM's disk is a
//! block device to its guest, so nothing is left for a node to do: the
//! PersistentVolume's `spec.capacity` and then the claim's `status.capacity`
//! take the new size in the same pass. A size the volume cannot take (a
//! shrink, a format conflict) marks the claim `ControllerResizeInfeasible`
//! in `status.allocatedResourceStatuses`, which lets the tenant lower the
//! request again (RecoverVolumeExpansionFailure).

use super::{provisioner_name, Context, Error, FORMAT_ATTRIBUTE, PROVISIONED_BY, RETRY};
use crate::events::Reason;
use crate::quantity;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;
use tracing::{info, warn};
use vmlet_provider::{DiskFormat, ErrorKind};

/// The `allocatedResourceStatuses` value for a size the volume cannot take.
const INFEASIBLE: &str = "ControllerResizeInfeasible";

/// The bytes a `storage` entry of `resources` states; `None` when absent or
/// unreadable.
fn storage_bytes(
    resources: Option<&std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Option<u64> {
    resources.and_then(|r| r.get("storage")).and_then(|q| quantity::parse_bytes(&q.0).ok())
}

/// What growing a bound claim takes: where its volume is and what size.
#[derive(Debug, PartialEq)]
pub(super) struct Growth {
    pub node: String,
    pub pool: String,
    pub volume: String,
    pub format: DiskFormat,
    /// The size the claim asks for, in bytes.
    pub requested_bytes: u64,
    /// The size the PersistentVolume states now, in bytes.
    pub current_bytes: u64,
}

/// Read what growing `claim`, bound to `pv`, takes. `Ok(None)`: nothing to
/// grow (the request fits, or the PersistentVolume is not one this
/// provisioner made for this very claim). `Err`: a volume of ours that
/// cannot grow, and why (for a Warning Event).
/// `shared_growable`: the back end grows a volume of a shared pool through
/// any host ([`vmlet_provider::Volumes::grows_shared_volumes`]).
pub(super) fn growth(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    provisioner: &str,
    shared_growable: bool,
) -> Result<Option<Growth>, String> {
    let Some(spec) = pv.spec.as_ref() else { return Ok(None) };
    let Some(csi) = spec.csi.as_ref() else { return Ok(None) };
    let bound_to_claim = spec.claim_ref.as_ref().and_then(|r| r.uid.as_deref()) == claim.uid().as_deref();
    if pv.annotations().get(PROVISIONED_BY).map(String::as_str) != Some(provisioner)
        || csi.driver != provisioner
        || !bound_to_claim
    {
        return Ok(None);
    }
    let Some((node, pool, volume)) = super::parse_handle(&csi.volume_handle) else { return Ok(None) };
    let requested = claim.spec.as_ref().and_then(|s| s.resources.as_ref()).and_then(|r| r.requests.as_ref());
    let Some(requested_bytes) = storage_bytes(requested) else { return Ok(None) };
    let current_bytes = storage_bytes(spec.capacity.as_ref()).unwrap_or(0);
    if requested_bytes <= current_bytes {
        return Ok(None);
    }
    let shared = csi.volume_attributes.as_ref().and_then(|a| a.get(super::SHARED_ATTRIBUTE));
    if shared.map(String::as_str) == Some("true") && !shared_growable {
        return Err(format!(
            "PersistentVolume {}'s volume lies in a pool that several hosts share, and vmlet grows those volumes not \
             yet (a running VM's disk grows only through the host that runs it); lower the request again",
            pv.name_any()
        ));
    }
    let stated = csi.volume_attributes.as_ref().and_then(|a| a.get(FORMAT_ATTRIBUTE));
    let format = match stated.map(String::as_str) {
        Some("raw") => DiskFormat::Raw,
        Some("qcow2") => DiskFormat::Qcow2,
        _ => {
            return Err(format!(
                "PersistentVolume {} states no format (csi.volumeAttributes.{FORMAT_ATTRIBUTE}) to grow its volume in",
                pv.name_any()
            ))
        }
    };
    Ok(Some(Growth {
        node: node.to_owned(),
        pool: pool.to_owned(),
        volume: volume.to_owned(),
        format,
        requested_bytes,
        current_bytes,
    }))
}

/// Grow the volume of `claim`, bound to the PersistentVolume `pv_name`, when
/// its class allows expansion and it asks for more than it has.
pub(super) async fn expand(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    pv_name: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if class.allow_volume_expansion != Some(true) || claim.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let namespace = claim.namespace().unwrap_or_default();
    let kube = super::kube_error(claim);
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let Some(pv) = pvs.get_opt(pv_name).await.map_err(kube("read the PersistentVolume of"))? else {
        return Ok(Action::await_change());
    };
    let Some(host) = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .and_then(|csi| super::parse_handle(&csi.volume_handle))
        .and_then(|(node, _, _)| ctx.hosts.get(node))
    else {
        return Ok(Action::await_change());
    };
    let provisioner = provisioner_name(host.provider.kind());
    let shared_growable = host.provider.volumes().is_some_and(|v| v.grows_shared_volumes());
    let growth = match growth(claim, &pv, &provisioner, shared_growable) {
        Ok(Some(growth)) => growth,
        Ok(None) => return Ok(Action::await_change()),
        Err(refusal) => return refuse(claim, ctx, &refusal).await,
    };
    let Some(volumes) = host.provider.volumes() else {
        let note = format!("host {} ({} back end) cannot grow volumes", growth.node, host.provider.kind());
        return refuse(claim, ctx, &note).await;
    };
    let grown = match volumes.resize_volume(&growth.pool, &growth.volume, growth.format, growth.requested_bytes).await {
        Ok(grown) => grown,
        Err(e) if e.kind == ErrorKind::Transient => {
            // Tried again with backoff (not infeasible); the Events say why.
            ctx.events.publish(claim, Reason::VolumeResizeFailed, &e.to_string());
            return Err(e.into());
        }
        Err(e) => return refuse(claim, ctx, &e.to_string()).await,
    };
    let size = grown.capacity_bytes.to_string();
    let pv_patch = serde_json::json!({"spec": {"capacity": {"storage": size}}});
    pvs.patch(pv_name, &PatchParams::default(), &Patch::Merge(&pv_patch))
        .await
        .map_err(kube("record the new size in the PersistentVolume of"))?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let status = serde_json::json!({"status": {
        "capacity": {"storage": size},
        "allocatedResources": {"storage": growth.requested_bytes.to_string()},
        "allocatedResourceStatuses": null,
    }});
    claims
        .patch_status(&claim.name_any(), &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(kube("record the new size in the status of"))?;
    info!(node = %growth.node, pool = %growth.pool, volume = %growth.volume, from_bytes = growth.current_bytes, to_bytes = grown.capacity_bytes, "volume expanded");
    let note = format!(
        "grew volume {} in pool {} on {} from {} to {} bytes",
        growth.volume, growth.pool, growth.node, growth.current_bytes, grown.capacity_bytes
    );
    ctx.events.publish(claim, Reason::VolumeResizeSuccessful, &note);
    Ok(Action::await_change())
}

/// Report that `claim`'s volume cannot take its new size: a Warning Event
/// and `ControllerResizeInfeasible`, so the tenant may lower the request.
async fn refuse(claim: &PersistentVolumeClaim, ctx: &Context, refusal: &str) -> Result<Action, Error> {
    warn!(refusal, "claim not expanded");
    ctx.events.publish(claim, Reason::VolumeResizeFailed, refusal);
    let namespace = claim.namespace().unwrap_or_default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let status = serde_json::json!({"status": {"allocatedResourceStatuses": {"storage": INFEASIBLE}}});
    claims
        .patch_status(&claim.name_any(), &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(super::kube_error(claim)("mark the resize infeasible in the status of"))?;
    Ok(Action::requeue(RETRY))
}
