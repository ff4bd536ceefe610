//! The `vcenters` section of vmlet's configuration: vCenters (or standalone
//! ESXi hosts) whose ESXi hosts become virtual nodes, found when vmlet
//! starts, as `clouds` does for OpenStack.
//!
//! ```yaml
//! vcenters:
//!   - name: vc1                          # a DNS label, unique among vcenters
//!     url: https://vcenter.example.com/sdk
//!     username: vmlet@vsphere.local
//!     passwordFile: /etc/vmlet/vsphere-password      # or:
//!     passwordSecret: {namespace: vmlet-system, name: vsphere, key: password}
//!     thumbprint: "AB:CD:…"              # SHA-256 of the server certificate; or
//!     caFile: /etc/vmlet/vcenter-ca.pem  # the CA that signed it (one of the two; no insecure mode)
//!     datacenter: DC0                    # the datacenter whose hosts are served
//!     hosts: [esx-1.example.com]         # these ESXi hosts; or
//!     clusters: [C0]                     # every host of these clusters; neither: every host of the datacenter
//!     templates: [ubuntu-24.04]          # the VM templates spec.image may name
//!     libraryItems: [images/ubuntu-24.04] # and these content library VM templates, as <library>/<item>
//!     folder: vmlet                      # the VM folder clones go to (default: the template's)
//!     resourcePool: tenants              # the pool under each host's cluster (default: its root pool)
//!     datastore: ds-fast                 # where clones' disks go (default: the template's datastore)
//!     datastores: [ds-fast, ds-bulk]     # what spec.providerOptions.datastore may name
//!     networks:                          # what spec.networks[].name may name
//!       - {name: lan, network: VM Network}                # portgroup "VM Network" as `lan`
//!       - {name: dmz, network: DMZ-PG, namespaces: [web]} # only these namespaces' VMs
//!     nodeNamePrefix: vs-                # node name = prefix + the host's name (lower case, `_` → `-`)
//!     labels: {tier: gold}               # like hosts[]: labels, taints, maxPods, ratios
//! ```
//!
//! `templates`, `libraryItems`, `datastores` and `networks` are a security boundary between
//! namespaces, as a cloud's `images` and `networks` are: vmlet's vSphere user
//! may clone any VM onto any datastore and network, a VirtualMachine only a
//! template, datastore and network listed here (absent: none; `datastore` is
//! always allowed). A VM's `spec.networks[i]` re-backs the template's
//! `i`-th network card to the named network (a standard network or a
//! distributed portgroup); without `spec.networks` the clone keeps the
//! template's. `folder`, `resourcePool`, `datastore` and the networks'
//! vSphere names are looked up in `datacenter` when a VM is cloned; one that
//! is missing fails the clone naming the field. The password is read from the file
//! or the Secret, never from the command line, and never logged. Nodes are
//! labelled `topology.kubernetes.io/region` = datacenter and
//! `topology.kubernetes.io/zone` = cluster (none for a standalone host).

use crate::config::{check_dns_label, AcceleratorConfig, ConfigError, HostConfig, TaintConfig};
use serde::Deserialize;
use std::collections::BTreeMap;

/// One vCenter whose ESXi hosts this process serves.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VCenterHostsConfig {
    /// The vCenter's name in vmlet: a DNS label, unique among `vcenters`;
    /// part of each host's URI (`vsphere://<name>/<host>`).
    pub name: String,
    /// The SDK endpoint, `https://host[:port]/sdk`.
    pub url: String,
    /// The user vmlet logs in as.
    pub username: String,
    /// A file on vmlet's machine holding the password (keep it mode 0600);
    /// one trailing newline is ignored.
    #[serde(default)]
    pub password_file: Option<String>,
    /// A Secret key holding the password (vmlet needs `get` on it).
    #[serde(default)]
    pub password_secret: Option<PasswordSecretRef>,
    /// SHA-256 thumbprint of the server's certificate, 32 hex byte pairs
    /// (`AB:CD:…` or without colons).
    #[serde(default)]
    pub thumbprint: Option<String>,
    /// A PEM file of the CA(s) the server's certificate chains to.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// The datacenter whose hosts and templates are used.
    pub datacenter: String,
    /// The ESXi hosts to serve, by their inventory names.
    #[serde(default)]
    pub hosts: Option<Vec<String>>,
    /// Serve every host of these clusters.
    #[serde(default)]
    pub clusters: Option<Vec<String>>,
    /// The template names VirtualMachines may clone (`spec.image`). Absent: none.
    #[serde(default)]
    pub templates: Vec<String>,
    /// The content library VM template items VirtualMachines may name in
    /// `spec.image`, each `<library>/<item>`. Absent: none.
    #[serde(default)]
    pub library_items: Vec<String>,
    /// The VM folder clones are made in, by name (unique among the
    /// datacenter's VM folders). Absent: the template's folder.
    #[serde(default)]
    pub folder: Option<String>,
    /// The resource pool clones are placed in, by name, looked up under each
    /// host's compute resource (cluster or standalone host). Absent: its
    /// root pool.
    #[serde(default)]
    pub resource_pool: Option<String>,
    /// The datastore clones' files go to, by name. Absent: the template's.
    #[serde(default)]
    pub datastore: Option<String>,
    /// Further datastores a VirtualMachine may name in
    /// `spec.providerOptions.datastore` (besides `datastore`). Absent: none.
    #[serde(default)]
    pub datastores: Vec<String>,
    /// The vSphere networks VirtualMachines may join by name
    /// (`spec.networks[].name`). Absent: none (clones keep the template's).
    #[serde(default)]
    pub networks: Vec<VCenterNetwork>,
    /// Prepended to each host's name to make its node name.
    #[serde(default)]
    pub node_name_prefix: String,
    /// Extra labels of every node of this vCenter.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node taints, as for `hosts[]`.
    #[serde(default)]
    pub taints: Option<Vec<TaintConfig>>,
    /// Pod capacity of each node. Default 110.
    #[serde(default)]
    pub max_pods: Option<u32>,
    /// CPU allocation ratio of every host. Default 1.0.
    #[serde(default)]
    pub cpu_allocation_ratio: Option<f64>,
    /// Memory allocation ratio of every host. Default 1.0.
    #[serde(default)]
    pub memory_allocation_ratio: Option<f64>,
}

/// A vSphere network offered to VirtualMachines under a name
/// ([`VCenterHostsConfig::networks`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VCenterNetwork {
    /// The name VMs give in `spec.networks[].name`: a DNS label, unique in
    /// the vCenter entry.
    pub name: String,
    /// The vSphere network's inventory name in the datacenter (a standard
    /// portgroup such as `VM Network`, or a distributed portgroup).
    pub network: String,
    /// The namespaces whose VMs may join it; absent: every namespace.
    #[serde(default)]
    pub namespaces: Option<Vec<String>>,
}

/// A key of a Secret holding a password.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PasswordSecretRef {
    /// The Secret's namespace.
    pub namespace: String,
    /// The Secret's name.
    pub name: String,
    /// The key in its data. Default `password`.
    #[serde(default = "default_password_key")]
    pub key: String,
}

fn default_password_key() -> String {
    "password".to_owned()
}

/// Where a vCenter's password comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PasswordSource<'a> {
    /// A file.
    File(&'a str),
    /// A Secret's key.
    Secret(&'a PasswordSecretRef),
}

/// How a vCenter's certificate is trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrustSource<'a> {
    /// The certificate's SHA-256 thumbprint, as configured.
    Thumbprint(&'a str),
    /// A CA file.
    CaFile(&'a str),
}

/// Whether `value` is 32 hex byte pairs, with or without `:` between them.
fn is_thumbprint(value: &str) -> bool {
    let hex: Vec<char> = value.trim().chars().filter(|c| *c != ':').collect();
    hex.len() == 64 && hex.iter().all(char::is_ascii_hexdigit)
}

/// The node-name form of an ESXi host's inventory name: lower case, every
/// character other than `a-z`, `0-9`, `.` and `-` replaced by `-`
/// (`DC0_C0_H0` → `dc0-c0-h0`).
pub fn node_name_of_host(host: &str) -> String {
    host.chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-' { c } else { '-' })
        .collect()
}

impl VCenterHostsConfig {
    /// Where the password comes from (validated: exactly one).
    pub fn password_source(&self) -> PasswordSource<'_> {
        match (&self.password_file, &self.password_secret) {
            (Some(file), _) => PasswordSource::File(file),
            (None, Some(secret)) => PasswordSource::Secret(secret),
            (None, None) => unreachable!("validated: passwordFile or passwordSecret"),
        }
    }

    /// How the certificate is trusted (validated: exactly one).
    pub fn trust_source(&self) -> TrustSource<'_> {
        match (&self.thumbprint, &self.ca_file) {
            (Some(thumbprint), _) => TrustSource::Thumbprint(thumbprint),
            (None, Some(file)) => TrustSource::CaFile(file),
            (None, None) => unreachable!("validated: thumbprint or caFile"),
        }
    }

    /// Whether the ESXi host `host` of cluster `cluster` (`None`:
    /// standalone) is one this entry serves.
    pub fn selects(&self, host: &str, cluster: Option<&str>) -> bool {
        match (&self.hosts, &self.clusters) {
            (Some(hosts), _) => hosts.iter().any(|h| h == host),
            (None, Some(clusters)) => cluster.is_some_and(|c| clusters.iter().any(|w| w == c)),
            (None, None) => true,
        }
    }

    /// The host config of ESXi host `host` in cluster `cluster`: node name
    /// `nodeNamePrefix` + [`node_name_of_host`], labels region = datacenter
    /// and zone = cluster, no host files. Errors: the node name or a label
    /// is not valid in Kubernetes.
    pub fn host_config(&self, index: usize, host: &str, cluster: Option<&str>) -> Result<HostConfig, ConfigError> {
        let mut labels = self.labels.clone();
        labels.insert("topology.kubernetes.io/region".to_owned(), self.datacenter.clone());
        if let Some(cluster) = cluster {
            labels.insert("topology.kubernetes.io/zone".to_owned(), cluster.to_owned());
        }
        let config = HostConfig {
            name: format!("{}{}", self.node_name_prefix, node_name_of_host(host)),
            provider: "vsphere".to_owned(),
            uri: format!("vsphere://{}/{host}", self.name),
            labels,
            taints: self.taints.clone(),
            max_pods: self.max_pods.unwrap_or(110),
            cpu_allocation_ratio: self.cpu_allocation_ratio.unwrap_or(1.0),
            memory_allocation_ratio: self.memory_allocation_ratio.unwrap_or(1.0),
            accelerator: AcceleratorConfig::Auto,
            storage_roots: Some(vec![]),
            backup_roots: Some(vec![]),
            migration_uri: None,
            allow_unsafe_migration: false,
            networks: vec![],
        };
        config.validate_one().map_err(|(field, message)| ConfigError::Invalid {
            field: format!("vcenters[{index}]: ESXi host {host:?}: {field}"),
            message,
        })?;
        Ok(config)
    }

    /// Check the entry at `vcenters[index]`. Errors name the field and the fix.
    pub fn validate(&self, index: usize) -> Result<(), ConfigError> {
        let at = |field: &str| format!("vcenters[{index}].{field}");
        let invalid = |field: &str, message: String| Err(ConfigError::Invalid { field: at(field), message });
        if let Err(why) = check_dns_label(&self.name) {
            return invalid("name", format!("{:?} {why}", self.name));
        }
        let Some(rest) = self.url.strip_prefix("https://") else {
            return invalid(
                "url",
                format!("{:?} is not https://host[:port]/sdk (vmlet never sends credentials in clear)", self.url),
            );
        };
        if rest.is_empty() || rest.starts_with('/') {
            return invalid("url", format!("{:?} names no host; write https://vcenter.example.com/sdk", self.url));
        }
        if self.username.is_empty() {
            return invalid("username", "is empty; name the vSphere user vmlet logs in as".into());
        }
        match (&self.password_file, &self.password_secret) {
            (None, None) => return invalid("passwordFile", "and passwordSecret are both missing; give one".into()),
            (Some(_), Some(_)) => return invalid("passwordSecret", "and passwordFile are both given; keep one".into()),
            (Some(file), None) if !file.starts_with('/') => {
                return invalid("passwordFile", format!("{file:?} is not an absolute path"));
            }
            _ => {}
        }
        match (&self.thumbprint, &self.ca_file) {
            (None, None) => {
                return invalid(
                    "thumbprint",
                    "and caFile are both missing; give the server certificate's SHA-256 thumbprint or the CA file \
                     that signed it (vmlet has no mode that trusts any certificate)"
                        .into(),
                )
            }
            (Some(_), Some(_)) => return invalid("caFile", "and thumbprint are both given; keep one".into()),
            (Some(thumbprint), None) if !is_thumbprint(thumbprint) => {
                return invalid(
                    "thumbprint",
                    format!("{thumbprint:?} is not a SHA-256 thumbprint: want 32 hex byte pairs such as AB:CD:…"),
                );
            }
            (None, Some(file)) if !file.starts_with('/') => {
                return invalid("caFile", format!("{file:?} is not an absolute path"));
            }
            _ => {}
        }
        if self.datacenter.is_empty() {
            return invalid("datacenter", "is empty; name the datacenter whose hosts vmlet serves".into());
        }
        if self.hosts.is_some() && self.clusters.is_some() {
            return invalid("clusters", "and hosts are both given; choose hosts by name or by cluster".into());
        }
        for (field, list) in [("hosts", &self.hosts), ("clusters", &self.clusters)] {
            if list.as_ref().is_some_and(Vec::is_empty) {
                return invalid(field, "is empty; name at least one, or leave it out for every host".into());
            }
        }
        for (j, template) in self.templates.iter().enumerate() {
            if template.is_empty() {
                return invalid(&format!("templates[{j}]"), "is empty; name a VM template".into());
            }
        }
        for (j, entry) in self.library_items.iter().enumerate() {
            let parts = entry.split_once('/');
            if !parts.is_some_and(|(library, item)| !library.is_empty() && !item.is_empty() && !item.contains('/')) {
                return invalid(
                    &format!("libraryItems[{j}]"),
                    format!("{entry:?} is not <library>/<item>; name a content library and one of its items"),
                );
            }
            if self.templates.contains(entry) {
                return invalid(
                    &format!("libraryItems[{j}]"),
                    format!("{entry:?} is also in templates; spec.image must name one thing, so keep one"),
                );
            }
        }
        for (field, value) in
            [("folder", &self.folder), ("resourcePool", &self.resource_pool), ("datastore", &self.datastore)]
        {
            if value.as_deref() == Some("") {
                return invalid(field, "is empty; name one, or leave it out for the default".into());
            }
        }
        for (j, datastore) in self.datastores.iter().enumerate() {
            if datastore.is_empty() {
                return invalid(&format!("datastores[{j}]"), "is empty; name a datastore".into());
            }
        }
        for (j, network) in self.networks.iter().enumerate() {
            if let Err(why) = check_dns_label(&network.name) {
                return invalid(&format!("networks[{j}].name"), format!("{:?} {why}", network.name));
            }
            if self.networks[..j].iter().any(|n| n.name == network.name) {
                return invalid(&format!("networks[{j}].name"), format!("{:?} is given twice", network.name));
            }
            if network.network.is_empty() {
                return invalid(&format!("networks[{j}].network"), "is empty; name the vSphere network".into());
            }
            for (k, namespace) in network.namespaces.iter().flatten().enumerate() {
                if let Err(why) = check_dns_label(namespace) {
                    return invalid(&format!("networks[{j}].namespaces[{k}]"), format!("{namespace:?} {why}"));
                }
            }
        }
        for (field, ratio) in
            [("cpuAllocationRatio", self.cpu_allocation_ratio), ("memoryAllocationRatio", self.memory_allocation_ratio)]
        {
            if ratio.is_some_and(|r| !(r > 0.0 && r <= 64.0)) {
                return invalid(field, format!("{ratio:?} is out of range; use a number above 0 and at most 64"));
            }
        }
        if self.max_pods == Some(0) {
            return invalid("maxPods", "is 0; a node needs room for at least one pod".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(yaml: &str) -> VCenterHostsConfig {
        serde_yaml::from_str(yaml).expect("parses")
    }

    const THUMBPRINT: &str =
        "DB:86:28:5D:09:6B:FF:B7:F6:6D:BC:72:4B:6A:76:5C:9F:F0:F1:70:1A:E7:6A:FC:B8:7C:59:64:AD:44:72:6A";

    fn base() -> String {
        format!(
            "{{name: vc1, url: https://vc.example/sdk, username: vmlet, passwordFile: /etc/vmlet/pw, thumbprint: \
             '{THUMBPRINT}', datacenter: DC0}}"
        )
    }

    #[test]
    fn hosts_are_chosen_by_name_by_cluster_or_all() {
        let by_name = entry(&base().replace("datacenter: DC0", "datacenter: DC0, hosts: [DC0_H0]"));
        assert!(by_name.selects("DC0_H0", None) && !by_name.selects("DC0_C0_H0", Some("DC0_C0")));
        let by_cluster = entry(&base().replace("datacenter: DC0", "datacenter: DC0, clusters: [DC0_C0]"));
        assert!(by_cluster.selects("DC0_C0_H1", Some("DC0_C0")));
        assert!(!by_cluster.selects("DC0_H0", None), "a standalone host is in no cluster");
        assert!(entry(&base()).selects("anything", None));
    }

    #[test]
    fn an_esxi_host_becomes_a_node_named_by_prefix_and_host_with_region_and_zone() {
        let e = entry(&base().replace("datacenter: DC0", "datacenter: DC0, nodeNamePrefix: vs-, labels: {tier: gold}"));
        let host = e.host_config(0, "DC0_C0_H2", Some("DC0_C0")).unwrap();
        assert_eq!((host.name.as_str(), host.uri.as_str()), ("vs-dc0-c0-h2", "vsphere://vc1/DC0_C0_H2"));
        assert_eq!(host.provider, "vsphere");
        assert_eq!(
            host.labels,
            BTreeMap::from([
                ("tier".to_owned(), "gold".to_owned()),
                ("topology.kubernetes.io/region".to_owned(), "DC0".to_owned()),
                ("topology.kubernetes.io/zone".to_owned(), "DC0_C0".to_owned()),
            ])
        );
        assert_eq!((host.max_pods, host.cpu_allocation_ratio), (110, 1.0));
        assert_eq!(host.storage_roots, Some(vec![]), "no host files on an ESXi node");
        let standalone = e.host_config(0, "esx-1.example.com", None).unwrap();
        assert_eq!(standalone.name, "vs-esx-1.example.com");
        assert!(!standalone.labels.contains_key("topology.kubernetes.io/zone"));
    }

    #[test]
    fn the_password_and_the_trust_come_from_exactly_one_place() {
        let e = entry(&base());
        assert_eq!(e.password_source(), PasswordSource::File("/etc/vmlet/pw"));
        assert_eq!(e.trust_source(), TrustSource::Thumbprint(THUMBPRINT));
        let secret = entry(
            "{name: vc1, url: https://vc/sdk, username: u, passwordSecret: {namespace: vmlet-system, name: vsphere}, \
             caFile: /etc/vmlet/ca.pem, datacenter: DC0}",
        );
        assert!(secret.validate(0).is_ok());
        let want =
            PasswordSecretRef { namespace: "vmlet-system".into(), name: "vsphere".into(), key: "password".into() };
        assert_eq!(secret.password_source(), PasswordSource::Secret(&want));
        assert_eq!(secret.trust_source(), TrustSource::CaFile("/etc/vmlet/ca.pem"));
    }

    #[test]
    fn bad_entries_are_refused_naming_the_field() {
        let b = base();
        let cases = [
            (b.replace("name: vc1", "name: VC_1"), "vcenters[0].name:"),
            (b.replace("https://vc.example/sdk", "http://vc.example/sdk"), "vcenters[0].url:"),
            (b.replace("https://vc.example/sdk", "https:///sdk"), "vcenters[0].url:"),
            (b.replace("username: vmlet", "username: ''"), "vcenters[0].username:"),
            (b.replace("passwordFile: /etc/vmlet/pw, ", ""), "vcenters[0].passwordFile:"),
            (b.replace("/etc/vmlet/pw", "pw"), "vcenters[0].passwordFile:"),
            (
                b.replace("passwordFile: /etc/vmlet/pw", "passwordFile: /p, passwordSecret: {namespace: a, name: b}"),
                "vcenters[0].passwordSecret:",
            ),
            (b.replace(&format!("thumbprint: '{THUMBPRINT}', "), ""), "vcenters[0].thumbprint:"),
            (b.replace(THUMBPRINT, "AB:CD"), "vcenters[0].thumbprint:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, caFile: /ca.pem"), "vcenters[0].caFile:"),
            (b.replace("datacenter: DC0", "datacenter: ''"), "vcenters[0].datacenter:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, hosts: [a], clusters: [b]"), "vcenters[0].clusters:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, hosts: []"), "vcenters[0].hosts:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, templates: ['']"), "vcenters[0].templates[0]:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, libraryItems: [lib]"), "vcenters[0].libraryItems[0]:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, libraryItems: [lib/a/b]"), "vcenters[0].libraryItems[0]:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, libraryItems: [a/b, /b]"), "vcenters[0].libraryItems[1]:"),
            (
                b.replace("datacenter: DC0", "datacenter: DC0, templates: [lib/t], libraryItems: [lib/t]"),
                "vcenters[0].libraryItems[0]:",
            ),
            (b.replace("datacenter: DC0", "datacenter: DC0, cpuAllocationRatio: 0"), "vcenters[0].cpuAllocationRatio:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, folder: ''"), "vcenters[0].folder:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, resourcePool: ''"), "vcenters[0].resourcePool:"),
            (b.replace("datacenter: DC0", "datacenter: DC0, datastores: [a, '']"), "vcenters[0].datastores[1]:"),
            (
                b.replace("datacenter: DC0", "datacenter: DC0, networks: [{name: VM Network, network: VM Network}]"),
                "vcenters[0].networks[0].name:",
            ),
            (
                b.replace(
                    "datacenter: DC0",
                    "datacenter: DC0, networks: [{name: a, network: x}, {name: a, network: y}]",
                ),
                "vcenters[0].networks[1].name:",
            ),
            (
                b.replace("datacenter: DC0", "datacenter: DC0, networks: [{name: a, network: ''}]"),
                "vcenters[0].networks[0].network:",
            ),
            (
                b.replace("datacenter: DC0", "datacenter: DC0, networks: [{name: a, network: x, namespaces: [A_b]}]"),
                "vcenters[0].networks[0].namespaces[0]:",
            ),
        ];
        for (yaml, field) in cases {
            let error = entry(&yaml).validate(0).expect_err(&yaml).to_string();
            assert!(error.starts_with(field), "{yaml}: {error}");
        }
        assert!(entry(&b).validate(0).is_ok());
    }

    #[test]
    fn there_is_no_insecure_switch() {
        let yaml = base().replace("datacenter: DC0", "datacenter: DC0, insecure: true");
        let error = serde_yaml::from_str::<VCenterHostsConfig>(&yaml).unwrap_err().to_string();
        assert!(error.contains("unknown field `insecure`"), "{error}");
    }
}
