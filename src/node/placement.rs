//! The placement record (`status.placement` of a VirtualMachine): where a VM
//! lives, and the agent's decision to define or power on a VM here or not.
//!
//! "Not on this host" never means "define it here" by itself: before an agent
//! defines or powers on a VM, it reads the record fresh, asks the other hosts
//! of this process ("where is VM X", [`Provider::locate`]), and lets
//! [`verdict`] decide. The record is written before power-on, guarded by the
//! VirtualMachine's resourceVersion, so two agents never both claim a VM.

use super::Hosts;
use crate::v1alpha1::{Placement, VirtualMachine, VirtualMachineStatus};
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use tracing::{debug, warn};
use vmlet_provider::{Location, VmId};

/// What the agent of host `here` may do with a VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Define it here if needed and run it here; `record` when the placement
    /// record must first say this host.
    RunHere {
        /// Whether `status.placement` must be (re)written to this host.
        record: bool,
    },
    /// Do not define or power it on here: it lives on `node`.
    LivesElsewhere {
        /// The node that holds the VM (or that the record names).
        node: String,
    },
}

/// What one host knows about a VM, for [`verdict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HereState {
    /// This host has no definition of the VM.
    Absent,
    /// Defined here and powered off (or crashed).
    Inactive,
    /// Defined here and running (or paused, shutting down).
    Active,
}

/// Decide whether host `here` may run a VM, from what the host reports
/// (`state`), the placement record (`record`: its node, if any), the other
/// hosts of this process that hold a definition (`held_elsewhere`), and
/// whether a node is served by this process (`ours`: its answer is then
/// complete, so a record naming it can be checked).
///
/// - A VM that runs here runs here: the record follows it.
/// - A definition elsewhere, or a record naming a host this process cannot
///   check, wins over defining or powering on here.
/// - A record naming one of our hosts that no longer holds the VM (undefined
///   behind vmlet) no longer binds it.
pub fn verdict(
    here: &str,
    state: HereState,
    record: Option<&str>,
    held_elsewhere: &[String],
    ours: impl Fn(&str) -> bool,
) -> Verdict {
    let elsewhere = |node: &str| Verdict::LivesElsewhere { node: node.to_owned() };
    let run_here = Verdict::RunHere { record: record != Some(here) };
    match state {
        HereState::Active => run_here,
        _ if record == Some(here) && state == HereState::Inactive => run_here,
        _ => {
            if let Some(node) = held_elsewhere.first() {
                return elsewhere(node);
            }
            match record {
                Some(node) if node != here && !ours(node) => elsewhere(node),
                _ => run_here,
            }
        }
    }
}

/// The nodes of this process, other than `here`, whose host holds the VM
/// `id` (named `backend_name` by vmlet). A back end that sees beyond its host
/// (Nova, vSphere) may name a host of its own ([`Location::OtherHost`]): that
/// becomes the node of this process that serves the host, or, when none does,
/// the back end's host name (not a node of ours: it keeps the VM from being
/// defined here, but is never recorded). A host that does not answer is left
/// out (logged): the record still guards it.
pub async fn held_elsewhere(hosts: &Hosts, here: &str, id: &VmId, backend_name: &str) -> Vec<String> {
    let all = hosts.list();
    let mut nodes = Vec::new();
    for host in all.iter().filter(|h| h.name != here) {
        let node = match host.provider.locate(id, backend_name).await {
            Ok(Location::ThisHost(_)) => host.name.clone(),
            Ok(Location::OtherHost(backend_host)) => node_of_backend_host(&all, &backend_host),
            Ok(_) => continue,
            Err(e) => {
                debug!(node.name = %host.name, vm.uid = %id, error = %e, "host did not answer where the VM is");
                continue;
            }
        };
        if node != here && !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    nodes
}

/// The node of `hosts` whose provider's back-end host is `backend_host`, or
/// `backend_host` itself when no node of this process serves it.
fn node_of_backend_host(hosts: &[super::HostHandle], backend_host: &str) -> String {
    hosts
        .iter()
        .find(|h| h.provider.backend_host().as_deref() == Some(backend_host))
        .map_or_else(|| backend_host.to_owned(), |h| h.name.clone())
}

/// Every host of this process that holds VM `id` (named `backend_name`). Errors: the
/// host `recorded` (the placement record's node) does not answer, so the
/// caller cannot conclude "nowhere"; another host that does not answer is
/// left out (logged), so that one host down does not hold up every VM.
pub async fn holders(
    hosts: &Hosts,
    id: &VmId,
    backend_name: &str,
    recorded: Option<&str>,
) -> Result<Vec<super::HostHandle>, vmlet_provider::Error> {
    let mut found = Vec::new();
    for host in hosts.list() {
        // The recorded host is asked by UID alone (a full look), the others
        // by the cheaper locate.
        let answer = if recorded == Some(host.name.as_str()) {
            host.provider.get(id).await.map(|s| s.map_or(Location::NotOnThisHost, Location::ThisHost))
        } else {
            host.provider.locate(id, backend_name).await
        };
        match answer {
            Ok(Location::ThisHost(_)) => found.push(host),
            Ok(_) => {}
            Err(e) if recorded == Some(host.name.as_str()) => return Err(e),
            Err(e) => {
                warn!(node.name = %host.name, vm.uid = %id, error = %e, "host did not answer whether it holds the VM")
            }
        }
    }
    Ok(found)
}

/// The node the record of `vm` names.
pub fn recorded_node(vm: &VirtualMachine) -> Option<&str> {
    vm.status.as_ref().and_then(|s| s.placement.as_ref()).map(|p| p.node_name.as_str())
}

/// How [`record`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// The record now names the node.
    Done,
    /// The record changed meanwhile to name another node (or the VM was
    /// deleted or replaced); nothing was written.
    Changed,
    /// The fresh VirtualMachine no longer wants what the caller does (the
    /// reason, from the caller's `refuse`); nothing was written.
    Refused(&'static str),
}

/// Why [`record`] did not write: the record no longer names what the caller
/// expected.
const RECORD_CHANGED: &str = "the placement record changed meanwhile";

/// Write `placement` into the VM's status, if the record still names
/// `expected` (what the caller decided from) and `refuse` finds nothing
/// against it in the fresh VirtualMachine ([`update_status`], so a success
/// also proves the VirtualMachine read was current when written). Errors:
/// the API server.
pub async fn record(
    vms: &Api<VirtualMachine>,
    name: &str,
    uid: &str,
    expected: Option<&str>,
    placement: Placement,
    refuse: impl Fn(&VirtualMachine) -> Option<&'static str>,
) -> Result<Recorded, kube::Error> {
    Ok(record_from(vms, name, uid, None, expected, placement, refuse).await?.0)
}

/// [`record`], deciding first from `cached` ([`update_status_from`]); also
/// the VirtualMachine as written, when it was.
pub async fn record_from(
    vms: &Api<VirtualMachine>,
    name: &str,
    uid: &str,
    cached: Option<VirtualMachine>,
    expected: Option<&str>,
    placement: Placement,
    refuse: impl Fn(&VirtualMachine) -> Option<&'static str>,
) -> Result<(Recorded, Option<VirtualMachine>), kube::Error> {
    let (updated, written) = update_status_from(vms, name, uid, cached, |vm| {
        if let Some(why) = refuse(vm) {
            return Change::Refuse(why);
        }
        let current = recorded_node(vm);
        if current == Some(placement.node_name.as_str())
            && vm.status.as_ref().and_then(|s| s.placement.as_ref()) == Some(&placement)
        {
            return Change::Unchanged;
        }
        if current != expected && current != Some(placement.node_name.as_str()) {
            return Change::Refuse(RECORD_CHANGED);
        }
        let mut status = vm.status.clone().unwrap_or_default();
        status.placement = Some(placement.clone());
        Change::Write(Box::new(status))
    })
    .await?;
    let recorded = match updated {
        Updated::Written | Updated::Unchanged => Recorded::Done,
        Updated::Refused(RECORD_CHANGED) | Updated::Gone => Recorded::Changed,
        Updated::Refused(why) => Recorded::Refused(why),
    };
    Ok((recorded, written))
}

/// What [`update_status`]'s `change` makes of the VirtualMachine read fresh.
pub enum Change {
    /// Write this status.
    Write(Box<VirtualMachineStatus>),
    /// It says so already.
    Unchanged,
    /// Not to be written, for this reason.
    Refuse(&'static str),
}

/// How [`update_status`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Updated {
    /// Written.
    Written,
    /// Nothing to write.
    Unchanged,
    /// `change` refused, for this reason.
    Refused(&'static str),
    /// The VirtualMachine is gone or was replaced (another UID).
    Gone,
}

/// Change the status of VirtualMachine `name` (UID `uid`) by `change`, applied
/// to the object read fresh from the API server and written as a whole
/// status guarded by its resourceVersion: what `change` decided from is what
/// the write replaces. Retried with a fresh read on a conflict with another
/// writer (up to 5 times; then [`Updated::Refused`]). Errors: the API server.
pub async fn update_status(
    vms: &Api<VirtualMachine>,
    name: &str,
    uid: &str,
    change: impl Fn(&VirtualMachine) -> Change,
) -> Result<Updated, kube::Error> {
    Ok(update_status_from(vms, name, uid, None, change).await?.0)
}

/// [`update_status`], deciding first from `cached` (a watch cache's copy)
/// instead of a fresh read: its resourceVersion guards the write all the
/// same, so a stale copy only costs a conflict, then a fresh read. Also
/// returns the VirtualMachine as written, when it was.
pub async fn update_status_from(
    vms: &Api<VirtualMachine>,
    name: &str,
    uid: &str,
    cached: Option<VirtualMachine>,
    change: impl Fn(&VirtualMachine) -> Change,
) -> Result<(Updated, Option<VirtualMachine>), kube::Error> {
    let mut cached = cached;
    for _ in 0..5 {
        let current = match cached.take() {
            Some(vm) => Some(vm),
            None => vms.get_opt(name).await?,
        };
        let Some(mut vm) = current else { return Ok((Updated::Gone, None)) };
        if vm.uid().as_deref() != Some(uid) {
            return Ok((Updated::Gone, None));
        }
        let status = match change(&vm) {
            Change::Write(status) => *status,
            Change::Unchanged => return Ok((Updated::Unchanged, None)),
            Change::Refuse(why) => return Ok((Updated::Refused(why), None)),
        };
        vm.status = Some(status);
        let params = PostParams { field_manager: Some("vmlet-agent".into()), ..PostParams::default() };
        match vms.replace_status(name, &params, &vm).await {
            Ok(written) => return Ok((Updated::Written, Some(written))),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok((Updated::Gone, None)),
            Err(e) => return Err(e),
        }
    }
    Ok((Updated::Refused("the VirtualMachine kept changing (5 conflicts in a row)"), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(node: &str) -> bool {
        node.starts_with("host-")
    }

    fn elsewhere(node: &str) -> Verdict {
        Verdict::LivesElsewhere { node: node.into() }
    }

    #[test]
    fn a_new_vm_is_defined_here_and_recorded_first() {
        assert_eq!(verdict("host-a", HereState::Absent, None, &[], ours), Verdict::RunHere { record: true });
    }

    #[test]
    fn a_vm_recorded_on_another_host_is_never_defined_here() {
        let b = ["host-b".to_owned()];
        assert_eq!(verdict("host-a", HereState::Absent, Some("host-b"), &b, ours), elsewhere("host-b"));
        // A host of another vmlet process cannot be asked: its record binds.
        assert_eq!(verdict("host-a", HereState::Absent, Some("kvm-9"), &[], ours), elsewhere("kvm-9"));
    }

    #[test]
    fn a_vm_that_another_host_holds_is_not_defined_here_even_without_a_record() {
        let b = ["host-b".to_owned()];
        assert_eq!(verdict("host-a", HereState::Absent, None, &b, ours), elsewhere("host-b"));
        assert_eq!(verdict("host-a", HereState::Absent, Some("host-a"), &b, ours), elsewhere("host-b"));
        assert_eq!(verdict("host-a", HereState::Inactive, None, &b, ours), elsewhere("host-b"));
    }

    #[test]
    fn a_vm_running_here_stays_here_and_the_record_follows_it() {
        assert_eq!(verdict("host-a", HereState::Active, None, &[], ours), Verdict::RunHere { record: true });
        assert_eq!(verdict("host-a", HereState::Active, Some("host-b"), &[], ours), Verdict::RunHere { record: true });
        assert_eq!(verdict("host-a", HereState::Active, Some("host-a"), &[], ours), Verdict::RunHere { record: false });
    }

    #[test]
    fn a_stopped_vm_recorded_here_starts_here() {
        let b = ["host-b".to_owned()];
        assert_eq!(
            verdict("host-a", HereState::Inactive, Some("host-a"), &b, ours),
            Verdict::RunHere { record: false }
        );
        assert_eq!(verdict("host-a", HereState::Absent, Some("host-a"), &[], ours), Verdict::RunHere { record: false });
    }

    #[test]
    fn a_record_naming_our_host_that_lost_the_vm_no_longer_binds_it() {
        assert_eq!(verdict("host-a", HereState::Absent, Some("host-b"), &[], ours), Verdict::RunHere { record: true });
    }

    #[test]
    fn a_stopped_definition_here_recorded_on_a_host_we_cannot_ask_is_not_started() {
        assert_eq!(verdict("host-a", HereState::Inactive, Some("kvm-9"), &[], ours), elsewhere("kvm-9"));
    }
}
