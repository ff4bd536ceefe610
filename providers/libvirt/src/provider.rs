//! [`LibvirtProvider`]: the [`Provider`] operations on one libvirt connection.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::Domain;
use vmlet_provider::{
    Backup, CloudInit, Console, Error, ErrorKind, GuestExec, HostImages, HostInfo, Location, Migration, PortForward,
    Provider, Resize, Result, Snapshots, Stats, VmId, VmSpec, VmStatus,
};

use crate::cloud_init::{remove_seed, require_local_host, seed_path, write_seed, BUILD_DEADLINE, DEFAULT_SEED_DIR};
use crate::connection::Connection;
use crate::domains::{find, identity_of, scan, status_of, UuidCache};
use crate::error::{from_libvirt, is_no_domain, is_no_storage_pool, is_operation_invalid, is_unsupported_flags};
use crate::events::DomainEvents;
use crate::in_flight::InFlight;
use crate::kvm_probe::{self, Verdict};
use crate::networks::{self, OfferedNetwork};
use crate::xml::{
    console_log_path, domain_xml, pool_target_path, Accelerator, DomainKind, CONSOLE_LOG_DIR, DEFAULT_IMAGES_DIR,
    DEFAULT_POOL,
};

/// Calls in flight on one connection at most: below libvirtd's default
/// `max_client_requests` (5), past which libvirtd stops reading the client's
/// socket and warns "Client hit max requests limit".
pub(crate) const MAX_CALLS_IN_FLIGHT: usize = 4;

/// Guest-agent calls in flight on one connection at most. Each may wait up to
/// its agent timeout for a guest; the other permits stay free for lifecycle calls.
pub(crate) const MAX_AGENT_CALLS_IN_FLIGHT: usize = 2;

/// Which accelerator a QEMU host's domains use (the host config's
/// `accelerator`); the test driver ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AcceleratorSetting {
    /// KVM where the host's domain capabilities offer it, TCG otherwise.
    #[default]
    Auto,
    /// KVM; connecting fails when the host does not offer it.
    Kvm,
    /// Software emulation (TCG), even where KVM is offered.
    Tcg,
}

/// The VMs of one libvirt host, reached through one libvirt connection URI
/// (`qemu:///system`, `qemu+ssh://host/system`, `test:///<abs path>.xml`).
///
/// Every VM is a persistent domain named [`VmSpec::backend_name`] whose
/// `<metadata>` carries vmlet's identity element (namespace
/// `https://vmlet.io/xmlns/domain/v1`, attributes `uid`, `namespace`, `name`).
/// Domains without it are never listed or touched.
///
/// Blocking libvirt calls run on tokio's blocking pool. The connection reopens
/// itself when libvirtd restarts; each operation is retried once on the new
/// connection. With the test driver (`test:///…`) every new connection starts
/// again from the inventory file, so a reconnect would lose all VMs defined
/// since: state that must outlive the process needs a daemon-held host.
///
/// Capabilities: on QEMU the serial console ([`Console`]: history from virtlogd's
/// log, live attach through `virDomainOpenConsole`), commands in the guest
/// ([`GuestExec`], through qemu-guest-agent), [`Stats`], [`Resize`] (vCPU
/// hot-plug and the balloon within the ceilings a VM was defined with, or its
/// definition for the next start) and [`Migration`] (peer-to-peer live and
/// offline migration to another libvirt host: see
/// [`LibvirtProvider::with_migration_uri`] for how other hosts reach this one)
/// and [`Backup`] (a VM's disk to a qcow2 file on the host, and new disks from
/// such files); on the test driver, which has neither consoles nor agents nor
/// migration nor block jobs, [`Stats`] and [`Resize`].
///
/// cloud-init: a QEMU VM with [`VmSpec::cloud_init`] gets a NoCloud seed image
/// in this host's seed directory ([`LibvirtProvider::with_seed_dir`]),
/// attached as a read-only CD-ROM; the test driver ignores `cloud_init`.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct LibvirtProvider {
    host: Arc<Host>,
    /// This host as a migration destination and how it migrates
    /// ([`LibvirtProvider::with_host_name`], [`LibvirtProvider::with_migration_uri`]).
    pub(crate) migration: Arc<MigrationSettings>,
    /// Where cloud-init seed images go ([`LibvirtProvider::with_seed_dir`]).
    seed_dir: Arc<Path>,
    /// The networks VMs may join ([`LibvirtProvider::with_networks`]).
    networks: Arc<[OfferedNetwork]>,
}

/// How a host takes part in migrations (see `migration.rs`).
#[derive(Clone, Debug)]
pub(crate) struct MigrationSettings {
    /// This host's name in vmlet.
    pub(crate) host_name: String,
    /// The URI other hosts' libvirtd reach this one's with; empty when there is
    /// none (a local connection URI and no configured one).
    pub(crate) uri: String,
    /// Whether live migrations pass `VIR_MIGRATE_UNSAFE`.
    pub(crate) allow_unsafe: bool,
}

/// The shared state behind a [`LibvirtProvider`].
pub(crate) struct Host {
    pub(crate) connection: Connection,
    pub(crate) uuids: Arc<UuidCache>,
    /// The driver behind the URI (and for QEMU the accelerator), chosen at
    /// connect time.
    pub(crate) kind: DomainKind,
    /// Permits for calls on `connection` ([`MAX_CALLS_IN_FLIGHT`]). A call
    /// keeps its permit until libvirt returns, even when its caller stopped
    /// waiting for it.
    calls: Arc<tokio::sync::Semaphore>,
    /// Permits for guest-agent calls ([`MAX_AGENT_CALLS_IN_FLIGHT`]).
    agent_calls: tokio::sync::Semaphore,
    /// One guest-agent call per VM at a time ([`LibvirtProvider::agent_turn`]):
    /// a VM whose agent hangs holds at most one of the host's permits.
    agent_queues: Mutex<HashMap<VmId, Arc<tokio::sync::Semaphore>>>,
    /// The boot (domain id) whose console output each VM last served while
    /// running, so that a stopped VM's log keeps its boot (see `console.rs`).
    pub(crate) boots: Mutex<HashMap<VmId, String>>,
    /// The backups, restores and snapshot operations running in this process
    /// (see `in_flight.rs`).
    in_flight: InFlight,
}

impl LibvirtProvider {
    /// Open a connection to `uri` (a libvirt connection URI, see
    /// <https://libvirt.org/uri.html>) and return a provider for its host.
    ///
    /// Also silences libvirt's default error printing to stderr for the whole
    /// process: errors reach the caller as values instead.
    ///
    /// Errors: `Transient` when the daemon does not answer (not running,
    /// socket missing), `Permanent` for an unknown driver or a refused
    /// connection, with libvirt's error as source.
    pub async fn connect(uri: &str) -> Result<LibvirtProvider> {
        Self::connect_with(uri, AcceleratorSetting::Auto).await
    }

    /// [`LibvirtProvider::connect`], with the accelerator for QEMU domains
    /// chosen by `accelerator`: with `Auto`, `kvm` when the host's domain
    /// capabilities for the `kvm` virt type can be read
    /// (`virConnectGetDomainCapabilities`, what `virsh domcapabilities
    /// --virttype kvm` shows) and, on a local connection, a probe guest
    /// booted the host's kernel under KVM (up to 20 s, once per connect;
    /// `kvm_probe.rs`; a local host without a kernel in `/boot` to probe
    /// with gets TCG), `qemu` (TCG) otherwise.
    ///
    /// Errors: those of `connect`, and `InvalidInput` for `Kvm` on a QEMU host
    /// that does not offer KVM (the message carries libvirt's reason, e.g.
    /// `/dev/kvm` missing or not usable).
    pub async fn connect_with(uri: &str, accelerator: AcceleratorSetting) -> Result<LibvirtProvider> {
        let uri = uri.to_owned();
        let uuids = Arc::new(UuidCache::default());
        let cache = uuids.clone();
        let (connection, kind, hostname) = tokio::task::spawn_blocking(move || {
            virt::error::clear_error_callback();
            let connection = Connection::open_with_events(&uri, DomainEvents::new(uuids.clone()))?;
            let local = is_local_uri(connection.uri());
            let kind = connection.with(|conn| domain_kind(conn, accelerator, local))?;
            let hostname = connection.with(|conn| Ok(conn.hostname().ok()))?;
            Ok::<_, Error>((connection, kind, hostname))
        })
        .await
        .map_err(|e| not_completed("connect to libvirt", e))??;
        if let DomainKind::Qemu(chosen) = kind {
            tracing::info!(libvirt.uri = %connection.uri(), accelerator = chosen.as_str(), "QEMU host");
        }
        let migration = MigrationSettings {
            host_name: hostname.unwrap_or_else(|| connection.uri().to_owned()),
            uri: if is_local_uri(connection.uri()) { String::new() } else { connection.uri().to_owned() },
            allow_unsafe: false,
        };
        Ok(LibvirtProvider {
            host: Arc::new(Host {
                connection,
                uuids: cache,
                kind,
                calls: Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_IN_FLIGHT)),
                agent_calls: tokio::sync::Semaphore::new(MAX_AGENT_CALLS_IN_FLIGHT),
                agent_queues: Mutex::default(),
                boots: Mutex::default(),
                in_flight: InFlight::default(),
            }),
            migration: Arc::new(migration),
            seed_dir: Arc::from(Path::new(DEFAULT_SEED_DIR)),
            networks: Arc::from([]),
        })
    }

    /// The directory that holds the cloud-init seed images of this host's VMs
    /// (an absolute path on the libvirt host, which is this machine: seeds
    /// need a local connection). Each VM with [`VmSpec::cloud_init`] gets
    /// `<dir>/<domain name>_<vm uid>.iso` (mode 0644, readable by QEMU),
    /// written when it is defined and removed when it is undefined; the
    /// directory is created (0755) when missing. Default:
    /// `/var/lib/vmlet/seeds`.
    #[must_use]
    pub fn with_seed_dir(mut self, dir: PathBuf) -> Self {
        self.seed_dir = Arc::from(dir);
        self
    }

    /// Write the NoCloud seed of `spec` into the seed directory and return its
    /// path. Errors: `Unsupported` on a remote connection; those of
    /// [`write_seed`].
    async fn write_seed(&self, spec: &VmSpec, cloud_init: &CloudInit) -> Result<String> {
        const OP: &str = "write cloud-init seed";
        require_local_host(self.uri())?;
        let path = seed_path(&self.seed_dir, &spec.backend_name(), &spec.id);
        let Some(source) = path.to_str().filter(|_| path.is_absolute()) else {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "the seed directory {} must be an absolute UTF-8 path, as libvirt names disk files",
                    self.seed_dir.display()
                ),
            ));
        };
        write_seed(&self.seed_dir, &path, cloud_init, BUILD_DEADLINE).await?;
        tracing::info!(path = source, "cloud-init seed written");
        Ok(source.to_owned())
    }

    /// The networks this host offers VMs, in order: a VM's
    /// `spec.networks[].name` must be one offered to its namespace, and a VM
    /// that names none gets the first of those (see `networks.rs`). Default:
    /// none, so VMs get no network interface at all: QEMU's user-mode
    /// network, which hands the guest the host's loopback, is never used.
    /// Checked when a VM is defined; a defined VM keeps its interfaces.
    #[must_use]
    pub fn with_networks(mut self, networks: Vec<OfferedNetwork>) -> Self {
        self.networks = Arc::from(networks);
        self
    }

    /// Name this host as vmlet does (its node name), for
    /// [`Migration::target`]. Default: the libvirt host's hostname
    /// (`virConnectGetHostname`), or the connection URI when it has none.
    #[must_use]
    pub fn with_host_name(mut self, name: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.migration).host_name = name.into();
        self
    }

    /// The libvirt URI other hosts' libvirtd use to reach this host's libvirtd
    /// during a peer-to-peer migration to it ([`Migration::target`]), e.g.
    /// `qemu+tcp://10.0.0.2/system`: the *source daemon* opens it, not vmlet,
    /// so it must work from the other hosts with the source daemon's
    /// credentials (for `qemu+ssh://`, root's SSH key on the source host).
    ///
    /// Default: the connection URI when it names a remote host
    /// (`qemu+tcp://kvm-2/system`). A local connection (`qemu:///system`) has
    /// no usable default, since another host's daemon cannot reach
    /// `qemu:///system`: without this such a host cannot be a migration
    /// target (a migration to it fails with `InvalidInput`), but it can still
    /// migrate its VMs away.
    #[must_use]
    pub fn with_migration_uri(mut self, uri: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.migration).uri = uri.into();
        self
    }

    /// Let live migrations from this host pass `VIR_MIGRATE_UNSAFE`: migrate
    /// VMs whose disks libvirt does not know to be safely shared (a disk on a
    /// local file system, or shared storage without `cache='none'`). Only for
    /// disks that both hosts see at the same path on storage they really share
    /// (two daemons on one machine, as in the tests); with a disk that the
    /// target holds as a different file, the guest would continue on that file.
    /// Default: `false`, and such a migration fails with `Unsupported`.
    #[must_use]
    pub fn with_unsafe_migration(mut self, allow: bool) -> Self {
        Arc::make_mut(&mut self.migration).allow_unsafe = allow;
        self
    }

    /// The backups, restores and snapshot operations this host runs now.
    pub(crate) fn in_flight(&self) -> &InFlight {
        &self.host.in_flight
    }

    /// VM `id`'s turn for a guest-agent call: first its own queue (one call
    /// per VM at a time), then one of the host's
    /// [`MAX_AGENT_CALLS_IN_FLIGHT`] permits, held until the returned turn
    /// is dropped. So a VM whose agent does not answer (each call waits up
    /// to libvirt's agent timeout) delays its own calls only, and other VMs'
    /// calls find a host permit. Errors: `Permanent` (for `operation`) when
    /// the queues were closed (never, while the provider lives).
    pub(crate) async fn agent_turn(&self, operation: &'static str, id: &VmId) -> Result<AgentTurn<'_>> {
        let closed = |_| Error::new(operation, ErrorKind::Permanent, "the provider's guest-agent queue was closed");
        let queue = {
            let mut queues = self.host.agent_queues.lock().unwrap_or_else(PoisonError::into_inner);
            // Queues nobody waits on or holds are dropped as others are made.
            queues.retain(|_, queue| Arc::strong_count(queue) > 1);
            Arc::clone(queues.entry(id.clone()).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(1))))
        };
        let vm = queue.acquire_owned().await.map_err(closed)?;
        let host = self.host.agent_calls.acquire().await.map_err(closed)?;
        Ok(AgentTurn { _host: host, _vm: vm })
    }

    /// The accelerator of this host's QEMU domains; `None` on the test driver.
    pub fn accelerator(&self) -> Option<Accelerator> {
        match self.host.kind {
            DomainKind::Qemu(accelerator) => Some(accelerator),
            DomainKind::Test => None,
        }
    }

    /// The libvirt connection URI this provider was opened with.
    pub fn uri(&self) -> &str {
        self.host.connection.uri()
    }

    /// Run `f` with the host and a live connection on the blocking pool, once
    /// one of the connection's [`MAX_CALLS_IN_FLIGHT`] permits is free.
    pub(crate) async fn blocking<T, F>(&self, operation: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&Host, &Connect) -> Result<T> + Send + 'static,
    {
        self.spawn_blocking(operation, f).await?.await.map_err(|e| not_completed(operation, e))?
    }

    /// [`LibvirtProvider::blocking`], given up with a `Transient` error after
    /// `deadline` (waiting for a permit included). The call itself cannot be
    /// cancelled: it goes on in the background, holding its permit, until
    /// libvirt returns.
    pub(crate) async fn blocking_within<T, F>(&self, operation: &'static str, deadline: Duration, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&Host, &Connect) -> Result<T> + Send + 'static,
    {
        match tokio::time::timeout(deadline, self.blocking(operation, f)).await {
            Ok(result) => result,
            Err(_) => Err(Error::new(
                operation,
                ErrorKind::Transient,
                format!("libvirt did not answer within {}s", deadline.as_secs_f32()),
            )),
        }
    }

    /// Start `f` with the host and a live connection on the blocking pool once
    /// one of the connection's [`MAX_CALLS_IN_FLIGHT`] permits is free; the
    /// task keeps the permit until `f` returns.
    pub(crate) async fn spawn_blocking<T, F>(
        &self,
        operation: &'static str,
        f: F,
    ) -> Result<tokio::task::JoinHandle<Result<T>>>
    where
        T: Send + 'static,
        F: Fn(&Host, &Connect) -> Result<T> + Send + 'static,
    {
        let permit = Arc::clone(&self.host.calls)
            .acquire_owned()
            .await
            .map_err(|_| Error::new(operation, ErrorKind::Permanent, "the provider's call queue was closed"))?;
        let host = Arc::clone(&self.host);
        Ok(tokio::task::spawn_blocking(move || {
            let _permit = permit;
            host.connection.with(|conn| f(&host, conn))
        }))
    }

    /// The driver behind this provider's connection.
    pub(crate) fn domain_kind(&self) -> DomainKind {
        self.host.kind
    }
}

/// A VM's turn for one guest-agent call ([`LibvirtProvider::agent_turn`]).
pub(crate) struct AgentTurn<'a> {
    _host: tokio::sync::SemaphorePermit<'a>,
    _vm: tokio::sync::OwnedSemaphorePermit,
}

/// The error for a blocking task that panicked or was cancelled.
pub(crate) fn not_completed(operation: &'static str, err: tokio::task::JoinError) -> Error {
    Error::new(operation, ErrorKind::Permanent, format!("libvirt call did not complete: {err}"))
}

impl Host {
    /// Where libvirt keeps this host's QEMU logs (`<domain>.log`), when vmlet
    /// can read them: a local system daemon's (`qemu:///system`).
    pub(crate) fn qemu_logs(&self) -> Option<&'static Path> {
        (self.connection.uri() == "qemu:///system").then(|| Path::new("/var/log/libvirt/qemu"))
    }

    /// The domain with identity `id`, or a `NotFound` error naming it.
    pub(crate) fn require(&self, conn: &Connect, operation: &'static str, id: &VmId) -> Result<Domain> {
        find(conn, &self.uuids, id)?
            .ok_or_else(|| Error::new(operation, ErrorKind::NotFound, format!("no domain carries vmlet uid {id}")))
    }

    /// The status of the domain with identity `id`, if there is one.
    fn get(&self, conn: &Connect, id: &VmId) -> Result<Option<VmStatus>> {
        let Some(domain) = find(conn, &self.uuids, id)? else {
            return Ok(None);
        };
        match identity_of(&domain) {
            Ok(Some(identity)) => status_of(&domain, identity, self.qemu_logs()).map(Some),
            Ok(None) => Ok(None),
            Err(err) if is_no_domain(&err) => Ok(None),
            Err(err) => Err(from_libvirt("read domain metadata", err)),
        }
    }

    /// Forget what this host remembered about VM `id` (its cached UUID and
    /// console boot): the VM left the host.
    pub(crate) fn forget(&self, id: &VmId) {
        self.uuids.remove(id);
        self.boots.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(id);
    }

    /// Whether this host holds VM `id`, found from the cache or by the name
    /// vmlet gives it: one lookup, never a scan of every domain (asked for
    /// every VM of every other host when a VM is first placed).
    fn locate(&self, conn: &Connect, id: &VmId, name: &str) -> Result<Location> {
        if self.uuids.get(id).is_some() {
            return Ok(match self.get(conn, id)? {
                Some(status) => Location::ThisHost(status),
                None => Location::NotOnThisHost,
            });
        }
        let domain = match conn.lookup_domain_by_name(name) {
            Ok(domain) => domain,
            Err(err) if is_no_domain(&err) => return Ok(Location::NotOnThisHost),
            Err(err) => return Err(from_libvirt("look up domain", err)),
        };
        match identity_of(&domain) {
            Ok(Some(identity)) if identity.id == *id => {
                if let Ok(uuid) = domain.uuid_string() {
                    self.uuids.insert(id.clone(), uuid);
                }
                status_of(&domain, identity, self.qemu_logs()).map(Location::ThisHost)
            }
            Ok(_) => Ok(Location::NotOnThisHost),
            Err(err) if is_no_domain(&err) => Ok(Location::NotOnThisHost),
            Err(err) => Err(from_libvirt("read domain metadata", err)),
        }
    }

    /// Define `spec` unless its domain exists, with the cloud-init seed image
    /// at `seed` attached when given.
    fn ensure_defined(
        &self,
        conn: &Connect,
        spec: &VmSpec,
        seed: Option<&str>,
        networks: &[OfferedNetwork],
    ) -> Result<VmStatus> {
        const OP: &str = "define domain";
        if let Some(status) = self.get(conn, &spec.id)? {
            return Ok(status);
        }
        let kind = self.kind;
        validate(spec, kind)?;
        // The test driver's domains get no devices, but a name the host
        // does not offer is refused on it too.
        let nics = networks::resolve(networks, spec)?;
        let nics = if kind.is_qemu() { nics } else { Vec::new() };
        refuse_macs_in_use(conn, &nics)?;
        let name = spec.backend_name();
        match conn.lookup_domain_by_name(&name) {
            Ok(domain) => return Err(name_taken(&name, &domain)),
            Err(err) if is_no_domain(&err) => {}
            Err(err) => return Err(from_libvirt(OP, err)),
        }
        let uuid = uuid::Uuid::new_v4().to_string();
        // Known before the domain exists: libvirt's event loop may hand over
        // the event of its definition before `define_domain_xml` returns
        // here, and an event of a UUID the cache does not know is dropped.
        self.uuids.insert(spec.id.clone(), uuid.clone());
        let domain = conn.define_domain_xml(&domain_xml(spec, kind, &uuid, seed, &nics)).map_err(|e| {
            self.uuids.remove(&spec.id);
            from_libvirt(OP, e)
        })?;
        let identity = identity_of(&domain).map_err(|e| from_libvirt(OP, e))?.ok_or_else(|| {
            Error::new(
                OP,
                ErrorKind::Permanent,
                format!(
                    "domain {name} was defined but libvirt kept no vmlet metadata; undefine it (virsh undefine {name})"
                ),
            )
        })?;
        let status = status_of(&domain, identity, self.qemu_logs())?;
        self.uuids.insert(spec.id.clone(), status.backend_id.clone());
        tracing::info!(domain = %name, domain.uuid = %status.backend_id, "domain defined");
        Ok(status)
    }

    fn start(&self, conn: &Connect, id: &VmId) -> Result<()> {
        const OP: &str = "start domain";
        let domain = self.require(conn, OP, id)?;
        if is_active(&domain, OP)? {
            return Ok(());
        }
        if self.kind.is_qemu() {
            refuse_user_mode_network(&domain)?;
            prepare_console_log_dir(self.connection.uri());
        }
        match domain.create() {
            Ok(()) => Ok(()),
            // Started by someone else since the check.
            Err(err) if is_operation_invalid(&err) && is_active(&domain, OP)? => Ok(()),
            Err(err) => Err(from_libvirt(OP, err)),
        }
    }

    fn stop(&self, conn: &Connect, id: &VmId, how: Stop) -> Result<()> {
        let operation = how.operation();
        let Some(domain) = find(conn, &self.uuids, id)? else {
            return Ok(());
        };
        if !is_active(&domain, operation)? {
            return Ok(());
        }
        // A paused (or PM-suspended) guest cannot hear the power button, and
        // libvirt refuses to press it: such a domain is powered off at once,
        // or a VM stopped by a guest's emulation failure or a full disk could
        // never be stopped or deleted.
        let paused = domain
            .state()
            .is_ok_and(|(state, _)| crate::domains::power_from_libvirt(state) == vmlet_provider::PowerState::Paused);
        let result = match how {
            Stop::Shutdown if paused => {
                tracing::warn!(vm.uid = %id, "the domain is paused and cannot shut down by itself; powering it off");
                domain.destroy()
            }
            Stop::Shutdown => domain.shutdown(),
            Stop::Destroy => domain.destroy(),
        };
        match result {
            Ok(()) => Ok(()),
            // Stopped by itself or by someone else since the check.
            Err(err) if is_operation_invalid(&err) && !is_active(&domain, operation)? => Ok(()),
            Err(err) => Err(from_libvirt(operation, err)),
        }
    }

    /// Undefine VM `id`'s domain, then remove its console log and its
    /// cloud-init seed (in `seed_dir`), if any.
    fn undefine(&self, conn: &Connect, id: &VmId, seed_dir: &Path) -> Result<()> {
        const OP: &str = "undefine domain";
        let Some(domain) = find(conn, &self.uuids, id)? else {
            return Ok(());
        };
        if is_active(&domain, OP)? {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("domain for vmlet uid {id} is still active; destroy it first"),
            ));
        }
        let uuid = domain.uuid_string().ok();
        let name = domain.name().ok();
        // Also remove what libvirt keeps beside the definition; drivers that do
        // not know a flag (the test driver rejects NVRAM) get fewer.
        // Checkpoints (incremental backups' bases): libvirt refuses to
        // undefine a domain that has any without the flag; their bitmaps stay
        // in the disk file.
        let all = virt::sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | virt::sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA;
        let checkpoints = all | virt::sys::VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA;
        let mut result = Ok(());
        for flags in [checkpoints | virt::sys::VIR_DOMAIN_UNDEFINE_NVRAM, checkpoints, all, 0] {
            result = domain.undefine_flags(flags);
            match &result {
                Err(err) if flags != 0 && is_unsupported_flags(err) => continue,
                _ => break,
            }
        }
        match result {
            Ok(()) => {}
            Err(err) if is_no_domain(&err) => {}
            Err(err) => return Err(from_libvirt(OP, err)),
        }
        self.forget(id);
        if let (DomainKind::Qemu(_), Some(uuid)) = (self.kind, uuid) {
            remove_console_log(self.connection.uri(), &uuid);
        }
        if let (DomainKind::Qemu(_), Some(name)) = (self.kind, name) {
            if is_local_uri(self.connection.uri()) {
                remove_seed(&seed_path(seed_dir, &name, id));
            }
        }
        Ok(())
    }

    fn host_info(&self, conn: &Connect) -> Result<HostInfo> {
        const OP: &str = "read host info";
        let node = conn.node_info().map_err(|e| from_libvirt(OP, e))?;
        Ok(HostInfo {
            cpus: node.cpus,
            memory_bytes: node.memory.saturating_mul(1024),
            architecture: kubernetes_architecture(&node.model),
            hypervisor: hypervisor(conn, OP)?,
            accelerator: match self.kind {
                DomainKind::Qemu(accelerator) => Some(accelerator.as_str().to_owned()),
                DomainKind::Test => None,
            },
            storage_roots: default_storage_roots(conn)?,
        })
    }
}

/// The host's default storage roots: the target path of the storage pool named
/// [`DEFAULT_POOL`] (active or not), or [`DEFAULT_IMAGES_DIR`] when the host
/// has no such pool, the pool has no target path, or the driver keeps no
/// pools. Errors: `Transient` when libvirtd does not answer; other failures
/// (e.g. an ACL that hides pools) fall back to [`DEFAULT_IMAGES_DIR`], logged
/// at debug level.
fn default_storage_roots(conn: &Connect) -> Result<Vec<String>> {
    const OP: &str = "read the default storage pool";
    let fallback = || Ok(vec![DEFAULT_IMAGES_DIR.to_owned()]);
    let xml = conn.lookup_storage_pool_by_name(DEFAULT_POOL).and_then(|pool| pool.xml_desc(0));
    match xml {
        Ok(xml) => match pool_target_path(&xml) {
            Some(path) => Ok(vec![path]),
            None => fallback(),
        },
        Err(err) if is_no_storage_pool(&err) => fallback(),
        Err(err) => {
            let err = from_libvirt(OP, err);
            if err.is_transient() {
                return Err(err);
            }
            tracing::debug!(
                pool = DEFAULT_POOL,
                error = %err,
                "the default storage pool cannot be read; the default images directory is the storage root"
            );
            fallback()
        }
    }
}

/// How [`Host::stop`] stops a domain.
#[derive(Clone, Copy)]
enum Stop {
    /// `virDomainShutdown`: ACPI power button, the guest decides.
    Shutdown,
    /// `virDomainDestroy`: power off at once.
    Destroy,
}

impl Stop {
    fn operation(self) -> &'static str {
        match self {
            Stop::Shutdown => "shut down domain",
            Stop::Destroy => "destroy domain",
        }
    }
}

/// Create [`CONSOLE_LOG_DIR`] for virtlogd when libvirtd runs on this machine
/// (the URI names no host); a failure is logged, and the domain's start then
/// reports what virtlogd could not open.
fn prepare_console_log_dir(uri: &str) {
    if !is_local_uri(uri) {
        return;
    }
    if let Err(err) = std::fs::create_dir_all(CONSOLE_LOG_DIR) {
        tracing::warn!(path = CONSOLE_LOG_DIR, error = %err, "cannot create the console log directory");
    }
}

/// Remove the console log of the undefined domain `uuid` (vmlet's file, not the
/// user's); failures are logged.
fn remove_console_log(uri: &str, uuid: &str) {
    if !is_local_uri(uri) {
        return;
    }
    let path = console_log_path(uuid);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => tracing::warn!(path = %path, error = %err, "cannot remove the console log"),
    }
}

/// True when `uri` names no remote host (`qemu:///system`, `qemu+unix:///system`).
pub(crate) fn is_local_uri(uri: &str) -> bool {
    uri.split_once("://").is_some_and(|(_, rest)| rest.starts_with('/'))
}

/// Whether `domain` is active (running, paused or shutting down).
pub(crate) fn is_active(domain: &Domain, operation: &'static str) -> Result<bool> {
    domain.is_active().map_err(|e| from_libvirt(operation, e))
}

/// Whether KVM runs a guest on the host of local connection `uri`: boots
/// `kernel` (a path QEMU can read there) in a transient KVM domain without
/// disks and waits up to `wait` for its first console line, as
/// `accelerator: auto` does with the host's own kernel (see
/// [`LibvirtProvider::connect_with`]). `Ok(None)` when KVM runs it,
/// `Ok(Some(reason))` when it does not.
///
/// Errors: those of [`LibvirtProvider::connect`]; `InvalidInput` for a
/// remote connection (the probe reads its console log where vmlet runs).
pub async fn probe_kvm(uri: &str, kernel: &str, wait: std::time::Duration) -> Result<Option<String>> {
    const OP: &str = "probe KVM";
    if !is_local_uri(uri) {
        return Err(Error::new(OP, ErrorKind::InvalidInput, format!("{uri} is no local connection: no probe")));
    }
    let (uri, kernel) = (uri.to_owned(), kernel.to_owned());
    tokio::task::spawn_blocking(move || {
        let connection = Connection::open(&uri)?;
        connection.with(|conn| {
            Ok(match kvm_probe::probe_with(conn, &kernel, wait) {
                Verdict::Runs => None,
                Verdict::Fails(why) | Verdict::NotProbed(why) => Some(why),
            })
        })
    })
    .await
    .map_err(|e| not_completed(OP, e))?
}

/// The domain flavour this connection's driver takes; for QEMU, with the
/// accelerator `setting` resolves to on this host: with `Auto`, KVM only
/// where the capabilities offer it and, on a `local` connection, a probe
/// guest ran under it (see `kvm_probe.rs`).
fn domain_kind(conn: &Connect, setting: AcceleratorSetting, local: bool) -> Result<DomainKind> {
    const OP: &str = "connect to libvirt";
    let driver = conn.driver_type().map_err(|e| from_libvirt(OP, e))?;
    match driver.as_str() {
        "TEST" => Ok(DomainKind::Test),
        "QEMU" => {
            let kvm = match setting {
                AcceleratorSetting::Tcg => return Ok(DomainKind::Qemu(Accelerator::Tcg)),
                AcceleratorSetting::Auto | AcceleratorSetting::Kvm => {
                    conn.domain_capabilities(None, Some("x86_64"), None, Some("kvm"), 0)
                }
            };
            match (kvm, setting) {
                (Ok(_), AcceleratorSetting::Auto) if local => match kvm_probe::probe(conn, kvm_probe::PROBE_WAIT) {
                    Verdict::Runs => Ok(DomainKind::Qemu(Accelerator::Kvm)),
                    Verdict::NotProbed(why) => {
                        tracing::warn!(
                            reason = %why,
                            "KVM is offered but vmlet could not check that it runs a guest; QEMU domains use TCG \
                             (set accelerator: kvm to use KVM unchecked)"
                        );
                        Ok(DomainKind::Qemu(Accelerator::Tcg))
                    }
                    Verdict::Fails(why) => {
                        tracing::warn!(
                            reason = %why,
                            "KVM is offered but does not run a guest here; QEMU domains use TCG (node label \
                             vmlet.io/accelerator=tcg; set accelerator: kvm to insist)"
                        );
                        Ok(DomainKind::Qemu(Accelerator::Tcg))
                    }
                },
                (Ok(_), _) => Ok(DomainKind::Qemu(Accelerator::Kvm)),
                (Err(err), AcceleratorSetting::Kvm) => Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "accelerator kvm: the host offers no KVM ({}); make /dev/kvm usable by QEMU \
                         (group kvm, mode 0660) or set accelerator: auto or tcg",
                        err.message()
                    ),
                )),
                (Err(err), _) => {
                    tracing::info!(reason = %err.message(), "no KVM on this host; QEMU domains use TCG");
                    Ok(DomainKind::Qemu(Accelerator::Tcg))
                }
            }
        }
        other => Err(Error::new(
            OP,
            ErrorKind::Unsupported,
            format!("libvirt driver {other} is not supported; use a qemu:// or test:// URI"),
        )),
    }
}

/// Reject specs libvirt cannot express.
fn validate(spec: &VmSpec, kind: DomainKind) -> Result<()> {
    const OP: &str = "define domain";
    let invalid = |message: String| Err(Error::new(OP, ErrorKind::InvalidInput, message));
    if spec.cpus == 0 {
        return invalid("cpus must be at least 1".into());
    }
    if spec.memory_bytes < 1024 * 1024 {
        return invalid(format!("memory must be at least 1 MiB, got {} bytes", spec.memory_bytes));
    }
    if spec.backend_name().contains('/') {
        return invalid(format!("domain name {} must not contain '/'", spec.backend_name()));
    }
    if kind.is_qemu() {
        if let Some(image) = spec.image.as_ref().filter(|image| !image.starts_with('/')) {
            return invalid(format!("image {image} must be an absolute path to a disk file on the libvirt host"));
        }
        if let Some(boot) = &spec.kernel_boot {
            for path in std::iter::once(&boot.kernel).chain(&boot.initrd) {
                if !path.starts_with('/') {
                    return invalid(format!("kernel boot file {path} must be an absolute path on the libvirt host"));
                }
            }
        }
    }
    Ok(())
}

/// Refuse to start a domain with QEMU's user-mode network (`<interface
/// type='user'>`, which vmlet gave every domain before hosts offered
/// networks): it hands the guest the host's loopback at 10.0.2.2. A running
/// one is left running; a stopped one stays stopped until it is defined
/// anew. Errors: `InvalidInput` saying so; those of reading the definition.
fn refuse_user_mode_network(domain: &Domain) -> Result<()> {
    const OP: &str = "start domain";
    let xml = domain.xml_desc(virt::sys::VIR_DOMAIN_XML_INACTIVE).map_err(|e| from_libvirt(OP, e))?;
    if !crate::xml::interfaces(&xml).iter().any(|nic| nic.kind == "user") {
        return Ok(());
    }
    let name = domain.name().unwrap_or_default();
    Err(Error::new(
        OP,
        ErrorKind::InvalidInput,
        format!(
            "domain {name} has QEMU's user-mode network interface (from a vmlet before hosts offered networks), \
             which hands the guest the host's loopback (10.0.2.2); vmlet does not start it. Delete the \
             VirtualMachine with deletionPolicy Retain, undefine the domain (virsh undefine {name}; its disks \
             are kept) and create the VirtualMachine again to give it the host's networks"
        ),
    ))
}

/// Refuse fixed MAC addresses another domain of this host already has: a
/// clone of another VM's MAC would get that VM's DHCP lease (and with it its
/// address as pod IP) and disturb its traffic. Errors: `InvalidInput` naming
/// `spec.networks[<i>].macAddress` and the domain; those of listing domains.
fn refuse_macs_in_use(conn: &Connect, nics: &[networks::Nic]) -> Result<()> {
    const OP: &str = "define domain";
    if nics.iter().all(|nic| nic.mac.is_none()) {
        return Ok(());
    }
    let domains = conn.list_all_domains(0).map_err(|e| from_libvirt(OP, e))?;
    for domain in domains {
        let Ok(xml) = domain.xml_desc(virt::sys::VIR_DOMAIN_XML_INACTIVE) else { continue };
        let used: Vec<String> = crate::xml::interfaces(&xml).into_iter().filter_map(|nic| nic.mac).collect();
        if let Some(i) = nics.iter().position(|nic| nic.mac.as_ref().is_some_and(|mac| used.contains(mac))) {
            let name = domain.name().unwrap_or_default();
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.networks[{i}].macAddress: {} is already the MAC address of domain {name} on this host; \
                     give another one, or leave it out and libvirt picks a free one",
                    nics[i].mac.as_deref().unwrap_or_default()
                ),
            ));
        }
    }
    Ok(())
}

/// The error for a domain name that a domain without this VM's identity holds.
fn name_taken(name: &str, domain: &Domain) -> Error {
    let owner = match identity_of(domain) {
        Ok(Some(identity)) => {
            format!("it belongs to VirtualMachine {}/{} (uid {})", identity.namespace, identity.name, identity.id)
        }
        Ok(None) => "it carries no vmlet identity, so vmlet did not create it".to_owned(),
        Err(err) => format!("its vmlet identity could not be read ({})", err.message()),
    };
    Error::new(
        "define domain",
        ErrorKind::Permanent,
        format!(
            "a domain named {name} already exists on this host and {owner}; \
             rename it (virsh domrename) or remove it (virsh undefine) to let vmlet define its own"
        ),
    )
}

/// `libvirt <version> (<driver>)`, e.g. `libvirt 9.0.0 (QEMU)`.
fn hypervisor(conn: &Connect, operation: &'static str) -> Result<String> {
    let driver = conn.driver_type().map_err(|e| from_libvirt(operation, e))?;
    let version = conn.lib_version().map_err(|e| from_libvirt(operation, e))?;
    Ok(format!("libvirt {}.{}.{} ({driver})", version / 1_000_000, version / 1_000 % 1_000, version % 1_000))
}

/// Kubernetes' name (`GOARCH`) for a libvirt/uname CPU architecture; unknown
/// ones pass through unchanged.
fn kubernetes_architecture(arch: &str) -> String {
    match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "i686" | "i586" | "i486" | "i386" => "386",
        "armv7l" | "armv6l" => "arm",
        "ppc64le" => "ppc64le",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        other => other,
    }
    .to_owned()
}

#[async_trait::async_trait]
impl Provider for LibvirtProvider {
    /// Always `libvirt`.
    fn kind(&self) -> &'static str {
        "libvirt"
    }

    /// Asks the daemon for its library version (one round trip). Errors:
    /// `Transient` when it does not answer even after one reconnect.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt"))]
    async fn ping(&self) -> Result<()> {
        const OP: &str = "ping libvirt";
        self.blocking(OP, |_, conn| {
            conn.lib_version().map(drop).map_err(|e| {
                let mut err = from_libvirt(OP, e);
                err.kind = ErrorKind::Transient;
                err
            })
        })
        .await
    }

    /// `virNodeGetInfo` (logical CPUs, memory KiB → bytes, CPU model mapped to
    /// Kubernetes' architecture names), `libvirt <version> (<driver>)`, and as
    /// default storage root the target path of the storage pool named `default`
    /// (`virsh pool-dumpxml default`), `/var/lib/libvirt/images` without one.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt"))]
    async fn host_info(&self) -> Result<HostInfo> {
        self.blocking("read host info", |host, conn| host.host_info(conn)).await
    }

    /// Scans all domains, defined and active; one metadata read per domain.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt"))]
    async fn list(&self) -> Result<Vec<VmStatus>> {
        self.blocking("list domains", |host, conn| {
            let mut statuses = Vec::new();
            for (domain, identity) in scan(conn, &host.uuids)? {
                match status_of(&domain, identity, host.qemu_logs()) {
                    Ok(status) => statuses.push(status),
                    // Undefined during the scan.
                    Err(err) if err.kind == ErrorKind::NotFound => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(statuses)
        })
        .await
    }

    /// One lookup by the cached domain UUID, verified against its metadata; a
    /// full scan when the cache misses.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>> {
        let id = id.clone();
        self.blocking("get domain", move |host, conn| host.get(conn, &id)).await
    }

    /// This host only (one libvirt connection sees one host), from the cache
    /// or a lookup by `backend_name`, never a scan of every domain.
    async fn locate(&self, id: &VmId, backend_name: &str) -> Result<Location> {
        let (id, name) = (id.clone(), backend_name.to_owned());
        self.blocking("locate domain", move |host, conn| host.locate(conn, &id, &name)).await
    }

    /// Defines a persistent domain named [`VmSpec::backend_name`]: `<domain
    /// type='test'>` on the test driver, `<domain type='kvm'>` or `<domain
    /// type='qemu'>` (see [`AcceleratorSetting`]; machine `pc`, ACPI, direct kernel boot from
    /// `spec.kernel_boot`, a virtio disk from `spec.image` and one per
    /// `spec.disks` in the format it gives (a claim's missing image made
    /// first: raw, sparse), a serial console
    /// recorded by virtlogd, a qemu-guest-agent channel, user-mode networking,
    /// and `spec.cloud_init` as a NoCloud seed image written into the seed
    /// directory and attached as a read-only IDE CD-ROM) on QEMU. The test
    /// driver ignores `spec.image`, `spec.kernel_boot` and `spec.cloud_init`.
    /// An existing domain is returned as it is (its seed is not written
    /// again). The domain UUID is random, so a redefined VM gets a new backend
    /// id. Errors: `InvalidInput` for zero CPUs, less than 1 MiB or a relative
    /// image or kernel path, an empty cloud-init instance id, and for any
    /// `spec.providerOptions` key (libvirt reads none); `Unsupported` for
    /// drivers other than test and QEMU, and for `spec.cloud_init` on a remote
    /// connection or without `genisoimage`; `Transient` when the seed image
    /// was not built within a minute; `Permanent` when the name is taken by a
    /// domain without this identity (the seed just written is removed again
    /// when the define fails).
    #[instrument(skip(self, spec), fields(provider = "libvirt", vm.uid = %spec.id, vm.name = %spec.name))]
    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus> {
        if let Some(key) = spec.options.keys().next() {
            return Err(Error::new(
                "define domain",
                ErrorKind::InvalidInput,
                format!(
                    "spec.providerOptions.{key}: the libvirt back end reads no provider options; remove \
                     spec.providerOptions (its keys are for other back ends, e.g. OpenStack's flavor)"
                ),
            ));
        }
        if !spec.disks.is_empty() && self.host.kind.is_qemu() {
            if let Some(status) = self.get(&spec.id).await? {
                return Ok(status);
            }
            validate(spec, self.host.kind)?;
            make_data_disks(self.uri(), &spec.disks).await?;
        }
        let seed = match &spec.cloud_init {
            Some(cloud_init) if self.host.kind.is_qemu() => {
                if let Some(status) = self.get(&spec.id).await? {
                    return Ok(status);
                }
                validate(spec, self.host.kind)?;
                Some(self.write_seed(spec, cloud_init).await?)
            }
            _ => None,
        };
        let (spec, source, networks) = (spec.clone(), seed.clone(), Arc::clone(&self.networks));
        let defined = self
            .blocking("define domain", move |host, conn| host.ensure_defined(conn, &spec, source.as_deref(), &networks))
            .await;
        if let (Err(_), Some(seed)) = (&defined, seed) {
            remove_seed(Path::new(&seed));
        }
        defined
    }

    /// `virDomainCreate` unless active, once the backing chains its
    /// definition pins still match the images' headers (`chains.rs`).
    /// Errors: `NotFound` when no domain carries this identity;
    /// `InvalidInput` naming the field when a header changed since the
    /// define (nothing is started).
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn start(&self, id: &VmId) -> Result<()> {
        self.verify_chains("start domain", id, false).await?;
        let id = id.clone();
        self.blocking("start domain", move |host, conn| host.start(conn, &id)).await
    }

    /// `virDomainShutdown` (ACPI power button) if active, `virDomainDestroy`
    /// if paused (a paused guest cannot act on the button); a VM that does
    /// not exist is success, as there is nothing to stop.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn shutdown(&self, id: &VmId) -> Result<()> {
        let id = id.clone();
        self.blocking(Stop::Shutdown.operation(), move |host, conn| host.stop(conn, &id, Stop::Shutdown)).await
    }

    /// `virDomainDestroy` if active; a VM that does not exist is success.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn destroy(&self, id: &VmId) -> Result<()> {
        let id = id.clone();
        self.blocking(Stop::Destroy.operation(), move |host, conn| host.stop(conn, &id, Stop::Destroy)).await
    }

    /// The serial console on QEMU; `None` on the test driver, which has none.
    /// The domain lifecycle events of this host's connection (define,
    /// undefine, start, stop, pause, resume, crash), on every driver that has
    /// them (QEMU and the test driver do; see `events.rs`).
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<vmlet_provider::Change>> {
        self.host.connection.events().map(|events| events.subscribe())
    }

    fn console(&self) -> Option<&dyn Console> {
        self.host.kind.is_qemu().then_some(self as &dyn Console)
    }

    /// Commands through qemu-guest-agent on QEMU; `None` on the test driver,
    /// which has no guest agent.
    fn guest_exec(&self) -> Option<&dyn GuestExec> {
        self.host.kind.is_qemu().then_some(self as &dyn GuestExec)
    }

    /// TCP connections to the guest at the address its libvirt network
    /// leased to it, on QEMU (see `port_forward.rs`); `None` on the test
    /// driver, whose guests and addresses are not real.
    fn port_forward(&self) -> Option<&dyn PortForward> {
        self.host.kind.is_qemu().then_some(self as &dyn PortForward)
    }

    /// CPU time and memory on every driver (see [`Stats`] for what is measured).
    fn stats(&self) -> Option<&dyn Stats> {
        Some(self)
    }

    /// vCPU hot-plug and balloon within the VM's ceilings, or the persistent
    /// definition for the next start, on every driver (see `resize.rs`).
    fn resize(&self) -> Option<&dyn Resize> {
        Some(self)
    }

    /// Peer-to-peer live and offline migration on QEMU (see `migration.rs`);
    /// `None` on the test driver, which cannot migrate.
    fn migration(&self) -> Option<&dyn Migration> {
        self.host.kind.is_qemu().then_some(self as &dyn Migration)
    }

    /// Backups to a qcow2 file on the host (libvirt's push-mode backup of a
    /// running VM, qemu-img for an inactive one) and restores from them on
    /// QEMU (see `backup.rs`); `None` on the test driver, which has no block
    /// jobs.
    fn backup(&self) -> Option<&dyn Backup> {
        self.host.kind.is_qemu().then_some(self as &dyn Backup)
    }

    /// libvirt's internal snapshots (see `snapshot.rs`) on every driver: on
    /// QEMU in the VM's qcow2 disk (reverts on a local connection only), on
    /// the test driver in libvirt's memory, where a revert only makes the
    /// snapshot the current one (it has no disks).
    fn snapshots(&self) -> Option<&dyn Snapshots> {
        Some(self)
    }

    /// Host images read where they are (see `host_images.rs`): on every
    /// driver (the test driver attaches no disks, but the files are read
    /// all the same); a connection to another machine answers `Unsupported`.
    fn host_images(&self) -> Option<&dyn HostImages> {
        Some(self)
    }

    /// Volumes in the host's storage pools of files through libvirt's
    /// storage API (see `volumes.rs`), on every driver (the test driver's
    /// pools are in memory).
    fn volumes(&self) -> Option<&dyn vmlet_provider::Volumes> {
        Some(self)
    }

    /// `virDomainUndefineFlags` with MANAGED_SAVE, SNAPSHOTS_METADATA,
    /// CHECKPOINTS_METADATA and NVRAM,
    /// fewer flags where the driver rejects them. Disk files are never deleted;
    /// vmlet's console log and cloud-init seed of a QEMU domain are (best
    /// effort: a failure is logged).
    /// Errors: `InvalidInput` while the domain is active.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn undefine(&self, id: &VmId) -> Result<()> {
        let (id, seed_dir) = (id.clone(), Arc::clone(&self.seed_dir));
        self.blocking("undefine domain", move |host, conn| host.undefine(conn, &id, &seed_dir)).await
    }
}

#[cfg(test)]
#[path = "provider_tests.rs"]
mod tests;

/// Make the data disks of a VM about to be defined that do not exist yet and
/// say how big they are to be ([`vmlet_provider::DataDisk::create_bytes`]): a
/// sparse raw image, mode 0600 (libvirt hands it to QEMU at start). Existing
/// images are left alone, whatever their size. Only where vmlet shares the
/// host's files. Errors: `InvalidInput` naming the disk when its directory
/// does not exist or an image that must exist does not; `Unsupported` on a
/// remote connection; `Permanent` when the file cannot be made.
async fn make_data_disks(uri: &str, disks: &[vmlet_provider::DataDisk]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    const OP: &str = "make data disk";
    for disk in disks {
        let path = Path::new(&disk.path);
        if tokio::fs::symlink_metadata(path).await.is_ok() {
            continue;
        }
        let Some(bytes) = disk.create_bytes else {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("spec.disks[{}]: the image {} does not exist", disk.name, disk.path),
            ));
        };
        if !is_local_uri(uri) {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "spec.disks[{}]: vmlet makes a new volume's image where the files are; the connection {uri} \
                     reaches another machine: make {} there first",
                    disk.name, disk.path
                ),
            ));
        }
        if !path.parent().is_some_and(Path::is_dir) {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.disks[{}]: the volume's directory for {} does not exist on the host; create it (the \
                     PersistentVolume's path)",
                    disk.name, disk.path
                ),
            ));
        }
        let (path, name) = (disk.path.clone(), disk.name.clone());
        let made = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
            file.set_len(bytes)?;
            file.sync_all()
        })
        .await
        .map_err(|e| Error::new(OP, ErrorKind::Permanent, format!("making the image did not complete: {e}")))?;
        match made {
            Ok(()) => tracing::info!(disk = %name, path = %disk.path, bytes, "data disk image made"),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => {
                return Err(Error::new(
                    OP,
                    ErrorKind::Permanent,
                    format!("spec.disks[{name}]: cannot make the image {}: {err}", disk.path),
                ))
            }
        }
    }
    Ok(())
}
