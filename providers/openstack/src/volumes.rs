//! Cinder volumes as vmlet's [`Volumes`]: what the dynamic provisioner
//! (`openstack.vmlet.io`) makes for a PersistentVolumeClaim on a Nova node,
//! through the block-storage API v3
//! (<https://docs.openstack.org/api-ref/block-storage/v3/>).
//!
//! - A **pool** is a Cinder volume type (`GET /types`; `__DEFAULT__` is
//!   every cloud's default), named by the StorageClass's `pool` parameter.
//! - A volume is found by its **name** (`GET /volumes/detail?name=`), which
//!   the provisioner derives from the claim's UID, and must carry the
//!   metadata [`VOLUME_KEY`] = its name: vmlet never adopts, resizes or
//!   deletes a volume it did not make, whatever its name.
//! - Sizes are whole GiB (Cinder's unit): a request is rounded up.
//! - Volumes are block devices, attached **raw**: a class asking for
//!   `qcow2` is refused, and so is a volume filled from a host file (a
//!   catalogue image file or a backup file), which Cinder cannot read.
//! - [`Volume::path`] is the volume's id, which [`crate::OpenStackProvider`]
//!   attaches to the server (`block_device_mapping_v2`, or
//!   `os-volume_attachments` for a server that exists already).
//!
//! Every call is idempotent: a create that finds the volume returns it, a
//! delete of a missing volume succeeds, a resize to the current size
//! changes nothing. Each waits for Cinder to settle the volume (`creating`,
//! `extending`, `deleting`) up to [`crate::CloudOptions::task_timeout`].

use std::collections::BTreeMap;
use std::time::Instant;

use reqwest::Method;
use serde::Deserialize;
use serde_json::json;
use vmlet_provider::{
    validate_volume_name, DiskFormat, Error, ErrorKind, Result, Volume, VolumeRequest, VolumeSource, Volumes,
};

use crate::provider::OpenStackProvider;
use crate::session::{Call, Cloud, Service};

/// One GiB in bytes: Cinder's unit of volume size.
const GIB: u64 = 1 << 30;
/// The metadata key vmlet sets on every volume it makes, to the volume's
/// name: the mark without which vmlet touches no volume.
pub(crate) const VOLUME_KEY: &str = "vmlet.io.volume";

/// A volume as `GET /volumes/detail` and `GET /volumes/{id}` show it.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CinderVolume {
    pub(crate) id: String,
    #[serde(default)]
    pub(crate) name: Option<String>,
    /// creating, available, in-use, extending, deleting, error, ...
    pub(crate) status: String,
    /// GiB.
    pub(crate) size: u64,
    /// The volume type's name.
    #[serde(default)]
    pub(crate) volume_type: Option<String>,
    #[serde(default)]
    pub(crate) metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub(crate) attachments: Vec<VolumeAttachment>,
}

/// One attachment of a volume.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct VolumeAttachment {
    pub(crate) server_id: String,
}

impl CinderVolume {
    /// vmlet made it, under this name.
    fn is_vmlets(&self, name: &str) -> bool {
        self.metadata.get(VOLUME_KEY).map(String::as_str) == Some(name) && self.name.as_deref() == Some(name)
    }

    fn settled(&self) -> bool {
        matches!(self.status.as_str(), "available" | "in-use")
    }

    fn as_volume(&self, pool: &str) -> Volume {
        let bytes = self.size.saturating_mul(GIB);
        Volume {
            pool: pool.to_owned(),
            name: self.name.clone().unwrap_or_default(),
            path: self.id.clone(),
            capacity_bytes: bytes,
            // Cinder reports no allocation: a volume of its backends takes
            // its whole size, as far as its API tells.
            allocation_bytes: bytes,
            format: Some(DiskFormat::Raw),
        }
    }
}

/// `bytes` in whole GiB, rounded up (at least 1).
fn gib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(GIB).max(1)
}

impl Cloud {
    /// The volume `id`, or `None` when Cinder has none of that id.
    pub(crate) async fn cinder_volume(&self, operation: &'static str, id: &str) -> Result<Option<CinderVolume>> {
        #[derive(Deserialize)]
        struct One {
            volume: CinderVolume,
        }
        let call = Call::new(Service::BlockStorage, Method::GET, format!("/volumes/{id}"));
        match self.json::<One>(operation, &call).await {
            Ok(one) => Ok(Some(one.volume)),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The volume vmlet made under `name`, if any. Errors: `Conflict` when
    /// several volumes of vmlet bear that name.
    async fn vmlet_volume(&self, operation: &'static str, name: &str) -> Result<Option<CinderVolume>> {
        #[derive(Deserialize)]
        struct Listing {
            volumes: Vec<CinderVolume>,
        }
        let call = Call::new(Service::BlockStorage, Method::GET, "/volumes/detail").query("name", name);
        let listing: Listing = self.json(operation, &call).await?;
        let mut ours = listing.volumes.into_iter().filter(|v| v.is_vmlets(name));
        let first = ours.next();
        if let Some(second) = ours.next() {
            return Err(Error::new(
                operation,
                ErrorKind::Conflict,
                format!(
                    "Cinder holds several volumes named {name} with vmlet's mark ({} and {}); vmlet touches none of \
                     them until an operator deletes the extra one",
                    first.map(|v| v.id).unwrap_or_default(),
                    second.id
                ),
            ));
        }
        Ok(first)
    }

    /// Fail unless `pool` is a volume type of the cloud. Errors: `NotFound`
    /// naming the pool and the types there are.
    async fn check_volume_type(&self, operation: &'static str, pool: &str) -> Result<()> {
        #[derive(Deserialize)]
        struct Types {
            volume_types: Vec<Type>,
        }
        #[derive(Deserialize)]
        struct Type {
            name: String,
        }
        let types: Types = self.json(operation, &Call::new(Service::BlockStorage, Method::GET, "/types")).await?;
        if types.volume_types.iter().any(|t| t.name == pool) {
            return Ok(());
        }
        let names: Vec<_> = types.volume_types.into_iter().map(|t| t.name).collect();
        Err(Error::new(
            operation,
            ErrorKind::NotFound,
            format!(
                "pool {pool:?}: Cinder has no volume type of that name (it has: {}); set the StorageClass's \
                 parameters.pool to one of them",
                names.join(", ")
            ),
        ))
    }

    /// Wait until volume `id` is `in-use` by server `server`. Errors: as
    /// [`Cloud::wait_volume`]'s.
    pub(crate) async fn wait_attached(&self, operation: &'static str, id: &str, server: &str) -> Result<()> {
        let attached = |v: &CinderVolume| v.status == "in-use" && v.attachments.iter().any(|a| a.server_id == server);
        self.wait_volume(operation, id, "being attached", false, attached).await.map(drop)
    }

    /// Poll volume `id` until `done` holds. Errors: `Permanent` when Cinder
    /// puts it in an `error*` state, `NotFound` when it goes (unless
    /// `gone_ok`), `Transient` after [`crate::CloudOptions::task_timeout`].
    async fn wait_volume(
        &self,
        operation: &'static str,
        id: &str,
        what: &str,
        gone_ok: bool,
        done: impl Fn(&CinderVolume) -> bool,
    ) -> Result<Option<CinderVolume>> {
        let deadline = Instant::now() + self.options.task_timeout;
        loop {
            let volume = self.cinder_volume(operation, id).await?;
            match &volume {
                None if gone_ok => return Ok(None),
                None => {
                    return Err(Error::new(operation, ErrorKind::NotFound, format!("Cinder volume {id} went away")))
                }
                Some(v) if done(v) => return Ok(volume),
                Some(v) if v.status.starts_with("error") => {
                    return Err(Error::new(
                        operation,
                        ErrorKind::Permanent,
                        format!("Cinder volume {id} is in status {} while {what}; see cinder-volume's log", v.status),
                    ))
                }
                Some(v) if Instant::now() >= deadline => {
                    return Err(Error::new(
                        operation,
                        ErrorKind::Transient,
                        format!(
                            "Cinder volume {id} still in status {} after {} s while {what}",
                            v.status,
                            self.options.task_timeout.as_secs()
                        ),
                    ))
                }
                Some(_) => tokio::time::sleep(self.options.poll_interval).await,
            }
        }
    }
}

#[async_trait::async_trait]
impl Volumes for OpenStackProvider {
    /// `POST /volumes` of `ceil(capacity / GiB)` GiB in volume type
    /// `request.pool`, named `request.name` with the metadata
    /// [`VOLUME_KEY`], then waits until it is `available`. A volume of vmlet
    /// by that name is returned as it is when it is as large as asked.
    ///
    /// Errors: `InvalidInput` for a format other than raw; `Unsupported` for
    /// a volume filled from a host file; `NotFound` for an unknown volume
    /// type; `Conflict` for an existing volume of another type or smaller
    /// size; `Permanent` when Cinder puts the volume in `error` (it is
    /// deleted, so that the next call makes it anew); `Unsupported` when the
    /// catalog has no block-storage endpoint.
    async fn create_volume(&self, request: &VolumeRequest) -> Result<Volume> {
        const OP: &str = "create volume";
        validate_volume_name(OP, &request.name)?;
        if request.format != DiskFormat::Raw {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "parameters.format {}: Cinder volumes are block devices that Nova attaches raw; remove format \
                     from the StorageClass (or set it to raw)",
                    request.format
                ),
            ));
        }
        if request.source != VolumeSource::Empty {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                "the claim's dataSourceRef names a host file (a VirtualMachineImage file or a backup), which Cinder \
                 cannot read; on a Nova node a claim starts empty",
            ));
        }
        let size = gib_ceil(request.capacity_bytes);
        if let Some(found) = self.cloud.vmlet_volume(OP, &request.name).await? {
            if found.volume_type.as_deref().is_some_and(|t| t != request.pool) || found.size < size {
                return Err(Error::new(
                    OP,
                    ErrorKind::Conflict,
                    format!(
                        "Cinder volume {} ({}) is {} GiB of type {}, not {size} GiB of type {}",
                        request.name,
                        found.id,
                        found.size,
                        found.volume_type.as_deref().unwrap_or("(none)"),
                        request.pool
                    ),
                ));
            }
            let settled = self.cloud.wait_volume(OP, &found.id, "being created", false, CinderVolume::settled).await?;
            return Ok(settled.unwrap_or(found).as_volume(&request.pool));
        }
        self.cloud.check_volume_type(OP, &request.pool).await?;
        #[derive(Deserialize)]
        struct Created {
            volume: CinderVolume,
        }
        let body = json!({"volume": {
            "name": request.name,
            "size": size,
            "volume_type": request.pool,
            "description": "made by vmlet for a PersistentVolumeClaim",
            "metadata": {VOLUME_KEY: request.name},
        }});
        let call = Call::new(Service::BlockStorage, Method::POST, "/volumes").body(body);
        let created: Created = self.cloud.json(OP, &call).await?;
        let id = created.volume.id;
        tracing::info!(volume.id = %id, volume.name = %request.name, size_gib = size, pool = %request.pool, "Cinder volume created");
        match self.cloud.wait_volume(OP, &id, "being created", false, |v| v.status == "available").await {
            Ok(volume) => Ok(volume.expect("wait_volume returns the volume unless gone_ok").as_volume(&request.pool)),
            Err(e) if e.kind == ErrorKind::Permanent => {
                // An errored volume can only be deleted: make room for the
                // next try.
                let delete = Call::new(Service::BlockStorage, Method::DELETE, format!("/volumes/{id}"));
                if let Err(cleanup) = self.cloud.send(OP, &delete).await {
                    tracing::warn!(volume.id = %id, error = %cleanup, "deleting the errored volume failed");
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The volume of vmlet named `name`, when its type is `pool`.
    async fn volume(&self, pool: &str, name: &str) -> Result<Option<Volume>> {
        const OP: &str = "read volume";
        validate_volume_name(OP, name)?;
        let found = self.cloud.vmlet_volume(OP, name).await?;
        Ok(found.filter(|v| v.volume_type.as_deref().is_none_or(|t| t == pool)).map(|v| v.as_volume(pool)))
    }

    /// `DELETE /volumes/{id}` of vmlet's volume `name`, waiting until Cinder
    /// has removed it. Errors: `Conflict` while it is attached to a server.
    async fn delete_volume(&self, pool: &str, name: &str) -> Result<()> {
        const OP: &str = "delete volume";
        validate_volume_name(OP, name)?;
        let Some(found) = self.cloud.vmlet_volume(OP, name).await? else { return Ok(()) };
        if let Some(attachment) = found.attachments.first() {
            return Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "Cinder volume {name} ({}) of pool {pool} is still attached to server {}",
                    found.id, attachment.server_id
                ),
            ));
        }
        if found.status != "deleting" {
            let call = Call::new(Service::BlockStorage, Method::DELETE, format!("/volumes/{}", found.id));
            match self.cloud.send(OP, &call).await {
                Ok(_) => {}
                Err(e) if e.kind == ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        self.cloud.wait_volume(OP, &found.id, "being deleted", true, |_| false).await?;
        tracing::info!(volume.id = %found.id, volume.name = %name, "Cinder volume deleted");
        Ok(())
    }

    /// `os-extend` of vmlet's volume `name` to `ceil(capacity / GiB)` GiB
    /// (microversion 3.42: also while attached, and Cinder tells Nova, which
    /// grows the disk under the running server), waiting until Cinder
    /// reports the new size. Errors: `NotFound`; `InvalidInput` for a
    /// smaller size or a format other than raw.
    async fn resize_volume(&self, pool: &str, name: &str, format: DiskFormat, capacity_bytes: u64) -> Result<Volume> {
        const OP: &str = "resize volume";
        validate_volume_name(OP, name)?;
        if format != DiskFormat::Raw {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("Cinder volume {name} is raw, not {format}")));
        }
        let found = self.cloud.vmlet_volume(OP, name).await?.ok_or_else(|| {
            Error::new(OP, ErrorKind::NotFound, format!("Cinder has no volume {name} of vmlet in pool {pool}"))
        })?;
        let size = gib_ceil(capacity_bytes);
        if size < found.size {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("Cinder volume {name} has {} GiB; volumes never shrink (asked: {size} GiB)", found.size),
            ));
        }
        if size > found.size {
            let call = Call::new(Service::BlockStorage, Method::POST, format!("/volumes/{}/action", found.id))
                .body(json!({"os-extend": {"new_size": size}}));
            self.cloud.send(OP, &call).await?;
            tracing::info!(volume.id = %found.id, volume.name = %name, from_gib = found.size, to_gib = size, "Cinder volume extended");
        }
        let grown =
            self.cloud.wait_volume(OP, &found.id, "being extended", false, |v| v.size >= size && v.settled()).await?;
        Ok(grown.unwrap_or(found).as_volume(pool))
    }

    /// Cinder grows a volume wherever it is attached and tells Nova, which
    /// grows the disk under the running server: any host's process may
    /// grow any volume.
    fn grows_shared_volumes(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, mark: Option<&str>) -> CinderVolume {
        CinderVolume {
            id: "0b6f".into(),
            name: Some(name.into()),
            status: "available".into(),
            size: 2,
            volume_type: Some("__DEFAULT__".into()),
            metadata: mark.map(|m| BTreeMap::from([(VOLUME_KEY.to_owned(), m.to_owned())])).unwrap_or_default(),
            attachments: Vec::new(),
        }
    }

    #[test]
    fn sizes_round_up_to_whole_gib() {
        assert_eq!(gib_ceil(1), 1);
        assert_eq!(gib_ceil(GIB), 1);
        assert_eq!(gib_ceil(GIB + 1), 2);
        assert_eq!(gib_ceil(20 * GIB), 20);
    }

    #[test]
    fn only_a_volume_with_vmlets_mark_for_its_own_name_is_vmlets() {
        assert!(volume("ns_data_1", Some("ns_data_1")).is_vmlets("ns_data_1"));
        assert!(!volume("ns_data_1", None).is_vmlets("ns_data_1"), "a tenant's volume of that name");
        assert!(!volume("ns_data_1", Some("other_claim_2")).is_vmlets("ns_data_1"), "a renamed volume");
    }

    #[test]
    fn a_volume_is_its_id_raw_in_whole_gib() {
        let v = volume("ns_data_1", Some("ns_data_1")).as_volume("__DEFAULT__");
        assert_eq!(v.path, "0b6f");
        assert_eq!(v.capacity_bytes, 2 * GIB);
        assert_eq!(v.format, Some(DiskFormat::Raw));
        assert_eq!(v.pool, "__DEFAULT__");
    }
}
