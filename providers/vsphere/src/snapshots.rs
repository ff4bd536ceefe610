//! A VM's snapshots: the vim25 calls behind the provider's
//! [`vmlet_provider::Snapshots`].
//!
//! - [`snapshots_of`]: the VM's `snapshot.rootSnapshotList` read with
//!   `RetrievePropertiesEx`, its `VirtualMachineSnapshotTree`s (each with its
//!   `childSnapshotList`) flattened into one list, parents before children.
//! - [`create_snapshot`]: `CreateSnapshot_Task` (`name`, `description`,
//!   `memory`, `quiesce`); its `info.result` is the new
//!   `VirtualMachineSnapshot`.
//! - [`revert_to_snapshot`]: `RevertToSnapshot_Task` on the snapshot, with
//!   `suppressPowerOn` (a VM is reverted only while powered off, and stays
//!   so).
//! - [`remove_snapshot`]: `RemoveSnapshot_Task` with `removeChildren` false
//!   (its children become its parent's; the disks are consolidated).
//! - [`clone_snapshot_to_template`]: `CloneVM_Task` of the VM with
//!   `VirtualMachineCloneSpec.snapshot` (the disks as the snapshot holds
//!   them), `template` true, `vmlet.io.uid` cleared.
//!
//! Element names and order follow the vim25 WSDL (as govmomi's
//! `vim25/types` spells them).

use std::time::Duration;

use tokio::time::Instant;

use crate::properties::{self, object_set, prop_set, ObjectContent};
use crate::session::Session;
use crate::soap::MoRef;
use crate::vms::{wait_for_task, PowerState, UID_KEY};
use crate::xml::{escape, Element};
use crate::Error;

/// One snapshot of a VM (a `VirtualMachineSnapshotTree` without its children).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// `snapshot`: its `VirtualMachineSnapshot` reference, e.g. `snapshot-3`.
    pub moref: MoRef,
    /// `name` (vSphere does not make names unique; vmlet's are).
    pub name: String,
    /// `description`.
    pub description: String,
    /// `createTime` in seconds since the Unix epoch; `None` when vSphere's
    /// value is not an `xsd:dateTime`.
    pub created_unix_seconds: Option<i64>,
    /// `state`: the VM's power state the snapshot holds: `PoweredOn` only for
    /// a snapshot with memory of a running VM (a disk-only snapshot records
    /// `poweredOff`, as a revert to it leaves the VM).
    pub state: PowerState,
    /// `quiesced`: whether the guest's filesystems were frozen (VMware Tools).
    pub quiesced: bool,
}

/// What [`create_snapshot`] takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateSnapshot<'a> {
    /// `name`.
    pub name: &'a str,
    /// `description`.
    pub description: &'a str,
    /// `memory`: dump the running VM's memory too (ignored by vSphere for a
    /// VM that is off).
    pub memory: bool,
    /// `quiesce`: freeze the guest's filesystems through VMware Tools (a
    /// running VM without memory only; fails without Tools).
    pub quiesce: bool,
}

/// What [`clone_snapshot_to_template`] makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotClone<'a> {
    /// The VM whose snapshot is cloned.
    pub vm: &'a MoRef,
    /// The snapshot (one of `vm`'s).
    pub snapshot: &'a MoRef,
    /// The VM folder to put the template in.
    pub folder: &'a MoRef,
    /// The template's name (vSphere: unique in its folder, at most 80 characters).
    pub name: &'a str,
    /// The `HostSystem` to register it on.
    pub host: &'a MoRef,
    /// The `ResourcePool` to place it in.
    pub pool: &'a MoRef,
}

const TREE_PATH: &str = "snapshot.rootSnapshotList";

/// Every snapshot of `vm`, parents before their children; none when it has
/// none (`snapshot` unset).
///
/// Errors: those of [`Session`] calls; a `ManagedObjectNotFound` fault when
/// `vm` is gone.
pub async fn snapshots_of(session: &Session, vm: &MoRef) -> Result<Vec<Snapshot>, Error> {
    let spec = prop_set("VirtualMachine", &[TREE_PATH]) + &object_set(vm, &[]);
    let objects = properties::retrieve(session, &spec).await?;
    if let Some((_, fault)) = objects.iter().flat_map(|o| &o.missing).find(|(_, f)| f == "ManagedObjectNotFound") {
        let message = format!("VM {} is gone", vm.value);
        return Err(Error::Fault { operation: "RetrievePropertiesEx", fault: fault.clone(), message });
    }
    Ok(snapshots_from_objects(&objects))
}

fn snapshots_from_objects(objects: &[ObjectContent]) -> Vec<Snapshot> {
    let mut out = Vec::new();
    if let Some(list) = objects.first().and_then(|o| o.get(TREE_PATH)) {
        flatten(list, &mut out);
    }
    out
}

/// The trees among `parent`'s children (the `val` of the list, or a
/// tree's `childSnapshotList` elements), depth first.
fn flatten(parent: &Element, out: &mut Vec<Snapshot>) {
    for tree in parent.children.iter().filter(|c| c.child("snapshot").is_some()) {
        let Some(moref) = tree.child("snapshot").and_then(MoRef::from_element) else { continue };
        let text = |name: &str| tree.child_text(name).unwrap_or_default().trim().to_owned();
        out.push(Snapshot {
            moref,
            name: text("name"),
            description: text("description"),
            created_unix_seconds: unix_seconds(&text("createTime")),
            state: PowerState::parse(&text("state")),
            quiesced: text("quiesced") == "true",
        });
        for children in tree.children_named("childSnapshotList") {
            // Each `childSnapshotList` element is itself one tree.
            flatten(&Element { children: vec![children.clone()], ..Element::default() }, out);
        }
    }
}

/// Seconds since the Unix epoch of an `xsd:dateTime`
/// (`2026-12-06T06:10:00.123456Z`, or with a `±hh:mm` offset; no offset is
/// UTC); `None` when it is not one.
fn unix_seconds(value: &str) -> Option<i64> {
    let (date, time) = value.split_once('T')?;
    let mut ymd = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let (clock, offset) = match time.find(['Z', '+', '-']) {
        Some(at) => (&time[..at], &time[at..]),
        None => (time, ""),
    };
    let mut hms = clock.splitn(3, ':');
    let hour: i64 = hms.next()?.parse().ok()?;
    let minute: i64 = hms.next()?.parse().ok()?;
    let second: i64 = hms.next()?.split('.').next()?.parse().ok()?;
    let offset_seconds = match offset {
        "" | "Z" => 0,
        _ => {
            let sign = if offset.starts_with('-') { -1 } else { 1 };
            let (h, m) = offset[1..].split_once(':')?;
            sign * (h.parse::<i64>().ok()? * 3600 + m.parse::<i64>().ok()? * 60)
        }
    };
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hour * 3600 + minute * 60 + second - offset_seconds)
}

/// The `CreateSnapshot_Task` arguments, in the WSDL's order.
fn create_args(request: &CreateSnapshot<'_>) -> String {
    format!(
        "<name>{}</name><description>{}</description><memory>{}</memory><quiesce>{}</quiesce>",
        escape(request.name),
        escape(request.description),
        request.memory,
        request.quiesce
    )
}

/// Takes snapshot `request` of `vm` (`CreateSnapshot_Task`) and waits for
/// the task, at most `deadline`; returns the new snapshot's reference.
///
/// Errors: [`Error::Fault`] of the call or the task (`InvalidPowerState`,
/// `TaskInProgress` → Conflict; `ToolsUnavailable` for a quiesce without
/// Tools; `SnapshotFault`s); [`Error::TaskTimeout`] (the snapshot may still
/// be taken: a caller looks for its name before taking it again);
/// [`Error::Response`] when the task names no snapshot.
pub async fn create_snapshot(
    session: &Session,
    vm: &MoRef,
    request: &CreateSnapshot<'_>,
    deadline: Duration,
) -> Result<MoRef, Error> {
    const METHOD: &str = "CreateSnapshot_Task";
    let result = run(session, METHOD, vm, &create_args(request), deadline).await?;
    result.as_ref().and_then(MoRef::from_element).ok_or_else(|| Error::Response {
        operation: METHOD,
        status: 200,
        reason: "the snapshot task succeeded but names no snapshot in info.result".into(),
    })
}

/// Puts `snapshot`'s VM back to it (`RevertToSnapshot_Task` with
/// `suppressPowerOn`: a VM reverted to a snapshot with memory is not
/// powered on) and waits for the task, at most `deadline`.
///
/// Errors: [`Error::Fault`] (`ManagedObjectNotFound` when the snapshot is
/// gone; `InvalidState`, `TaskInProgress`); [`Error::TaskTimeout`].
pub async fn revert_to_snapshot(session: &Session, snapshot: &MoRef, deadline: Duration) -> Result<(), Error> {
    run(session, "RevertToSnapshot_Task", snapshot, "<suppressPowerOn>true</suppressPowerOn>", deadline)
        .await
        .map(|_| ())
}

/// Removes `snapshot` (`RemoveSnapshot_Task`, `removeChildren` false: its
/// children become its parent's) and waits for the task, at most `deadline`.
///
/// Errors: [`Error::Fault`] (`ManagedObjectNotFound` when it is gone
/// already; `TaskInProgress`); [`Error::TaskTimeout`].
pub async fn remove_snapshot(session: &Session, snapshot: &MoRef, deadline: Duration) -> Result<(), Error> {
    run(session, "RemoveSnapshot_Task", snapshot, "<removeChildren>false</removeChildren>", deadline).await.map(|_| ())
}

/// The `CloneVM_Task` arguments of `request`, elements in the WSDL's order
/// (`VirtualMachineCloneSpec`: location, template, config, powerOn,
/// snapshot; `VirtualMachineRelocateSpec`: pool before host). The config
/// clears [`UID_KEY`] (an empty value removes an `extraConfig` key): the
/// template is no VM of vmlet's, and the VMs cloned from it get their own.
fn clone_args(request: &SnapshotClone<'_>) -> String {
    format!(
        "{folder}<name>{name}</name><spec><location>{pool}{host}</location><template>true</template>\
         <config><extraConfig><key>{UID_KEY}</key><value xsi:type=\"xsd:string\"></value></extraConfig></config>\
         <powerOn>false</powerOn>{snapshot}</spec>",
        folder = request.folder.to_xml("folder"),
        name = escape(request.name),
        pool = request.pool.to_xml("pool"),
        host = request.host.to_xml("host"),
        snapshot = request.snapshot.to_xml("snapshot"),
    )
}

/// Makes template `request.name` from `request.snapshot` of `request.vm`
/// (`CloneVM_Task` with `spec.snapshot` and `spec.template`) and waits for
/// the task, at most `deadline`; returns the template. The VM is not
/// touched, running or not.
///
/// Errors: [`Error::Fault`] of the call or the task (`DuplicateName` when
/// the folder has a VM of that name; `InvalidArgument`, `InvalidState`);
/// [`Error::TaskTimeout`] (the clone may still finish: a caller looks for
/// the name before cloning again); [`Error::Response`] when the task names
/// no VM.
pub async fn clone_snapshot_to_template(
    session: &Session,
    request: &SnapshotClone<'_>,
    deadline: Duration,
) -> Result<MoRef, Error> {
    const METHOD: &str = "CloneVM_Task";
    let result = run(session, METHOD, request.vm, &clone_args(request), deadline).await?;
    result.as_ref().and_then(MoRef::from_element).ok_or_else(|| Error::Response {
        operation: METHOD,
        status: 200,
        reason: "the clone task succeeded but names no VM in info.result".into(),
    })
}

/// A VM by name in one folder, for [`clone_snapshot_to_template`]'s
/// idempotence: its reference and whether it is a template yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Named {
    pub moref: MoRef,
    pub template: bool,
}

/// The VMs named `name` among `folder`'s children (`childEntity`).
///
/// Errors: those of [`Session`] calls.
pub(crate) async fn vms_named(session: &Session, folder: &MoRef, name: &str) -> Result<Vec<Named>, Error> {
    let select = [properties::traversal("children", "Folder", "childEntity", &[])];
    let spec = prop_set("VirtualMachine", &["name", "config.template"]) + &object_set(folder, &select);
    let objects = properties::retrieve(session, &spec).await?;
    Ok(objects
        .iter()
        .filter(|o| o.obj.kind == "VirtualMachine" && o.text("name") == Some(name))
        .map(|o| Named { moref: o.obj.clone(), template: o.text("config.template") == Some("true") })
        .collect())
}

/// `parent` of `vm`: the folder it is in.
///
/// Errors: those of [`Session`] calls.
pub(crate) async fn folder_of(session: &Session, vm: &MoRef) -> Result<Option<MoRef>, Error> {
    let spec = prop_set("VirtualMachine", &["parent"]) + &object_set(vm, &[]);
    Ok(properties::retrieve(session, &spec).await?.first().and_then(|o| o.moref("parent")))
}

/// Calls a `…_Task` method and waits for its task; returns `info.result`.
async fn run(
    session: &Session,
    method: &'static str,
    this: &MoRef,
    args: &str,
    deadline: Duration,
) -> Result<Option<Element>, Error> {
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
    use crate::properties::objects_of;
    use crate::soap::parse_response;

    /// A `RetrievePropertiesEx` answer as govmomi's simulator writes it for
    /// a VM with a snapshot and a child of it.
    const TREE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<soapenv:Envelope xmlns:soapenv="http://schemas.xmlsoap.org/soap/envelope/" xmlns:xsd="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"><soapenv:Body><RetrievePropertiesExResponse xmlns="urn:vim25"><returnval><objects><obj type="VirtualMachine">vm-61</obj><propSet><name>snapshot.rootSnapshotList</name><val xsi:type="ArrayOfVirtualMachineSnapshotTree"><VirtualMachineSnapshotTree xsi:type="VirtualMachineSnapshotTree"><snapshot type="VirtualMachineSnapshot">snapshot-70</snapshot><vm type="VirtualMachine">vm-61</vm><name>ns_before_u1</name><description>taken by vmlet; VM poweredOn</description><id>1</id><createTime>2026-12-06T06:10:00.123456789Z</createTime><state>poweredOn</state><quiesced>false</quiesced><childSnapshotList><snapshot type="VirtualMachineSnapshot">snapshot-71</snapshot><vm type="VirtualMachine">vm-61</vm><name>ns_after_u2</name><description>taken by vmlet; VM poweredOff</description><id>2</id><createTime>2026-12-06T08:10:00+02:00</createTime><state>poweredOff</state><quiesced>true</quiesced><replaySupported>false</replaySupported></childSnapshotList><replaySupported>false</replaySupported></VirtualMachineSnapshotTree></val></propSet></objects></returnval></RetrievePropertiesExResponse></soapenv:Body></soapenv:Envelope>"#;

    #[test]
    fn a_snapshot_tree_is_read_parents_first_with_its_children() {
        let objects = objects_of(&parse_response(TREE.as_bytes()).unwrap().unwrap());
        let snapshots = snapshots_from_objects(&objects);
        assert_eq!(
            snapshots,
            vec![
                Snapshot {
                    moref: MoRef::new("VirtualMachineSnapshot", "snapshot-70"),
                    name: "ns_before_u1".into(),
                    description: "taken by vmlet; VM poweredOn".into(),
                    created_unix_seconds: Some(1_796_537_400),
                    state: PowerState::PoweredOn,
                    quiesced: false,
                },
                Snapshot {
                    moref: MoRef::new("VirtualMachineSnapshot", "snapshot-71"),
                    name: "ns_after_u2".into(),
                    description: "taken by vmlet; VM poweredOff".into(),
                    created_unix_seconds: Some(1_796_537_400),
                    state: PowerState::PoweredOff,
                    quiesced: true,
                },
            ]
        );
    }

    #[test]
    fn a_vm_without_snapshots_has_none() {
        let doc = r#"<Envelope><Body><RetrievePropertiesExResponse><returnval><objects><obj type="VirtualMachine">vm-61</obj></objects></returnval></RetrievePropertiesExResponse></Body></Envelope>"#;
        assert!(snapshots_from_objects(&objects_of(&parse_response(doc.as_bytes()).unwrap().unwrap())).is_empty());
    }

    #[test]
    fn xsd_date_times_are_read_with_their_offset_and_junk_is_none() {
        assert_eq!(unix_seconds("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(unix_seconds("2000-03-01T00:00:00"), Some(951_868_800));
        assert_eq!(unix_seconds("2000-03-01T01:30:00+01:30"), Some(951_868_800));
        assert_eq!(unix_seconds("1999-12-31T23:00:00-01:00"), Some(946_684_800));
        assert_eq!(unix_seconds("yesterday"), None);
        assert_eq!(unix_seconds("2000-13-01T00:00:00Z"), None);
    }

    #[test]
    fn a_snapshot_is_asked_for_with_its_escaped_name_memory_and_quiesce() {
        let request = CreateSnapshot { name: "a<b", description: "d&e", memory: true, quiesce: false };
        assert_eq!(
            create_args(&request),
            "<name>a&lt;b</name><description>d&amp;e</description><memory>true</memory><quiesce>false</quiesce>"
        );
    }

    #[test]
    fn a_template_is_cloned_from_the_snapshot_without_the_vms_uid() {
        let (vm, snapshot) =
            (MoRef::new("VirtualMachine", "vm-61"), MoRef::new("VirtualMachineSnapshot", "snapshot-70"));
        let (folder, host) = (MoRef::new("Folder", "group-v3"), MoRef::new("HostSystem", "host-21"));
        let pool = MoRef::new("ResourcePool", "resgroup-8");
        let request = SnapshotClone {
            vm: &vm,
            snapshot: &snapshot,
            folder: &folder,
            name: "ns_web2_restored_u",
            host: &host,
            pool: &pool,
        };
        assert_eq!(
            clone_args(&request),
            r#"<folder type="Folder">group-v3</folder><name>ns_web2_restored_u</name><spec><location><pool type="ResourcePool">resgroup-8</pool><host type="HostSystem">host-21</host></location><template>true</template><config><extraConfig><key>vmlet.io.uid</key><value xsi:type="xsd:string"></value></extraConfig></config><powerOn>false</powerOn><snapshot type="VirtualMachineSnapshot">snapshot-70</snapshot></spec>"#
        );
    }
}
