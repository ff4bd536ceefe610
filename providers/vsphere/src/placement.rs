//! Where a clone goes and what it is cloned from: the names vmlet's
//! configuration gives (VM folder, resource pool, datastore, networks)
//! looked up in one datacenter, and the template's current snapshot and
//! network cards.
//!
//! - [`read_datacenter`]: one `RetrievePropertiesEx` from the root folder
//!   through each datacenter's `vmFolder`, `hostFolder`, `datastoreFolder`
//!   and `networkFolder` (`Folder.childEntity`, `ComputeResource.resourcePool`,
//!   `ResourcePool.resourcePool`), reading names and parents, so that each
//!   object's datacenter comes from its parent chain.
//! - [`read_template`]: the template's `snapshot.currentSnapshot` and the
//!   network cards of `config.hardware.device` (their vim25 type and key).
//! - [`read_portgroup`]: a distributed portgroup's `key` and its switch's
//!   `uuid`, which a `VirtualEthernetCardDistributedVirtualPortBackingInfo`
//!   names.

use std::collections::HashMap;

use crate::hosts::datacenter_of;
use crate::properties::{self, object_set, prop_set, traversal, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::Error;

/// An inventory object found by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// `name`.
    pub name: String,
    /// Its reference.
    pub moref: MoRef,
}

/// A resource pool with the root pool of its compute resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    /// `name`.
    pub name: String,
    /// Its `ResourcePool` (or `VirtualApp`) reference.
    pub moref: MoRef,
    /// The root pool of the compute resource (cluster or standalone host)
    /// it is under; `None` when its parent chain is not readable.
    pub root: Option<MoRef>,
}

/// The VM folders, resource pools, datastores and networks of one datacenter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Datacenter {
    /// The folders that hold VMs (`childType` has `VirtualMachine`).
    pub vm_folders: Vec<Named>,
    /// Every resource pool, root pools (named `Resources`) included.
    pub pools: Vec<Pool>,
    /// The datastores.
    pub datastores: Vec<Named>,
    /// Standard networks (`Network`), distributed portgroups
    /// (`DistributedVirtualPortgroup`) and opaque networks, by `name`.
    pub networks: Vec<Named>,
}

impl Datacenter {
    /// The one VM folder named `name`. Errors: a message saying there is
    /// none, or more than one.
    pub fn vm_folder(&self, name: &str) -> Result<&MoRef, String> {
        one(self.vm_folders.iter().filter(|f| f.name == name).map(|f| &f.moref), "VM folder", name)
    }

    /// The one pool named `name` under the compute resource whose root pool
    /// is `root`. Errors: a message saying there is none, or more than one.
    pub fn pool(&self, name: &str, root: &MoRef) -> Result<&MoRef, String> {
        let found = self.pools.iter().filter(|p| p.name == name && p.root.as_ref() == Some(root)).map(|p| &p.moref);
        one(found, "resource pool under the host's cluster", name)
    }

    /// The one datastore named `name`. Errors: as [`Datacenter::vm_folder`].
    pub fn datastore(&self, name: &str) -> Result<&MoRef, String> {
        one(self.datastores.iter().filter(|d| d.name == name).map(|d| &d.moref), "datastore", name)
    }

    /// The one network named `name`. Errors: as [`Datacenter::vm_folder`].
    pub fn network(&self, name: &str) -> Result<&MoRef, String> {
        one(self.networks.iter().filter(|n| n.name == name).map(|n| &n.moref), "network", name)
    }
}

fn one<'a>(mut found: impl Iterator<Item = &'a MoRef>, what: &str, name: &str) -> Result<&'a MoRef, String> {
    match (found.next(), found.next()) {
        (Some(one), None) => Ok(one),
        (None, _) => Err(format!("the datacenter has no {what} named {name:?}")),
        (Some(a), Some(b)) => {
            Err(format!("the datacenter has more than one {what} named {name:?} ({}, {})", a.value, b.value))
        }
    }
}

/// The `specSet` content of the walk.
fn datacenter_spec(root: &MoRef) -> String {
    let props = [
        prop_set("Folder", &["name", "parent", "childType"]),
        prop_set("Datacenter", &["name"]),
        prop_set("ComputeResource", &["parent", "resourcePool"]),
        prop_set("ResourcePool", &["name", "parent"]),
        prop_set("Datastore", &["name", "parent"]),
        prop_set("Network", &["name", "parent"]),
    ]
    .concat();
    let select = vec![
        traversal("folder", "Folder", "childEntity", &["folder", "vms", "hosts", "stores", "nets", "compute"]),
        traversal("vms", "Datacenter", "vmFolder", &["folder"]),
        traversal("hosts", "Datacenter", "hostFolder", &["folder"]),
        traversal("stores", "Datacenter", "datastoreFolder", &["folder"]),
        traversal("nets", "Datacenter", "networkFolder", &["folder"]),
        traversal("compute", "ComputeResource", "resourcePool", &["pool"]),
        traversal("pool", "ResourcePool", "resourcePool", &["pool"]),
    ];
    props + &object_set(root, &select)
}

/// The VM folders, pools, datastores and networks of the datacenter named
/// `datacenter`.
///
/// Errors: those of [`Session`] calls (one `RetrievePropertiesEx`, plus
/// `ContinueRetrievePropertiesEx` for a large inventory).
pub async fn read_datacenter(session: &Session, datacenter: &str) -> Result<Datacenter, Error> {
    let spec = datacenter_spec(&session.service_content().root_folder);
    Ok(datacenter_from_objects(&properties::retrieve(session, &spec).await?, datacenter))
}

fn datacenter_from_objects(objects: &[ObjectContent], datacenter: &str) -> Datacenter {
    let by_ref: HashMap<&MoRef, &ObjectContent> = objects.iter().map(|o| (&o.obj, o)).collect();
    let mut out = Datacenter::default();
    for object in objects {
        if datacenter_of(object, &by_ref).as_deref() != Some(datacenter) {
            continue;
        }
        let named = || Named { name: object.text("name").unwrap_or_default().to_owned(), moref: object.obj.clone() };
        match object.obj.kind.as_str() {
            "Folder"
                if object.get("childType").is_some_and(|t| t.children.iter().any(|c| c.text == "VirtualMachine")) =>
            {
                out.vm_folders.push(named());
            }
            "ResourcePool" | "VirtualApp" => {
                out.pools.push(Pool { name: named().name, moref: object.obj.clone(), root: root_pool(object, &by_ref) })
            }
            "Datastore" => out.datastores.push(named()),
            "Network" | "DistributedVirtualPortgroup" | "OpaqueNetwork" => out.networks.push(named()),
            _ => {}
        }
    }
    out
}

/// The root pool above `pool`: the last `ResourcePool` before a compute
/// resource in its parent chain.
fn root_pool(pool: &ObjectContent, by_ref: &HashMap<&MoRef, &ObjectContent>) -> Option<MoRef> {
    let mut current = pool;
    for _ in 0..64 {
        let parent = current.moref("parent")?;
        if parent.kind.ends_with("ComputeResource") {
            return Some(current.obj.clone());
        }
        current = by_ref.get(&parent)?;
    }
    None
}

/// A network card of a template: its vim25 type (`VirtualVmxnet3`,
/// `VirtualE1000`, ...) and device key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// The device's `xsi:type`.
    pub kind: String,
    /// `key`, unique in the VM; a clone's card keeps it.
    pub key: i32,
    /// What its backing names: a standard network's `deviceName`, or a
    /// distributed portgroup's `port.portgroupKey`; `None` for another backing.
    pub backing: Option<String>,
}

/// What a clone is made from: the template's current snapshot (a linked
/// clone's parent) and its network cards in device order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateFacts {
    /// `snapshot.currentSnapshot`; `None` without snapshots.
    pub snapshot: Option<MoRef>,
    /// The network cards of `config.hardware.device`, in order.
    pub nics: Vec<Nic>,
}

/// The vim25 subtypes of `VirtualEthernetCard`.
const ETHERNET_CARDS: [&str; 9] = [
    "VirtualE1000",
    "VirtualE1000e",
    "VirtualPCNet32",
    "VirtualVmxnet",
    "VirtualVmxnet2",
    "VirtualVmxnet3",
    "VirtualVmxnet3Vrdma",
    "VirtualSriovEthernetCard",
    "VirtualEthernetCard",
];

/// The current snapshot and network cards of `template`.
///
/// Errors: those of [`Session`] calls.
pub async fn read_template(session: &Session, template: &MoRef) -> Result<TemplateFacts, Error> {
    let spec = prop_set("VirtualMachine", &["snapshot.currentSnapshot", "config.hardware.device"])
        + &object_set(template, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    Ok(objects.first().map(template_from_object).unwrap_or_default())
}

fn template_from_object(object: &ObjectContent) -> TemplateFacts {
    let nics = object
        .get("config.hardware.device")
        .map(|devices| {
            devices
                .children
                .iter()
                .filter(|d| d.xsi_type().is_some_and(|kind| ETHERNET_CARDS.contains(&kind)))
                .filter_map(|d| {
                    let backing = d.child("backing");
                    let named = backing.and_then(|b| b.child_text("deviceName"));
                    let port = backing.and_then(|b| b.child("port")).and_then(|p| p.child_text("portgroupKey"));
                    Some(Nic {
                        kind: d.xsi_type()?.to_owned(),
                        key: d.child_text("key")?.trim().parse().ok()?,
                        backing: named.or(port).map(|b| b.trim().to_owned()),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    TemplateFacts { snapshot: object.moref("snapshot.currentSnapshot"), nics }
}

/// Where a VM is: its folder, pool and datastores.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmLocation {
    /// `parent`: its VM folder.
    pub folder: Option<MoRef>,
    /// `resourcePool`.
    pub pool: Option<MoRef>,
    /// `datastore`: the datastores holding its files.
    pub datastores: Vec<MoRef>,
}

/// The folder, pool and datastores of `vm`.
///
/// Errors: those of [`Session`] calls.
pub async fn read_location(session: &Session, vm: &MoRef) -> Result<VmLocation, Error> {
    let spec = prop_set("VirtualMachine", &["parent", "resourcePool", "datastore"]) + &object_set(vm, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    let Some(object) = objects.first() else { return Ok(VmLocation::default()) };
    let datastores = object
        .get("datastore")
        .map(|d| d.children.iter().filter_map(MoRef::from_element).collect())
        .unwrap_or_default();
    Ok(VmLocation { folder: object.moref("parent"), pool: object.moref("resourcePool"), datastores })
}

/// A distributed portgroup as a card's backing names it: its switch's
/// `uuid` and its `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortgroupPort {
    /// The `DistributedVirtualSwitch`'s `uuid`.
    pub switch_uuid: String,
    /// The portgroup's `key`.
    pub portgroup_key: String,
}

/// The switch UUID and key of the distributed portgroup `portgroup`.
///
/// Errors: those of [`Session`] calls; [`Error::Response`] when vSphere
/// reports no key or switch.
pub async fn read_portgroup(session: &Session, portgroup: &MoRef) -> Result<PortgroupPort, Error> {
    const OP: &str = "RetrievePropertiesEx";
    let missing = |what: &str| Error::Response {
        operation: OP,
        status: 200,
        reason: format!("distributed portgroup {} has no {what}", portgroup.value),
    };
    let spec = prop_set("DistributedVirtualPortgroup", &["key", "config.distributedVirtualSwitch"])
        + &object_set(portgroup, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    let object = objects.first().ok_or_else(|| missing("properties"))?;
    let key = object.text("key").ok_or_else(|| missing("key"))?.to_owned();
    let switch = object.moref("config.distributedVirtualSwitch").ok_or_else(|| missing("switch"))?;
    let spec = prop_set("DistributedVirtualSwitch", &["uuid"]) + &object_set(&switch, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    let uuid = objects.first().and_then(|o| o.text("uuid")).ok_or_else(|| missing("switch uuid"))?;
    Ok(PortgroupPort { switch_uuid: uuid.to_owned(), portgroup_key: key })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xml::Element;

    fn val(text: &str, kind: Option<&str>) -> Element {
        Element {
            name: "val".into(),
            attrs: kind.map(|k| vec![("type".to_owned(), k.to_owned())]).unwrap_or_default(),
            children: vec![],
            text: text.into(),
        }
    }

    fn object(obj: MoRef, props: Vec<(&str, Element)>) -> ObjectContent {
        ObjectContent { obj, props: props.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(), missing: vec![] }
    }

    #[test]
    fn names_are_found_in_their_datacenter_and_pools_under_their_cluster() {
        let vm_types = Element {
            name: "val".into(),
            children: vec![Element { name: "string".into(), text: "VirtualMachine".into(), ..Element::default() }],
            ..Element::default()
        };
        let parent = |kind: &str, value: &str| ("parent", val(value, Some(kind)));
        let objects = vec![
            object(MoRef::new("Datacenter", "dc-1"), vec![("name", val("DC0", None))]),
            object(MoRef::new("Datacenter", "dc-2"), vec![("name", val("DC1", None))]),
            object(
                MoRef::new("Folder", "vmf-1"),
                vec![("name", val("vm", None)), parent("Datacenter", "dc-1"), ("childType", vm_types.clone())],
            ),
            object(
                MoRef::new("Folder", "vmf-2"),
                vec![("name", val("vmlet", None)), parent("Folder", "vmf-1"), ("childType", vm_types.clone())],
            ),
            object(
                MoRef::new("Folder", "vmf-9"),
                vec![("name", val("vmlet", None)), parent("Datacenter", "dc-2"), ("childType", vm_types)],
            ),
            object(MoRef::new("Folder", "hf-1"), vec![("name", val("host", None)), parent("Datacenter", "dc-1")]),
            object(MoRef::new("ClusterComputeResource", "c-1"), vec![parent("Folder", "hf-1")]),
            object(MoRef::new("ClusterComputeResource", "c-2"), vec![parent("Folder", "hf-1")]),
            object(
                MoRef::new("ResourcePool", "rp-1"),
                vec![("name", val("Resources", None)), parent("ClusterComputeResource", "c-1")],
            ),
            object(
                MoRef::new("ResourcePool", "rp-2"),
                vec![("name", val("Resources", None)), parent("ClusterComputeResource", "c-2")],
            ),
            object(
                MoRef::new("ResourcePool", "rp-3"),
                vec![("name", val("tenants", None)), parent("ResourcePool", "rp-1")],
            ),
            object(
                MoRef::new("ResourcePool", "rp-4"),
                vec![("name", val("tenants", None)), parent("ResourcePool", "rp-2")],
            ),
            object(MoRef::new("Datastore", "ds-1"), vec![("name", val("LocalDS_0", None)), parent("Folder", "hf-1")]),
            object(
                MoRef::new("DistributedVirtualPortgroup", "pg-1"),
                vec![("name", val("DC0_DVPG0", None)), parent("Folder", "hf-1")],
            ),
            object(MoRef::new("Network", "net-1"), vec![("name", val("VM Network", None)), parent("Folder", "hf-1")]),
        ];
        let dc = datacenter_from_objects(&objects, "DC0");
        assert_eq!(dc.vm_folder("vmlet"), Ok(&MoRef::new("Folder", "vmf-2")), "not DC1's folder of that name");
        assert_eq!(dc.pool("tenants", &MoRef::new("ResourcePool", "rp-2")), Ok(&MoRef::new("ResourcePool", "rp-4")));
        assert_eq!(dc.pool("Resources", &MoRef::new("ResourcePool", "rp-1")), Ok(&MoRef::new("ResourcePool", "rp-1")));
        assert_eq!(dc.datastore("LocalDS_0"), Ok(&MoRef::new("Datastore", "ds-1")));
        assert_eq!(dc.network("DC0_DVPG0"), Ok(&MoRef::new("DistributedVirtualPortgroup", "pg-1")));
        assert_eq!(dc.network("VM Network"), Ok(&MoRef::new("Network", "net-1")));
        assert_eq!(
            dc.vm_folder("host"),
            Err("the datacenter has no VM folder named \"host\"".into()),
            "a host folder holds no VMs"
        );
        assert_eq!(dc.datastore("nfs"), Err("the datacenter has no datastore named \"nfs\"".into()));
        let mut twice = objects.clone();
        twice.push(object(
            MoRef::new("Network", "net-2"),
            vec![("name", val("VM Network", None)), parent("Folder", "hf-1")],
        ));
        let error = datacenter_from_objects(&twice, "DC0").network("VM Network").unwrap_err();
        assert_eq!(error, "the datacenter has more than one network named \"VM Network\" (net-1, net-2)");
    }

    #[test]
    fn a_template_s_snapshot_and_network_cards_are_read_in_device_order() {
        let text = |name: &str, text: &str| Element { name: name.into(), text: text.into(), ..Element::default() };
        let device = |kind: &str, key: &str| Element {
            name: "VirtualDevice".into(),
            attrs: vec![("xsi:type".to_owned(), kind.to_owned())],
            children: vec![text("key", key)],
            ..Element::default()
        };
        let mut standard = device("VirtualVmxnet3", "4000");
        standard.children.push(Element {
            name: "backing".into(),
            children: vec![text("deviceName", "VM Network")],
            ..Element::default()
        });
        let mut distributed = device("VirtualE1000", "4001");
        let port = Element {
            name: "port".into(),
            children: vec![text("switchUuid", "50 2a"), text("portgroupKey", "dvportgroup-11")],
            ..Element::default()
        };
        distributed.children.push(Element { name: "backing".into(), children: vec![port], ..Element::default() });
        let devices = Element {
            name: "val".into(),
            children: vec![device("VirtualDisk", "2000"), standard, distributed, device("VirtualPCNet32", "4002")],
            ..Element::default()
        };
        let facts = template_from_object(&object(
            MoRef::new("VirtualMachine", "vm-1"),
            vec![
                ("snapshot.currentSnapshot", val("snapshot-7", Some("VirtualMachineSnapshot"))),
                ("config.hardware.device", devices),
            ],
        ));
        assert_eq!(facts.snapshot, Some(MoRef::new("VirtualMachineSnapshot", "snapshot-7")));
        assert_eq!(
            facts.nics,
            vec![
                Nic { kind: "VirtualVmxnet3".into(), key: 4000, backing: Some("VM Network".into()) },
                Nic { kind: "VirtualE1000".into(), key: 4001, backing: Some("dvportgroup-11".into()) },
                Nic { kind: "VirtualPCNet32".into(), key: 4002, backing: None },
            ]
        );
        assert_eq!(
            template_from_object(&object(MoRef::new("VirtualMachine", "vm-1"), vec![])),
            TemplateFacts::default()
        );
    }
}
