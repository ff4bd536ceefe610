//! [`Cloud`]: one authenticated session with an OpenStack cloud, shared by
//! every hypervisor's provider (through `Arc`).
//!
//! - Keystone v3 token (see `auth.rs`), renewed before it expires and once
//!   more when a service answers 401; one renewal at a time however many
//!   callers need it (the others wait for its result).
//! - Endpoints from the token's catalog for the configured region and
//!   interface: compute (required), placement, image and block storage
//!   (Cinder v3, catalog type `block-storage` or `volumev3`; optional).
//! - The compute microversion, negotiated once from Nova's version document
//!   (see `microversion.rs`) and sent as `OpenStack-API-Version: compute X.Y`
//!   on every compute call.
//! - A timeout on every HTTP call ([`CloudOptions::request_timeout`]).
//! - One cloud-wide listing of vmlet's servers, kept for
//!   [`CloudOptions::listing_ttl`] and shared by all hosts (see `compute.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::{Mutex, OnceCell};
use vmlet_provider::{Error, ErrorKind, Result};

use crate::auth::{auth_body, endpoint, renewal_margin, TokenBody};
use crate::compute::{Flavor, Server};
use crate::config::{CloudConfig, Secret};
use crate::error::{from_status, from_transport, unexpected_body};
use crate::hosts::Hypervisor;
use crate::microversion::{negotiate, Microversion};

/// Timeouts, polling and caching of a [`Cloud`]. `Default` gives the values
/// named on each field.
#[derive(Clone, Debug)]
pub struct CloudOptions {
    /// Longest any one HTTP call may take, connect to last byte (30 s).
    pub request_timeout: Duration,
    /// Longest a TCP + TLS connect may take (10 s).
    pub connect_timeout: Duration,
    /// How long one listing of all servers serves `list`/`get` of every host
    /// (2 s). Operations of this process invalidate it.
    pub listing_ttl: Duration,
    /// How long the flavor list is kept (60 s); an unknown flavor refreshes it.
    pub flavor_ttl: Duration,
    /// Pause between two polls of a server while waiting for Nova (1 s).
    pub poll_interval: Duration,
    /// Longest wait for a new server to leave BUILD (300 s).
    pub build_timeout: Duration,
    /// Longest wait for a resize, its confirmation or a deletion (300 s).
    pub task_timeout: Duration,
    /// Speak at most this compute microversion, even where Nova and vmlet
    /// know a higher one (`None`: no cap). For clouds whose policy or
    /// proxies misbehave at recent versions; below 2.74 servers are placed
    /// with `availability_zone: "<zone>:<host>"`.
    pub max_microversion: Option<Microversion>,
    /// The Glance image ids VMs may boot (`spec.image`, by id or by a name
    /// that resolves to one of these): the boundary between tenants, since
    /// vmlet's admin user could boot any project's private image. `None`:
    /// any image vmlet's user may use (a single trusted tenant, tests).
    pub allowed_images: Option<Vec<String>>,
    /// The network UUIDs any VM may name in `spec.providerOptions.networks`
    /// (`auto` and `none` are always allowed; so are the UUIDs of
    /// [`CloudOptions::offered_networks`] offered to the VM's namespace):
    /// vmlet's admin user could attach a VM to any project's network.
    /// `None`: any.
    pub allowed_networks: Option<Vec<String>>,
    /// The Neutron networks VMs may join by name (`spec.networks[].name`),
    /// in order: a VM that names none (and no `providerOptions.networks`)
    /// joins the first one offered to its namespace. Empty: VMs cannot use
    /// `spec.networks`.
    pub offered_networks: Vec<crate::OfferedNetwork>,
}

impl Default for CloudOptions {
    fn default() -> Self {
        CloudOptions {
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            listing_ttl: Duration::from_secs(2),
            flavor_ttl: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            build_timeout: Duration::from_secs(300),
            task_timeout: Duration::from_secs(300),
            max_microversion: None,
            allowed_images: None,
            allowed_networks: None,
            offered_networks: Vec::new(),
        }
    }
}

/// The block-storage microversion vmlet speaks (Cinder v3): 3.42 extends
/// attached volumes (Queens and later).
pub(crate) const VOLUME_API_VERSION: &str = "3.42";

/// The OpenStack services vmlet calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Service {
    /// Nova.
    Compute,
    /// Placement.
    Placement,
    /// Glance.
    Image,
    /// Cinder (block storage, API v3).
    BlockStorage,
}

impl Service {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Service::Compute => "Nova",
            Service::Placement => "Placement",
            Service::Image => "Glance",
            Service::BlockStorage => "Cinder",
        }
    }
}

/// One HTTP call to a service: path below the service's endpoint, query,
/// JSON body, and for compute an optional lower microversion.
pub(crate) struct Call {
    pub(crate) service: Service,
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) query: Vec<(String, String)>,
    pub(crate) body: Option<Value>,
    pub(crate) version: Option<Microversion>,
}

impl Call {
    /// A call without query, body or pinned version.
    pub(crate) fn new(service: Service, method: Method, path: impl Into<String>) -> Self {
        Call { service, method, path: path.into(), query: Vec::new(), body: None, version: None }
    }

    /// `GET` on compute.
    pub(crate) fn get(path: impl Into<String>) -> Self {
        Call::new(Service::Compute, Method::GET, path)
    }

    /// `POST` of `body` on compute.
    pub(crate) fn post(path: impl Into<String>, body: Value) -> Self {
        Call::new(Service::Compute, Method::POST, path).body(body)
    }

    #[must_use]
    pub(crate) fn query(mut self, key: &str, value: impl Into<String>) -> Self {
        self.query.push((key.to_owned(), value.into()));
        self
    }

    #[must_use]
    pub(crate) fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    /// Speak at most `version` for this call (a field it reads was removed
    /// later).
    #[must_use]
    pub(crate) fn at_most(mut self, version: Microversion) -> Self {
        self.version = Some(version);
        self
    }

    fn what(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// A successful answer.
pub(crate) struct Reply {
    pub(crate) body: Vec<u8>,
}

/// A token and what came with it.
struct Session {
    token: Secret,
    /// The project vmlet's servers are created in and confined to.
    project: Option<String>,
    renew_at: Instant,
    compute: String,
    placement: Option<String>,
    image: Option<String>,
    block_storage: Option<String>,
}

/// The cloud-wide listing of vmlet's servers (see [`Cloud::servers`]).
pub(crate) struct Listing {
    started: Instant,
    fetched: Instant,
    epoch: u64,
    pub(crate) servers: Arc<Vec<Server>>,
}

/// One OpenStack cloud, authenticated: shared (`Arc<Cloud>`) by the
/// providers of all its hypervisors. Created by [`Cloud::connect`].
///
/// Needs a user with the admin role (or a policy granting the same): vmlet
/// lists all projects' servers (`all_tenants`), reads hypervisors and
/// services, places servers on hosts and migrates them. Servers are created
/// in the token's project.
pub struct Cloud {
    pub(crate) config: CloudConfig,
    pub(crate) options: CloudOptions,
    http: reqwest::Client,
    session: Mutex<Option<Arc<Session>>>,
    compute_version: OnceCell<(Microversion, Microversion)>,
    pub(crate) listing: Mutex<Option<Listing>>,
    listing_epoch: AtomicU64,
    pub(crate) flavors: Mutex<Option<(Instant, Arc<Vec<Flavor>>)>>,
    pub(crate) hosts: Mutex<Option<(Instant, Arc<Vec<Hypervisor>>)>>,
}

impl std::fmt::Debug for Cloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cloud").field("config", &self.config).field("options", &self.options).finish_non_exhaustive()
    }
}

impl Cloud {
    /// A session with the cloud `config` describes: authenticates with
    /// Keystone, finds the compute endpoint and negotiates the compute
    /// microversion.
    ///
    /// Errors: `PermissionDenied` naming Keystone when it refuses the
    /// credentials; `InvalidInput` for a `cacert` that is no PEM certificate,
    /// or a catalog without the compute endpoint for the configured region
    /// and interface (the message names what is missing); `Permanent` for a
    /// Nova older than 2.60; `Transient` when Keystone or Nova cannot be
    /// reached (connect, timeout, TLS: the message names the endpoint).
    pub async fn connect(config: CloudConfig, options: CloudOptions) -> Result<Arc<Cloud>> {
        let cloud = Arc::new(Cloud::new(config, options)?);
        cloud.compute_version().await?;
        Ok(cloud)
    }

    /// A session that authenticates on its first call. Errors: as
    /// [`Cloud::connect`] for the TLS settings only.
    pub fn new(config: CloudConfig, options: CloudOptions) -> Result<Cloud> {
        const OP: &str = "configure OpenStack client";
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(options.request_timeout)
            .connect_timeout(options.connect_timeout)
            .user_agent(concat!("vmlet-openstack/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &config.tls.ca_pem {
            let origin = config.tls.ca_origin.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| {
                Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!("clouds.yaml cacert {origin}: not a PEM certificate: {e}"),
                )
            })?;
            if certs.is_empty() {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!("clouds.yaml cacert {origin}: holds no certificate"),
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        if !config.tls.verify {
            tracing::warn!(cloud = %config.name, "clouds.yaml verify: false: TLS certificates are not checked");
            builder = builder.danger_accept_invalid_certs(true);
        }
        let http = builder.build().map_err(|e| {
            Error::new(OP, ErrorKind::InvalidInput, format!("cannot build the HTTP client: {e}")).with_source(e)
        })?;
        Ok(Cloud {
            config,
            options,
            http,
            session: Mutex::new(None),
            compute_version: OnceCell::new(),
            listing: Mutex::new(None),
            listing_epoch: AtomicU64::new(0),
            flavors: Mutex::new(None),
            hosts: Mutex::new(None),
        })
    }

    /// The cloud's name in clouds.yaml.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The options this cloud was created with.
    pub fn options(&self) -> &CloudOptions {
        &self.options
    }

    /// The compute microversion vmlet speaks with this Nova (negotiated on
    /// the first call), and Nova's own maximum.
    pub async fn compute_microversion(&self) -> Result<(Microversion, Microversion)> {
        self.compute_version().await
    }

    async fn compute_version(&self) -> Result<(Microversion, Microversion)> {
        self.compute_version.get_or_try_init(|| self.negotiate_compute_version()).await.copied()
    }

    /// Whether the catalog has an endpoint of `service`.
    pub(crate) async fn has_service(&self, service: Service) -> Result<bool> {
        let session = self.session().await?;
        Ok(match service {
            Service::Compute => true,
            Service::Placement => session.placement.is_some(),
            Service::Image => session.image.is_some(),
            Service::BlockStorage => session.block_storage.is_some(),
        })
    }

    /// The current token, renewed first when it is close to expiry. One
    /// renewal at a time: callers that arrive during one wait for it.
    async fn session(&self) -> Result<Arc<Session>> {
        let mut guard = self.session.lock().await;
        if let Some(session) = guard.as_ref() {
            if Instant::now() < session.renew_at {
                return Ok(session.clone());
            }
        }
        let session = Arc::new(self.authenticate().await?);
        *guard = Some(session.clone());
        Ok(session)
    }

    /// Forget `used` (a service refused it with 401) unless it was renewed
    /// meanwhile.
    async fn forget_token(&self, used: &Arc<Session>) {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| Arc::ptr_eq(s, used)) {
            *guard = None;
        }
    }

    /// `POST /v3/auth/tokens`.
    async fn authenticate(&self) -> Result<Session> {
        const OP: &str = "authenticate with Keystone";
        let url = format!("{}/auth/tokens", self.config.auth_url);
        let sent = Instant::now();
        let response = self
            .http
            .post(&url)
            .json(&auth_body(&self.config.credentials))
            .send()
            .await
            .map_err(|e| from_transport(OP, "Keystone", &self.config.auth_url, e))?;
        let status = response.status().as_u16();
        let token = response.headers().get("X-Subject-Token").and_then(|v| v.to_str().ok()).map(Secret::new);
        let body = response.bytes().await.map_err(|e| from_transport(OP, "Keystone", &self.config.auth_url, e))?;
        if !(200..300).contains(&status) {
            return Err(from_status(OP, "Keystone", "POST /v3/auth/tokens", status, &body));
        }
        let token = token.ok_or_else(|| {
            Error::new(OP, ErrorKind::Permanent, "Keystone answered without an X-Subject-Token header")
        })?;
        let body: TokenBody =
            serde_json::from_slice(&body).map_err(|e| unexpected_body(OP, "Keystone", "POST /v3/auth/tokens", e))?;
        let lifetime = body.token.lifetime().unwrap_or(Duration::from_secs(3600));
        let renew_at = sent + lifetime.saturating_sub(renewal_margin(lifetime));
        let (region, interface) = (self.config.region.as_deref(), self.config.interface);
        let catalog = &body.token.catalog;
        let find = |service_type: &str| {
            endpoint(catalog, service_type, region, interface).map_err(|why| {
                Error::new(OP, ErrorKind::InvalidInput, format!("cloud {}: {}", self.config.name, why.0))
            })
        };
        let compute = find("compute")?.ok_or_else(|| {
            Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "cloud {}: the token's catalog has no compute service (is the token scoped to a project? set \
                     project_name/project_id in clouds.yaml)",
                    self.config.name
                ),
            )
        })?;
        let placement = find("placement")?;
        let image = find("image")?;
        let block_storage = match find("block-storage")? {
            Some(url) => Some(url),
            None => find("volumev3")?,
        };
        tracing::debug!(cloud = %self.config.name, lifetime_s = lifetime.as_secs(), compute = %compute, "Keystone token");
        let project = body.token.project.map(|p| p.id);
        Ok(Session { token, project, renew_at, compute, placement, image, block_storage })
    }

    /// GET Nova's version document and choose the microversion.
    async fn negotiate_compute_version(&self) -> Result<(Microversion, Microversion)> {
        const OP: &str = "negotiate the compute API microversion";
        let session = self.session().await?;
        let url = version_document_url(&session.compute);
        let response = self
            .http
            .get(&url)
            .header("X-Auth-Token", session.token.expose())
            .send()
            .await
            .map_err(|e| from_transport(OP, "Nova", &url, e))?;
        let status = response.status().as_u16();
        let body = response.bytes().await.map_err(|e| from_transport(OP, "Nova", &url, e))?;
        if !(200..300).contains(&status) {
            return Err(from_status(OP, "Nova", &format!("GET {url}"), status, &body));
        }
        let doc: Value = serde_json::from_slice(&body).map_err(|e| unexpected_body(OP, "Nova", "GET /", e))?;
        let version = doc.get("version").cloned().or_else(|| {
            doc.get("versions")?
                .as_array()?
                .iter()
                .find(|v| v.get("id").and_then(Value::as_str) == Some("v2.1"))
                .cloned()
        });
        let read =
            |key: &str| version.as_ref().and_then(|v| v.get(key)).and_then(Value::as_str).and_then(Microversion::parse);
        let (Some(min), Some(max)) = (read("min_version"), read("version")) else {
            return Err(Error::new(
                OP,
                ErrorKind::Permanent,
                format!("{url} has no v2.1 version document with microversions: is this Nova's compute endpoint?"),
            ));
        };
        let capped = self.options.max_microversion.map_or(max, |cap| max.min(cap));
        let chosen = negotiate(min, capped).map_err(|why| Error::new(OP, ErrorKind::Permanent, why))?;
        tracing::info!(cloud = %self.config.name, microversion = %chosen, nova_max = %max, "compute API");
        Ok((chosen, max))
    }

    /// Send `call`; on 401 forget the token, renew it and send once more.
    /// Non-2xx answers become errors (see `error.rs`).
    pub(crate) async fn send(&self, operation: &'static str, call: &Call) -> Result<Reply> {
        let version = match call.service {
            Service::Compute => Some(self.compute_version().await?.0),
            _ => None,
        };
        let mut renewed = false;
        loop {
            let session = self.session().await?;
            let base = match call.service {
                Service::Compute => Some(session.compute.as_str()),
                Service::Placement => session.placement.as_deref(),
                Service::Image => session.image.as_deref(),
                Service::BlockStorage => session.block_storage.as_deref(),
            }
            .ok_or_else(|| {
                Error::new(
                    operation,
                    ErrorKind::Unsupported,
                    format!("the catalog has no {} endpoint", call.service.name()),
                )
            })?;
            let url = format!("{}{}", service_root(call.service, base), call.path);
            let mut request =
                self.http.request(call.method.clone(), &url).header("X-Auth-Token", session.token.expose());
            if let Some(version) = version {
                let version = call.version.map_or(version, |cap| version.min(cap));
                request = request.header("OpenStack-API-Version", format!("compute {version}"));
            }
            if call.service == Service::Placement {
                request = request.header("OpenStack-API-Version", "placement 1.10");
            }
            if call.service == Service::BlockStorage {
                // 3.42: extending an attached (in-use) volume.
                request = request.header("OpenStack-API-Version", format!("volume {VOLUME_API_VERSION}"));
            }
            if !call.query.is_empty() {
                request = request.query(&call.query);
            }
            if let Some(body) = &call.body {
                request = request.json(body);
            }
            let service = call.service.name();
            let response = request.send().await.map_err(|e| from_transport(operation, service, base, e))?;
            let status = response.status().as_u16();
            let body = response.bytes().await.map_err(|e| from_transport(operation, service, base, e))?;
            if status == 401 {
                if !renewed {
                    renewed = true;
                    self.forget_token(&session).await;
                    continue;
                }
                return Err(Error::new(
                    operation,
                    ErrorKind::PermissionDenied,
                    format!(
                        "{service} refused a freshly renewed Keystone token for {} (HTTP 401): check that the \
                         clouds.yaml user has a role on its project and that {service}'s keystone_authtoken \
                         settings work",
                        call.what()
                    ),
                ));
            }
            if !(200..300).contains(&status) {
                return Err(from_status(operation, service, &call.what(), status, &body));
            }
            return Ok(Reply { body: body.to_vec() });
        }
    }

    /// Send `call` and read its JSON answer.
    pub(crate) async fn json<T: DeserializeOwned>(&self, operation: &'static str, call: &Call) -> Result<T> {
        let reply = self.send(operation, call).await?;
        serde_json::from_slice(&reply.body)
            .map_err(|e| unexpected_body(operation, call.service.name(), &call.what(), e))
    }

    /// Mark the shared server listing out of date (after this process
    /// changed a server).
    pub(crate) fn invalidate_listing(&self) {
        self.listing_epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// The cloud-wide listing of vmlet's servers: a cached one younger than
    /// the TTL (and no older than the last invalidation), unless `fresh`,
    /// which asks for one fetched after this call began. Callers that arrive
    /// while one is fetched share it.
    /// The project of vmlet's token: where its servers are created, and the
    /// only project whose servers it lists or acts on (`None` for a domain-
    /// or system-scoped token, which cannot create servers).
    pub(crate) async fn project_id(&self) -> Result<Option<String>> {
        Ok(self.session().await?.project.clone())
    }

    pub(crate) async fn servers(&self, fresh: bool) -> Result<Arc<Vec<Server>>> {
        let asked = Instant::now();
        let mut guard = self.listing.lock().await;
        let epoch = self.listing_epoch.load(Ordering::SeqCst);
        if let Some(listing) = guard.as_ref() {
            let current = listing.epoch == epoch;
            let young = listing.fetched.elapsed() < self.options.listing_ttl;
            if current && ((!fresh && young) || listing.started >= asked) {
                return Ok(listing.servers.clone());
            }
        }
        let started = Instant::now();
        let servers = Arc::new(self.list_vmlet_servers().await?);
        *guard = Some(Listing { started, fetched: Instant::now(), epoch, servers: servers.clone() });
        Ok(servers)
    }
}

/// The URL of a service's root for `base` (the catalog URL): Glance's
/// catalog entry usually names no version, so `/v2` is added.
fn service_root(service: Service, base: &str) -> String {
    match service {
        Service::Image if !base.ends_with("/v2") => format!("{base}/v2"),
        _ => base.to_owned(),
    }
}

/// Where Nova's version document is for a compute endpoint: the endpoint
/// up to its `v2.1` segment (an endpoint may end in the project id, from
/// old catalogs' `/v2.1/%(tenant_id)s`).
fn version_document_url(compute: &str) -> String {
    match compute.find("/v2.1/") {
        Some(at) => compute[..at + "/v2.1".len()].to_owned() + "/",
        None => format!("{}/", compute.trim_end_matches('/')),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_document_is_at_the_v2_1_segment() {
        assert_eq!(version_document_url("http://h:8774/v2.1"), "http://h:8774/v2.1/");
        assert_eq!(version_document_url("http://h:8774/v2.1/0a1b2c"), "http://h:8774/v2.1/");
        assert_eq!(version_document_url("https://h/compute/v2.1/"), "https://h/compute/v2.1/");
    }

    #[test]
    fn glance_gets_v2_added() {
        assert_eq!(service_root(Service::Image, "http://g:9292"), "http://g:9292/v2");
        assert_eq!(service_root(Service::Image, "http://g:9292/v2"), "http://g:9292/v2");
        assert_eq!(service_root(Service::Compute, "http://n/v2.1"), "http://n/v2.1");
    }

    #[test]
    fn calls_describe_themselves_without_query_or_body() {
        let call = Call::post("/servers/x/action", serde_json::json!({"os-start": null})).query("a", "b");
        assert_eq!(call.what(), "POST /servers/x/action");
    }
}
