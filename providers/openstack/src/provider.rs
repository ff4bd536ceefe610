//! [`OpenStackProvider`]: the [`Provider`] operations for one nova-compute
//! host of a [`Cloud`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tracing::instrument;
use vmlet_provider::{
    Console, DiskFormat, Error, ErrorKind, HostInfo, ImageReference, Location, Migration, Provider, Resize, Result,
    VmId, VmSpec, VmStatus,
};

use crate::compute::Server;
use crate::hosts::HostState;
use crate::mapping::{
    flavor_named, host_of, mib_ceil, smallest_fitting, status_of, uid_of, FLAVOR_PIN_KEY, HOST_KEY, NAMESPACE_KEY,
    NAME_KEY, NEXT_FLAVOR_KEY, UID_KEY,
};
use crate::microversion::CREATE_WITH_HOST;
use crate::options;
use crate::session::{Call, Cloud};
use crate::volumes::{CinderVolume, VOLUME_KEY};

/// The servers vmlet manages on one nova-compute host (`OS-EXT-SRV-ATTR:host`
/// = the compute service's host name), through a [`Cloud`] session shared
/// with the other hosts' providers.
///
/// - Identity: a server is vmlet's when its metadata has `vmlet.io:uid`
///   (see [`crate::mapping`]); it is named [`VmSpec::backend_name`]. Servers
///   without the key are never listed or touched.
/// - `list`/`get` read one cloud-wide listing (`GET
///   /servers/detail?all_tenants=1`) shared by every host for
///   [`crate::CloudOptions::listing_ttl`]; `locate` answers for the whole
///   cloud.
/// - Every operation acts only on a server on this host; one on another host
///   gets `NotFound` (`Conflict` for `ensure_defined` and `undefine`, which
///   must not create a twin or report a server elsewhere as gone).
/// - Capabilities: [`Resize`] (at the next start, by flavor), [`Migration`]
///   (live and cold, to a named host), [`Console`] (output only). No guest
///   commands, no stats.
///
/// Cloning is cheap and shares the session.
#[derive(Clone, Debug)]
pub struct OpenStackProvider {
    pub(crate) cloud: Arc<Cloud>,
    pub(crate) host: String,
    pub(crate) node_name: String,
}

/// A compute host named with its cloud, `<cloud>/<host>`
/// ([`Provider::backend_host`], [`Location::OtherHost`]).
fn qualified(cloud: &Cloud, host: &str) -> String {
    format!("{}/{host}", cloud.name())
}

impl OpenStackProvider {
    /// The Cinder volumes of `spec.disks`, in order: each disk's path must
    /// be the id of a volume vmlet made (its [`VOLUME_KEY`] mark), which a
    /// PersistentVolume of `openstack.vmlet.io` names, attached raw. A host
    /// file (a `hostImage` or a local PersistentVolume's image) is no
    /// volume Nova can attach.
    ///
    /// Errors: `InvalidInput` naming `spec.disks[<name>]` and the fix.
    async fn data_volumes(&self, spec: &VmSpec) -> Result<Vec<CinderVolume>> {
        const OP: &str = "define server";
        let mut volumes = Vec::with_capacity(spec.disks.len());
        for disk in &spec.disks {
            let refuse = |why: String| {
                Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.disks[{}]: {why}; on a Nova node a data disk is a PersistentVolumeClaim of a \
                         StorageClass with provisioner openstack.vmlet.io (a Cinder volume)",
                        disk.name
                    ),
                )
            };
            if disk.path.starts_with('/') || disk.format != DiskFormat::Raw {
                return Err(refuse(format!(
                    "{:?} is a file on a hypervisor host, which Nova cannot attach",
                    disk.path
                )));
            }
            let volume = self.cloud.cinder_volume(OP, &disk.path).await?;
            match volume {
                Some(v) if v.metadata.contains_key(VOLUME_KEY) => volumes.push(v),
                Some(_) => return Err(refuse(format!("Cinder volume {} was not made by vmlet", disk.path))),
                None => return Err(refuse(format!("Cinder has no volume {}", disk.path))),
            }
        }
        Ok(volumes)
    }

    /// Attach to `server` (which existed before this define) each of
    /// `volumes` that it lacks (`POST /servers/{id}/os-volume_attachments`),
    /// waiting until Cinder reports the volume `in-use` by it. Errors:
    /// `Conflict` when a volume is attached to another server.
    async fn attach_missing(&self, server: &Server, volumes: &[CinderVolume]) -> Result<()> {
        const OP: &str = "attach volume";
        for volume in volumes {
            let attached_to = |v: &CinderVolume| v.attachments.iter().any(|a| a.server_id == server.id);
            if attached_to(volume) {
                continue;
            }
            if let Some(other) = volume.attachments.first() {
                return Err(Error::new(
                    OP,
                    ErrorKind::Conflict,
                    format!(
                        "Cinder volume {} ({}) is attached to server {}, not {}",
                        volume.name.as_deref().unwrap_or_default(),
                        volume.id,
                        other.server_id,
                        server.id
                    ),
                ));
            }
            let call = Call::post(
                format!("/servers/{}/os-volume_attachments", server.id),
                json!({"volumeAttachment": {"volumeId": volume.id}}),
            );
            self.cloud.send(OP, &call).await?;
            tracing::info!(server.id = %server.id, volume.id = %volume.id, "volume attached");
            self.cloud.wait_attached(OP, &volume.id, &server.id).await?;
        }
        Ok(())
    }

    /// The provider of compute host `host` (a hypervisor's `service.host`,
    /// as [`Cloud::hypervisors`] lists it as [`crate::Hypervisor::host`]).
    /// Its node name (for [`Migration::target`]) defaults to `host`.
    pub fn new(cloud: Arc<Cloud>, host: impl Into<String>) -> Self {
        let host = host.into();
        OpenStackProvider { cloud, node_name: host.clone(), host }
    }

    /// Name this host as vmlet does (its node name), for
    /// [`Migration::target`].
    #[must_use]
    pub fn with_node_name(mut self, name: impl Into<String>) -> Self {
        self.node_name = name.into();
        self
    }

    /// The compute host this provider manages.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The shared session.
    pub fn cloud(&self) -> &Arc<Cloud> {
        &self.cloud
    }

    /// vmlet's server with this UID anywhere in the cloud (vmlet's project),
    /// from the shared listing; when the listing has none, from a fresh one
    /// (so "nowhere" is never an old answer). Errors: `Permanent` when two
    /// servers carry the UID (vmlet acts on neither until one is removed),
    /// and the listing's.
    pub(crate) async fn find_anywhere(&self, id: &VmId) -> Result<Option<Server>> {
        for fresh in [false, true] {
            let servers = self.cloud.servers(fresh).await?;
            let mut carrying = servers.iter().filter(|s| uid_of(s) == Some(id.0.as_str()));
            if let Some(server) = carrying.next() {
                if let Some(other) = carrying.next() {
                    return Err(Error::new(
                        "find server",
                        ErrorKind::Permanent,
                        format!(
                            "servers {} and {} both carry vmlet.io:uid {id}; vmlet acts on neither until an \
                             administrator removes the one that is not this VM's",
                            server.id, other.id
                        ),
                    ));
                }
                return Ok(Some(server.clone()));
            }
        }
        Ok(None)
    }

    /// vmlet's server with this UID on this host, as Nova shows it now.
    /// Errors: `NotFound` when there is none here (the message names the
    /// host it is on, if any).
    pub(crate) async fn find_here(&self, operation: &'static str, id: &VmId) -> Result<Server> {
        let listed = self.find_anywhere(id).await?;
        let not_found = |why: String| Error::new(operation, ErrorKind::NotFound, why);
        let Some(listed) = listed else {
            return Err(not_found(format!("no server with vmlet.io:uid {id} in the cloud")));
        };
        let server = self
            .cloud
            .server(&listed.id)
            .await?
            .ok_or_else(|| not_found(format!("server {} ({id}) is gone", listed.id)))?;
        match host_of(&server) {
            Some(host) if host == self.host => Ok(server),
            Some(other) => {
                Err(not_found(format!("server {} ({id}) is on host {other}, not on {}", server.id, self.host)))
            }
            None => Err(not_found(format!("server {} ({id}) is on no host", server.id))),
        }
    }

    /// The VM status of a server, with the size a pending resize gives it.
    pub(crate) async fn status(&self, server: &Server) -> Result<VmStatus> {
        let next = match server.metadata.get(NEXT_FLAVOR_KEY) {
            Some(flavor_id) => self.cloud.flavors(false).await?.iter().find(|f| &f.id == flavor_id).cloned(),
            None => None,
        };
        Ok(status_of(server, next.as_ref()))
    }

    /// Poll the server until `check` says done (`Some(Ok)`) or failed
    /// (`Some(Err)`), at most `timeout`. Errors: `NotFound` when the server
    /// disappears; `Transient` at the deadline, naming the state it is in.
    pub(crate) async fn wait_server(
        &self,
        operation: &'static str,
        server_id: &str,
        waiting_for: &str,
        timeout: Duration,
        mut check: impl FnMut(&Server) -> Option<Result<()>>,
    ) -> Result<Server> {
        let deadline = Instant::now() + timeout;
        loop {
            let server = self.cloud.server(server_id).await?.ok_or_else(|| {
                Error::new(
                    operation,
                    ErrorKind::NotFound,
                    format!("server {server_id} disappeared while {waiting_for}"),
                )
            })?;
            match check(&server) {
                Some(Ok(())) => return Ok(server),
                Some(Err(e)) => return Err(e),
                None => {}
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    operation,
                    ErrorKind::Transient,
                    format!(
                        "server {server_id} is still {} (task {}) after {} s {waiting_for}; vmlet retries",
                        server.status,
                        server.task_state.as_deref().unwrap_or("none"),
                        timeout.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(self.cloud.options.poll_interval).await;
        }
    }

    /// Wait while the server builds; an error for one whose build failed
    /// (ERROR without ever having run), with Nova's fault: `Transient` after
    /// deleting it when the scheduler found no valid host (the next attempt
    /// creates it again), `Permanent` otherwise (the user must act).
    async fn built(&self, operation: &'static str, server: Server) -> Result<Server> {
        let server = if server.status == "BUILD" {
            let timeout = self.cloud.options.build_timeout;
            self.wait_server(operation, &server.id.clone(), "building", timeout, |s| {
                (s.status != "BUILD").then_some(Ok(()))
            })
            .await?
        } else {
            server
        };
        if server.status == "ERROR" && server.launched_at.is_none() {
            let fault = server.fault.as_ref().map(|f| f.message.trim_end_matches('.')).unwrap_or("no fault recorded");
            if fault.contains("No valid host") {
                // The scheduler found no room (or Placement failed): the
                // server never ran and holds nothing. Remove it so that
                // the next attempt creates it again.
                self.cloud.delete_server(&server.id).await?;
                tracing::warn!(server.id = %server.id, fault, "build failed; deleted the never-started server");
                return Err(Error::new(
                    operation,
                    ErrorKind::Transient,
                    format!(
                        "Nova could not place server {} on host {}: {fault}; vmlet deleted the never-started server \
                         and retries (is the host full or disabled?)",
                        server.id, self.host
                    ),
                ));
            }
            return Err(Error::new(
                operation,
                ErrorKind::Permanent,
                format!(
                    "Nova could not build server {} on host {}: {fault}. Delete the server (or the VirtualMachine) \
                     after fixing the cause",
                    server.id, self.host
                ),
            ));
        }
        Ok(server)
    }

    /// `os-start`, `os-stop`: send the action unless the server is in
    /// `done` already or heading there (task `heading`); a 409 is success
    /// when a re-read shows that.
    async fn power_action(
        &self,
        operation: &'static str,
        server: &Server,
        action: &str,
        done: &str,
        heading: &str,
    ) -> Result<()> {
        let settled = |s: &Server| s.status == done || s.task_state.as_deref() == Some(heading);
        if settled(server) {
            return Ok(());
        }
        match self.cloud.server_action(operation, &server.id, json!({ action: null })).await {
            Err(e) if e.kind == ErrorKind::Conflict => {
                let now = self.cloud.server(&server.id).await?;
                if now.as_ref().is_some_and(settled) {
                    Ok(())
                } else {
                    Err(e)
                }
            }
            other => other,
        }
    }

    /// Wait until the server is `status` with no task running.
    pub(crate) async fn wait_settled(
        &self,
        operation: &'static str,
        server_id: &str,
        status: &'static str,
        timeout: Duration,
    ) -> Result<Server> {
        let waiting_for = format!("waiting for {status}");
        self.wait_server(operation, server_id, &waiting_for, timeout, |s| {
            if s.status == status && s.task_state.is_none() {
                Some(Ok(()))
            } else if s.status == "ERROR" && s.task_state.is_none() {
                // (ERROR with a task: a hard reboot out of ERROR is running.)
                Some(Err(Error::new(
                    operation,
                    ErrorKind::Permanent,
                    format!(
                        "server {server_id} went into ERROR: {}",
                        s.fault.as_ref().map(|f| f.message.as_str()).unwrap_or("no fault recorded")
                    ),
                )))
            } else {
                None
            }
        })
        .await
    }

    /// The create request for `spec` on this host.
    async fn create_body(
        &self,
        spec: &VmSpec,
        options: &options::ServerOptions,
        volumes: &[CinderVolume],
    ) -> Result<Value> {
        const OP: &str = "define server";
        let image = spec.image.as_deref().filter(|i| !i.is_empty()).ok_or_else(|| {
            Error::new(
                OP,
                ErrorKind::InvalidInput,
                "spec.image: Nova boots servers from an image; name a Glance image (id or name)",
            )
        })?;
        let image_id = self.cloud.resolve_image(image).await?;
        if let Some(allowed) = &self.cloud.options.allowed_images {
            if !allowed.contains(&image_id) {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.image: image {image:?} ({image_id}) is not one this cloud allows for VMs (allowed ids: \
                         [{}]); use one of them, or ask vmlet's administrator to add it to the cloud's images in \
                         vmlet's config",
                        allowed.join(", ")
                    ),
                ));
            }
        }
        let networks = crate::networks::server_networks(
            spec,
            options.networks.as_ref(),
            &self.cloud.options.offered_networks,
            self.cloud.options.allowed_networks.as_deref(),
        )?;
        let flavors = self.cloud.flavors(false).await?;
        let flavor = match &options.flavor {
            Some(wanted) => {
                let flavor = match flavor_named(&flavors, wanted) {
                    Some(f) => f.clone(),
                    None => flavor_named(&self.cloud.flavors(true).await?, wanted).cloned().ok_or_else(|| {
                        Error::new(
                            OP,
                            ErrorKind::InvalidInput,
                            format!(
                                "spec.providerOptions.flavor: no public flavor with id or name {wanted:?} in the cloud"
                            ),
                        )
                    })?,
                };
                // The pod's requests are what Kubernetes counts (scheduler,
                // ResourceQuota): a flavor of another size would hide it.
                if (flavor.vcpus, flavor.ram) != (spec.cpus, mib_ceil(spec.memory_bytes)) {
                    return Err(Error::new(
                        OP,
                        ErrorKind::InvalidInput,
                        format!(
                            "spec.providerOptions.flavor: {} has {} vCPUs and {} MiB but spec.resources asks for {} \
                             and {} MiB; set spec.resources to the flavor's size",
                            flavor.name,
                            flavor.vcpus,
                            flavor.ram,
                            spec.cpus,
                            mib_ceil(spec.memory_bytes)
                        ),
                    ));
                }
                flavor
            }
            None => smallest_fitting(&flavors, spec.cpus, spec.memory_bytes).cloned().ok_or_else(|| {
                Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.resources: no flavor has at least {} vCPUs and {} MiB; name one in \
                         spec.providerOptions.flavor or ask the cloud's operators for one",
                        spec.cpus,
                        mib_ceil(spec.memory_bytes)
                    ),
                )
            })?,
        };
        let mut metadata = Map::new();
        metadata.insert(UID_KEY.into(), json!(spec.id.0));
        metadata.insert(NAMESPACE_KEY.into(), json!(spec.namespace));
        metadata.insert(NAME_KEY.into(), json!(spec.name));
        metadata.insert(HOST_KEY.into(), json!(self.host));
        if options.flavor.is_some() {
            metadata.insert(FLAVOR_PIN_KEY.into(), json!(flavor.id));
        }
        let mut server = json!({
            "name": spec.backend_name(),
            "imageRef": image_id,
            "flavorRef": flavor.id,
            "networks": networks.to_json(),
            "metadata": metadata,
        });
        if !volumes.is_empty() {
            // The image as the boot disk (what imageRef alone gives), then
            // each data disk in spec.disks order; Nova detaches them, never
            // deletes them, when the server goes.
            let boot = json!({"boot_index": 0, "uuid": image_id, "source_type": "image",
                "destination_type": "local", "delete_on_termination": true});
            let data = volumes.iter().map(|v| {
                json!({"boot_index": -1, "uuid": v.id, "source_type": "volume",
                    "destination_type": "volume", "delete_on_termination": false})
            });
            server["block_device_mapping_v2"] = Value::Array(std::iter::once(boot).chain(data).collect());
        }
        if let Some(cloud_init) = &spec.cloud_init {
            // Nova hands it to the guest through its metadata service and
            // config drive, where cloud-init's OpenStack source reads it.
            use base64::Engine;
            server["user_data"] = json!(base64::engine::general_purpose::STANDARD.encode(&cloud_init.user_data));
        }
        let (version, _) = self.cloud.compute_microversion().await?;
        if version >= CREATE_WITH_HOST {
            server["host"] = json!(self.host);
        } else {
            let hosts = self.cloud.hypervisors().await?;
            let zone = hosts
                .iter()
                .find(|h| h.host == self.host)
                .and_then(|h| h.availability_zone.clone())
                .unwrap_or_else(|| "nova".into());
            server["availability_zone"] = json!(format!("{zone}:{}", self.host));
        }
        tracing::info!(flavor = %flavor.name, image = %image_id, "creating server");
        Ok(json!({ "server": server }))
    }

    /// Resize a stopped server to `flavor_id` and confirm (see `resize.rs`).
    pub(crate) async fn apply_pending_flavor(&self, server: &Server) -> Result<Server> {
        crate::resize::resize_stopped_to(self, server, server.metadata[NEXT_FLAVOR_KEY].as_str()).await
    }
}

/// Off or crashed with no task running: nothing to stop.
fn is_inactive(server: &Server) -> bool {
    matches!(server.status.as_str(), "SHUTOFF" | "ERROR") && server.task_state.is_none()
}

#[async_trait::async_trait]
impl Provider for OpenStackProvider {
    fn kind(&self) -> &'static str {
        "openstack"
    }

    /// `GET /os-services?binary=nova-compute&host=<host>`: Nova answers with
    /// a valid token, and this host's nova-compute is up. Errors:
    /// `Transient` when Nova is unreachable or the compute service is down;
    /// `NotFound` when Nova has no compute service on this host.
    #[instrument(skip(self), fields(provider = "openstack", host = %self.host))]
    async fn ping(&self) -> Result<()> {
        const OP: &str = "ping";
        #[derive(serde::Deserialize)]
        struct Services {
            services: Vec<ServiceState>,
        }
        #[derive(serde::Deserialize)]
        struct ServiceState {
            state: String,
        }
        let call = Call::get("/os-services").query("binary", "nova-compute").query("host", self.host.clone());
        let services: Services = self.cloud.json(OP, &call).await?;
        match services.services.first() {
            None => Err(Error::new(
                OP,
                ErrorKind::NotFound,
                format!("Nova has no nova-compute service on host {}", self.host),
            )),
            Some(s) if s.state != "up" => Err(Error::new(
                OP,
                ErrorKind::Transient,
                format!("nova-compute on host {} is {} (Nova no longer hears from it)", self.host, s.state),
            )),
            Some(_) => Ok(()),
        }
    }

    /// The hypervisor's raw vCPUs and memory (see [`Cloud::hypervisors`]),
    /// its architecture, and `OpenStack Nova <Nova's max microversion>
    /// (<hypervisor_type>)`. Errors: `NotFound` when the cloud has no
    /// hypervisor on this host; `Transient`.
    async fn host_info(&self) -> Result<HostInfo> {
        let hosts = self.cloud.hypervisors().await?;
        let Some(h) = hosts.iter().find(|h| h.host == self.host) else {
            return Err(Error::new(
                "probe host",
                ErrorKind::NotFound,
                format!("Nova lists no hypervisor on host {}", self.host),
            ));
        };
        if h.state == HostState::Down {
            tracing::warn!(host = %self.host, "nova-compute is down");
        }
        let (_, nova_max) = self.cloud.compute_microversion().await?;
        Ok(HostInfo {
            cpus: h.cpus,
            memory_bytes: h.memory_bytes,
            architecture: h.architecture.clone(),
            hypervisor: format!("OpenStack Nova {nova_max} ({})", h.hypervisor_type),
            accelerator: None,
            storage_roots: Vec::new(),
        })
    }

    async fn list(&self) -> Result<Vec<VmStatus>> {
        let servers = self.cloud.servers(false).await?;
        let mut out = Vec::new();
        for server in servers.iter().filter(|s| host_of(s) == Some(self.host.as_str())) {
            out.push(self.status(server).await?);
        }
        Ok(out)
    }

    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>> {
        let servers = self.cloud.servers(false).await?;
        match servers.iter().find(|s| uid_of(s) == Some(id.0.as_str()) && host_of(s) == Some(self.host.as_str())) {
            Some(server) => Ok(Some(self.status(server).await?)),
            None => Ok(None),
        }
    }

    /// Where the cloud holds the server with this UID: `ThisHost`,
    /// `OtherHost(<compute host>)`, or `Nowhere` (after a fresh listing).
    /// `<cloud>/<compute host>`, as [`Location::OtherHost`] gives it: the
    /// cloud's name keeps two clouds' hosts of the same name apart.
    fn backend_host(&self) -> Option<String> {
        Some(qualified(&self.cloud, &self.host))
    }

    async fn locate(&self, id: &VmId, _backend_name: &str) -> Result<Location> {
        Ok(match self.find_anywhere(id).await? {
            None => Location::Nowhere,
            Some(server) => match host_of(&server) {
                Some(host) if host == self.host => Location::ThisHost(self.status(&server).await?),
                Some(host) => Location::OtherHost(qualified(&self.cloud, host)),
                None => Location::Nowhere,
            },
        })
    }

    /// Create the server on this host unless the cloud has one with this UID
    /// (fresh listing first, so a retry after a crash finds the one created
    /// before). Waits until it leaves BUILD ([`crate::CloudOptions::build_timeout`]).
    ///
    /// Nova boots every server it creates (it has no "create stopped"); a
    /// server created here is therefore stopped at once (`os-stop`, waiting
    /// for SHUTOFF), so that a defined VM is off until [`Provider::start`]
    /// as the contract says. The guest runs briefly during that first boot.
    /// An existing server is returned as it is.
    ///
    /// Errors: `InvalidInput` for kernel boot, a missing or unknown image or
    /// flavor, no fitting flavor, an unknown `spec.providerOptions` key, a
    /// network the cloud does not offer the VM's namespace, a MAC address,
    /// or both `spec.networks` and `providerOptions.networks` (see
    /// `networks.rs`), all before a server is created;
    /// `Conflict` when the server is on another host; `Permanent` when Nova
    /// could not build it (with Nova's fault); `QuotaExceeded`; `Transient`
    /// (also when the scheduler found no room on this host: the failed,
    /// never-started server is deleted so that a retry creates it again).
    #[instrument(skip(self, spec), fields(provider = "openstack", host = %self.host, vm.uid = %spec.id, vm.name = %spec.backend_name()))]
    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus> {
        const OP: &str = "define server";
        if spec.kernel_boot.is_some() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                "spec.kernel: Nova cannot boot a kernel directly; boot from an image (spec.image)",
            ));
        }
        if let Some(cloud_init) = &spec.cloud_init {
            check_cloud_init(cloud_init)?;
        }
        let volumes = self.data_volumes(spec).await?;
        let server_options = options::parse(&spec.options)?;
        self.cloud.invalidate_listing();
        let existing = match self.find_anywhere(&spec.id).await? {
            Some(server) => Some(self.cloud.server(&server.id).await?),
            None => None,
        };
        let mut created_now = false;
        let server = match existing.flatten() {
            Some(server) => {
                match host_of(&server) {
                    Some(host) if host == self.host => {}
                    other => {
                        return Err(Error::new(
                            OP,
                            ErrorKind::Conflict,
                            format!(
                                "server {} with this VM's UID exists on host {}; vmlet does not create a second one \
                                 (migrate it instead)",
                                server.id,
                                other.unwrap_or("(none)")
                            ),
                        ));
                    }
                }
                server
            }
            None => {
                let body = self.create_body(spec, &server_options, &volumes).await?;
                let id = self.cloud.create_server(body).await?;
                created_now = true;
                tracing::info!(server.id = %id, "server created");
                self.cloud.server(&id).await?.ok_or_else(|| {
                    Error::new(OP, ErrorKind::Transient, format!("server {id} vanished right after its creation"))
                })?
            }
        };
        let mut server = self.built(OP, server).await?;
        if !created_now {
            self.attach_missing(&server, &volumes).await?;
        }
        if created_now && server.status == "ACTIVE" {
            // Nova starts what it creates; a defined VM is off until `start`.
            self.power_action(OP, &server, "os-stop", "SHUTOFF", "powering-off").await?;
            server = self.wait_settled(OP, &server.id, "SHUTOFF", self.cloud.options.task_timeout).await?;
        }
        self.status(&server).await
    }

    /// `os-start` (a hard `reboot` for a server in ERROR that ran before:
    /// Nova refuses os-start there), after applying a resize recorded for
    /// the next start; waits until the server is ACTIVE
    /// ([`crate::CloudOptions::task_timeout`]). A running server is left
    /// alone.
    #[instrument(skip(self), fields(provider = "openstack", host = %self.host, vm.uid = %id))]
    async fn start(&self, id: &VmId) -> Result<()> {
        const OP: &str = "start server";
        let mut server = self.find_here(OP, id).await?;
        if server.metadata.contains_key(NEXT_FLAVOR_KEY) && server.status == "SHUTOFF" && server.task_state.is_none() {
            server = self.apply_pending_flavor(&server).await?;
        }
        if server.status == "ERROR" && server.launched_at.is_some() {
            // Nova refuses os-start in ERROR; a hard reboot is its way back.
            tracing::info!(server.id = %server.id, "server in ERROR: hard reboot");
            self.cloud.server_action(OP, &server.id, json!({ "reboot": { "type": "HARD" } })).await?;
        } else {
            self.power_action(OP, &server, "os-start", "ACTIVE", "powering-on").await?;
        }
        self.wait_settled(OP, &server.id, "ACTIVE", self.cloud.options.task_timeout).await.map(|_| ())
    }

    /// `os-stop`, without waiting. Nova has one stop: it asks the guest to
    /// shut down and powers it off after the compute host's
    /// `shutdown_timeout` (default 60 s).
    #[instrument(skip(self), fields(provider = "openstack", host = %self.host, vm.uid = %id))]
    async fn shutdown(&self, id: &VmId) -> Result<()> {
        const OP: &str = "shut down server";
        let server = self.find_here(OP, id).await?;
        if is_inactive(&server) {
            return Ok(());
        }
        self.power_action(OP, &server, "os-stop", "SHUTOFF", "powering-off").await
    }

    /// `os-stop` (Nova has no separate hard power-off: the guest gets the
    /// host's `shutdown_timeout` to stop), then wait until SHUTOFF.
    #[instrument(skip(self), fields(provider = "openstack", host = %self.host, vm.uid = %id))]
    async fn destroy(&self, id: &VmId) -> Result<()> {
        const OP: &str = "power off server";
        let server = self.find_here(OP, id).await?;
        if is_inactive(&server) {
            return Ok(());
        }
        self.power_action(OP, &server, "os-stop", "SHUTOFF", "powering-off").await?;
        self.wait_settled(OP, &server.id, "SHUTOFF", self.cloud.options.task_timeout).await.map(|_| ())
    }

    fn image_reference(&self) -> ImageReference {
        ImageReference::Catalog
    }

    fn console(&self) -> Option<&dyn Console> {
        Some(self)
    }

    fn resize(&self) -> Option<&dyn Resize> {
        Some(self)
    }

    /// Cinder volumes (see `volumes.rs`). A cloud whose catalog has no
    /// block-storage service answers every call with `Unsupported`, naming
    /// it, so a claim of its class gets that reason.
    fn volumes(&self) -> Option<&dyn vmlet_provider::Volumes> {
        Some(self)
    }

    fn migration(&self) -> Option<&dyn Migration> {
        Some(self)
    }

    /// `DELETE /servers/{id}` of a stopped server, then wait until Nova
    /// forgot it. No server with this UID is success. Errors: `InvalidInput`
    /// while it runs; `Conflict` when it is on another host.
    #[instrument(skip(self), fields(provider = "openstack", host = %self.host, vm.uid = %id))]
    async fn undefine(&self, id: &VmId) -> Result<()> {
        const OP: &str = "delete server";
        let Some(listed) = self.find_anywhere(id).await? else { return Ok(()) };
        let Some(server) = self.cloud.server(&listed.id).await? else { return Ok(()) };
        if let Some(host) = host_of(&server).filter(|h| *h != self.host) {
            return Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!("server {} ({id}) is on host {host}, not on {}; delete it there", server.id, self.host),
            ));
        }
        let status = status_of(&server, None);
        if status.power.is_active() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("server {} is {}; stop it before deleting it", server.id, server.status),
            ));
        }
        if self.cloud.delete_server(&server.id).await? {
            tracing::info!(server.id = %server.id, "server deleted");
        }
        let deadline = Instant::now() + self.cloud.options.task_timeout;
        while self.cloud.server(&server.id).await?.is_some() {
            if Instant::now() >= deadline {
                return Err(Error::new(
                    OP,
                    ErrorKind::Transient,
                    format!("Nova still shows server {} after deleting it; vmlet retries", server.id),
                ));
            }
            tokio::time::sleep(self.cloud.options.poll_interval).await;
        }
        self.cloud.invalidate_listing();
        Ok(())
    }
}

/// Nova's limit on a server's `user_data`: 65535 bytes once base64-encoded.
const USER_DATA_LIMIT: usize = 65535;

/// What Nova can deliver of `cloud_init`: user data up to its size limit;
/// the guest's hostname comes from the server's name and its network from
/// Neutron, so a network config is refused rather than dropped.
fn check_cloud_init(cloud_init: &vmlet_provider::CloudInit) -> Result<()> {
    const OP: &str = "define server";
    if cloud_init.network_config.is_some() {
        return Err(Error::new(
            OP,
            ErrorKind::Unsupported,
            "spec.cloudInit.networkData: Nova configures a server's network from Neutron and has no field for \
             cloud-init network config; remove networkData (choose networks in spec.networks)",
        ));
    }
    let encoded = cloud_init.user_data.len().div_ceil(3) * 4;
    if encoded > USER_DATA_LIMIT {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "spec.cloudInit.userData: {} bytes, {encoded} base64-encoded, over Nova's limit of {USER_DATA_LIMIT}; \
                 make it smaller (e.g. a #include of a URL, or gzip it)",
                cloud_init.user_data.len()
            ),
        ));
    }
    Ok(())
}
