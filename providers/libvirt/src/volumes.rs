//! Volumes ([`Volumes`]) in libvirt storage pools, made, grown and removed
//! through libvirt's storage API (`virStorageVolCreateXML`,
//! `virStorageVolResize`, `virStorageVolDelete`), so that libvirtd, not
//! vmlet, touches the pool's files: this works on a remote connection too.
//!
//! Only pools whose volumes are files (`dir`, `fs`, `netfs`) are used; a
//! volume's file is `<pool target>/<volume name>`. A new volume is sparse
//! (`<allocation>` 0), mode 0600, in the requested format. The format a
//! volume reports ([`Volume::format`]) is libvirt's view: its `dir` pools
//! probe it from the file's header at every refresh, and the guest writes
//! that header, so it is never used to open or grow a disk; callers pass
//! the format they made the volume in.
//!
//! Every operation refreshes the pool first (`virStoragePoolRefresh`), so
//! that files made or removed behind libvirtd are seen; a refresh libvirt
//! refuses for now (another volume of the pool is being built) is skipped
//! and libvirt's last view of the pool used. Each operation, refresh
//! included, is given up with `Transient` after [`DEADLINE`].
//!
//! On the test driver (`test:///…`) pools and volumes live in libvirtd's
//! memory only (`test:///default` has a `dir` pool named `default-pool`),
//! and resizing is not implemented (`Unsupported`).

use std::time::Duration;

use tracing::instrument;
use virt::connect::Connect;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;
use vmlet_provider::{
    validate_volume_name, BackingFile, DiskFormat, Error, ErrorKind, Result, Volume, VolumeRequest, VolumeSource,
    Volumes,
};

use crate::error::{from_libvirt, is_no_storage_pool, kind_of};
use crate::provider::{is_local_uri, LibvirtProvider};
use crate::qemu_img;
use crate::xml::escape;

/// How long one volume operation may take in libvirt: looking the pool up,
/// refreshing it and the change itself (for qcow2, libvirtd runs qemu-img).
const DEADLINE: Duration = Duration::from_secs(60);

/// How long copying an image into a new volume may take.
const COPY_DEADLINE: Duration = Duration::from_secs(30 * 60);

/// The pool types whose volumes are files the hypervisor opens by path.
const FILE_POOL_TYPES: [&str; 3] = ["dir", "fs", "netfs"];

/// qcow2 sizes are whole 512-byte sectors: qemu-img rounds a new image's
/// size up to one, and refuses to resize to any other size.
const QCOW2_SECTOR: u64 = 512;

#[async_trait::async_trait]
impl Volumes for LibvirtProvider {
    /// See [`Volumes::create_volume`]. A qcow2 capacity is rounded up to a
    /// multiple of 512 bytes. A volume made meanwhile by another caller
    /// counts as existing.
    #[instrument(skip(self, request), fields(provider = "libvirt", volume.pool = %request.pool, volume.name = %request.name))]
    async fn create_volume(&self, request: &VolumeRequest) -> Result<Volume> {
        const OP: &str = "create volume";
        validate_volume_name(OP, &request.name)?;
        if request.capacity_bytes == 0 {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("volume {}: capacity 0 bytes", request.name)));
        }
        if request.source.backing().is_some() && request.format != DiskFormat::Qcow2 {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("volume {}: an overlay on a backing file must be qcow2, not {}", request.name, request.format),
            ));
        }
        let request = VolumeRequest {
            capacity_bytes: rounded_capacity(request.format, request.capacity_bytes),
            ..request.clone()
        };
        if let Some(image) = request.source.image() {
            self.check_fits(OP, &request, image).await?;
        }
        match &request.source {
            VolumeSource::Copy(image) => self.create_copy(&request, image).await,
            _ => self.blocking_within(OP, DEADLINE, move |_, conn| create(conn, &request)).await,
        }
    }

    /// See [`Volumes::volume`].
    #[instrument(skip(self), fields(provider = "libvirt"))]
    async fn volume(&self, pool: &str, name: &str) -> Result<Option<Volume>> {
        const OP: &str = "read volume";
        validate_volume_name(OP, name)?;
        let (pool, name) = (pool.to_owned(), name.to_owned());
        self.blocking_within(OP, DEADLINE, move |_, conn| {
            let storage = open_pool(conn, OP, &pool)?;
            let found = match lookup(&storage, OP, &name)? {
                Some(found) => Some(found),
                // A pool that several hosts share lists a volume another
                // host made only once it is refreshed.
                None => {
                    storage.refresh(0).map_err(|err| from_libvirt(OP, err))?;
                    lookup(&storage, OP, &name)?
                }
            };
            found.map(|found| found.into_volume(OP, &pool, &name)).transpose()
        })
        .await
    }

    /// See [`Volumes::delete_volume`]: `virStorageVolDelete` without
    /// wiping (the file is unlinked).
    #[instrument(skip(self), fields(provider = "libvirt"))]
    async fn delete_volume(&self, pool: &str, name: &str) -> Result<()> {
        const OP: &str = "delete volume";
        validate_volume_name(OP, name)?;
        let (pool, name) = (pool.to_owned(), name.to_owned());
        self.blocking_within(OP, DEADLINE, move |_, conn| {
            let storage = open_pool(conn, OP, &pool)?;
            let deleted = storage.lookup_storage_vol_by_name(&name).and_then(|volume| volume.delete(0));
            match deleted {
                Ok(()) => {
                    tracing::info!(volume.pool = %pool, volume.name = %name, "volume deleted");
                    Ok(())
                }
                Err(err) if is_no_volume(&err) => Ok(()),
                Err(err) => Err(from_libvirt(OP, err)),
            }
        })
        .await
    }

    /// See [`Volumes::resize_volume`]: `virDomainBlockResize` on the running
    /// domain of this host that has the volume's file as a disk, else
    /// `virStorageVolResize`, without allocating the new space. A qcow2
    /// capacity is rounded up to a multiple of 512 bytes first. The test
    /// driver cannot resize volumes: `Unsupported`.
    #[instrument(skip(self), fields(provider = "libvirt"))]
    async fn resize_volume(&self, pool: &str, name: &str, format: DiskFormat, capacity_bytes: u64) -> Result<Volume> {
        const OP: &str = "resize volume";
        validate_volume_name(OP, name)?;
        if capacity_bytes == 0 {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("volume {name}: capacity 0 bytes")));
        }
        let (pool, name) = (pool.to_owned(), name.to_owned());
        self.blocking_within(OP, DEADLINE, move |_, conn| resize(conn, &pool, &name, format, capacity_bytes)).await
    }
}

impl LibvirtProvider {
    /// Whether vmlet shares this host's files and QEMU opens them: what
    /// reading an image's size and copying it take.
    fn files_here(&self) -> bool {
        is_local_uri(self.uri()) && self.domain_kind().is_qemu()
    }

    /// Refuse `request` when its capacity is below the disk size of
    /// `image`, read by `qemu-img info` in the image's stated format (its
    /// own backing files are not opened). Where vmlet does not share the
    /// host's files, nothing is read and nothing refused.
    async fn check_fits(&self, operation: &'static str, request: &VolumeRequest, image: &BackingFile) -> Result<()> {
        if !self.files_here() {
            return Ok(());
        }
        let info = qemu_img::info(operation, &image.path, Some(image.format.as_str()), DEADLINE).await?;
        if request.capacity_bytes < info.virtual_size {
            return Err(Error::new(
                operation,
                ErrorKind::InvalidInput,
                format!(
                    "volume {}: {} bytes is less than its image {}'s disk of {} bytes, which the guest would see cut \
                     off; ask for at least {} bytes",
                    request.name, request.capacity_bytes, image.path, info.virtual_size, info.virtual_size
                ),
            ));
        }
        Ok(())
    }

    /// Make `request`'s volume as a full copy of `image`: unless the pool
    /// holds it already, an empty volume `<name>.partial` is made through
    /// libvirt, filled by `qemu-img convert -n` (both formats stated) and
    /// renamed to `<name>` in the pool's directory, so a copy cut short is
    /// never taken for a volume; a stale partial one is replaced.
    async fn create_copy(&self, request: &VolumeRequest, image: &BackingFile) -> Result<Volume> {
        const OP: &str = "copy image into volume";
        if !self.files_here() {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "volume {}: copying an image takes vmlet on the QEMU host (qemu:///system); use a class that \
                     makes overlays",
                    request.name
                ),
            ));
        }
        let done = request.clone();
        if let Some(volume) = self.blocking_within(OP, DEADLINE, move |_, conn| existing(conn, &done)).await? {
            return Ok(volume);
        }
        let partial =
            VolumeRequest { name: format!("{}.partial", request.name), source: VolumeSource::Empty, ..request.clone() };
        validate_volume_name(OP, &partial.name)?;
        self.delete_volume(&partial.pool, &partial.name).await?;
        let made = partial.clone();
        let target = self.blocking_within(OP, DEADLINE, move |_, conn| create(conn, &made)).await?;
        qemu_img::convert_into(
            OP,
            &image.path,
            image.format.as_str(),
            &target.path,
            request.format.as_str(),
            COPY_DEADLINE,
        )
        .await?;
        let path = std::path::Path::new(&target.path);
        let renamed = path.with_file_name(&request.name);
        std::fs::rename(path, &renamed).map_err(|e| {
            Error::new(OP, ErrorKind::Permanent, format!("rename {} to {}: {e}", target.path, renamed.display()))
        })?;
        tracing::info!(volume.pool = %request.pool, volume.name = %request.name, image = %image.path, "image copied into volume");
        let done = request.clone();
        self.blocking_within(OP, DEADLINE, move |_, conn| {
            existing(conn, &done)?.ok_or_else(|| {
                Error::new(
                    OP,
                    ErrorKind::Transient,
                    format!("volume {} is not in pool {} after its copy", done.name, done.pool),
                )
            })
        })
        .await
    }
}

/// `request`'s volume when the pool holds it (after a refresh, which
/// lists files renamed into its directory), checked as [`create`] checks
/// it; `None` when it holds none of that name.
fn existing(conn: &Connect, request: &VolumeRequest) -> Result<Option<Volume>> {
    const OP: &str = "create volume";
    let pool = open_pool(conn, OP, &request.pool)?;
    if lookup(&pool, OP, &request.name)?.is_none() {
        pool.refresh(0).map_err(|err| from_libvirt(OP, err))?;
    }
    match lookup(&pool, OP, &request.name)? {
        Some(found) => matching(found, request).map(Some),
        None => Ok(None),
    }
}

/// Make `request`'s volume unless the pool holds one of that name; either
/// way, the volume if it matches the request.
fn create(conn: &Connect, request: &VolumeRequest) -> Result<Volume> {
    const OP: &str = "create volume";
    let (pool_name, name) = (&request.pool, &request.name);
    let pool = open_pool(conn, OP, pool_name)?;
    let found = match lookup(&pool, OP, name)? {
        Some(found) => found,
        None => match StorageVol::create_xml(&pool, &volume_xml(request), 0) {
            Ok(volume) => {
                tracing::info!(
                    volume.pool = %pool_name,
                    volume.name = %name,
                    volume.format = %request.format,
                    volume.capacity_bytes = request.capacity_bytes,
                    "volume created"
                );
                read(&volume).map_err(|err| from_libvirt(OP, err))?
            }
            // Made by another caller since the lookup?
            Err(err) => lookup(&pool, OP, name)?.ok_or_else(|| from_libvirt(OP, err))?,
        },
    };
    matching(found, request)
}

/// `found` as the volume `request` asked for, when it is.
/// Errors: `Conflict` naming what differs (backing file, format, size).
fn matching(found: Found, request: &VolumeRequest) -> Result<Volume> {
    const OP: &str = "create volume";
    let (pool_name, name) = (&request.pool, &request.name);
    let backing = request.source.backing().map(|b| b.path.as_str());
    if backing.is_some() && found.backing.as_deref() != backing {
        return Err(Error::new(
            OP,
            ErrorKind::Conflict,
            format!(
                "pool {pool_name} holds a volume {name} on backing file {:?}; asked for one on {backing:?}: delete that \
                 volume or ask for another name",
                found.backing
            ),
        ));
    }
    if found.format.as_deref() != Some(request.format.as_str()) || found.capacity < request.capacity_bytes {
        let format = found.format.as_deref().unwrap_or("an unstated format");
        return Err(Error::new(
            OP,
            ErrorKind::Conflict,
            format!(
                "pool {pool_name} holds a volume {name} in {format} of {} bytes; asked for one in {} of at least {} \
                 bytes: delete that volume or ask for another name",
                found.capacity, request.format, request.capacity_bytes
            ),
        ));
    }
    found.into_volume(OP, pool_name, name)
}

/// Grow volume `name` of pool `pool_name`, made in `format`, to `capacity`
/// bytes: live through the running domain that has its file open (QEMU
/// reads and grows the file in the format the domain states, and tells the
/// guest), else through the pool, which reads the file in the format it
/// probes, so only while that is `format`. The size it has now is read the
/// same way, never from a header the pool probed in another format.
fn resize(conn: &Connect, pool_name: &str, name: &str, format: DiskFormat, capacity: u64) -> Result<Volume> {
    const OP: &str = "resize volume";
    let pool = open_pool(conn, OP, pool_name)?;
    let Some(found) = lookup(&pool, OP, name)? else {
        return Err(Error::new(OP, ErrorKind::NotFound, format!("pool {pool_name} holds no volume {name}")));
    };
    let mut volume = found.into_volume(OP, pool_name, name)?;
    let capacity = rounded_capacity(format, capacity);
    let live = running_domain_with(conn, &volume.path)?;
    let current = match &live {
        Some((domain, target)) => domain.block_info(target, 0).map_err(|err| from_libvirt(OP, err))?.capacity,
        None if volume.format == Some(format) => volume.capacity_bytes,
        None => {
            return Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "volume {name} of pool {pool_name} was made {format}, but libvirt now reads its file as {} (its \
                     guest wrote that header) and would grow it so; it grows while its VM runs",
                    volume.format.map_or("another format", DiskFormat::as_str)
                ),
            ));
        }
    };
    if capacity < current {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "volume {name} of pool {pool_name} has {current} bytes and cannot shrink to {capacity} bytes: volumes \
                 only grow"
            ),
        ));
    }
    volume.capacity_bytes = capacity;
    if capacity == current {
        return Ok(volume);
    }
    let how = match live {
        Some((domain, target)) => {
            domain
                .block_resize(&target, capacity, virt::sys::VIR_DOMAIN_BLOCK_RESIZE_BYTES)
                .map_err(|err| from_libvirt(OP, err))?;
            "live"
        }
        None => {
            pool.lookup_storage_vol_by_name(name)
                .and_then(|found| found.resize(capacity, 0))
                .map_err(|err| from_libvirt(OP, err))?;
            "offline"
        }
    };
    tracing::info!(
        volume.pool = %pool_name,
        volume.name = %name,
        from_bytes = current,
        to_bytes = capacity,
        how,
        "volume grown"
    );
    Ok(volume)
}

/// The running domain of `conn` that has the file `path` as a disk, and
/// that disk's target (`vdb`); `None` when none has.
fn running_domain_with(conn: &Connect, path: &str) -> Result<Option<(virt::domain::Domain, String)>> {
    const OP: &str = "resize volume";
    let domains =
        conn.list_all_domains(virt::sys::VIR_CONNECT_LIST_DOMAINS_ACTIVE).map_err(|err| from_libvirt(OP, err))?;
    for domain in domains {
        // A domain that stopped meanwhile has no live XML: not the one.
        let Ok(xml) = domain.xml_desc(0) else { continue };
        if let Some(disk) = crate::xml::disks(&xml).into_iter().find(|d| d.source.as_deref() == Some(path)) {
            return Ok(Some((domain, disk.target)));
        }
    }
    Ok(None)
}

/// `capacity` as the volume will have it: for qcow2 rounded up to whole
/// sectors ([`QCOW2_SECTOR`]).
fn rounded_capacity(format: DiskFormat, capacity: u64) -> u64 {
    match format {
        DiskFormat::Raw => capacity,
        DiskFormat::Qcow2 => {
            capacity.checked_next_multiple_of(QCOW2_SECTOR).unwrap_or(u64::MAX - u64::MAX % QCOW2_SECTOR)
        }
    }
}

/// Storage pool `name`, checked to keep files and to run, and refreshed.
/// Errors: `NotFound` naming the pools the host has; `Unsupported` for a
/// pool of other volumes; `Permanent` for a pool that is not running.
fn open_pool(conn: &Connect, operation: &'static str, name: &str) -> Result<StoragePool> {
    let pool = match conn.lookup_storage_pool_by_name(name) {
        Ok(pool) => pool,
        Err(err) if is_no_storage_pool(&err) => return Err(no_such_pool(conn, operation, name, err)),
        Err(err) => return Err(from_libvirt(operation, err)),
    };
    let xml = pool.xml_desc(0).map_err(|err| from_libvirt(operation, err))?;
    let kind = pool_type(&xml).map_err(|e| {
        Error::new(operation, ErrorKind::Permanent, format!("libvirt's XML of storage pool {name} does not parse: {e}"))
    })?;
    if !FILE_POOL_TYPES.contains(&kind.as_deref().unwrap_or("")) {
        return Err(Error::new(
            operation,
            ErrorKind::Unsupported,
            format!(
                "storage pool {name} is of type {}; vmlet makes volumes in pools of files only ({})",
                kind.as_deref().unwrap_or("(none stated)"),
                FILE_POOL_TYPES.join(", ")
            ),
        ));
    }
    if !pool.is_active().map_err(|err| from_libvirt(operation, err))? {
        return Err(Error::new(
            operation,
            ErrorKind::Permanent,
            format!(
                "storage pool {name} is not running: start it (virsh pool-start {name}; pool-autostart keeps it so)"
            ),
        ));
    }
    if let Err(err) = pool.refresh(0) {
        if kind_of(&err) == ErrorKind::Transient {
            return Err(from_libvirt(operation, err));
        }
        tracing::debug!(pool = %name, error = %err, "storage pool not refreshed; libvirt's last view of it is used");
    }
    Ok(pool)
}

/// The `NotFound` error for a missing pool `name`, naming the pools the
/// host has (or that they cannot be listed).
fn no_such_pool(conn: &Connect, operation: &'static str, name: &str, err: VirtError) -> Error {
    let pools = conn
        .list_all_storage_pools(0)
        .map(|pools| pools.iter().filter_map(|pool| pool.name().ok()).collect::<Vec<_>>());
    let has = match pools {
        Ok(mut names) if !names.is_empty() => {
            names.sort();
            format!("the host has {}", names.join(", "))
        }
        Ok(_) => "the host has none".to_owned(),
        Err(list) => format!("the host's pools cannot be listed: {}", list.message()),
    };
    Error::new(operation, ErrorKind::NotFound, format!("no storage pool {name} on this host; {has}")).with_source(err)
}

/// What libvirt says of a volume, its format not checked yet.
#[derive(Debug, PartialEq, Eq)]
struct Found {
    path: String,
    capacity: u64,
    allocation: u64,
    /// `<target><format type>`; `None` when the XML states none.
    format: Option<String>,
    /// `<backingStore><path>`, as libvirt reads it from the file's header.
    backing: Option<String>,
}

impl Found {
    /// The volume `name` of pool `pool` this is, its format as libvirt
    /// reports it (`None` for one other than raw and qcow2). Errors:
    /// `Permanent` for a path that is no absolute file path.
    fn into_volume(self, operation: &'static str, pool: &str, name: &str) -> Result<Volume> {
        let format = self.format.as_deref().and_then(DiskFormat::from_name);
        if !self.path.starts_with('/') {
            return Err(Error::new(
                operation,
                ErrorKind::Permanent,
                format!("volume {name} of pool {pool} is at {:?}, no absolute file path", self.path),
            ));
        }
        Ok(Volume {
            pool: pool.to_owned(),
            name: name.to_owned(),
            path: self.path,
            capacity_bytes: self.capacity,
            allocation_bytes: self.allocation,
            format,
        })
    }
}

/// Volume `name` of `pool`, or `None` when it has none (or it went away
/// while being read).
fn lookup(pool: &StoragePool, operation: &'static str, name: &str) -> Result<Option<Found>> {
    match pool.lookup_storage_vol_by_name(name).and_then(|volume| read(&volume)) {
        Ok(found) => Ok(Some(found)),
        Err(err) if is_no_volume(&err) => Ok(None),
        Err(err) => Err(from_libvirt(operation, err)),
    }
}

/// What libvirt says of `volume` (its info refreshes the volume's sizes).
fn read(volume: &StorageVol) -> Result<Found, VirtError> {
    let path = volume.path()?;
    let info = volume.info()?;
    let xml = volume.xml_desc(0)?;
    let (format, backing) = (volume_format(&xml), volume_backing(&xml));
    Ok(Found { path, capacity: info.capacity, allocation: info.allocation, format, backing })
}

/// True when `err` says the pool has no volume of the asked name.
fn is_no_volume(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::NoStorageVolume)
}

/// The volume XML for `request` (`virStorageVolCreateXML`): a sparse file
/// of its capacity in its format, mode 0600, on its backing file (with that
/// file's format stated) when it has one.
fn volume_xml(request: &VolumeRequest) -> String {
    let backing = request.source.backing().map_or_else(String::new, |b| {
        format!(
            "  <backingStore>\n    <path>{}</path>\n    <format type='{}'/>\n  </backingStore>\n",
            escape(&b.path),
            b.format.as_str()
        )
    });
    format!(
        "<volume>\n  <name>{}</name>\n  <capacity unit='bytes'>{}</capacity>\n  <allocation unit='bytes'>0</allocation>\n  \
         <target>\n    <format type='{}'/>\n    <permissions>\n      <mode>0600</mode>\n    </permissions>\n  \
         </target>\n{backing}</volume>\n",
        escape(&request.name),
        request.capacity_bytes,
        request.format.as_str(),
    )
}

/// `<volume><backingStore><path>` of a volume's XML; `None` when it has
/// none.
fn volume_backing(xml: &str) -> Option<String> {
    let document = roxmltree::Document::parse(xml).ok()?;
    let store = document.root_element().children().find(|c| c.has_tag_name("backingStore"))?;
    let path = store.children().find(|c| c.has_tag_name("path"))?;
    path.text().map(str::to_owned)
}

/// `<volume><target><format type='…'/>` of a volume's XML; `None` when it
/// states none or the XML does not parse (then the format is unknown, and
/// the volume refused as such).
fn volume_format(xml: &str) -> Option<String> {
    let document = roxmltree::Document::parse(xml).ok()?;
    let root = document.root_element();
    let target = root.children().find(|c| c.has_tag_name("target"))?;
    let format = target.children().find(|c| c.has_tag_name("format"))?;
    format.attribute("type").map(str::to_owned)
}

/// `<pool type='…'>` of a pool's XML; `None` when it states none.
fn pool_type(xml: &str) -> std::result::Result<Option<String>, roxmltree::Error> {
    let document = roxmltree::Document::parse(xml)?;
    Ok(document.root_element().attribute("type").map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(name: &str, capacity_bytes: u64, format: DiskFormat) -> VolumeRequest {
        VolumeRequest { pool: "default".into(), name: name.into(), capacity_bytes, format, source: VolumeSource::Empty }
    }

    #[test]
    fn a_new_volume_is_a_sparse_file_of_its_capacity_in_its_format_mode_0600() {
        let xml = volume_xml(&request("ns_claim_0f8e", 10 << 30, DiskFormat::Qcow2));
        let document = roxmltree::Document::parse(&xml).expect("volume XML parses");
        let root = document.root_element();
        assert!(root.has_tag_name("volume"));
        let text = |path: &[&str]| {
            let mut node = root;
            for name in path {
                node = node.children().find(|c| c.has_tag_name(*name)).unwrap_or_else(|| panic!("{name} in {xml}"));
            }
            node
        };
        assert_eq!(text(&["name"]).text(), Some("ns_claim_0f8e"));
        assert_eq!(text(&["capacity"]).text(), Some("10737418240"));
        assert_eq!(text(&["capacity"]).attribute("unit"), Some("bytes"));
        assert_eq!(text(&["allocation"]).text(), Some("0"));
        assert_eq!(text(&["allocation"]).attribute("unit"), Some("bytes"));
        assert_eq!(text(&["target", "permissions", "mode"]).text(), Some("0600"));
        assert_eq!(volume_format(&xml).as_deref(), Some("qcow2"));
        assert_eq!(volume_format(&volume_xml(&request("r", 1, DiskFormat::Raw))).as_deref(), Some("raw"));
    }

    #[test]
    fn an_overlay_states_its_backing_file_and_that_files_format() {
        let mut overlay = request("ns_claim_0f8e", 1 << 30, DiskFormat::Qcow2);
        overlay.source = VolumeSource::Overlay(BackingFile { path: "/images/a&b.raw".into(), format: DiskFormat::Raw });
        let xml = volume_xml(&overlay);
        assert!(
            xml.contains(
                "<backingStore>\n    <path>/images/a&amp;b.raw</path>\n    <format type='raw'/>\n  </backingStore>"
            ),
            "{xml}"
        );
        assert_eq!(volume_backing(&xml).as_deref(), Some("/images/a&b.raw"));
        assert_eq!(volume_backing(&volume_xml(&request("r", 1, DiskFormat::Raw))), None);
    }

    #[test]
    fn a_volume_name_is_escaped_in_its_xml() {
        // Names are validated before, but the XML never depends on it.
        let xml = volume_xml(&request("a<b>&'c", 1, DiskFormat::Raw));
        let document = roxmltree::Document::parse(&xml).expect("volume XML parses");
        let name = document.root_element().children().find(|c| c.has_tag_name("name")).expect("name");
        assert_eq!(name.text(), Some("a<b>&'c"));
    }

    #[test]
    fn the_format_is_read_from_the_volumes_target_only() {
        // What libvirt 9's dir pool answers for a qcow2 volume.
        let xml = "<volume type='file'>\n  <name>v</name>\n  <key>/p/v</key>\n  <source>\n  </source>\n  \
                   <capacity unit='bytes'>1048576</capacity>\n  <allocation unit='bytes'>200704</allocation>\n  \
                   <physical unit='bytes'>196616</physical>\n  <target>\n    <path>/p/v</path>\n    \
                   <format type='qcow2'/>\n    <permissions>\n      <mode>0600</mode>\n      <owner>0</owner>\n      \
                   <group>0</group>\n    </permissions>\n    <compat>1.1</compat>\n    <clusterSize \
                   unit='B'>65536</clusterSize>\n    <features/>\n  </target>\n  <backingStore>\n    \
                   <path>/p/base</path>\n    <format type='raw'/>\n  </backingStore>\n</volume>\n";
        assert_eq!(volume_format(xml).as_deref(), Some("qcow2"));
        let no_target_format = "<volume><name>v</name><backingStore><format type='raw'/></backingStore>\
                                <target><path>/p/v</path></target></volume>";
        assert_eq!(volume_format(no_target_format), None);
        assert_eq!(volume_format("<volume><target><format type='vmdk'/>"), None);
        assert_eq!(volume_format("<volume><target><format type='vmdk'/></target></volume>").as_deref(), Some("vmdk"));
    }

    #[test]
    fn a_pools_type_is_its_root_attribute() {
        assert_eq!(pool_type("<pool type='dir'><name>p</name></pool>").expect("parses").as_deref(), Some("dir"));
        assert_eq!(pool_type("<pool><name>p</name></pool>").expect("parses"), None);
        assert!(pool_type("<pool type='dir'>").is_err());
    }

    #[test]
    fn a_qcow2_capacity_is_rounded_up_to_whole_sectors_and_a_raw_one_is_kept() {
        assert_eq!(rounded_capacity(DiskFormat::Qcow2, 1), 512);
        assert_eq!(rounded_capacity(DiskFormat::Qcow2, 512), 512);
        assert_eq!(rounded_capacity(DiskFormat::Qcow2, 1000), 1024);
        assert_eq!(rounded_capacity(DiskFormat::Raw, 1000), 1000);
        assert_eq!(rounded_capacity(DiskFormat::Qcow2, u64::MAX), u64::MAX - 511);
    }

    #[test]
    fn a_format_other_than_raw_or_qcow2_is_reported_as_none_not_refused() {
        // libvirt's dir pools probe a file's format: a guest that writes a
        // vmdk header into its raw volume must not make the volume unusable.
        let found =
            Found { path: "/p/v".into(), capacity: 1, allocation: 0, format: Some("vmdk".into()), backing: None };
        assert_eq!(found.into_volume("test", "p", "v").expect("vmdk").format, None);
        let found =
            Found { path: "/p/v".into(), capacity: 1, allocation: 0, format: Some("raw".into()), backing: None };
        let volume = found.into_volume("test", "p", "v").expect("raw");
        assert_eq!((volume.path.as_str(), volume.format), ("/p/v", Some(DiskFormat::Raw)));
        let relative =
            Found { path: "v".into(), capacity: 1, allocation: 0, format: Some("raw".into()), backing: None };
        assert_eq!(relative.into_volume("test", "p", "v").unwrap_err().kind, ErrorKind::Permanent);
    }
}
