//! Making, resizing, stopping and removing VMs: the vim25 calls behind the
//! provider's define, shutdown and undefine.
//!
//! - [`list_templates`]: the templates (`config.template` true) of the
//!   inventory with their datacenter, read in one `RetrievePropertiesEx`.
//! - [`clone_vm`]: `CloneVM_Task` of a template onto one host and a pool
//!   of its compute resource, into a folder and optionally a datastore,
//!   powered off, with `vmlet.io.uid` in `config.extraConfig`, the VM's
//!   size and hot-add ceilings ([`Hardware`]: one core per socket, so that
//!   any vCPU count fits whatever the template's `numCoresPerSocket`), its
//!   network cards re-backed ([`NicBacking`]), and a linked clone (the
//!   template's current snapshot, `diskMoveType`
//!   `createNewChildDiskBacking`) when the template has a snapshot.
//! - [`reconfigure_size`]: `ReconfigVM_Task` of `numCPUs` and `memoryMB`;
//!   [`reconfigure_hardware`]: the same with hot-add and the ceilings (a
//!   powered-off VM); [`reconfigure_live`]: `numCPUs` and `memoryMB` only
//!   (a running VM with hot-add).
//! - [`shutdown_guest`]: `ShutdownGuest` (asks VMware Tools in the guest;
//!   no task, vSphere answers at once).
//! - [`relocate_vm`]: `RelocateVM_Task` to another host and its pool
//!   (vMotion of a running VM; the disks stay where they are).
//! - [`destroy_vm`]: `Destroy_Task` (the VM and its disks).

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::hosts::datacenter_of;
use crate::placement::PortgroupPort;
use crate::properties::{self, datacenter_walk, object_set, prop_set, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::vms::{wait_for_task, MAX_CPUS_KEY, MAX_MEMORY_KEY, NEXT_CPUS_KEY, NEXT_MEMORY_KEY, UID_KEY};
use crate::xml::escape;
use crate::Error;

/// A VM template (`config.template` true).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// `name`, what `spec.image` names.
    pub name: String,
    /// Its `VirtualMachine` reference.
    pub moref: MoRef,
    /// `parent`: the VM folder it is in; clones are made in the same folder.
    pub folder: Option<MoRef>,
    /// The name of the `Datacenter` it belongs to (empty when unknown).
    pub datacenter: String,
}

/// The `specSet` content that walks every datacenter's VM folders to the
/// VMs, with the folders' parents and datacenters' names for
/// [`datacenter_of`].
fn templates_spec(root: &MoRef) -> String {
    let props = [
        prop_set("Folder", &["parent"]),
        prop_set("Datacenter", &["name"]),
        prop_set("VirtualMachine", &["name", "parent", "config.template"]),
    ]
    .concat();
    props + &object_set(root, &datacenter_walk("vmFolder", &[]))
}

/// Every template of the inventory, sorted by datacenter and name.
///
/// Errors: those of [`Session`] calls (one `RetrievePropertiesEx`, plus
/// `ContinueRetrievePropertiesEx` for a large inventory).
pub async fn list_templates(session: &Session) -> Result<Vec<Template>, Error> {
    let spec = templates_spec(&session.service_content().root_folder);
    Ok(templates_from_objects(&properties::retrieve(session, &spec).await?))
}

/// The VMs named `name`, templates or not, each with whether it is a
/// template (`config.template`), sorted by datacenter.
///
/// Errors: those of [`Session`] calls.
pub(crate) async fn vms_named(session: &Session, name: &str) -> Result<Vec<(Template, bool)>, Error> {
    let spec = templates_spec(&session.service_content().root_folder);
    let objects = properties::retrieve(session, &spec).await?;
    Ok(vms_from_objects(&objects, |vm| vm.text("name") == Some(name)))
}

fn templates_from_objects(objects: &[ObjectContent]) -> Vec<Template> {
    vms_from_objects(objects, |_| true).into_iter().filter(|(_, template)| *template).map(|(t, _)| t).collect()
}

/// The VMs of a [`templates_spec`] read that `wanted` keeps, with whether
/// each is a template, sorted by datacenter and name.
fn vms_from_objects(objects: &[ObjectContent], wanted: impl Fn(&ObjectContent) -> bool) -> Vec<(Template, bool)> {
    let by_ref: HashMap<&MoRef, &ObjectContent> = objects.iter().map(|o| (&o.obj, o)).collect();
    let mut vms: Vec<(Template, bool)> = objects
        .iter()
        .filter(|o| o.obj.kind == "VirtualMachine" && wanted(o))
        .map(|vm| {
            (
                Template {
                    name: vm.text("name").unwrap_or_default().to_owned(),
                    moref: vm.obj.clone(),
                    folder: vm.moref("parent"),
                    datacenter: datacenter_of(vm, &by_ref).unwrap_or_default(),
                },
                vm.text("config.template") == Some("true"),
            )
        })
        .collect();
    vms.sort_by(|(a, _), (b, _)| (&a.datacenter, &a.name).cmp(&(&b.datacenter, &b.name)));
    vms
}

/// A VM's size and the ceilings a live resize may grow it to. CPU hot-add
/// is enabled when `max_cpus` is above `cpus`, memory hot-add when
/// `max_memory_mib` is above `memory_mib`; the ceilings are recorded in
/// `config.extraConfig` ([`MAX_CPUS_KEY`], [`MAX_MEMORY_KEY`]), since
/// vSphere has no ceiling of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hardware {
    /// Virtual CPUs (`numCPUs`, one core per socket).
    pub cpus: u32,
    /// Memory in MiB (`memoryMB`; vSphere wants a multiple of 4).
    pub memory_mib: u64,
    /// The vCPU ceiling (at least `cpus`).
    pub max_cpus: u32,
    /// The memory ceiling in MiB (at least `memory_mib`, a multiple of 4).
    pub max_memory_mib: u64,
}

impl Hardware {
    /// The `VirtualMachineConfigSpec` elements from `numCPUs` to
    /// `cpuHotAddEnabled`, in the WSDL's order.
    fn size_xml(&self) -> String {
        format!(
            "<numCPUs>{}</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>{}</memoryMB>\
             <memoryHotAddEnabled>{}</memoryHotAddEnabled><cpuHotAddEnabled>{}</cpuHotAddEnabled>",
            self.cpus,
            self.memory_mib,
            self.max_memory_mib > self.memory_mib,
            self.max_cpus > self.cpus,
        )
    }

    /// The `extraConfig` elements recording the ceilings.
    fn ceilings_xml(&self) -> String {
        option_xml(MAX_CPUS_KEY, &self.max_cpus.to_string())
            + &option_xml(MAX_MEMORY_KEY, &self.max_memory_mib.to_string())
    }
}

/// One `extraConfig` `OptionValue` with a string value.
fn option_xml(key: &str, value: &str) -> String {
    format!(
        r#"<extraConfig><key>{}</key><value xsi:type="xsd:string">{}</value></extraConfig>"#,
        escape(key),
        escape(value)
    )
}

/// What a template's network card is backed by in the clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicNetwork {
    /// A standard network (`Network`): its name and reference
    /// (`VirtualEthernetCardNetworkBackingInfo`).
    Standard {
        /// The network's `name` (the backing's `deviceName`).
        name: String,
        /// Its reference.
        moref: MoRef,
    },
    /// A distributed portgroup
    /// (`VirtualEthernetCardDistributedVirtualPortBackingInfo`).
    Portgroup(PortgroupPort),
}

/// An edit of one of the template's network cards in the clone: the card
/// (its vim25 type and key, as the template has it) and its new backing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicBacking {
    /// The card's `xsi:type`, e.g. `VirtualVmxnet3`.
    pub kind: String,
    /// The card's device `key`.
    pub key: i32,
    /// The network it joins.
    pub network: NicNetwork,
}

impl NicBacking {
    /// The `deviceChange` element: an `edit` of the card with only its key
    /// and backing (the rest of the card stays the template's).
    fn to_xml(&self) -> String {
        let backing = match &self.network {
            NicNetwork::Standard { name, moref } => format!(
                r#"<backing xsi:type="VirtualEthernetCardNetworkBackingInfo"><deviceName>{}</deviceName>{}</backing>"#,
                escape(name),
                moref.to_xml("network")
            ),
            NicNetwork::Portgroup(port) => format!(
                r#"<backing xsi:type="VirtualEthernetCardDistributedVirtualPortBackingInfo"><port><switchUuid>{}</switchUuid><portgroupKey>{}</portgroupKey></port></backing>"#,
                escape(&port.switch_uuid),
                escape(&port.portgroup_key)
            ),
        };
        format!(
            r#"<deviceChange><operation>edit</operation><device xsi:type="{}"><key>{}</key>{backing}</device></deviceChange>"#,
            escape(&self.kind),
            self.key
        )
    }
}

/// Where and how [`clone_vm`] makes a VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneRequest<'a> {
    /// The template to clone.
    pub template: &'a MoRef,
    /// The VM folder to put the clone in.
    pub folder: &'a MoRef,
    /// The clone's name (vSphere: unique in its folder, at most 80 characters).
    pub name: &'a str,
    /// The `HostSystem` to register it on.
    pub host: &'a MoRef,
    /// The `ResourcePool` to place it in (of the host's compute resource).
    pub pool: &'a MoRef,
    /// The `Datastore` for the clone's files; `None`: the template's.
    pub datastore: Option<&'a MoRef>,
    /// The template's current snapshot: the clone is linked to it (its
    /// disks are children of the snapshot's, `createNewChildDiskBacking`);
    /// `None`: a full clone.
    pub snapshot: Option<&'a MoRef>,
    /// The value of `config.extraConfig["vmlet.io.uid"]`.
    pub uid: &'a str,
    /// The size, hot-add and ceilings.
    pub hardware: Hardware,
    /// The network cards to re-back; the others keep the template's.
    pub nics: &'a [NicBacking],
}

/// The `CloneVM_Task` arguments of `request`, elements in the WSDL's order
/// (`VirtualMachineCloneSpec`: location, template, config, powerOn,
/// snapshot; `VirtualMachineRelocateSpec`: datastore, diskMoveType, pool,
/// host; `VirtualMachineConfigSpec`: size, hot-add, deviceChange, extraConfig).
fn clone_args(request: &CloneRequest<'_>) -> String {
    let datastore = request.datastore.map(|d| d.to_xml("datastore")).unwrap_or_default();
    let (disk_move, snapshot) = match request.snapshot {
        Some(snapshot) => ("<diskMoveType>createNewChildDiskBacking</diskMoveType>", snapshot.to_xml("snapshot")),
        None => ("", String::new()),
    };
    let nics: String = request.nics.iter().map(NicBacking::to_xml).collect();
    format!(
        "{folder}<name>{name}</name><spec><location>{datastore}{disk_move}{pool}{host}</location><template>false</template>\
         <config>{size}{nics}{uid}{ceilings}</config><powerOn>false</powerOn>{snapshot}</spec>",
        folder = request.folder.to_xml("folder"),
        name = escape(request.name),
        pool = request.pool.to_xml("pool"),
        host = request.host.to_xml("host"),
        size = request.hardware.size_xml(),
        uid = option_xml(UID_KEY, request.uid),
        ceilings = request.hardware.ceilings_xml(),
    )
}

/// Clones `request.template` (`CloneVM_Task`) and waits for the task, at
/// most `deadline`; returns the new VM.
///
/// Errors: [`Error::Fault`] of the call or the task (`DuplicateName` when
/// the folder has a VM of that name, kind `Permanent`; `InvalidArgument`,
/// `InvalidState`, ...); [`Error::TaskTimeout`] (the clone may still
/// finish: a caller looks for the UID before cloning again);
/// [`Error::Response`] when the task names no VM.
pub async fn clone_vm(session: &Session, request: &CloneRequest<'_>, deadline: Duration) -> Result<MoRef, Error> {
    const METHOD: &str = "CloneVM_Task";
    let result = run_task(session, METHOD, request.template, &clone_args(request), deadline).await?;
    result.as_ref().and_then(MoRef::from_element).ok_or_else(|| Error::Response {
        operation: METHOD,
        status: 200,
        reason: "the clone task succeeded but names no VM in info.result".into(),
    })
}

/// Sets `vm`'s virtual CPUs and memory (`ReconfigVM_Task` with `numCPUs`,
/// one core per socket, and `memoryMB`, a multiple of 4) and waits for the task, at most `deadline`.
///
/// Errors: [`Error::Fault`] (`InvalidPowerState` when the VM runs without
/// hot-add, kind `Conflict`); [`Error::TaskTimeout`].
pub async fn reconfigure_size(
    session: &Session,
    vm: &MoRef,
    cpus: u32,
    memory_mib: u64,
    deadline: Duration,
) -> Result<(), Error> {
    let args = format!(
        "<spec><numCPUs>{cpus}</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>{memory_mib}</memoryMB></spec>"
    );
    run_task(session, "ReconfigVM_Task", vm, &args, deadline).await.map(|_| ())
}

/// The `extraConfig` elements recording a size for the next start
/// ([`NEXT_CPUS_KEY`], [`NEXT_MEMORY_KEY`]); `None` removes them (an empty
/// value removes an `extraConfig` key).
fn next_start_xml(next: Option<(u32, u64)>) -> String {
    let (cpus, memory_mib) = next.map(|(c, m)| (c.to_string(), m.to_string())).unwrap_or_default();
    option_xml(NEXT_CPUS_KEY, &cpus) + &option_xml(NEXT_MEMORY_KEY, &memory_mib)
}

/// Sets a powered-off `vm`'s size, hot-add and ceilings ([`Hardware`],
/// `ReconfigVM_Task`), removes a recorded next-start size, and waits for
/// the task, at most `deadline`.
///
/// Errors: [`Error::Fault`] (`InvalidPowerState` when the VM runs: hot-add
/// changes only while it is off); [`Error::TaskTimeout`].
pub async fn reconfigure_hardware(
    session: &Session,
    vm: &MoRef,
    hardware: &Hardware,
    deadline: Duration,
) -> Result<(), Error> {
    let args = format!("<spec>{}{}{}</spec>", hardware.size_xml(), hardware.ceilings_xml(), next_start_xml(None));
    run_task(session, "ReconfigVM_Task", vm, &args, deadline).await.map(|_| ())
}

/// Records the size a running `vm` gets at its next start (`(vCPUs, MiB)`
/// in `config.extraConfig`, [`NEXT_CPUS_KEY`] and [`NEXT_MEMORY_KEY`]: a
/// running VM's `numCPUs` cannot change without hot-add), or removes the
/// record (`None`), and waits for the task, at most `deadline`. Whoever
/// starts the VM applies it first ([`reconfigure_hardware`]).
///
/// Errors: [`Error::Fault`]; [`Error::TaskTimeout`].
pub async fn record_next_start(
    session: &Session,
    vm: &MoRef,
    next: Option<(u32, u64)>,
    deadline: Duration,
) -> Result<(), Error> {
    let args = format!("<spec>{}</spec>", next_start_xml(next));
    run_task(session, "ReconfigVM_Task", vm, &args, deadline).await.map(|_| ())
}

/// Grows a running `vm` with hot-add: `ReconfigVM_Task` of `numCPUs` and
/// `memoryMB` (a running VM's `numCoresPerSocket` cannot change), removing
/// a recorded next-start size, and waits for the task, at most `deadline`. The caller checks the VM's
/// hot-add and ceilings first (vSphere refuses a change it cannot make live
/// with a fault; govmomi's simulator accepts any).
///
/// Errors: [`Error::Fault`]; [`Error::TaskTimeout`].
pub async fn reconfigure_live(
    session: &Session,
    vm: &MoRef,
    cpus: u32,
    memory_mib: u64,
    deadline: Duration,
) -> Result<(), Error> {
    let args =
        format!("<spec><numCPUs>{cpus}</numCPUs><memoryMB>{memory_mib}</memoryMB>{}</spec>", next_start_xml(None));
    run_task(session, "ReconfigVM_Task", vm, &args, deadline).await.map(|_| ())
}

/// Asks the guest to shut down (`ShutdownGuest`, through VMware Tools) and
/// returns without waiting.
///
/// Errors: [`Error::Fault`]: `ToolsUnavailable` when Tools do not run in
/// the guest, `InvalidPowerState` when the VM is off.
pub async fn shutdown_guest(session: &Session, vm: &MoRef) -> Result<(), Error> {
    session.call("ShutdownGuest", vm, "").await.map(|_| ())
}

/// The `RelocateVM_Task` arguments that move a VM to `host` and its compute
/// resource's `pool` and nothing else (`VirtualMachineRelocateSpec`: pool
/// before host; no datastore, so its disks stay on the storage both hosts
/// reach).
fn relocate_args(host: &MoRef, pool: &MoRef) -> String {
    format!("<spec>{}{}</spec>", pool.to_xml("pool"), host.to_xml("host"))
}

/// Moves `vm` to `host` and its `pool` (`RelocateVM_Task`: vMotion when the
/// VM runs, a cold relocation when it is off) and waits for the task, at
/// most `deadline`. The VM keeps its reference.
///
/// Errors: [`Error::Fault`] of the call or the task (`InvalidState`,
/// `MigrationFault`s such as `NoCompatibleHost`, `InvalidArgument`);
/// [`Error::TaskTimeout`] (the relocation may still finish).
pub async fn relocate_vm(
    session: &Session,
    vm: &MoRef,
    host: &MoRef,
    pool: &MoRef,
    deadline: Duration,
) -> Result<(), Error> {
    run_task(session, "RelocateVM_Task", vm, &relocate_args(host, pool), deadline).await.map(|_| ())
}

/// Removes `vm` and its disks from the inventory and the datastore
/// (`Destroy_Task`) and waits for the task, at most `deadline`.
///
/// Errors: [`Error::Fault`] (`InvalidPowerState` while it is on;
/// `ManagedObjectNotFound` when it is gone); [`Error::TaskTimeout`].
pub async fn destroy_vm(session: &Session, vm: &MoRef, deadline: Duration) -> Result<(), Error> {
    run_task(session, "Destroy_Task", vm, "", deadline).await.map(|_| ())
}

/// Calls a `…_Task` method and waits for its task; returns `info.result`.
async fn run_task(
    session: &Session,
    method: &'static str,
    this: &MoRef,
    args: &str,
    deadline: Duration,
) -> Result<Option<crate::xml::Element>, Error> {
    let started = Instant::now();
    let response = session.call(method, this, args).await?;
    let task = response.child("returnval").and_then(MoRef::from_element).ok_or_else(|| Error::Response {
        operation: method,
        status: 200,
        reason: "no Task in the answer".into(),
    })?;
    wait_for_task(session, method, &task, started, deadline).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relocation_names_the_pool_then_the_host_and_no_datastore() {
        let host = MoRef::new("HostSystem", "host-<2>");
        let pool = MoRef::new("ResourcePool", "resgroup-8");
        assert_eq!(
            relocate_args(&host, &pool),
            r#"<spec><pool type="ResourcePool">resgroup-8</pool><host type="HostSystem">host-&lt;2&gt;</host></spec>"#
        );
    }

    #[test]
    fn a_clone_places_the_vm_on_the_host_powered_off_with_its_uid_and_size() {
        let template = MoRef::new("VirtualMachine", "vm-1");
        let folder = MoRef::new("Folder", "group-v3");
        let host = MoRef::new("HostSystem", "host-21");
        let pool = MoRef::new("ResourcePool", "resgroup-8");
        let request = CloneRequest {
            template: &template,
            folder: &folder,
            name: "ns_a<b",
            host: &host,
            pool: &pool,
            datastore: None,
            snapshot: None,
            uid: "0000-1",
            hardware: Hardware { cpus: 2, memory_mib: 512, max_cpus: 2, max_memory_mib: 512 },
            nics: &[],
        };
        assert_eq!(
            clone_args(&request),
            r#"<folder type="Folder">group-v3</folder><name>ns_a&lt;b</name><spec><location><pool type="ResourcePool">resgroup-8</pool><host type="HostSystem">host-21</host></location><template>false</template><config><numCPUs>2</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>512</memoryMB><memoryHotAddEnabled>false</memoryHotAddEnabled><cpuHotAddEnabled>false</cpuHotAddEnabled><extraConfig><key>vmlet.io.uid</key><value xsi:type="xsd:string">0000-1</value></extraConfig><extraConfig><key>vmlet.io.maxCpus</key><value xsi:type="xsd:string">2</value></extraConfig><extraConfig><key>vmlet.io.maxMemoryMiB</key><value xsi:type="xsd:string">512</value></extraConfig></config><powerOn>false</powerOn></spec>"#
        );
    }

    #[test]
    fn a_linked_clone_on_a_datastore_with_hot_add_and_re_backed_cards_follows_the_wsdl_order() {
        let template = MoRef::new("VirtualMachine", "vm-1");
        let folder = MoRef::new("Folder", "group-v9");
        let host = MoRef::new("HostSystem", "host-21");
        let pool = MoRef::new("ResourcePool", "resgroup-30");
        let datastore = MoRef::new("Datastore", "datastore-12");
        let snapshot = MoRef::new("VirtualMachineSnapshot", "snapshot-5");
        let nics = [
            NicBacking {
                kind: "VirtualVmxnet3".into(),
                key: 4000,
                network: NicNetwork::Standard {
                    name: "VM <Network>".into(),
                    moref: MoRef::new("Network", "network-7"),
                },
            },
            NicBacking {
                kind: "VirtualE1000".into(),
                key: 4001,
                network: NicNetwork::Portgroup(PortgroupPort {
                    switch_uuid: "50 2a".into(),
                    portgroup_key: "dvportgroup-11".into(),
                }),
            },
        ];
        let request = CloneRequest {
            template: &template,
            folder: &folder,
            name: "ns_web",
            host: &host,
            pool: &pool,
            datastore: Some(&datastore),
            snapshot: Some(&snapshot),
            uid: "0000-2",
            hardware: Hardware { cpus: 1, memory_mib: 256, max_cpus: 4, max_memory_mib: 256 },
            nics: &nics,
        };
        assert_eq!(
            clone_args(&request),
            concat!(
                r#"<folder type="Folder">group-v9</folder><name>ns_web</name><spec><location>"#,
                r#"<datastore type="Datastore">datastore-12</datastore><diskMoveType>createNewChildDiskBacking</diskMoveType>"#,
                r#"<pool type="ResourcePool">resgroup-30</pool><host type="HostSystem">host-21</host></location><template>false</template><config>"#,
                r#"<numCPUs>1</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>256</memoryMB>"#,
                r#"<memoryHotAddEnabled>false</memoryHotAddEnabled><cpuHotAddEnabled>true</cpuHotAddEnabled>"#,
                r#"<deviceChange><operation>edit</operation><device xsi:type="VirtualVmxnet3"><key>4000</key>"#,
                r#"<backing xsi:type="VirtualEthernetCardNetworkBackingInfo"><deviceName>VM &lt;Network&gt;</deviceName><network type="Network">network-7</network></backing></device></deviceChange>"#,
                r#"<deviceChange><operation>edit</operation><device xsi:type="VirtualE1000"><key>4001</key>"#,
                r#"<backing xsi:type="VirtualEthernetCardDistributedVirtualPortBackingInfo"><port><switchUuid>50 2a</switchUuid><portgroupKey>dvportgroup-11</portgroupKey></port></backing></device></deviceChange>"#,
                r#"<extraConfig><key>vmlet.io.uid</key><value xsi:type="xsd:string">0000-2</value></extraConfig>"#,
                r#"<extraConfig><key>vmlet.io.maxCpus</key><value xsi:type="xsd:string">4</value></extraConfig>"#,
                r#"<extraConfig><key>vmlet.io.maxMemoryMiB</key><value xsi:type="xsd:string">256</value></extraConfig>"#,
                r#"</config><powerOn>false</powerOn><snapshot type="VirtualMachineSnapshot">snapshot-5</snapshot></spec>"#,
            )
        );
    }

    #[test]
    fn templates_are_the_vms_marked_template_with_their_datacenter() {
        use crate::xml::Element;
        let val = |text: &str, kind: Option<&str>| Element {
            name: "val".into(),
            attrs: kind.map(|k| vec![("type".to_owned(), k.to_owned())]).unwrap_or_default(),
            children: vec![],
            text: text.into(),
        };
        let object = |obj: MoRef, props: Vec<(&str, Element)>| ObjectContent {
            obj,
            props: props.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            missing: vec![],
        };
        let objects = vec![
            object(MoRef::new("Datacenter", "dc-1"), vec![("name", val("DC0", None))]),
            object(MoRef::new("Folder", "group-v3"), vec![("parent", val("dc-1", Some("Datacenter")))]),
            object(
                MoRef::new("VirtualMachine", "vm-1"),
                vec![
                    ("name", val("template-c0", None)),
                    ("parent", val("group-v3", Some("Folder"))),
                    ("config.template", val("true", None)),
                ],
            ),
            object(
                MoRef::new("VirtualMachine", "vm-2"),
                vec![
                    ("name", val("DC0_C0_RP0_VM1", None)),
                    ("parent", val("group-v3", Some("Folder"))),
                    ("config.template", val("false", None)),
                ],
            ),
        ];
        let templates = templates_from_objects(&objects);
        assert_eq!(
            templates,
            vec![Template {
                name: "template-c0".into(),
                moref: MoRef::new("VirtualMachine", "vm-1"),
                folder: Some(MoRef::new("Folder", "group-v3")),
                datacenter: "DC0".into(),
            }]
        );
    }
}
