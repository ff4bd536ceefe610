//! Making, resizing, stopping and removing VMs: the vim25 calls behind the
//! provider's define, shutdown and undefine.
//!
//! - [`list_templates`]: the templates (`config.template` true) of the
//!   inventory with their datacenter, read in one `RetrievePropertiesEx`.
//! - [`clone_vm`]: `CloneVM_Task` of a template onto one host and its
//!   compute resource's root pool, powered off, with `vmlet.io.uid` in
//!   `config.extraConfig` and the VM's size in the clone's config (one core
//!   per socket, so that any vCPU count fits whatever the template's
//!   `numCoresPerSocket`).
//! - [`reconfigure_size`]: `ReconfigVM_Task` of `numCPUs` and `memoryMB`.
//! - [`shutdown_guest`]: `ShutdownGuest` (asks VMware Tools in the guest;
//!   no task, vSphere answers at once).
//! - [`relocate_vm`]: `RelocateVM_Task` to another host and its pool
//!   (vMotion of a running VM; the disks stay where they are).
//! - [`destroy_vm`]: `Destroy_Task` (the VM and its disks).

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::hosts::datacenter_of;
use crate::properties::{self, datacenter_walk, object_set, prop_set, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::vms::{wait_for_task, UID_KEY};
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

fn templates_from_objects(objects: &[ObjectContent]) -> Vec<Template> {
    let by_ref: HashMap<&MoRef, &ObjectContent> = objects.iter().map(|o| (&o.obj, o)).collect();
    let mut templates: Vec<Template> = objects
        .iter()
        .filter(|o| o.obj.kind == "VirtualMachine" && o.text("config.template") == Some("true"))
        .map(|vm| Template {
            name: vm.text("name").unwrap_or_default().to_owned(),
            moref: vm.obj.clone(),
            folder: vm.moref("parent"),
            datacenter: datacenter_of(vm, &by_ref).unwrap_or_default(),
        })
        .collect();
    templates.sort_by(|a, b| (&a.datacenter, &a.name).cmp(&(&b.datacenter, &b.name)));
    templates
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
    /// The `ResourcePool` to place it in (the host's compute resource's root pool).
    pub pool: &'a MoRef,
    /// The value of `config.extraConfig["vmlet.io.uid"]`.
    pub uid: &'a str,
    /// Virtual CPUs (`numCPUs`).
    pub cpus: u32,
    /// Memory in MiB (`memoryMB`; vSphere wants a multiple of 4).
    pub memory_mib: u64,
}

/// The `CloneVM_Task` arguments of `request`, elements in the WSDL's order
/// (`VirtualMachineCloneSpec`: location, template, config, powerOn;
/// `VirtualMachineRelocateSpec`: pool before host).
fn clone_args(request: &CloneRequest<'_>) -> String {
    format!(
        "{folder}<name>{name}</name><spec><location>{pool}{host}</location><template>false</template>\
         <config><numCPUs>{cpus}</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>{memory}</memoryMB><extraConfig><key>{key}</key>\
         <value xsi:type=\"xsd:string\">{uid}</value></extraConfig></config><powerOn>false</powerOn></spec>",
        folder = request.folder.to_xml("folder"),
        name = escape(request.name),
        pool = request.pool.to_xml("pool"),
        host = request.host.to_xml("host"),
        cpus = request.cpus,
        memory = request.memory_mib,
        key = UID_KEY,
        uid = escape(request.uid),
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
            uid: "0000-1",
            cpus: 2,
            memory_mib: 512,
        };
        assert_eq!(
            clone_args(&request),
            r#"<folder type="Folder">group-v3</folder><name>ns_a&lt;b</name><spec><location><pool type="ResourcePool">resgroup-8</pool><host type="HostSystem">host-21</host></location><template>false</template><config><numCPUs>2</numCPUs><numCoresPerSocket>1</numCoresPerSocket><memoryMB>512</memoryMB><extraConfig><key>vmlet.io.uid</key><value xsi:type="xsd:string">0000-1</value></extraConfig></config><powerOn>false</powerOn></spec>"#
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
