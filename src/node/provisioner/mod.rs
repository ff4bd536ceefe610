//! Dynamic provisioning of VM data disks: PersistentVolumeClaims of a
//! StorageClass whose `provisioner` is a back end's (`<kind>.vmlet.io`,
//! e.g. `libvirt.vmlet.io`) get a volume in a storage pool of the host the
//! scheduler picked, and a PersistentVolume bound to them.
//!
//! It follows the external-provisioner protocol of sig-storage
//! (<https://github.com/kubernetes-csi/external-provisioner>,
//! <https://kubernetes.io/docs/concepts/storage/dynamic-provisioning/>):
//!
//! - **Claim → volume.** A claim that is not bound, of a class with
//!   `volumeBindingMode: WaitForFirstConsumer`, waits until kube-scheduler
//!   writes the node it picked for the claim's first pod into the annotation
//!   [`SELECTED_NODE`]. The process that serves that node makes the volume
//!   `<namespace>_<claim>_<claim uid>` in the class's `pool` (parameter
//!   `format`: `raw`, the default, or `qcow2`), of the claim's requested
//!   size, through the host's back end ([`vmlet_provider::Volumes`]). The
//!   names are vmlet's: neither the tenant nor the claim picks a file.
//! - **Volume → PersistentVolume** `pvc-<claim uid>`: pre-bound to the
//!   claim (`claimRef` with its UID), with the class's reclaim policy, the
//!   claim's access modes and volume mode, node affinity to the host, and a
//!   CSI source (`driver` = the provisioner, `volumeHandle` =
//!   `<node>/<pool>/<volume>`, and the format it was made in as the
//!   volume attribute [`FORMAT_ATTRIBUTE`]: the pool's own idea of a file's
//!   format is probed from the guest's bytes) that no kubelet mounts (the driver's
//!   `CSIDriver` says `attachRequired: false`; the node agent reads the
//!   handle, [`super::volumes`]). kube-controller-manager's PV controller
//!   then binds the claim. A pool of one host gives `ReadWriteOnce` (and
//!   `ReadWriteOncePod`) only: a claim asking for more is refused with a
//!   Warning Event. A class with `shared: "true"` says its pool is one
//!   storage that several hosts define alike (same name, same path): its
//!   volumes may also be `ReadWriteMany`, their PersistentVolumes are tied
//!   to the class's `allowedTopologies` (or to no node) instead of the host,
//!   and carry [`SHARED_ATTRIBUTE`], so a VM on them can move between hosts.
//! - **Data sources.** A claim whose `dataSourceRef` names a
//!   `VirtualMachineImage` gets a qcow2 overlay on (or, with `fromImage:
//!   copy`, a full copy of) the image's file; one naming a
//!   `VirtualMachineBackup` of its own namespace gets a full copy of the
//!   backup's boot disk, or with the annotation
//!   [`BACKUP_DISK_ANNOTATION`] `<disk>` of that data disk, made on the
//!   backup's host from the one file vmlet named after that backup (and
//!   disk) ([`super::tasks::locate_backup`]). The disk is looked up in that
//!   backup's `status.dataDisks` only, and its file must bear vmlet's name
//!   for it, so no annotation reaches another namespace's file or any other.
//! - **Growth.** A bound claim of an `allowVolumeExpansion` class that asks
//!   for more gets its volume grown, live on a running VM ([`expansion`]).
//! - **Release → deletion.** A PersistentVolume of `Delete` policy carries
//!   the finalizer [`FINALIZER`]. Once its claim is gone (phase `Released`),
//!   the volume is deleted from the pool, and then the PersistentVolume.
//!   `Retain` keeps both.
//!
//! Everything is idempotent (names derive from the claim's UID), so a pass
//! cut short by a crash or a timeout is simply run again. A claim whose
//! class is not vmlet's, or whose selected node another process serves, is
//! left alone.

mod expansion;

use super::Hosts;
use crate::events::{EventSink, Reason};
use crate::quantity;
use crate::v1alpha1::BACKUP_DISK_ANNOTATION;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference,
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};
use vmlet_provider::{DiskFormat, VolumeRequest, VolumeSource, MAX_VOLUME_NAME_BYTES};

/// The annotation in which kube-scheduler names the node it picked for a
/// claim of a `WaitForFirstConsumer` class.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The annotation that names the provisioner of a PersistentVolume.
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// The CSI volume attribute in which a PersistentVolume states the format
/// its volume was made in (`raw`, `qcow2`): what the disk is attached in.
pub const FORMAT_ATTRIBUTE: &str = "format";
/// The CSI volume attributes in which a PersistentVolume of a claim filled
/// from a `VirtualMachineImage` states the image its qcow2 volume is an
/// overlay on, and that image's format: what the node agent pins as the
/// disk's backing file (the volume's header, which the guest writes, is
/// never followed).
pub const BACKING_FILE_ATTRIBUTE: &str = "backingFile";
/// See [`BACKING_FILE_ATTRIBUTE`].
pub const BACKING_FORMAT_ATTRIBUTE: &str = "backingFormat";
/// The CSI volume attribute (`"true"`) of a PersistentVolume whose volume
/// lies in a pool that several hosts share (its class's parameter
/// `shared`): any host that defines the pool may attach it, not only the
/// one its `volumeHandle` names (the host that made it).
pub const SHARED_ATTRIBUTE: &str = "shared";
/// The finalizer that holds a PersistentVolume of `Delete` policy until its
/// volume is deleted from the pool.
pub const FINALIZER: &str = "vmlet.io/volume";
/// How long a claim that cannot be provisioned waits before the next try,
/// unless it changes first.
const RETRY: Duration = Duration::from_secs(30);

/// The provisioner name of a back end of kind `kind` (`libvirt` →
/// `libvirt.vmlet.io`): StorageClasses name it, and PersistentVolumes' CSI
/// sources carry it as their driver.
pub fn provisioner_name(kind: &str) -> String {
    format!("{kind}.vmlet.io")
}

/// A failed pass; it runs again after a backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API request failed.
    #[error("{action} {object}: {source}")]
    Kube {
        /// What was being done.
        action: &'static str,
        /// The object (`namespace/name`, or a PersistentVolume's name).
        object: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The back end failed.
    #[error(transparent)]
    Provider(#[from] vmlet_provider::Error),
}

struct Context {
    client: Client,
    hosts: Hosts,
    events: EventSink,
}

/// Run the claim and PersistentVolume controllers of this process's hosts
/// (claims of `namespace` only, when set) until `shutdown`.
pub async fn run(client: Client, namespace: Option<String>, hosts: Hosts, shutdown: CancellationToken) {
    let claims: Api<PersistentVolumeClaim> = match &namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let events = EventSink::new(client.clone(), "vmlet-provisioner");
    let ctx = Arc::new(Context { client, hosts, events });
    info!("volume provisioner starting");
    let stop = shutdown.clone();
    let claims = Controller::new(claims, watcher::Config::default())
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(
            crate::metrics::counted("claim", provision),
            |claim, error, _| retry("claim", &claim.name_any(), error),
            ctx.clone(),
        )
        .for_each(|_| async {});
    let released = Controller::new(volumes, watcher::Config::default())
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reclaim, |volume, error, _| retry("PersistentVolume", &volume.name_any(), error), ctx)
        .for_each(|_| async {});
    tokio::join!(claims, released);
}

fn retry(kind: &str, name: &str, error: &Error) -> Action {
    warn!(kind, name, %error, "provisioner pass failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// What a claim asks of the provisioner, read from it and its class.
#[derive(Debug, PartialEq)]
struct Wanted {
    node: String,
    pool: String,
    format: DiskFormat,
    capacity_bytes: u64,
    /// What the claim is filled from (`spec.dataSourceRef`); `None`: an
    /// empty volume.
    source: Option<DataSource>,
    /// A claim filled from an image gets a full copy of it (class parameter
    /// `fromImage: copy`) rather than a qcow2 overlay on it (`overlay`, the
    /// default). A claim filled from a backup always gets a full copy.
    copy: bool,
    /// The class's pool is storage that several hosts share (parameter
    /// `shared: "true"`): the volume is no one host's.
    shared: bool,
}

/// What a claim's volume is filled from (its `spec.dataSourceRef`, group
/// `vmlet.io`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum DataSource {
    /// A cluster-scoped `VirtualMachineImage`, by name.
    Image(String),
    /// A `VirtualMachineBackup` of the claim's own namespace, by name: the
    /// volume is an independent copy of a disk it holds (its whole
    /// incremental chain read), made on the backup's host.
    Backup {
        /// The backup's name.
        backup: String,
        /// The data disk whose copy fills the claim (the claim's annotation
        /// [`BACKUP_DISK_ANNOTATION`], a checked disk name); `None`: the
        /// boot disk.
        disk: Option<String>,
    },
}

/// Why a claim of a vmlet class gets no volume now: the Warning Event's note.
type Refusal = String;

/// Read what `claim` of `class` (whose provisioner is `provisioner`) asks
/// for. `Ok(None)`: nothing to do (not ours, bound, or no node picked yet).
fn wanted(claim: &PersistentVolumeClaim, class: &StorageClass) -> Result<Option<Wanted>, Refusal> {
    let spec = claim.spec.as_ref();
    if spec.and_then(|s| s.volume_name.as_deref()).is_some_and(|v| !v.is_empty())
        || claim.metadata.deletion_timestamp.is_some()
    {
        return Ok(None);
    }
    let class_name = class.name_any();
    if class.volume_binding_mode.as_deref() != Some("WaitForFirstConsumer") {
        return Err(format!(
            "StorageClass {class_name} binds Immediate; vmlet makes a VM's volume on the host the scheduler picks \
             for the VM: set volumeBindingMode: WaitForFirstConsumer"
        ));
    }
    let Some(node) = claim.annotations().get(SELECTED_NODE) else { return Ok(None) };
    let parameters = class.parameters.clone().unwrap_or_default();
    let pool = parameters.get("pool").filter(|p| !p.is_empty()).ok_or_else(|| {
        format!("StorageClass {class_name} names no pool: set parameters.pool to a storage pool of the hosts")
    })?;
    if let Some(key) = parameters.keys().find(|k| !matches!(k.as_str(), "pool" | "format" | "shared" | "fromImage")) {
        return Err(format!(
            "StorageClass {class_name}: unknown parameter {key:?}; vmlet reads pool, format, shared and fromImage"
        ));
    }
    let copy = match parameters.get("fromImage").map(String::as_str) {
        None | Some("overlay") => false,
        Some("copy") => true,
        Some(other) => {
            return Err(format!("StorageClass {class_name}: parameters.fromImage {other:?}: use overlay or copy"));
        }
    };
    let shared = match parameters.get("shared").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(format!("StorageClass {class_name}: parameters.shared {other:?}: use \"true\" or \"false\""));
        }
    };
    let format = match parameters.get("format").map(String::as_str) {
        None | Some("raw") => DiskFormat::Raw,
        Some("qcow2") => DiskFormat::Qcow2,
        Some(other) => {
            return Err(format!("StorageClass {class_name}: parameters.format {other:?}: use raw or qcow2"));
        }
    };
    let modes = spec.and_then(|s| s.access_modes.clone()).unwrap_or_default();
    let one_host = |mode: &str| matches!(mode, "ReadWriteOnce" | "ReadWriteOncePod");
    if let Some(mode) = modes.iter().find(|m| !(one_host(m) || shared && m.as_str() == "ReadWriteMany")) {
        return Err(if shared {
            format!("spec.accessModes {mode}: a VM writes its disks; ask for ReadWriteOnce or ReadWriteMany")
        } else {
            format!(
                "spec.accessModes {mode}: a volume in pool {pool} lives on one host (StorageClass {class_name} does \
                 not say shared: \"true\"); ask for ReadWriteOnce"
            )
        });
    }
    let source = match spec.and_then(|s| s.data_source_ref.as_ref()) {
        None => None,
        Some(source) if source.api_group.as_deref() == Some(crate::v1alpha1::GROUP) => match source.kind.as_str() {
            "VirtualMachineImage" => {
                if format != DiskFormat::Qcow2 && !copy {
                    return Err(format!(
                        "spec.dataSourceRef names VirtualMachineImage {}: StorageClass {class_name} fills claims with \
                         qcow2 overlays on images, and makes raw volumes; use a class with parameters.format: qcow2, \
                         or one with parameters.fromImage: copy",
                        source.name
                    ));
                }
                Some(DataSource::Image(source.name.clone()))
            }
            "VirtualMachineBackup" => {
                let own = claim.namespace();
                if let Some(other) = source.namespace.as_ref().filter(|ns| Some(*ns) != own.as_ref()) {
                    return Err(format!(
                        "spec.dataSourceRef.namespace {other}: a claim is filled only from a VirtualMachineBackup of \
                         its own namespace; leave the namespace out"
                    ));
                }
                Some(DataSource::Backup { backup: source.name.clone(), disk: backup_disk(claim)? })
            }
            other => {
                return Err(format!(
                    "spec.dataSourceRef names {other} {}: vmlet fills claims from VirtualMachineImages and \
                     VirtualMachineBackups only",
                    source.name
                ));
            }
        },
        Some(source) => {
            return Err(format!(
                "spec.dataSourceRef names {} {}: vmlet fills claims from VirtualMachineImages and \
                 VirtualMachineBackups (apiGroup vmlet.io) only",
                source.kind, source.name
            ));
        }
    };
    let request = spec.and_then(|s| s.resources.as_ref()).and_then(|r| r.requests.as_ref());
    let size = request.and_then(|r| r.get("storage")).ok_or("spec.resources.requests.storage is not set")?;
    let capacity_bytes = quantity::parse_bytes(&size.0)
        .map_err(|e| format!("spec.resources.requests.storage {:?}: {e}", size.0))?
        .max(1);
    if claim.annotations().contains_key(BACKUP_DISK_ANNOTATION) && !matches!(source, Some(DataSource::Backup { .. })) {
        return Err(format!(
            "metadata.annotations[{BACKUP_DISK_ANNOTATION}] names a data disk of a backup, and spec.dataSourceRef \
             names no VirtualMachineBackup: remove the annotation, or fill the claim from a backup"
        ));
    }
    let copy = copy || matches!(source, Some(DataSource::Backup { .. }));
    Ok(Some(Wanted { node: node.clone(), pool: pool.clone(), format, capacity_bytes, source, copy, shared }))
}

/// The data disk of a backup that fills `claim` (its annotation
/// [`BACKUP_DISK_ANNOTATION`]): `None` without it (the boot disk). A value
/// that is no disk name ([`crate::v1alpha1::is_disk_name`]) is refused,
/// naming the annotation; whether the backup holds that disk is asked of
/// the backup's own status when the volume is made.
fn backup_disk(claim: &PersistentVolumeClaim) -> Result<Option<String>, Refusal> {
    match claim.annotations().get(BACKUP_DISK_ANNOTATION) {
        None => Ok(None),
        Some(disk) if crate::v1alpha1::is_disk_name(disk) => Ok(Some(disk.clone())),
        Some(disk) => Err(format!(
            "metadata.annotations[{BACKUP_DISK_ANNOTATION}] {disk:?} is no data disk's name (spec.disks[].name of \
             the backed-up VM: a DNS label of at most 20 characters): name one of the backup's status.dataDisks, or \
             remove the annotation to fill the claim from its boot disk"
        )),
    }
}

/// The volume name of `claim`: `<namespace>_<claim>_<uid>`, or
/// `<namespace>_<uid>` when that would be too long for a pool, with
/// `.qcow2` after it for a qcow2 volume (vmlet's rule for a file's format,
/// [`DiskFormat::of_image_path`], which a root disk's boot volume follows).
fn volume_name(namespace: &str, claim: &str, uid: &str, format: DiskFormat) -> String {
    let suffix = if format == DiskFormat::Qcow2 { ".qcow2" } else { "" };
    let full = format!("{namespace}_{claim}_{uid}{suffix}");
    if full.len() <= MAX_VOLUME_NAME_BYTES {
        full
    } else {
        format!("{namespace}_{uid}{suffix}")
    }
}

#[instrument(skip_all, fields(claim.namespace = claim.namespace().unwrap_or_default(), claim.name = %claim.name_any()))]
async fn provision(claim: Arc<PersistentVolumeClaim>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(class_name) = claim.spec.as_ref().and_then(|s| s.storage_class_name.clone()) else {
        return Ok(Action::await_change());
    };
    let namespace = claim.namespace().unwrap_or_default();
    let kube = kube_error(&claim);
    let classes: Api<StorageClass> = Api::all(ctx.client.clone());
    let Some(class) = classes.get_opt(&class_name).await.map_err(kube("read the StorageClass of"))? else {
        return Ok(Action::requeue(RETRY));
    };
    if !class.provisioner.ends_with(".vmlet.io") {
        return Ok(Action::await_change());
    }
    if let Some(pv_name) = claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()).filter(|v| !v.is_empty()) {
        return expansion::expand(&claim, &class, pv_name, &ctx).await;
    }
    let wanted = match wanted(&claim, &class) {
        Ok(Some(wanted)) => wanted,
        Ok(None) => return Ok(Action::await_change()),
        Err(refusal) => return Ok(refuse_if_ours(&claim, &ctx, &refusal)),
    };
    let Some(host) = ctx.hosts.get(&wanted.node) else { return Ok(Action::await_change()) };
    let provisioner = provisioner_name(host.provider.kind());
    if class.provisioner != provisioner {
        return Ok(Action::await_change());
    }
    let Some(volumes) = host.provider.volumes() else {
        let note = format!("host {} ({} back end) cannot make volumes", wanted.node, host.provider.kind());
        ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &note);
        return Ok(Action::requeue(RETRY));
    };
    let uid = claim.uid().unwrap_or_default();
    let pv_name = format!("pvc-{uid}");
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if pvs.get_opt(&pv_name).await.map_err(kube("look for the PersistentVolume of"))?.is_some() {
        return Ok(Action::await_change());
    }
    let base = match &wanted.source {
        None => None,
        Some(DataSource::Image(image)) => match image_base(&ctx.client, image, host.provider.kind()).await? {
            Ok(base) => {
                // Checked again when a VM attaches it; nothing is made on a
                // file outside the host's storage roots.
                let roots = &host.storage;
                if let Err(why) =
                    crate::storage::check_host_file(roots.roots(), roots.resolves_links(), &base.path).await
                {
                    let note = format!(
                        "spec.dataSourceRef: VirtualMachineImage {image}'s file {:?} {why}; host {} allows images only \
                         under its storage roots {roots}: ask an administrator to fix the image",
                        base.path, wanted.node
                    );
                    ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &note);
                    return Ok(Action::requeue(RETRY));
                }
                Some(base)
            }
            Err(refusal) => {
                ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &refusal);
                return Ok(Action::requeue(RETRY));
            }
        },
        Some(DataSource::Backup { backup, disk }) => {
            let found = super::tasks::locate_backup(
                &ctx.client,
                &namespace,
                backup,
                &wanted.node,
                &host.backup_roots,
                host.storage.resolves_links(),
            )
            .await
            .map_err(kube("read the VirtualMachineBackup of"))?;
            match found.and_then(|files| files.file_of(backup, disk.as_deref()).map(str::to_owned)) {
                // Written by vmlet (QEMU's backup job or qemu-img): its
                // format, and an incremental one's backing chain, are vmlet's.
                Ok(path) => Some(vmlet_provider::BackingFile { path, format: DiskFormat::Qcow2 }),
                Err(refusal) => {
                    let note = format!("spec.dataSourceRef: {refusal}");
                    ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &note);
                    return Ok(Action::requeue(RETRY));
                }
            }
        }
    };
    let request = VolumeRequest {
        pool: wanted.pool.clone(),
        name: volume_name(&namespace, &claim.name_any(), &uid, wanted.format),
        capacity_bytes: wanted.capacity_bytes,
        format: wanted.format,
        source: match base.clone() {
            None => VolumeSource::Empty,
            Some(image) if wanted.copy => VolumeSource::Copy(image),
            Some(image) => VolumeSource::Overlay(image),
        },
    };
    let volume = match volumes.create_volume(&request).await {
        Ok(volume) => volume,
        Err(e) if e.kind == vmlet_provider::ErrorKind::Transient => {
            // Tried again with backoff; the claim's Events say why it waits.
            ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &e.to_string());
            return Err(e.into());
        }
        Err(e) => {
            ctx.events.publish(claim.as_ref(), Reason::ProvisioningFailed, &e.to_string());
            return Ok(Action::requeue(RETRY));
        }
    };
    let backing = request.source.backing();
    let pv = persistent_volume(&claim, &class, &provisioner, &wanted, &volume.name, volume.capacity_bytes, backing);
    match pvs.create(&PostParams::default(), &pv).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(kube("create the PersistentVolume of")(e)),
    }
    info!(node = %wanted.node, pool = %volume.pool, volume = %volume.name, bytes = volume.capacity_bytes, pv = %pv_name, "volume provisioned");
    let note =
        format!("made volume {} in pool {} on {} as PersistentVolume {pv_name}", volume.name, volume.pool, wanted.node);
    ctx.events.publish(claim.as_ref(), Reason::ProvisioningSucceeded, &note);
    Ok(Action::await_change())
}

/// The file of `VirtualMachineImage` `name` on hosts of back-end kind
/// `kind`, as a claim's volume's backing file, its format by vmlet's rule
/// ([`DiskFormat::of_image_path`]). `Ok(Err)`: why it cannot be (for a
/// Warning Event). Whether the file may be used (under the host's storage
/// roots, its own chain) is the node agent's check when it attaches it.
async fn image_base(
    client: &Client,
    name: &str,
    kind: &str,
) -> Result<Result<vmlet_provider::BackingFile, Refusal>, Error> {
    let images: Api<crate::v1alpha1::VirtualMachineImage> = Api::all(client.clone());
    let entry = images.get_opt(name).await.map_err(|source| Error::Kube {
        action: "read the VirtualMachineImage",
        object: name.to_owned(),
        source,
    })?;
    let Some(entry) = entry else {
        return Ok(Err(format!("spec.dataSourceRef: no VirtualMachineImage {name}; an administrator creates it")));
    };
    Ok(match entry.spec.for_backend(kind) {
        Some((path, _)) => {
            Ok(vmlet_provider::BackingFile { path: path.to_owned(), format: DiskFormat::of_image_path(path) })
        }
        None => Err(format!("spec.dataSourceRef: VirtualMachineImage {name} names no image for {kind} hosts")),
    })
}

/// A maker of [`Error::Kube`] for requests about `claim`: given what was
/// being done, it turns an API error into the pass's error.
fn kube_error(claim: &PersistentVolumeClaim) -> impl Fn(&'static str) -> Box<dyn FnOnce(kube::Error) -> Error> {
    let object = format!("{}/{}", claim.namespace().unwrap_or_default(), claim.name_any());
    move |action| {
        let object = object.clone();
        Box::new(move |source| Error::Kube { action, object, source })
    }
}

/// Publish `refusal` on `claim`, a claim of one of vmlet's classes, unless
/// another process serves the node picked for it.
fn refuse_if_ours(claim: &PersistentVolumeClaim, ctx: &Context, refusal: &str) -> Action {
    // One process reports: the one serving the picked node, or any when
    // none is picked yet (an Immediate class).
    let node = claim.annotations().get(SELECTED_NODE);
    if node.is_some_and(|node| ctx.hosts.get(node).is_none()) {
        return Action::await_change();
    }
    warn!(refusal, "claim not provisioned");
    ctx.events.publish(claim, Reason::ProvisioningFailed, refusal);
    Action::requeue(RETRY)
}

/// The PersistentVolume of `claim` for the volume `volume` that `wanted`
/// asked for, of `capacity_bytes`.
fn persistent_volume(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    provisioner: &str,
    wanted: &Wanted,
    volume: &str,
    capacity_bytes: u64,
    base: Option<&vmlet_provider::BackingFile>,
) -> PersistentVolume {
    let (node, pool) = (wanted.node.as_str(), wanted.pool.as_str());
    let spec = claim.spec.clone().unwrap_or_default();
    let reclaim = class.reclaim_policy.clone().unwrap_or_else(|| "Delete".to_owned());
    let finalizers = (reclaim == "Delete").then(|| vec![FINALIZER.to_owned()]);
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(format!("pvc-{}", claim.uid().unwrap_or_default())),
            annotations: Some(BTreeMap::from([(PROVISIONED_BY.to_owned(), provisioner.to_owned())])),
            finalizers,
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_owned(), Quantity(capacity_bytes.to_string()))])),
            access_modes: spec.access_modes.clone().or_else(|| Some(vec!["ReadWriteOnce".to_owned()])),
            volume_mode: spec.volume_mode.clone(),
            storage_class_name: Some(class.name_any()),
            persistent_volume_reclaim_policy: Some(reclaim),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("PersistentVolumeClaim".to_owned()),
                namespace: claim.namespace(),
                name: Some(claim.name_any()),
                uid: claim.uid(),
                ..ObjectReference::default()
            }),
            csi: Some(CSIPersistentVolumeSource {
                driver: provisioner.to_owned(),
                volume_handle: format!("{node}/{pool}/{volume}"),
                volume_attributes: Some({
                    let mut attributes =
                        BTreeMap::from([(FORMAT_ATTRIBUTE.to_owned(), wanted.format.as_str().to_owned())]);
                    if let Some(base) = base {
                        attributes.insert(BACKING_FILE_ATTRIBUTE.to_owned(), base.path.clone());
                        attributes.insert(BACKING_FORMAT_ATTRIBUTE.to_owned(), base.format.as_str().to_owned());
                    }
                    if wanted.shared {
                        attributes.insert(SHARED_ATTRIBUTE.to_owned(), "true".to_owned());
                    }
                    attributes
                }),
                ..CSIPersistentVolumeSource::default()
            }),
            node_affinity: node_affinity(class, wanted),
            ..PersistentVolumeSpec::default()
        }),
        status: None,
    }
}

/// Where a PersistentVolume of `class` for `wanted` may be used: the one
/// host that made it; for a shared pool, the nodes of the class's
/// `allowedTopologies` (each term's label values, as the scheduler reads
/// them for provisioning), or any node when it has none.
fn node_affinity(class: &StorageClass, wanted: &Wanted) -> Option<VolumeNodeAffinity> {
    let requirement = |key: &str, values: Vec<String>| NodeSelectorRequirement {
        key: key.to_owned(),
        operator: "In".to_owned(),
        values: Some(values),
    };
    let terms: Vec<NodeSelectorTerm> = if wanted.shared {
        let topologies = class.allowed_topologies.as_deref().unwrap_or_default();
        topologies
            .iter()
            .map(|term| NodeSelectorTerm {
                match_expressions: Some(
                    term.match_label_expressions
                        .iter()
                        .flatten()
                        .map(|expression| requirement(&expression.key, expression.values.clone()))
                        .collect(),
                ),
                ..NodeSelectorTerm::default()
            })
            .collect()
    } else {
        vec![NodeSelectorTerm {
            match_expressions: Some(vec![requirement("kubernetes.io/hostname", vec![wanted.node.clone()])]),
            ..NodeSelectorTerm::default()
        }]
    };
    (!terms.is_empty()).then_some(VolumeNodeAffinity { required: Some(NodeSelector { node_selector_terms: terms }) })
}

/// The node, pool and volume of a PersistentVolume's CSI `volumeHandle`
/// (`<node>/<pool>/<volume>`); `None` for any other shape.
pub fn parse_handle(handle: &str) -> Option<(&str, &str, &str)> {
    let mut parts = handle.splitn(3, '/');
    let (node, pool, volume) = (parts.next()?, parts.next()?, parts.next()?);
    (![node, pool, volume].iter().any(|p| p.is_empty()) && !volume.contains('/')).then_some((node, pool, volume))
}

#[instrument(skip_all, fields(pv = %pv.name_any()))]
async fn reclaim(pv: Arc<PersistentVolume>, ctx: Arc<Context>) -> Result<Action, Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()) else { return Ok(Action::await_change()) };
    let Some((node, pool, volume)) = parse_handle(&csi.volume_handle) else { return Ok(Action::await_change()) };
    let Some(host) = ctx.hosts.get(node) else { return Ok(Action::await_change()) };
    let provisioner = provisioner_name(host.provider.kind());
    let ours = pv.annotations().get(PROVISIONED_BY) == Some(&provisioner) && csi.driver == provisioner;
    if !ours || !pv.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let name = pv.name_any();
    let kube = |action| {
        let object = name.clone();
        move |source| Error::Kube { action, object, source }
    };
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    let released = matches!(phase, Some("Released" | "Failed" | "Available"));
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if pv.metadata.deletion_timestamp.is_none() {
        if released {
            pvs.delete(&name, &DeleteParams::default()).await.map_err(kube("delete the released PersistentVolume"))?;
        }
        return Ok(Action::await_change());
    }
    if !released {
        // Deleted while bound: pv-protection holds it; the volume stays.
        return Ok(Action::await_change());
    }
    if let Some(volumes) = host.provider.volumes() {
        volumes.delete_volume(pool, volume).await?;
        info!(node, pool, volume, "volume deleted");
    }
    let finalizers: Vec<&String> = pv.finalizers().iter().filter(|f| *f != FINALIZER).collect();
    let patch = serde_json::json!({"metadata": {"resourceVersion": pv.resource_version(), "finalizers": finalizers}});
    pvs.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(kube("remove the finalizer of"))?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(json: serde_json::Value) -> StorageClass {
        let mut base = serde_json::json!({"metadata": {"name": "vmlet-local"}, "provisioner": "libvirt.vmlet.io",
            "volumeBindingMode": "WaitForFirstConsumer", "parameters": {"pool": "vms"}});
        merge(&mut base, json);
        serde_json::from_value(base).unwrap()
    }

    fn claim(json: serde_json::Value) -> PersistentVolumeClaim {
        let mut base = serde_json::json!({
            "metadata": {"name": "data", "namespace": "team-a", "uid": "0f8e1c2a-7b3d-4e5f-9a6b-1c2d3e4f5a6b",
                         "annotations": {SELECTED_NODE: "host-a"}},
            "spec": {"storageClassName": "vmlet-local", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}}});
        merge(&mut base, json);
        serde_json::from_value(base).unwrap()
    }

    fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
        match (base, patch) {
            (serde_json::Value::Object(base), serde_json::Value::Object(patch)) => {
                for (key, value) in patch {
                    merge(base.entry(key).or_insert(serde_json::Value::Null), value);
                }
            }
            (base, patch) => *base = patch,
        }
    }

    #[test]
    fn a_claim_with_a_picked_node_wants_its_size_in_the_class_pool_and_format() {
        let wanted = wanted(&claim(serde_json::json!({})), &class(serde_json::json!({}))).unwrap();
        assert_eq!(
            wanted,
            Some(Wanted {
                node: "host-a".into(),
                pool: "vms".into(),
                format: DiskFormat::Raw,
                capacity_bytes: 1 << 30,
                source: None,
                copy: false,
                shared: false,
            })
        );
        let qcow2 = class(serde_json::json!({"parameters": {"format": "qcow2"}}));
        assert_eq!(wanted_format(&qcow2), DiskFormat::Qcow2);
    }

    fn wanted_format(class: &StorageClass) -> DiskFormat {
        wanted(&claim(serde_json::json!({})), class).unwrap().unwrap().format
    }

    #[test]
    fn a_bound_claim_or_one_without_a_picked_node_waits_quietly() {
        let bound = claim(serde_json::json!({"spec": {"volumeName": "pvc-x"}}));
        assert_eq!(wanted(&bound, &class(serde_json::json!({}))), Ok(None));
        let unpicked = claim(serde_json::json!({"metadata": {"annotations": null}}));
        assert_eq!(wanted(&unpicked, &class(serde_json::json!({}))), Ok(None));
    }

    #[test]
    fn refusals_name_the_field_and_the_fix() {
        let immediate = class(serde_json::json!({"volumeBindingMode": "Immediate"}));
        assert!(wanted(&claim(serde_json::json!({})), &immediate)
            .unwrap_err()
            .ends_with("set volumeBindingMode: WaitForFirstConsumer"));
        let no_pool = class(serde_json::json!({"parameters": {"pool": ""}}));
        assert!(wanted(&claim(serde_json::json!({})), &no_pool).unwrap_err().contains("set parameters.pool"));
        let vmdk = class(serde_json::json!({"parameters": {"format": "vmdk"}}));
        assert_eq!(
            wanted(&claim(serde_json::json!({})), &vmdk).unwrap_err(),
            "StorageClass vmlet-local: parameters.format \"vmdk\": use raw or qcow2"
        );
        let shared = claim(serde_json::json!({"spec": {"accessModes": ["ReadWriteMany"]}}));
        assert_eq!(
            wanted(&shared, &class(serde_json::json!({}))).unwrap_err(),
            "spec.accessModes ReadWriteMany: a volume in pool vms lives on one host (StorageClass vmlet-local does \
             not say shared: \"true\"); ask for ReadWriteOnce"
        );
        let typo = class(serde_json::json!({"parameters": {"poool": "x"}}));
        assert!(wanted(&claim(serde_json::json!({})), &typo).unwrap_err().contains("unknown parameter \"poool\""));
    }

    #[test]
    fn the_persistent_volume_is_pre_bound_pinned_to_the_host_and_names_the_volume() {
        let claim = claim(serde_json::json!({}));
        let wanted = Wanted {
            node: "host-a".into(),
            pool: "vms".into(),
            format: DiskFormat::Qcow2,
            capacity_bytes: 1 << 30,
            source: None,
            copy: false,
            shared: false,
        };
        let pv =
            persistent_volume(&claim, &class(serde_json::json!({})), "libvirt.vmlet.io", &wanted, "v1", 1 << 30, None);
        let json = serde_json::to_value(&pv).unwrap();
        assert_eq!(json["metadata"]["name"], "pvc-0f8e1c2a-7b3d-4e5f-9a6b-1c2d3e4f5a6b");
        assert_eq!(json["metadata"]["finalizers"], serde_json::json!([FINALIZER]));
        assert_eq!(json["spec"]["claimRef"]["uid"], "0f8e1c2a-7b3d-4e5f-9a6b-1c2d3e4f5a6b");
        assert_eq!(
            json["spec"]["csi"],
            serde_json::json!({"driver": "libvirt.vmlet.io", "volumeHandle": "host-a/vms/v1",
                               "volumeAttributes": {"format": "qcow2"}})
        );
        assert_eq!(json["spec"]["capacity"]["storage"], "1073741824");
        assert_eq!(json["spec"]["persistentVolumeReclaimPolicy"], "Delete");
        assert_eq!(
            json["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"],
            serde_json::json!(["host-a"])
        );
        let retain_class = class(serde_json::json!({"reclaimPolicy": "Retain"}));
        let retain = persistent_volume(&claim, &retain_class, "libvirt.vmlet.io", &wanted, "v1", 1, None);
        assert_eq!(retain.metadata.finalizers, None, "Retain keeps the volume: no finalizer");
    }

    #[test]
    fn a_shared_class_allows_read_write_many_and_ties_its_volumes_to_its_topologies_only() {
        let rwx = claim(serde_json::json!({"spec": {"accessModes": ["ReadWriteMany"]}}));
        let local = class(serde_json::json!({}));
        let refusal = wanted(&rwx, &local).unwrap_err();
        assert!(
            refusal.starts_with("spec.accessModes ReadWriteMany: a volume in pool vms lives on one host"),
            "{refusal}"
        );
        let shared = class(serde_json::json!({"parameters": {"shared": "true"}}));
        let wanted_shared = wanted(&rwx, &shared).unwrap().unwrap();
        assert!(wanted_shared.shared);
        let rox = claim(serde_json::json!({"spec": {"accessModes": ["ReadOnlyMany"]}}));
        assert!(wanted(&rox, &shared).unwrap_err().contains("ask for ReadWriteOnce or ReadWriteMany"));
        let typo = class(serde_json::json!({"parameters": {"shared": "yes"}}));
        assert!(wanted(&rwx, &typo).unwrap_err().contains("parameters.shared \"yes\": use \"true\" or \"false\""));

        // No topologies: any node; else the class's, as node selector terms.
        let pv = persistent_volume(&rwx, &shared, "libvirt.vmlet.io", &wanted_shared, "v1", 1, None);
        let json = serde_json::to_value(&pv).unwrap();
        assert_eq!(json["spec"]["nodeAffinity"], serde_json::Value::Null);
        assert_eq!(json["spec"]["accessModes"], serde_json::json!(["ReadWriteMany"]));
        assert_eq!(json["spec"]["csi"]["volumeAttributes"][SHARED_ATTRIBUTE], "true");
        assert_eq!(json["spec"]["csi"]["volumeHandle"], "host-a/vms/v1", "the handle names the host that made it");
        let topologies = class(serde_json::json!({"parameters": {"shared": "true"}, "allowedTopologies": [
            {"matchLabelExpressions": [{"key": "kubernetes.io/hostname", "values": ["mig-a", "mig-b"]}]}]}));
        let pv = persistent_volume(&rwx, &topologies, "libvirt.vmlet.io", &wanted_shared, "v1", 1, None);
        assert_eq!(
            serde_json::to_value(&pv).unwrap()["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"],
            serde_json::json!([{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["mig-a", "mig-b"]}]}])
        );
    }

    #[test]
    fn a_shared_volume_grows_only_where_the_back_end_grows_it_through_any_host() {
        let rwo = claim(serde_json::json!({}));
        let shared = class(serde_json::json!({"parameters": {"shared": "true"}}));
        let wanted_shared = wanted(&rwo, &shared).unwrap().unwrap();
        let pv = persistent_volume(&rwo, &shared, "openstack.vmlet.io", &wanted_shared, "v1", 1 << 30, None);
        let grown = claim(serde_json::json!({"spec": {"resources": {"requests": {"storage": "2Gi"}}}}));
        let refusal = expansion::growth(&grown, &pv, "openstack.vmlet.io", false).unwrap_err();
        assert!(refusal.contains("a pool that several hosts share"), "{refusal}");
        let growth = expansion::growth(&grown, &pv, "openstack.vmlet.io", true).unwrap().unwrap();
        assert_eq!((growth.volume.as_str(), growth.requested_bytes, growth.current_bytes), ("v1", 2 << 30, 1 << 30));
    }

    #[test]
    fn volume_names_are_the_claims_and_handles_parse_back() {
        assert_eq!(volume_name("team-a", "data", "u-1", DiskFormat::Raw), "team-a_data_u-1");
        assert_eq!(volume_name("team-a", "data", "u-1", DiskFormat::Qcow2), "team-a_data_u-1.qcow2");
        assert_eq!(volume_name("team-a", &"c".repeat(253), "u-1", DiskFormat::Raw), "team-a_u-1");
        assert_eq!(parse_handle("host-a/vms/team-a_data_u-1"), Some(("host-a", "vms", "team-a_data_u-1")));
        for bad in ["host-a/vms", "host-a//v", "/vms/v", "host-a/vms/a/b", ""] {
            assert_eq!(parse_handle(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_bound_claim_asking_for_more_grows_its_own_volume_in_the_stated_format() {
        let wanted = Wanted {
            node: "host-a".into(),
            pool: "vms".into(),
            format: DiskFormat::Qcow2,
            capacity_bytes: 1 << 30,
            source: None,
            copy: false,
            shared: false,
        };
        let small = claim(serde_json::json!({}));
        let pv =
            persistent_volume(&small, &class(serde_json::json!({})), "libvirt.vmlet.io", &wanted, "v1", 1 << 30, None);
        let grown = claim(serde_json::json!({"spec": {"resources": {"requests": {"storage": "2Gi"}}}}));
        assert_eq!(
            expansion::growth(&grown, &pv, "libvirt.vmlet.io", false),
            Ok(Some(expansion::Growth {
                node: "host-a".into(),
                pool: "vms".into(),
                volume: "v1".into(),
                format: DiskFormat::Qcow2,
                requested_bytes: 2 << 30,
                current_bytes: 1 << 30,
            }))
        );
        assert_eq!(expansion::growth(&small, &pv, "libvirt.vmlet.io", false), Ok(None), "the request fits");
        assert_eq!(expansion::growth(&grown, &pv, "nova.vmlet.io", false), Ok(None), "another provisioner's volume");
        let other = claim(serde_json::json!({"metadata": {"uid": "11111111-2222-3333-4444-555555555555"},
                                              "spec": {"resources": {"requests": {"storage": "2Gi"}}}}));
        assert_eq!(expansion::growth(&other, &pv, "libvirt.vmlet.io", false), Ok(None), "bound to another claim");
        let mut unstated = pv.clone();
        unstated.spec.as_mut().unwrap().csi.as_mut().unwrap().volume_attributes = None;
        assert_eq!(
            expansion::growth(&grown, &unstated, "libvirt.vmlet.io", false).unwrap_err(),
            format!(
                "PersistentVolume {} states no format (csi.volumeAttributes.format) to grow its volume in",
                pv.name_any()
            )
        );
    }

    #[test]
    fn a_claim_from_a_catalogue_image_wants_a_qcow2_overlay_and_nothing_else_fills_claims() {
        let from = |kind: &str, group: &str| {
            claim(
                serde_json::json!({"spec": {"dataSourceRef": {"apiGroup": group, "kind": kind, "name": "debian-12"}}}),
            )
        };
        let qcow2 = class(serde_json::json!({"parameters": {"format": "qcow2"}}));
        let wanted_image = wanted(&from("VirtualMachineImage", "vmlet.io"), &qcow2).unwrap().unwrap().source;
        assert_eq!(wanted_image, Some(DataSource::Image("debian-12".into())));
        let raw = wanted(&from("VirtualMachineImage", "vmlet.io"), &class(serde_json::json!({}))).unwrap_err();
        assert!(raw.ends_with("use a class with parameters.format: qcow2, or one with parameters.fromImage: copy"));
        let copy = class(serde_json::json!({"parameters": {"fromImage": "copy"}}));
        let wanted_copy = wanted(&from("VirtualMachineImage", "vmlet.io"), &copy).unwrap().unwrap();
        assert!(wanted_copy.copy && wanted_copy.format == DiskFormat::Raw, "a full copy may be raw");
        let typo = class(serde_json::json!({"parameters": {"fromImage": "clone"}}));
        let refusal = wanted(&from("VirtualMachineImage", "vmlet.io"), &typo).unwrap_err();
        assert_eq!(refusal, "StorageClass vmlet-local: parameters.fromImage \"clone\": use overlay or copy");
        let snapshot = wanted(&from("VolumeSnapshot", "snapshot.storage.k8s.io"), &qcow2).unwrap_err();
        assert_eq!(
            snapshot,
            "spec.dataSourceRef names VolumeSnapshot debian-12: vmlet fills claims from VirtualMachineImages and \
             VirtualMachineBackups (apiGroup vmlet.io) only"
        );
        let pv = persistent_volume(
            &from("VirtualMachineImage", "vmlet.io"),
            &qcow2,
            "libvirt.vmlet.io",
            &wanted(&from("VirtualMachineImage", "vmlet.io"), &qcow2).unwrap().unwrap(),
            "v1",
            1 << 30,
            Some(&vmlet_provider::BackingFile { path: "/images/debian-12.raw".into(), format: DiskFormat::Raw }),
        );
        let attributes = pv.spec.unwrap().csi.unwrap().volume_attributes.unwrap();
        assert_eq!(attributes.get(BACKING_FILE_ATTRIBUTE).map(String::as_str), Some("/images/debian-12.raw"));
        assert_eq!(attributes.get(BACKING_FORMAT_ATTRIBUTE).map(String::as_str), Some("raw"));
    }

    #[test]
    fn a_claim_from_a_backup_of_its_own_namespace_wants_a_full_copy_in_any_format() {
        let from = |source: serde_json::Value| claim(serde_json::json!({"spec": {"dataSourceRef": source}}));
        let backup = serde_json::json!({"apiGroup": "vmlet.io", "kind": "VirtualMachineBackup", "name": "nightly"});
        for parameters in [serde_json::json!({}), serde_json::json!({"format": "qcow2"})] {
            let wanted = wanted(&from(backup.clone()), &class(serde_json::json!({"parameters": parameters}))).unwrap();
            let wanted = wanted.unwrap();
            assert_eq!(wanted.source, Some(DataSource::Backup { backup: "nightly".into(), disk: None }));
            assert!(wanted.copy, "a restored disk never leans on the backup file: {parameters}");
        }
        let mut own = backup.clone();
        own["namespace"] = "team-a".into();
        assert!(wanted(&from(own), &class(serde_json::json!({}))).is_ok());
        let mut other = backup;
        other["namespace"] = "team-b".into();
        assert_eq!(
            wanted(&from(other), &class(serde_json::json!({}))).unwrap_err(),
            "spec.dataSourceRef.namespace team-b: a claim is filled only from a VirtualMachineBackup of its own \
             namespace; leave the namespace out"
        );
        let unknown = serde_json::json!({"apiGroup": "vmlet.io", "kind": "VirtualMachine", "name": "web"});
        assert_eq!(
            wanted(&from(unknown), &class(serde_json::json!({}))).unwrap_err(),
            "spec.dataSourceRef names VirtualMachine web: vmlet fills claims from VirtualMachineImages and \
             VirtualMachineBackups only"
        );
    }

    #[test]
    fn a_claim_names_the_backups_data_disk_that_fills_it_by_annotation_and_nothing_else() {
        let backup = serde_json::json!({"apiGroup": "vmlet.io", "kind": "VirtualMachineBackup", "name": "nightly"});
        let annotated = |disk: &str| {
            claim(serde_json::json!({"metadata": {"annotations": {BACKUP_DISK_ANNOTATION: disk}},
                                     "spec": {"dataSourceRef": backup.clone()}}))
        };
        let source = wanted(&annotated("data"), &class(serde_json::json!({}))).unwrap().unwrap().source;
        assert_eq!(source, Some(DataSource::Backup { backup: "nightly".into(), disk: Some("data".into()) }));
        for hostile in
            ["../../team-b_nightly_u-1", "data/../../x", "..", "data.qcow2", "", "Data", "d".repeat(21).as_str()]
        {
            let refusal = wanted(&annotated(hostile), &class(serde_json::json!({}))).unwrap_err();
            assert!(
                refusal.starts_with(&format!(
                    "metadata.annotations[vmlet.io/backup-disk] {hostile:?} is no data disk's name"
                )),
                "{hostile:?}: {refusal}"
            );
        }
        let without_backup = claim(serde_json::json!({"metadata": {"annotations": {BACKUP_DISK_ANNOTATION: "data"}}}));
        let refusal = wanted(&without_backup, &class(serde_json::json!({}))).unwrap_err();
        assert!(
            refusal.contains("spec.dataSourceRef names no VirtualMachineBackup: remove the annotation"),
            "{refusal}"
        );
    }
}
