//! The ESXi hosts (vim25 `HostSystem`) of a vCenter, each with its cluster,
//! datacenter, hardware and state: what a node is made from.
//!
//! One `RetrievePropertiesEx` walks the inventory from the root folder down
//! (`Folder.childEntity` → `Datacenter.hostFolder` → `Folder.childEntity` →
//! `ComputeResource.host`; a `ClusterComputeResource` is a
//! `ComputeResource`), reading the names and parents of what it passes, so
//! that each host's cluster and datacenter come from its parent chain.

use std::collections::HashMap;

use crate::properties::{self, datacenter_walk, object_set, prop_set, traversal, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::Error;

/// One ESXi host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// `name`: the host's name in the inventory (often its FQDN or IP).
    pub name: String,
    /// Its `HostSystem` reference, e.g. `host-21`.
    pub moref: MoRef,
    /// The name of its `ClusterComputeResource`; `None` for a standalone host
    /// (whose parent is a plain `ComputeResource`).
    pub cluster: Option<String>,
    /// The name of the `Datacenter` it belongs to.
    pub datacenter: String,
    /// `summary.hardware.numCpuCores`: physical cores; `None` when vSphere
    /// reports no hardware (a host never connected).
    pub cpu_cores: Option<u32>,
    /// `summary.hardware.memorySize`: physical memory in bytes; `None` as above.
    pub memory_bytes: Option<u64>,
    /// `runtime.connectionState`.
    pub connection_state: ConnectionState,
    /// `runtime.inMaintenanceMode`.
    pub in_maintenance_mode: bool,
    /// The root `ResourcePool` of its compute resource (cluster or
    /// standalone), where VMs cloned onto it are placed; `None` when
    /// vSphere reports none.
    pub resource_pool: Option<MoRef>,
}

/// vim25 `HostSystemConnectionState`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionState {
    /// `connected`: vCenter manages the host.
    Connected,
    /// `disconnected`: an administrator disconnected it, or it was never connected.
    Disconnected,
    /// `notResponding`: vCenter lost its heartbeat.
    NotResponding,
    /// A value this crate does not know, as vSphere wrote it.
    Other(String),
}

impl ConnectionState {
    fn parse(value: &str) -> ConnectionState {
        match value {
            "connected" => ConnectionState::Connected,
            "disconnected" => ConnectionState::Disconnected,
            "notResponding" => ConnectionState::NotResponding,
            other => ConnectionState::Other(other.to_owned()),
        }
    }
}

const HOST_PATHS: [&str; 6] = [
    "name",
    "parent",
    "summary.hardware.numCpuCores",
    "summary.hardware.memorySize",
    "runtime.connectionState",
    "runtime.inMaintenanceMode",
];

/// The `specSet` content of the host inventory walk.
fn hosts_spec(root: &MoRef) -> String {
    let props = [
        prop_set("Folder", &["parent"]),
        prop_set("Datacenter", &["name"]),
        prop_set("ComputeResource", &["name", "parent", "resourcePool"]),
        prop_set("ClusterComputeResource", &["name", "parent", "resourcePool"]),
        prop_set("HostSystem", &HOST_PATHS),
    ]
    .concat();
    let mut select = datacenter_walk("hostFolder", &["compute"]);
    select.push(traversal("compute", "ComputeResource", "host", &[]));
    props + &object_set(root, &select)
}

/// Every `HostSystem` under the root folder, sorted by datacenter and name.
///
/// Errors: those of [`Session`] calls (one `RetrievePropertiesEx`, plus
/// `ContinueRetrievePropertiesEx` for a large inventory).
pub async fn list_hosts(session: &Session) -> Result<Vec<Host>, Error> {
    let spec = hosts_spec(&session.service_content().root_folder);
    Ok(hosts_from_objects(&properties::retrieve(session, &spec).await?))
}

/// The hosts among `objects`, their cluster and datacenter read from the
/// other objects' names and parents. A host whose datacenter is not among
/// them (it should be) gets an empty datacenter name.
fn hosts_from_objects(objects: &[ObjectContent]) -> Vec<Host> {
    let by_ref: HashMap<&MoRef, &ObjectContent> = objects.iter().map(|o| (&o.obj, o)).collect();
    let mut hosts: Vec<Host> = objects
        .iter()
        .filter(|o| o.obj.kind == "HostSystem")
        .map(|host| {
            let compute = host.moref("parent").and_then(|p| by_ref.get(&p).copied());
            let cluster = compute
                .filter(|c| c.obj.kind == "ClusterComputeResource")
                .and_then(|c| c.text("name"))
                .map(str::to_owned);
            Host {
                name: host.text("name").unwrap_or_default().to_owned(),
                moref: host.obj.clone(),
                cluster,
                datacenter: datacenter_of(host, &by_ref).unwrap_or_default(),
                cpu_cores: host.text("summary.hardware.numCpuCores").and_then(|v| v.parse().ok()),
                memory_bytes: host.text("summary.hardware.memorySize").and_then(|v| v.parse().ok()),
                connection_state: ConnectionState::parse(host.text("runtime.connectionState").unwrap_or_default()),
                in_maintenance_mode: host.text("runtime.inMaintenanceMode") == Some("true"),
                resource_pool: compute.and_then(|c| c.moref("resourcePool")),
            }
        })
        .collect();
    hosts.sort_by(|a, b| (&a.datacenter, &a.name).cmp(&(&b.datacenter, &b.name)));
    hosts
}

/// The name of the first `Datacenter` up `object`'s parent chain (at most
/// 64 levels: folders nest, but not forever).
pub(crate) fn datacenter_of(object: &ObjectContent, by_ref: &HashMap<&MoRef, &ObjectContent>) -> Option<String> {
    let mut current = object.moref("parent")?;
    for _ in 0..64 {
        let found = by_ref.get(&current)?;
        if current.kind == "Datacenter" {
            return found.text("name").map(str::to_owned);
        }
        current = found.moref("parent")?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::properties::objects_of;
    use crate::soap::parse_response;

    fn recorded_hosts() -> Vec<Host> {
        let response = parse_response(include_bytes!("../tests/fixtures/hosts.xml")).unwrap().unwrap();
        hosts_from_objects(&objects_of(&response))
    }

    #[test]
    fn the_recorded_inventory_has_three_clustered_hosts_and_one_standalone() {
        let hosts = recorded_hosts();
        let names: Vec<(&str, Option<&str>)> = hosts.iter().map(|h| (h.name.as_str(), h.cluster.as_deref())).collect();
        assert_eq!(
            names,
            [
                ("DC0_C0_H0", Some("DC0_C0")),
                ("DC0_C0_H1", Some("DC0_C0")),
                ("DC0_C0_H2", Some("DC0_C0")),
                ("DC0_H0", None)
            ]
        );
        for host in &hosts {
            assert_eq!(host.datacenter, "DC0", "{host:?}");
            assert_eq!(host.moref.kind, "HostSystem");
            assert_eq!((host.cpu_cores, host.memory_bytes), (Some(2), Some(4_294_430_720)), "{host:?}");
            assert_eq!(host.connection_state, ConnectionState::Connected);
            assert!(!host.in_maintenance_mode);
        }
    }

    #[test]
    fn the_walk_starts_at_the_root_folder_and_follows_compute_resources_to_hosts() {
        let spec = hosts_spec(&MoRef::new("Folder", "group-d1"));
        assert!(spec.contains(r#"<obj type="Folder">group-d1</obj>"#), "{spec}");
        assert!(spec.contains("<type>ComputeResource</type><path>host</path>"), "{spec}");
        assert!(spec.contains("<pathSet>runtime.inMaintenanceMode</pathSet>"), "{spec}");
    }

    #[test]
    fn unknown_connection_states_are_kept_as_written() {
        assert_eq!(ConnectionState::parse("notResponding"), ConnectionState::NotResponding);
        assert_eq!(ConnectionState::parse("rebooting"), ConnectionState::Other("rebooting".into()));
    }
}
