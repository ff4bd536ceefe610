//! vmlet's configuration file: which hypervisor hosts this process serves, and how.
//!
//! ```yaml
//! nodeIP: 127.0.0.1          # InternalIP of every node; the API server dials it for logs/exec
//! kubeletPort: 10250         # daemonEndpoints.kubeletEndpoint.Port of every node
//! controller: true           # take part in the election of the controllers' leader
//! namespace: team-a          # only this namespace's VirtualMachines (default: all)
//! identity: kvm-1            # this process among all vmlets (default: <hostname>_<8 random hex>)
//! leaderElection:            # one controller at a time, elected through a Lease
//!   namespace: team-a        # default: `namespace` above, else kube-system
//!   leaseName: vmlet-controller
//!   leaseDurationSeconds: 15 # 5..=300
//! stateDir: /var/lib/vmlet   # console history and other state
//! kubeletApi:                # the kubelet HTTPS API on kubeletPort
//!   tlsCertFile: /etc/vmlet/serving.crt
//!   tlsKeyFile: /etc/vmlet/serving.key
//!   clientCaFile: /etc/vmlet/kubelet-client-ca.crt
//! hosts:
//!   - name: host-a           # becomes the Node name
//!     provider: libvirt
//!     uri: qemu:///system
//!     labels: {zone: a}
//!     taints: [{key: virtual-kubelet.io/provider, value: vmlet, effect: NoSchedule}]
//!     maxPods: 110
//!     cpuAllocationRatio: 4.0  # allocatable cpu = probed cpus x 4 (overcommit)
//!     memoryAllocationRatio: 1.0
//!     accelerator: auto        # QEMU hosts: kvm where offered and a probe guest runs, else tcg (or force kvm | tcg)
//!     storageRoots: [/var/lib/libvirt/images]  # VM files only from here (default: the backend's)
//! ```
//!
//! [`Config::from_yaml`] resolves defaults and validates everything before any
//! socket is opened; its errors name the field and the fix.

use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

/// The taint every virtual node carries unless a host lists its own.
pub const DEFAULT_TAINT_KEY: &str = "virtual-kubelet.io/provider";
/// Value of the default taint.
pub const DEFAULT_TAINT_VALUE: &str = "vmlet";
/// Node label naming which VirtualMachines a node serves: a namespace, or
/// [`ALL_NAMESPACES_SCOPE`].
pub const SCOPE_LABEL: &str = "vmlet.io/scope";
/// [`SCOPE_LABEL`] value of a vmlet that serves all namespaces; uppercase, so no
/// namespace can be called that.
pub const ALL_NAMESPACES_SCOPE: &str = "AllNamespaces";

/// A configuration that cannot be used, naming the field and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The path given.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The YAML does not parse or has unknown fields.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The path given.
        path: String,
        /// The YAML error, with line and column.
        #[source]
        source: serde_yaml::Error,
    },
    /// A field has a value vmlet cannot use.
    #[error("{field}: {message}")]
    Invalid {
        /// The field, e.g. `hosts[1].name`.
        field: String,
        /// What is wrong and what to write instead.
        message: String,
    },
}

/// The resolved, validated configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// InternalIP of every node vmlet registers: where the API server reaches the
    /// kubelet API. Default 127.0.0.1.
    #[serde(default = "default_node_ip", rename = "nodeIP", alias = "nodeIp")]
    pub node_ip: IpAddr,
    /// Port of the first node's kubelet API (`daemonEndpoints.kubeletEndpoint.Port`);
    /// node `i` of `hosts` listens on this + `i` ([`Config::kubelet_port_of`]). Default 10250.
    #[serde(default = "default_kubelet_port")]
    pub kubelet_port: u16,
    /// Whether this process takes part in the election of the controllers'
    /// leader ([`crate::election`]): the one elected runs the VirtualMachine,
    /// backup, restore, snapshot and endpoints controllers. Default true.
    #[serde(default = "default_true")]
    pub controller: bool,
    /// This process's name among all vmlet processes: the holder it writes
    /// into its nodes' Leases and into the controllers' election Lease. Two
    /// processes must never share one; a restarted process that keeps its
    /// identity takes its own Leases back at once. Default
    /// `<hostname>_<8 random hex digits>` (new at each start). 1 to
    /// [`MAX_IDENTITY_LEN`] of letters, digits, `-`, `_`, `.`, `:`.
    #[serde(default = "default_identity")]
    pub identity: String,
    /// The Lease through which processes elect the one that runs the
    /// controllers; resolved by [`Config::from_yaml`].
    #[serde(default)]
    pub leader_election: LeaderElectionConfig,
    /// Only VirtualMachines in this namespace are handled (controller, VM
    /// cleanup, and the agents: a pod of another namespace bound to one of
    /// this vmlet's nodes is marked Failed, `NotAVirtualMachine`); default:
    /// all namespaces.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Lease duration in seconds (kube-node-lease). Default 40, as the kubelet's.
    #[serde(default = "default_lease_seconds")]
    pub lease_duration_seconds: u32,
    /// Where vmlet keeps its state, e.g. VMs' console history
    /// (`<stateDir>/vms/...`). Default `/var/lib/vmlet`.
    #[serde(default = "default_state_dir")]
    pub state_dir: std::path::PathBuf,
    /// The kubelet HTTPS API (logs, exec, attach, stats) serving all hosts.
    #[serde(default)]
    pub kubelet_api: crate::api::ApiConfig,
    /// The hypervisor hosts this process serves, one virtual node each.
    #[serde(default)]
    pub hosts: Vec<HostConfig>,
    /// Clouds whose compute hosts this process serves, found at start
    /// ([`crate::clouds`]).
    #[serde(default)]
    pub clouds: Vec<crate::clouds::CloudHostsConfig>,
    /// vCenters whose ESXi hosts this process serves, found at start
    /// ([`crate::vcenters`]).
    #[serde(default)]
    pub vcenters: Vec<crate::vcenters::VCenterHostsConfig>,
    /// Namespaces whose VMs may name host files themselves: `spec.image` as
    /// a path, `spec.kernelBoot`, `spec.disks[].hostImage` (still only under
    /// the host's storage roots). Every other namespace boots images of the
    /// catalogue (`VirtualMachineImage`) and gets disks from claims, as
    /// KubeVirt keeps hostDisk to administrators. Default: none.
    #[serde(default)]
    pub trusted_namespaces: Vec<String>,
    /// How much serial-console history vmlet keeps per VM (`kubectl logs`),
    /// as the kubelet's `containerLogMaxFiles`/`containerLogMaxSize`.
    #[serde(default)]
    pub console_history: ConsoleHistoryConfig,
}

/// Longest [`Config::identity`]: the election's field manager is
/// `kube-lease-manager-<identity>`, and field managers end at 128 characters.
pub const MAX_IDENTITY_LEN: usize = 100;

/// Namespace of the election Lease when the config names no namespace at all.
pub const DEFAULT_ELECTION_NAMESPACE: &str = "kube-system";

/// Where the election of the controllers' leader happens ([`Config::leader_election`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease. After [`Config::from_yaml`] never empty:
    /// absent, it is the config's `namespace` if set, else
    /// [`DEFAULT_ELECTION_NAMESPACE`].
    #[serde(default)]
    pub namespace: String,
    /// Name of the Lease (`coordination.k8s.io/v1`). Default `vmlet-controller`.
    #[serde(default = "default_lease_name")]
    pub lease_name: String,
    /// How long the Lease holds without renewal, in seconds, 5 to 300.
    /// Default 15: the leader renews every 5 s (a third), steps down when it
    /// could not renew for 10 s (two thirds), and a follower takes over
    /// within 15 s of the leader's last renewal.
    #[serde(default = "default_election_seconds")]
    pub lease_duration_seconds: u32,
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        LeaderElectionConfig {
            namespace: String::new(),
            lease_name: default_lease_name(),
            lease_duration_seconds: default_election_seconds(),
        }
    }
}

fn default_lease_name() -> String {
    "vmlet-controller".to_owned()
}

fn default_election_seconds() -> u32 {
    15
}

/// `<hostname>_<8 random hex digits>`, the hostname cut to what an identity
/// may hold ([`Config::identity`]).
fn default_identity() -> String {
    let host = hostname::get().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
    let host: String = host
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '-' })
        .take(MAX_IDENTITY_LEN - 9)
        .collect();
    let host = if host.is_empty() { "vmlet".to_owned() } else { host };
    format!("{host}_{:08x}", rand::random::<u32>())
}

/// Check an identity's shape ([`Config::identity`]).
fn check_identity(identity: &str) -> Result<(), String> {
    if identity.is_empty() || identity.len() > MAX_IDENTITY_LEN {
        return Err(format!(
            "{identity:?} must be 1 to {MAX_IDENTITY_LEN} characters; leave it out for <hostname>_<random>"
        ));
    }
    if !identity.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)) {
        return Err(format!("{identity:?} may hold only letters, digits, '-', '_', '.' and ':'"));
    }
    Ok(())
}

/// Limits of a VM's console history ([`Config::console_history`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConsoleHistoryConfig {
    /// Boots kept (one file each; `kubectl logs --previous` reads the one
    /// before the current). Default 5; at least 2.
    #[serde(default = "default_history_boots")]
    pub max_boots: u32,
    /// Bytes of history kept per boot, in MiB: past it, the older half of
    /// that boot's file is dropped (a `logs -f` reading it then ends).
    /// Default 10; at least 1.
    #[serde(default = "default_history_mib")]
    pub max_mib_per_boot: u64,
}

impl Default for ConsoleHistoryConfig {
    fn default() -> Self {
        ConsoleHistoryConfig { max_boots: default_history_boots(), max_mib_per_boot: default_history_mib() }
    }
}

fn default_history_boots() -> u32 {
    5
}

fn default_history_mib() -> u64 {
    10
}

/// One hypervisor host.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostConfig {
    /// Node name: a DNS-1123 subdomain, unique in this file.
    pub name: String,
    /// Backend name, e.g. `libvirt`.
    pub provider: String,
    /// Backend connection URI, e.g. `qemu:///system` or `test:///abs/path/host.xml`.
    pub uri: String,
    /// Extra Node labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node taints; default: `virtual-kubelet.io/provider=vmlet:NoSchedule`. An
    /// empty list means no taint: plain pods may then be scheduled onto the host.
    #[serde(default)]
    pub taints: Option<Vec<TaintConfig>>,
    /// Pod capacity of the node. Default 110, as the kubelet's.
    #[serde(default = "default_max_pods")]
    pub max_pods: u32,
    /// Virtual CPUs offered per physical CPU: allocatable cpu = probed cpus ×
    /// this ratio (Nova's `cpu_allocation_ratio`). Default 1.0, no overcommit.
    #[serde(default = "default_ratio")]
    pub cpu_allocation_ratio: f64,
    /// Guest memory offered per byte of host memory: allocatable memory = probed
    /// memory × this ratio (Nova's `ram_allocation_ratio`). Default 1.0.
    #[serde(default = "default_ratio")]
    pub memory_allocation_ratio: f64,
    /// How QEMU guests run on this host: `auto` (default: KVM where the host
    /// offers it and, on a local connection, a probe guest booted the host's
    /// kernel under it; software emulation otherwise), `kvm` (refuse to start
    /// without KVM) or `tcg` (software emulation). Hosts without a choice (the
    /// libvirt test driver) ignore it. The node reports the outcome as the label
    /// `vmlet.io/accelerator`.
    #[serde(default)]
    pub accelerator: AcceleratorConfig,
    /// Directories on the host (absolute, no `..`) under which VMs' disk
    /// images, kernels and initrds must lie: a boundary between namespaces,
    /// see [`crate::storage`]. Absent: the backend's default storage roots
    /// (libvirt: the `default` pool's directory, else
    /// `/var/lib/libvirt/images`). `[]` allows no file at all; `/` allows
    /// every file and must be written out.
    #[serde(default)]
    pub storage_roots: Option<Vec<String>>,
    /// Directories on the host (absolute, no `..`) where backups may be
    /// written: a VirtualMachineBackup's `spec.target.hostPath` must be one of
    /// them or lie under one, and the first is the default target. Absent:
    /// `[/var/lib/vmlet/backups]`. `[]` allows no backups on this host.
    #[serde(default)]
    pub backup_roots: Option<Vec<String>>,
    /// How the other hosts' back end reaches this one as a migration target:
    /// for libvirt the URI the *source* libvirtd opens in a peer-to-peer
    /// migration (e.g. `qemu+tcp://10.0.0.2/system`). Absent: `uri` when it
    /// names a remote host; a host known only as `qemu:///system` cannot
    /// receive VMs without it (it can still send them away).
    #[serde(default)]
    pub migration_uri: Option<String>,
    /// Let live migrations from this host move VMs whose disks libvirt does
    /// not know to be shared safely (`VIR_MIGRATE_UNSAFE`): only for disks all
    /// hosts see at the same path on storage they really share. Default false.
    #[serde(default)]
    pub allow_unsafe_migration: bool,
    /// The networks VMs on this host may join, in order: a VM's
    /// `spec.networks[].name` must be one of these offered to its namespace,
    /// and a VM that names none gets the first. Absent or `[]`: VMs get no
    /// network interface. QEMU's user-mode network is never offered (it hands
    /// the guest the host's loopback).
    #[serde(default)]
    pub networks: Vec<NetworkConfig>,
}

/// A network a host offers VMs ([`HostConfig::networks`]): a name and
/// exactly one of `network`, `bridge` and `macvtap`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkConfig {
    /// The name VMs give in `spec.networks[].name`: a DNS label, unique per
    /// host. Hosts that VMs migrate between must offer each name with the
    /// same meaning (a migrated domain keeps its interfaces).
    pub name: String,
    /// A libvirt network of the host by name (`virsh net-list`): NAT, routed
    /// or isolated, with libvirt's DHCP when it has a DHCP range.
    #[serde(default)]
    pub network: Option<String>,
    /// A bridge device on the host (e.g. `br0`).
    #[serde(default)]
    pub bridge: Option<String>,
    /// A host device for macvtap in bridge mode (e.g. `eth1`); guests on it
    /// cannot reach the host itself.
    #[serde(default)]
    pub macvtap: Option<String>,
    /// The namespaces whose VMs may join it; absent: every namespace.
    #[serde(default)]
    pub namespaces: Option<Vec<String>>,
    /// Refused: QEMU's user-mode network (slirp) hands every guest the host's
    /// loopback at 10.0.2.2, and libvirt 9 offers no way to close it. Kept as
    /// a field only to say so clearly.
    #[serde(default)]
    pub user: Option<serde_json::Value>,
}

impl NetworkConfig {
    /// Check one network: `(field, message)` relative to the network.
    fn validate(&self) -> Result<(), (String, String)> {
        let invalid = |field: &str, message: String| Err((field.to_owned(), message));
        if let Err(why) = check_dns_label(&self.name) {
            return invalid("name", format!("{:?} {why}", self.name));
        }
        if self.user.is_some() {
            return invalid(
                "user",
                "QEMU's user-mode network is not offered: it hands every guest the host's loopback \
                 (10.0.2.2 is the host's 127.0.0.1, so etcd, the kubelet API and anything else bound there \
                 would be open to tenants); offer an isolated or NAT libvirt network (network: <name>) instead"
                    .into(),
            );
        }
        let sources = [("network", &self.network), ("bridge", &self.bridge), ("macvtap", &self.macvtap)];
        let given: Vec<_> = sources.iter().filter(|(_, value)| value.is_some()).collect();
        if given.len() != 1 {
            return invalid(
                "network",
                "give exactly one of network (a libvirt network), bridge (a host bridge) and macvtap (a host device)"
                    .into(),
            );
        }
        let (field, value) = given[0];
        let value = value.as_deref().unwrap_or_default();
        if value.is_empty()
            || value.len() > 255
            || value.contains(['/', '\'', '"', '<', '>', '&'])
            || value.trim() != value
        {
            return invalid(field, format!("{value:?} is not a {field} name"));
        }
        for (j, namespace) in self.namespaces.iter().flatten().enumerate() {
            if let Err(why) = check_dns_label(namespace) {
                return invalid(&format!("namespaces[{j}]"), format!("{namespace:?} {why}"));
            }
        }
        Ok(())
    }
}

/// [`HostConfig::accelerator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcceleratorConfig {
    /// KVM where offered, else TCG.
    #[default]
    Auto,
    /// KVM, or the host fails to start.
    Kvm,
    /// Software emulation.
    Tcg,
}

/// A Node taint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TaintConfig {
    /// Taint key.
    pub key: String,
    /// Taint value (may be empty).
    #[serde(default)]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

fn default_node_ip() -> IpAddr {
    IpAddr::from([127, 0, 0, 1])
}
fn default_kubelet_port() -> u16 {
    10250
}
fn default_state_dir() -> std::path::PathBuf {
    "/var/lib/vmlet".into()
}
fn default_true() -> bool {
    true
}
fn default_lease_seconds() -> u32 {
    40
}
fn default_max_pods() -> u32 {
    110
}
fn default_ratio() -> f64 {
    1.0
}

/// Where backups go on a host whose config names no `backupRoots`.
pub const DEFAULT_BACKUP_ROOT: &str = "/var/lib/vmlet/backups";

impl HostConfig {
    /// The host's backup roots with the default applied
    /// ([`HostConfig::backup_roots`]).
    pub fn effective_backup_roots(&self) -> Vec<String> {
        self.backup_roots.clone().unwrap_or_else(|| vec![DEFAULT_BACKUP_ROOT.to_owned()])
    }

    /// The host's taints with the default applied.
    pub fn effective_taints(&self) -> Vec<TaintConfig> {
        self.taints.clone().unwrap_or_else(|| {
            vec![TaintConfig {
                key: DEFAULT_TAINT_KEY.to_owned(),
                value: DEFAULT_TAINT_VALUE.to_owned(),
                effect: "NoSchedule".to_owned(),
            }]
        })
    }
}

impl Config {
    /// Read and validate a config file. Errors: [`ConfigError`], naming the field.
    pub fn from_file(path: &Path, known_providers: &[&str]) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        Config::from_yaml(&text, known_providers).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse { path: path.display().to_string(), source },
            other => other,
        })
    }

    /// Parse and validate YAML text. `known_providers` lists the backends this
    /// binary was built with.
    pub fn from_yaml(text: &str, known_providers: &[&str]) -> Result<Config, ConfigError> {
        let mut config: Config =
            serde_yaml::from_str(text).map_err(|source| ConfigError::Parse { path: "<config>".to_owned(), source })?;
        if config.leader_election.namespace.is_empty() {
            config.leader_election.namespace =
                config.namespace.clone().unwrap_or_else(|| DEFAULT_ELECTION_NAMESPACE.to_owned());
        }
        config.validate(known_providers)?;
        Ok(config)
    }

    /// The scope of this process's VirtualMachines, as the `vmlet.io/scope`
    /// label value its nodes carry and its VM pods select: the namespace, or
    /// [`ALL_NAMESPACES_SCOPE`]. VMs of one scope never land on another's nodes,
    /// where no agent would clean them up.
    pub fn scope(&self) -> &str {
        self.namespace.as_deref().unwrap_or(ALL_NAMESPACES_SCOPE)
    }

    /// The port node `node`'s kubelet API listens on, as its Node's
    /// `daemonEndpoints.kubeletEndpoint.port` says: `kubeletPort` + the
    /// node's index in `hosts` (the clouds' compute hosts join `hosts` when
    /// found), so each node has a listener of its own
    /// ([`crate::api::ApiConfig::node_listeners`]). `None` for a node not in
    /// `hosts` or a port past 65535 (the process refuses to start then).
    pub fn kubelet_port_of(&self, node: &str) -> Option<u16> {
        let index = self.hosts.iter().position(|h| h.name == node)?;
        self.kubelet_port.checked_add(u16::try_from(index).ok()?)
    }

    /// How long a Lease lives without renewal.
    pub fn lease_duration(&self) -> Duration {
        Duration::from_secs(self.lease_duration_seconds.into())
    }

    fn validate(&self, known_providers: &[&str]) -> Result<(), ConfigError> {
        let invalid = |field: String, message: String| Err(ConfigError::Invalid { field, message });
        if self.hosts.is_empty() && self.clouds.is_empty() && self.vcenters.is_empty() && !self.controller {
            return invalid(
                "hosts".into(),
                "lists no host, there are no clouds or vcenters and `controller` is false: this process would do \
                 nothing; add at least one {name, provider, uri}, or set controller: true to run only the controllers"
                    .into(),
            );
        }
        for (i, cloud) in self.clouds.iter().enumerate() {
            cloud.validate(i, known_providers)?;
        }
        for (i, vcenter) in self.vcenters.iter().enumerate() {
            vcenter.validate(i)?;
            if self.vcenters[..i].iter().any(|earlier| earlier.name == vcenter.name) {
                return invalid(
                    format!("vcenters[{i}].name"),
                    format!("{:?} appears twice; vCenter names must be unique", vcenter.name),
                );
            }
        }
        for (i, namespace) in self.trusted_namespaces.iter().enumerate() {
            let label = namespace.len() <= 63
                && namespace.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && namespace.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && namespace.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
            if !label {
                return invalid(
                    format!("trustedNamespaces[{i}]"),
                    format!("{namespace:?} is no namespace name (a DNS label: a-z, 0-9 and '-', at most 63)"),
                );
            }
        }
        if self.lease_duration_seconds < 10 {
            return invalid(
                "leaseDurationSeconds".into(),
                format!("{} is too short; use at least 10 (default 40)", self.lease_duration_seconds),
            );
        }
        if self.console_history.max_boots < 2 {
            return invalid(
                "consoleHistory.maxBoots".into(),
                "must be at least 2 (the current boot and the previous one); default 5".into(),
            );
        }
        if self.console_history.max_mib_per_boot == 0 {
            return invalid("consoleHistory.maxMibPerBoot".into(), "must be at least 1; default 10".into());
        }
        if let Err((field, message)) = self.kubelet_api.validate() {
            return invalid(format!("kubeletApi.{field}"), message);
        }
        if let Some(ns) = &self.namespace {
            if ns.is_empty() || ns.len() > 63 || ns.contains('.') || check_subdomain(ns).is_err() {
                return invalid(
                    "namespace".into(),
                    format!("{ns:?} is not a namespace name: use lowercase letters, digits and '-', at most 63"),
                );
            }
        }
        // After `namespace`: the election's namespace defaults to it.
        if let Err(message) = check_identity(&self.identity) {
            return invalid("identity".into(), message);
        }
        let election = &self.leader_election;
        if !(5..=300).contains(&election.lease_duration_seconds) {
            return invalid(
                "leaderElection.leaseDurationSeconds".into(),
                format!("{} is out of range; use 5 to 300 (default 15)", election.lease_duration_seconds),
            );
        }
        if let Err(why) = check_dns_label(&election.namespace) {
            return invalid("leaderElection.namespace".into(), format!("{:?} {why}", election.namespace));
        }
        if let Err(why) = check_subdomain(&election.lease_name) {
            return invalid(
                "leaderElection.leaseName".into(),
                format!("{:?} is not a Lease name: {why} (default vmlet-controller)", election.lease_name),
            );
        }
        if self.kubelet_port == 0 {
            return invalid("kubeletPort".into(), "is 0; give the port the kubelet API listens on, e.g. 10250".into());
        }
        if usize::from(self.kubelet_port) + self.hosts.len().saturating_sub(1) > usize::from(u16::MAX) {
            return invalid(
                "kubeletPort".into(),
                format!(
                    "{} leaves no port for some of the {} hosts (host i listens on kubeletPort + i); lower it",
                    self.kubelet_port,
                    self.hosts.len()
                ),
            );
        }
        let mut names = BTreeSet::new();
        for (i, host) in self.hosts.iter().enumerate() {
            let at = |f: &str| format!("hosts[{i}].{f}");
            if !names.insert(host.name.as_str()) {
                return invalid(at("name"), format!("{:?} appears twice; node names must be unique", host.name));
            }
            if !known_providers.contains(&host.provider.as_str()) {
                return invalid(
                    at("provider"),
                    format!("{:?} is not a provider of this build; use one of {known_providers:?}", host.provider),
                );
            }
            if let Err((field, message)) = host.validate_one() {
                return invalid(at(&field), message);
            }
        }
        Ok(())
    }
}

impl HostConfig {
    /// `<kind> at <uri>` for messages, e.g. `libvirt at test:///srv/host-a.xml`:
    /// which back end and connection a host has.
    pub fn describe(&self, kind: &str) -> String {
        format!("{kind} at {}", self.uri)
    }

    /// Check this host's own fields: `(field, message)` of the first that
    /// cannot be used, the field relative to the host (`labels["x"]`).
    pub fn validate_one(&self) -> Result<(), (String, String)> {
        let invalid = |field: &str, message: String| Err((field.to_owned(), message));
        if let Err(why) = check_subdomain(&self.name) {
            return invalid("name", format!("{:?} is not a valid node name: {why}", self.name));
        }
        if let Err(why) = check_uri(&self.uri) {
            return invalid("uri", format!("{:?} {why}", self.uri));
        }
        for (key, value) in &self.labels {
            if let Err(why) = check_label(key, value) {
                return invalid(&format!("labels[{key:?}]"), why);
            }
        }
        for (field, ratio) in
            [("cpuAllocationRatio", self.cpu_allocation_ratio), ("memoryAllocationRatio", self.memory_allocation_ratio)]
        {
            if !(ratio > 0.0 && ratio <= 64.0) {
                return invalid(
                    field,
                    format!("{ratio} is out of range; use a number above 0 and at most 64 (1.0 = no overcommit)"),
                );
            }
        }
        if self.max_pods == 0 {
            return invalid("maxPods", "is 0; a node needs room for at least one pod".into());
        }
        for (j, root) in self.storage_roots.iter().flatten().enumerate() {
            if let Err(why) = crate::storage::check_root(root) {
                return invalid(&format!("storageRoots[{j}]"), format!("{root:?} {why}"));
            }
        }
        for (j, root) in self.backup_roots.iter().flatten().enumerate() {
            if let Err(why) = crate::storage::check_root(root) {
                return invalid(&format!("backupRoots[{j}]"), format!("{root:?} {why}"));
            }
        }
        for (j, network) in self.networks.iter().enumerate() {
            if let Err((field, message)) = network.validate() {
                return invalid(&format!("networks[{j}].{field}"), message);
            }
            if self.networks[..j].iter().any(|earlier| earlier.name == network.name) {
                return invalid(&format!("networks[{j}].name"), format!("{:?} is offered twice", network.name));
            }
        }
        for (j, taint) in self.effective_taints().iter().enumerate() {
            if !matches!(taint.effect.as_str(), "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                return invalid(
                    &format!("taints[{j}].effect"),
                    format!("{:?} is not a taint effect; use NoSchedule, PreferNoSchedule or NoExecute", taint.effect),
                );
            }
        }
        Ok(())
    }
}

/// Check a backend URI's shape: `scheme:` followed by `//`; a `test:` URI must
/// name an absolute inventory path (`test:///abs/path.xml`).
fn check_uri(uri: &str) -> Result<(), String> {
    let Some((scheme, rest)) = uri.split_once(':') else {
        return Err("has no scheme; write e.g. qemu:///system or test:///abs/path/host.xml".into());
    };
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    if !scheme_ok || !rest.starts_with("//") {
        return Err("is not a URI; write e.g. qemu:///system or qemu+ssh://root@host/system".into());
    }
    if scheme == "test" && !rest.starts_with("///") {
        return Err("names a relative path; the test driver needs an absolute one: test:///abs/path/host.xml".into());
    }
    Ok(())
}

/// Check a Node label (qualified-name key, label value), as the API server will.
fn check_label(key: &str, value: &str) -> Result<(), String> {
    let name_ok = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if prefix.is_some_and(|p| check_subdomain(p).is_err()) || !name_ok(name, 63) {
        return Err(format!(
            "{key:?} is not a label key: [prefix/]name, name up to 63 of letters, digits, '-', '_', '.', starting and ending alphanumeric"
        ));
    }
    if !value.is_empty() && !name_ok(value, 63) {
        return Err(format!("{value:?} is not a label value: up to 63 of letters, digits, '-', '_', '.'"));
    }
    Ok(())
}

/// Check a DNS-1123 label (what Kubernetes requires of namespace names).
pub(crate) fn check_dns_label(name: &str) -> Result<(), &'static str> {
    if name.len() > 63 || name.contains('.') {
        return Err("is not a DNS label: at most 63 lowercase letters, digits and '-', no '.'");
    }
    check_subdomain(name).map_err(|_| {
        "is not a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit"
    })
}

/// Check a DNS-1123 subdomain (what Kubernetes requires of node names).
fn check_subdomain(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 253 {
        return Err("it must be 1 to 253 characters");
    }
    for label in name.split('.') {
        let ok_chars = label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        let ok_ends = label.starts_with(|c: char| c.is_ascii_alphanumeric())
            && label.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok_chars || !ok_ends {
            return Err("use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROVIDERS: &[&str] = &["libvirt"];

    #[test]
    fn minimal_config_gets_kubelet_like_defaults() {
        let config =
            Config::from_yaml("hosts: [{name: host-a, provider: libvirt, uri: 'test:///default'}]", PROVIDERS).unwrap();
        assert_eq!(config.node_ip, IpAddr::from([127, 0, 0, 1]));
        assert_eq!(config.kubelet_port, 10250);
        let spelled = Config::from_yaml(
            "nodeIP: 127.0.0.2\nhosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]",
            PROVIDERS,
        );
        assert_eq!(spelled.unwrap().node_ip, IpAddr::from([127, 0, 0, 2]));
        assert_eq!(config.lease_duration(), Duration::from_secs(40));
        assert_eq!(config.hosts[0].max_pods, 110);
        assert_eq!((config.hosts[0].cpu_allocation_ratio, config.hosts[0].memory_allocation_ratio), (1.0, 1.0));
        let taints = config.hosts[0].effective_taints();
        assert_eq!(taints.len(), 1);
        assert_eq!(taints[0].key, "virtual-kubelet.io/provider");
        assert_eq!(taints[0].effect, "NoSchedule");
    }

    fn error_of(yaml: &str) -> String {
        Config::from_yaml(yaml, PROVIDERS).unwrap_err().to_string()
    }

    #[test]
    fn the_example_config_is_valid_and_serves_a_cloud_and_a_vcenter() {
        let config = Config::from_yaml(include_str!("../deploy/config.example.yaml"), &["libvirt", "openstack"])
            .unwrap_or_else(|e| panic!("deploy/config.example.yaml: {e}"));
        assert_eq!((config.clouds.len(), config.vcenters.len()), (1, 1));
        assert_eq!(config.vcenters[0].templates, ["template-c0".to_owned()]);
    }

    #[test]
    fn a_vcenter_alone_is_enough_and_its_entries_are_checked_with_their_index() {
        const VC: &str = "{name: vc1, url: 'https://vc/sdk', username: u, passwordFile: /p, caFile: /ca.pem, \
                          datacenter: DC0, templates: [template-c0]}";
        let config = Config::from_yaml(&format!("controller: false\nvcenters: [{VC}]"), PROVIDERS).unwrap();
        assert_eq!(config.vcenters.len(), 1);
        assert_eq!(
            (config.vcenters[0].name.as_str(), config.vcenters[0].templates.as_slice()),
            ("vc1", &["template-c0".to_owned()][..])
        );
        let e = error_of(&format!("vcenters: [{VC}, {VC}]"));
        assert!(e.starts_with("vcenters[1].name:") && e.contains("twice"), "{e}");
        let e = error_of(&format!("vcenters: [{VC}, {}]", VC.replace("vc1", "vc2").replace("caFile: /ca.pem, ", "")));
        assert!(e.starts_with("vcenters[1].thumbprint:"), "{e}");
    }

    #[test]
    fn bad_host_fields_are_named() {
        let e = error_of("hosts: [{name: Host_A, provider: libvirt, uri: 'qemu:///system'}]");
        assert!(e.starts_with("hosts[0].name:"), "{e}");
        let e = error_of("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}, {name: a, provider: libvirt, uri: 'qemu:///system'}]");
        assert!(e.starts_with("hosts[1].name:") && e.contains("twice"), "{e}");
        let e = error_of("hosts: [{name: a, provider: xen, uri: 'qemu:///system'}]");
        assert!(e.starts_with("hosts[0].provider:") && e.contains("libvirt"), "{e}");
        let e = error_of("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', cpuAllocationRatio: 0}]");
        assert!(e.starts_with("hosts[0].cpuAllocationRatio:"), "{e}");
        for uri in ["' '", "'not a uri'", "test://relative/host.xml", "'http:example'"] {
            let e = error_of(&format!("hosts: [{{name: a, provider: libvirt, uri: {uri}}}]"));
            assert!(e.starts_with("hosts[0].uri:"), "{uri}: {e}");
        }
        let e = error_of("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', labels: {'bad key!': v}}]");
        assert!(e.starts_with("hosts[0].labels[\"bad key!\"]:"), "{e}");
        let e = error_of("namespace: Bad_NS\nhosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]");
        assert!(e.starts_with("namespace:"), "{e}");
        let e = error_of("kubeletPort: 0\nhosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]");
        assert!(e.starts_with("kubeletPort:"), "{e}");
        assert!(Config::from_yaml(
            "hosts: [{name: a, provider: libvirt, uri: 'qemu+ssh://root@kvm-1/system', labels: {topology.kubernetes.io/zone: a-1}}]",
            PROVIDERS
        )
        .is_ok());
        let e = error_of(
            "hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', taints: [{key: k, effect: Sometimes}]}]",
        );
        assert!(e.starts_with("hosts[0].taints[0].effect:"), "{e}");
        let e = error_of("controller: false\nhosts: []");
        assert!(e.starts_with("hosts:") && e.contains("controller: true"), "{e}");
        // The controllers alone (e.g. a Deployment): no host needed.
        let alone = Config::from_yaml("hosts: []", PROVIDERS).expect("a controller-only config");
        assert!(alone.controller && alone.hosts.is_empty());
    }

    #[test]
    fn networks_name_exactly_one_source_and_never_user_mode() {
        let host = |networks: &str| {
            format!("hosts: [{{name: a, provider: libvirt, uri: 'qemu:///system', networks: {networks}}}]")
        };
        let config = Config::from_yaml(
            &host("[{name: lan, network: vmlet-lan, namespaces: [team-a]}, {name: dmz, bridge: br0}, {name: edge, macvtap: eth1}]"),
            PROVIDERS,
        )
        .unwrap();
        let networks = &config.hosts[0].networks;
        assert_eq!(networks.len(), 3);
        assert_eq!(
            (networks[0].network.as_deref(), networks[0].namespaces.as_deref()),
            (Some("vmlet-lan"), Some(&["team-a".to_owned()][..]))
        );
        assert_eq!(networks[1].bridge.as_deref(), Some("br0"));
        assert_eq!(networks[2].macvtap.as_deref(), Some("eth1"));
        let refusal = |networks: &str| Config::from_yaml(&host(networks), PROVIDERS).unwrap_err().to_string();
        let user = refusal("[{name: lan, user: {}}]");
        assert!(user.contains("networks[0].user") && user.contains("loopback"), "{user}");
        let two = refusal("[{name: lan, network: a, bridge: b}]");
        assert!(two.contains("networks[0].network") && two.contains("exactly one"), "{two}");
        let none = refusal("[{name: lan}]");
        assert!(none.contains("exactly one"), "{none}");
        let twice = refusal("[{name: lan, network: a}, {name: lan, bridge: b}]");
        assert!(twice.contains("networks[1].name") && twice.contains("offered twice"), "{twice}");
        let bad_name = refusal("[{name: Lan, network: a}]");
        assert!(bad_name.contains("networks[0].name"), "{bad_name}");
        let bad_source = refusal("[{name: lan, bridge: \"br'0\"}]");
        assert!(bad_source.contains("networks[0].bridge"), "{bad_source}");
        let bad_namespace = refusal("[{name: lan, network: a, namespaces: [team_a]}]");
        assert!(bad_namespace.contains("networks[0].namespaces[0]"), "{bad_namespace}");
    }

    #[test]
    fn storage_roots_default_to_the_backends_and_must_be_absolute_directories() {
        let config =
            Config::from_yaml("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]", PROVIDERS).unwrap();
        assert_eq!(config.hosts[0].storage_roots, None, "absent: the backend's default applies");
        let config = Config::from_yaml(
            "hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', storageRoots: [/srv/images, /]}]",
            PROVIDERS,
        )
        .unwrap();
        assert_eq!(config.hosts[0].storage_roots, Some(vec!["/srv/images".to_owned(), "/".to_owned()]));
        for (root, why) in [
            ("images", "is not an absolute path"),
            ("/srv/images/../../etc", "has a '..' component"),
            ("''", "is empty"),
            ("\"/srv/a\\tb\"", "contains a control character"),
        ] {
            let e = error_of(&format!(
                "hosts: [{{name: a, provider: libvirt, uri: 'qemu:///system', storageRoots: [/srv/ok, {root}]}}]"
            ));
            assert!(e.starts_with("hosts[0].storageRoots[1]: "), "{root}: {e}");
            assert!(e.contains(why), "{root}: {e}");
        }
        let e = error_of("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', storageRoots: [images]}]");
        assert_eq!(
            e,
            "hosts[0].storageRoots[0]: \"images\" is not an absolute path; write an absolute directory on the host, \
             e.g. /var/lib/libvirt/images"
        );
    }

    #[test]
    fn the_election_defaults_to_the_served_namespace_else_kube_system() {
        let host = "hosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]";
        let everywhere = Config::from_yaml(host, PROVIDERS).unwrap();
        assert_eq!(everywhere.leader_election.namespace, "kube-system");
        assert_eq!(everywhere.leader_election.lease_name, "vmlet-controller");
        assert_eq!(everywhere.leader_election.lease_duration_seconds, 15);
        let one = Config::from_yaml(&format!("namespace: team-a\n{host}"), PROVIDERS).unwrap();
        assert_eq!(one.leader_election.namespace, "team-a");
        let named = Config::from_yaml(
            &format!("namespace: team-a\nleaderElection: {{namespace: ops, leaseName: ctl, leaseDurationSeconds: 5}}\n{host}"),
            PROVIDERS,
        )
        .unwrap();
        assert_eq!(
            named.leader_election,
            LeaderElectionConfig { namespace: "ops".into(), lease_name: "ctl".into(), lease_duration_seconds: 5 }
        );
    }

    #[test]
    fn an_election_lease_duration_out_of_range_is_named_with_the_range() {
        let host = "hosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]";
        for seconds in [0, 4, 301] {
            let e = error_of(&format!("leaderElection: {{leaseDurationSeconds: {seconds}}}\n{host}"));
            assert!(e.starts_with("leaderElection.leaseDurationSeconds: "), "{e}");
            assert!(e.contains("5 to 300"), "{e}");
        }
        let e = error_of(&format!("leaderElection: {{leaseName: Bad_Name}}\n{host}"));
        assert!(e.starts_with("leaderElection.leaseName: "), "{e}");
    }

    #[test]
    fn identity_defaults_to_the_hostname_and_eight_random_hex_digits() {
        let host = "hosts: [{name: a, provider: libvirt, uri: 'qemu:///system'}]";
        let first = Config::from_yaml(host, PROVIDERS).unwrap().identity;
        let second = Config::from_yaml(host, PROVIDERS).unwrap().identity;
        let (name, random) = first.rsplit_once('_').expect("<hostname>_<hex>");
        assert!(!name.is_empty(), "{first}");
        assert!(random.len() == 8 && random.chars().all(|c| c.is_ascii_hexdigit()), "{first}");
        assert_ne!(first, second, "each start draws its own");
        let given = Config::from_yaml(&format!("identity: kvm-1.example_a:1\n{host}"), PROVIDERS).unwrap();
        assert_eq!(given.identity, "kvm-1.example_a:1");
        for bad in ["''", "'two words'", &"x".repeat(MAX_IDENTITY_LEN + 1)] {
            let e = error_of(&format!("identity: {bad}\n{host}"));
            assert!(e.starts_with("identity: "), "{bad}: {e}");
        }
    }

    #[test]
    fn unknown_fields_are_refused_with_their_name() {
        let e = error_of("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', maxpods: 3}]");
        assert!(e.contains("maxpods"), "{e}");
    }

    #[test]
    fn an_empty_taint_list_means_untainted() {
        let config =
            Config::from_yaml("hosts: [{name: a, provider: libvirt, uri: 'qemu:///system', taints: []}]", PROVIDERS)
                .unwrap();
        assert!(config.hosts[0].effective_taints().is_empty());
    }
}
