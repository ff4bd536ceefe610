//! The `clouds` section of vmlet's configuration: IaaS clouds (OpenStack
//! Nova today) whose compute hosts become virtual nodes, found when vmlet
//! starts instead of listed one by one.
//!
//! ```yaml
//! clouds:
//!   - provider: openstack
//!     cloud: production            # the entry in clouds.yaml
//!     cloudsFile: /etc/vmlet/clouds.yaml        # or:
//!     cloudsSecret: {namespace: vmlet-system, name: openstack, key: clouds.yaml}
//!     hosts: [compute-1, compute-2]  # these compute hosts; or
//!     availabilityZone: az1          # every host of a zone; neither: every host
//!     nodeNamePrefix: ""             # node name = prefix + the compute host's name
//!     labels: {tier: gold}           # like hosts[]: labels, taints, maxPods, ratios
//!     images: [155d900f-4e14-4e4c-a73d-069cbf4541e6]   # the Glance images VMs may boot
//!     networks:                      # the Neutron networks VMs may join
//!       - {name: lan, uuid: 3cb9bc59-5699-4588-a4b1-b87f96708bc6}   # spec.networks[].name: lan
//!       - {name: dmz, uuid: c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42, namespaces: [web]}
//!       - a1b2c3d4-0000-4000-8000-000000000001   # only by UUID, in providerOptions.networks
//! ```
//!
//! `images` and `networks` are a security boundary between namespaces, as
//! storage roots are on libvirt hosts: vmlet's user is the cloud's admin and
//! could boot any project's private image or join any network, so a
//! VirtualMachine may name only what the administrator listed here (absent:
//! no image, and only `auto` / `none` networks). A named network is what a
//! VM's `spec.networks[].name` chooses (as a libvirt host's `networks`), only
//! in its `namespaces` when given; a VM that names none (and no
//! `providerOptions.networks`) joins the first named one offered to its
//! namespace, or `auto` when there is none. A plain UUID may be named in
//! `spec.providerOptions.networks` by any namespace, as a named network's
//! UUID may be by the namespaces it is offered to.
//!
//! Credentials are read from the file or the Secret, never from the command
//! line, and never logged. Allocation ratios default to what the cloud's
//! Placement service reports for each host (1.0 where it reports none).

use crate::config::{check_dns_label, AcceleratorConfig, ConfigError, HostConfig, TaintConfig};
use serde::Deserialize;
use std::collections::BTreeMap;

/// One cloud whose compute hosts this process serves.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CloudHostsConfig {
    /// The back end: `openstack`.
    pub provider: String,
    /// The cloud's entry in the clouds.yaml (`clouds.<cloud>`).
    pub cloud: String,
    /// A clouds.yaml file on vmlet's machine (keep it mode 0600).
    #[serde(default)]
    pub clouds_file: Option<String>,
    /// A Secret key that holds the clouds.yaml (vmlet needs `get` on it).
    #[serde(default)]
    pub clouds_secret: Option<SecretKeyRef>,
    /// The compute hosts to serve, by the cloud's host names.
    #[serde(default)]
    pub hosts: Option<Vec<String>>,
    /// Serve every compute host of this availability zone.
    #[serde(default)]
    pub availability_zone: Option<String>,
    /// Prepended to each compute host's name to make its node name.
    #[serde(default)]
    pub node_name_prefix: String,
    /// Extra labels of every node of this cloud.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node taints, as for `hosts[]`.
    #[serde(default)]
    pub taints: Option<Vec<TaintConfig>>,
    /// Pod capacity of each node. Default 110.
    #[serde(default)]
    pub max_pods: Option<u32>,
    /// Overrides the cloud's CPU allocation ratio for every host.
    #[serde(default)]
    pub cpu_allocation_ratio: Option<f64>,
    /// Overrides the cloud's memory allocation ratio for every host.
    #[serde(default)]
    pub memory_allocation_ratio: Option<f64>,
    /// The Glance image ids VMs may boot (`spec.image` by id, or by a name
    /// that resolves to one of them). Absent: none.
    #[serde(default)]
    pub images: Vec<String>,
    /// The Neutron networks VMs may join: named ones (`spec.networks`) and
    /// plain UUIDs (`spec.providerOptions.networks`, besides `auto` and
    /// `none`). Absent: none.
    #[serde(default)]
    pub networks: Vec<CloudNetwork>,
}

/// One of [`CloudHostsConfig::networks`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum CloudNetwork {
    /// A network UUID any VM may name in `spec.providerOptions.networks`.
    Uuid(String),
    /// A network VMs choose by name in `spec.networks`.
    Named(NamedCloudNetwork),
}

/// A Neutron network offered to VMs under a name ([`CloudNetwork::Named`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NamedCloudNetwork {
    /// The name VMs give in `spec.networks[].name`: a DNS label, unique in
    /// the cloud entry.
    pub name: String,
    /// The Neutron network's UUID.
    pub uuid: String,
    /// The namespaces whose VMs may join it; absent: every namespace.
    #[serde(default)]
    pub namespaces: Option<Vec<String>>,
}

/// Whether `s` is a UUID in its usual text form (8-4-4-4-12 hex digits).
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_hexdigit()))
}

/// A key of a Secret.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// The Secret's namespace.
    pub namespace: String,
    /// The Secret's name.
    pub name: String,
    /// The key in its data. Default `clouds.yaml`.
    #[serde(default = "default_clouds_key")]
    pub key: String,
}

fn default_clouds_key() -> String {
    "clouds.yaml".to_owned()
}

/// Where a cloud's clouds.yaml comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudsSource<'a> {
    /// A file.
    File(&'a str),
    /// A Secret's key.
    Secret(&'a SecretKeyRef),
}

impl CloudHostsConfig {
    /// The network UUIDs listed without a name: any VM may name them in
    /// `spec.providerOptions.networks`.
    pub fn plain_network_uuids(&self) -> Vec<String> {
        let plain = self.networks.iter().filter_map(|n| match n {
            CloudNetwork::Uuid(uuid) => Some(uuid.clone()),
            CloudNetwork::Named(_) => None,
        });
        plain.collect()
    }

    /// The named networks, in order.
    pub fn named_networks(&self) -> impl Iterator<Item = &NamedCloudNetwork> {
        self.networks.iter().filter_map(|n| match n {
            CloudNetwork::Named(named) => Some(named),
            CloudNetwork::Uuid(_) => None,
        })
    }

    /// Where the clouds.yaml comes from (validated: exactly one).
    pub fn source(&self) -> CloudsSource<'_> {
        match (&self.clouds_file, &self.clouds_secret) {
            (Some(file), _) => CloudsSource::File(file),
            (None, Some(secret)) => CloudsSource::Secret(secret),
            (None, None) => unreachable!("validated: cloudsFile or cloudsSecret"),
        }
    }

    /// Whether the compute host `host` in availability zone `zone` is one
    /// this entry serves.
    pub fn selects(&self, host: &str, zone: Option<&str>) -> bool {
        match (&self.hosts, &self.availability_zone) {
            (Some(hosts), _) => hosts.iter().any(|h| h == host),
            (None, Some(wanted)) => zone == Some(wanted.as_str()),
            (None, None) => true,
        }
    }

    /// The host config of compute host `host` (in availability zone `zone`,
    /// with the allocation ratios the cloud reports, if any): node name
    /// `nodeNamePrefix + host`, label `topology.kubernetes.io/zone`, no host
    /// files allowed (the cloud's images come from its own catalog). Errors:
    /// the node name or zone label is not valid in Kubernetes.
    pub fn host_config(
        &self,
        host: &str,
        zone: Option<&str>,
        reported_ratios: (Option<f64>, Option<f64>),
    ) -> Result<HostConfig, ConfigError> {
        let mut labels = self.labels.clone();
        if let Some(zone) = zone {
            labels.insert("topology.kubernetes.io/zone".to_owned(), zone.to_owned());
        }
        let name = format!("{}{}", self.node_name_prefix, host.to_ascii_lowercase());
        let config = HostConfig {
            name,
            provider: self.provider.clone(),
            uri: format!("{}://{}/{host}", self.provider, self.cloud),
            labels,
            taints: self.taints.clone(),
            max_pods: self.max_pods.unwrap_or(110),
            cpu_allocation_ratio: self.cpu_allocation_ratio.or(reported_ratios.0).unwrap_or(1.0),
            memory_allocation_ratio: self.memory_allocation_ratio.or(reported_ratios.1).unwrap_or(1.0),
            accelerator: AcceleratorConfig::Auto,
            storage_roots: Some(vec![]),
            backup_roots: Some(vec![]),
            migration_uri: None,
            allow_unsafe_migration: false,
            networks: vec![],
        };
        config.validate_one().map_err(|(field, message)| ConfigError::Invalid {
            field: format!("clouds: compute host {host:?}: {field}"),
            message,
        })?;
        Ok(config)
    }

    /// Check the entry at `clouds[index]`; `known` are the providers of this
    /// build that can serve clouds. Errors name the field and the fix.
    pub fn validate(&self, index: usize, known: &[&str]) -> Result<(), ConfigError> {
        let at = |field: &str| format!("clouds[{index}].{field}");
        let invalid = |field: &str, message: String| Err(ConfigError::Invalid { field: at(field), message });
        if !known.contains(&self.provider.as_str()) {
            return invalid("provider", format!("{:?} cannot serve a cloud; use one of {known:?}", self.provider));
        }
        if self.cloud.is_empty() {
            return invalid("cloud", "is empty; name the cloud's entry in clouds.yaml".into());
        }
        match (&self.clouds_file, &self.clouds_secret) {
            (None, None) => {
                return invalid("cloudsFile", "and cloudsSecret are both missing; give one of them".into());
            }
            (Some(_), Some(_)) => {
                return invalid("cloudsSecret", "and cloudsFile are both given; keep one".into());
            }
            (Some(file), None) if !file.starts_with('/') => {
                return invalid("cloudsFile", format!("{file:?} is not an absolute path"));
            }
            _ => {}
        }
        if self.hosts.is_some() && self.availability_zone.is_some() {
            return invalid("availabilityZone", "and hosts are both given; choose hosts by name or by zone".into());
        }
        if self.hosts.as_ref().is_some_and(Vec::is_empty) {
            return invalid("hosts", "is empty; name at least one compute host, or leave it out for all".into());
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
        let mut names: Vec<&str> = Vec::new();
        for (j, network) in self.networks.iter().enumerate() {
            let field = |f: &str| format!("networks[{j}]{f}");
            let uuid = match network {
                CloudNetwork::Uuid(uuid) => uuid,
                CloudNetwork::Named(named) => {
                    if let Err(why) = check_dns_label(&named.name) {
                        return invalid(&field(".name"), format!("{:?} {why}", named.name));
                    }
                    if names.contains(&named.name.as_str()) {
                        return invalid(&field(".name"), format!("{:?} is offered twice", named.name));
                    }
                    names.push(&named.name);
                    if named.namespaces.as_ref().is_some_and(Vec::is_empty) {
                        return invalid(
                            &field(".namespaces"),
                            "is empty; list the namespaces that may use it, or leave it out for all".into(),
                        );
                    }
                    for (k, namespace) in named.namespaces.iter().flatten().enumerate() {
                        if let Err(why) = check_dns_label(namespace) {
                            return invalid(&field(&format!(".namespaces[{k}]")), format!("{namespace:?} {why}"));
                        }
                    }
                    &named.uuid
                }
            };
            if !is_uuid(uuid) {
                let at = if matches!(network, CloudNetwork::Named(_)) { field(".uuid") } else { field("") };
                return invalid(
                    &at,
                    format!("{uuid:?} is not a network UUID; give a Neutron network's id (openstack network list)"),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(yaml: &str) -> CloudHostsConfig {
        serde_yaml::from_str(yaml).expect("parses")
    }

    const BASE: &str = "{provider: openstack, cloud: prod, cloudsFile: /etc/vmlet/clouds.yaml}";

    #[test]
    fn hosts_are_chosen_by_name_by_zone_or_all() {
        let by_name = entry("{provider: openstack, cloud: prod, cloudsFile: /c.yaml, hosts: [nova-a]}");
        assert!(by_name.selects("nova-a", Some("az2")) && !by_name.selects("nova-b", Some("az1")));
        let by_zone = entry("{provider: openstack, cloud: prod, cloudsFile: /c.yaml, availabilityZone: az1}");
        assert!(by_zone.selects("nova-b", Some("az1")) && !by_zone.selects("nova-c", Some("az2")));
        assert!(!by_zone.selects("nova-d", None), "a host in no zone is not in az1");
        assert!(entry(BASE).selects("anything", None));
    }

    #[test]
    fn a_compute_host_becomes_a_node_with_its_zone_and_the_clouds_ratios_unless_overridden() {
        let e = entry(
            "{provider: openstack, cloud: prod, cloudsFile: /c.yaml, nodeNamePrefix: os-, cpuAllocationRatio: 2.0, \
             labels: {tier: gold}}",
        );
        let host = e.host_config("Nova-A", Some("az1"), (Some(16.0), Some(1.5))).unwrap();
        assert_eq!(host.name, "os-nova-a");
        assert_eq!(host.uri, "openstack://prod/Nova-A");
        assert_eq!(host.labels["topology.kubernetes.io/zone"], "az1");
        assert_eq!(host.labels["tier"], "gold");
        assert_eq!((host.cpu_allocation_ratio, host.memory_allocation_ratio), (2.0, 1.5));
        assert_eq!(host.storage_roots, Some(vec![]), "no host files for a cloud's VMs");
        let bad = entry("{provider: openstack, cloud: prod, cloudsFile: /c.yaml, nodeNamePrefix: Bad_}");
        let error = bad.host_config("nova-a", None, (None, None)).unwrap_err().to_string();
        assert!(error.contains("compute host \"nova-a\": name:"), "{error}");
    }

    #[test]
    fn a_secret_key_defaults_to_clouds_yaml() {
        let e = entry("{provider: openstack, cloud: prod, cloudsSecret: {namespace: vmlet-system, name: os}}");
        assert_eq!(
            e.source(),
            CloudsSource::Secret(&SecretKeyRef {
                namespace: "vmlet-system".into(),
                name: "os".into(),
                key: "clouds.yaml".into()
            })
        );
    }

    #[test]
    fn bad_entries_are_refused_naming_the_field() {
        let cases = [
            ("{provider: vsphere, cloud: prod, cloudsFile: /c.yaml}", "clouds[0].provider"),
            ("{provider: openstack, cloud: prod}", "clouds[0].cloudsFile"),
            ("{provider: openstack, cloud: prod, cloudsFile: c.yaml}", "clouds[0].cloudsFile"),
            (
                "{provider: openstack, cloud: prod, cloudsFile: /c.yaml, cloudsSecret: {namespace: a, name: b}}",
                "clouds[0].cloudsSecret",
            ),
            (
                "{provider: openstack, cloud: prod, cloudsFile: /c.yaml, hosts: [a], availabilityZone: z}",
                "clouds[0].availabilityZone",
            ),
            ("{provider: openstack, cloud: prod, cloudsFile: /c.yaml, hosts: []}", "clouds[0].hosts"),
            (
                "{provider: openstack, cloud: prod, cloudsFile: /c.yaml, cpuAllocationRatio: 0}",
                "clouds[0].cpuAllocationRatio",
            ),
        ];
        for (yaml, field) in cases {
            let error = entry(yaml).validate(0, &["openstack"]).expect_err(yaml).to_string();
            assert!(error.starts_with(&format!("{field}:")), "{yaml}: {error}");
        }
        assert!(entry(BASE).validate(0, &["openstack"]).is_ok());
    }

    #[test]
    fn networks_are_named_entries_or_plain_uuids() {
        let e = entry(
            "{provider: openstack, cloud: prod, cloudsFile: /c.yaml, networks: [\
             {name: lan, uuid: 3cb9bc59-5699-4588-a4b1-b87f96708bc6}, \
             a1b2c3d4-0000-4000-8000-000000000001, \
             {name: dmz, uuid: c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42, namespaces: [web, shop]}]}",
        );
        assert!(e.validate(0, &["openstack"]).is_ok());
        assert_eq!(e.plain_network_uuids(), vec!["a1b2c3d4-0000-4000-8000-000000000001".to_owned()]);
        let named: Vec<(&str, &str, Option<&[String]>)> =
            e.named_networks().map(|n| (n.name.as_str(), n.uuid.as_str(), n.namespaces.as_deref())).collect();
        assert_eq!(
            named,
            vec![
                ("lan", "3cb9bc59-5699-4588-a4b1-b87f96708bc6", None),
                ("dmz", "c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42", Some(&["web".to_owned(), "shop".to_owned()][..])),
            ]
        );
        let plain_only = entry(
            "{provider: openstack, cloud: p, cloudsFile: /c.yaml, networks: [3cb9bc59-5699-4588-a4b1-b87f96708bc6]}",
        );
        assert_eq!(plain_only.named_networks().count(), 0, "today's configs keep working");
    }

    #[test]
    fn bad_networks_are_refused_naming_the_entry() {
        const NET: &str = "3cb9bc59-5699-4588-a4b1-b87f96708bc6";
        let cases = [
            (format!("[{{name: Lan, uuid: {NET}}}]"), "clouds[0].networks[0].name:"),
            (format!("[{{name: lan, uuid: {NET}}}, {{name: lan, uuid: {NET}}}]"), "clouds[0].networks[1].name:"),
            ("[{name: lan, uuid: private}]".to_owned(), "clouds[0].networks[0].uuid:"),
            (format!("[{NET}, not-a-uuid]"), "clouds[0].networks[1]:"),
            (format!("[{{name: lan, uuid: {NET}, namespaces: []}}]"), "clouds[0].networks[0].namespaces:"),
            (format!("[{{name: lan, uuid: {NET}, namespaces: [Web]}}]"), "clouds[0].networks[0].namespaces[0]:"),
        ];
        for (networks, field) in cases {
            let yaml = format!("{{provider: openstack, cloud: prod, cloudsFile: /c.yaml, networks: {networks}}}");
            let error = entry(&yaml).validate(0, &["openstack"]).expect_err(&yaml).to_string();
            assert!(error.starts_with(field), "{yaml}: {error}");
        }
        let unknown_key = "{provider: openstack, cloud: p, cloudsFile: /c.yaml, networks: [{name: lan, id: x}]}";
        assert!(serde_yaml::from_str::<CloudHostsConfig>(unknown_key).is_err(), "a misspelt field is no UUID");
    }
}
