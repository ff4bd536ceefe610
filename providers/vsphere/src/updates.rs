//! vSphere status by push: one `PropertyCollector` filter per [`VCenter`]
//! over all its VMs, followed with `WaitForUpdatesEx`, keeps a cache of the
//! properties [`list_vms`] reads, so that the providers of a vCenter's hosts
//! read VMs from memory instead of polling every VM.
//!
//! Follows the vim25 `PropertyCollector` update model (vSphere Web Services
//! API, "Client Data Synchronization"): `CreatePropertyCollector` makes a
//! collector of this session; `CreateFilter` on it selects the VMs (the
//! traversal [`list_vms`] walks) and their paths; `WaitForUpdatesEx` with
//! version `""` answers with every VM (`ObjectUpdate` kind `enter`), then,
//! with the version of the last answer, with what changed since (`enter`,
//! `modify`, `leave`; `PropertyChange` op `assign`, `add`, `remove`,
//! `indirectRemove`), or with nothing after `maxWaitSeconds`. An answer
//! marked `truncated` is followed at once by the rest.
//!
//! Guarantees and fallbacks:
//! - The cache is *current* only after a full first answer and until any
//!   call fails; readers ([`owned_vms`]) fall back to [`list_vms`] (a direct
//!   read) while it is not, so a missing or stale entry never makes vmlet
//!   think a VM is gone.
//! - Read your writes: a cache answer is given only when every task of this
//!   session that has ended (power on and off, clone, relocate, reconfigure,
//!   destroy: [`Session::task_guard`]) ended before the `WaitForUpdatesEx`
//!   whose answer was applied last was sent; vSphere updates a VM before it
//!   completes the task that changed it, so that answer includes the
//!   change. When a task ends the follower cancels its pending wait
//!   (`CancelWaitForUpdates`) and asks again at once; a reader waits for
//!   that at most [`CATCH_UP`], then reads directly.
//! - A `modify` of `config.changeVersion` (every reconfiguration) re-reads
//!   that VM's properties directly: some servers (govmomi's simulator)
//!   report a reconfiguration as a change of `config` rather than of the
//!   watched paths below it.
//! - A collector and its filter die with their session: after a re-login
//!   (`NotAuthenticated`, [`Session::logins`]) or any failure the follower
//!   marks the cache stale, backs off (1 s doubling to 30 s), makes a new
//!   collector and starts again from version `""`.
//! - The follower is never idle for longer than `maxWaitSeconds`, which
//!   keeps the vCenter's one session alive (vCenter ends sessions idle for
//!   30 minutes by default).
//!
//! Caveat: VMs changed by others are seen when vSphere reports the change
//! (about 20 ms on the simulator, usually under a second on vCenter), not at
//! once; the node agent's resync tolerates that as it tolerated the time
//! between two polls.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::properties::{self, datacenter_walk, object_set, prop_set, ObjectContent};
use crate::provider::VCenter;
use crate::session::Session;
use crate::soap::{fault_type, MoRef};
use crate::vms::{list_vms, vms_from_objects, Vm, VM_PATHS};
use crate::xml::{escape, Element};
use crate::Error;

/// `maxWaitSeconds` of each `WaitForUpdatesEx`: how long vSphere holds a
/// wait open when nothing changes.
pub(crate) const MAX_WAIT_SECONDS: u64 = 30;

/// The HTTP deadline of a `WaitForUpdatesEx`: `maxWaitSeconds` plus slack
/// for a busy server.
const WAIT_DEADLINE: Duration = Duration::from_secs(MAX_WAIT_SECONDS + 15);

/// Deadline of the follower's other calls (create, cancel, destroy).
const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// How long a reader waits for the cache to catch up with a task that
/// just ended, or for the first answer, before it reads directly.
pub(crate) const CATCH_UP: Duration = Duration::from_secs(2);

/// How often a cancel is repeated while the wait it cancels goes on.
const CANCEL_AGAIN: Duration = Duration::from_millis(500);

/// The first and the longest pause after a failed follow.
const BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// Changes at every reconfiguration; its `modify` triggers a re-read.
const CHANGE_VERSION: &str = "config.changeVersion";

/// The paths the filter watches: those [`list_vms`] reads, and
/// [`CHANGE_VERSION`].
fn watched_paths() -> Vec<&'static str> {
    VM_PATHS.iter().copied().chain([CHANGE_VERSION]).collect()
}

/// The `PropertyFilterSpec` content: every VM of the datacenters' VM
/// folders under `root` (the traversal of [`list_vms`]), its watched paths.
fn filter_spec(root: &MoRef) -> String {
    prop_set("VirtualMachine", &watched_paths()) + &object_set(root, &datacenter_walk("vmFolder", &[]))
}

/// vim25 `ObjectUpdateKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpdateKind {
    /// `enter`: the object entered the filter's set (first answer, or new).
    Enter,
    /// `modify`: watched properties changed.
    Modify,
    /// `leave`: the object left the set (destroyed, or out of the traversal).
    Leave,
}

/// vim25 `PropertyChangeOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeOp {
    /// `assign`: the path has the value `val` (none: unset).
    Assign,
    /// `add`: an element `val` was added at the path.
    Add,
    /// `remove`: the path's element was removed.
    Remove,
    /// `indirectRemove`: the path went away with its parent.
    IndirectRemove,
}

/// One vim25 `PropertyChange`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PropertyChange {
    pub name: String,
    pub op: ChangeOp,
    pub val: Option<Element>,
}

/// One vim25 `ObjectUpdate`: `missing` holds the `missingSet` paths with
/// their fault types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectUpdate {
    pub kind: UpdateKind,
    pub obj: MoRef,
    pub changes: Vec<PropertyChange>,
    pub missing: Vec<(String, String)>,
}

/// One vim25 `UpdateSet` (all filter sets flattened: this collector has
/// one filter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UpdateSet {
    pub version: String,
    pub truncated: bool,
    pub objects: Vec<ObjectUpdate>,
}

/// The `UpdateSet` of a `WaitForUpdatesExResponse`, `None` when it has no
/// `returnval` (`maxWaitSeconds` passed without a change), or why it cannot
/// be read.
pub(crate) fn update_set_from_response(response: &Element) -> Result<Option<UpdateSet>, String> {
    let Some(set) = response.child("returnval") else { return Ok(None) };
    let version = set.child_text("version").ok_or("an UpdateSet without a version")?.trim().to_owned();
    let truncated = set.child_text("truncated").map(str::trim) == Some("true");
    let mut objects = Vec::new();
    for update in set.children_named("filterSet").flat_map(|f| f.children_named("objectSet")) {
        let obj = update.child("obj").and_then(MoRef::from_element).ok_or("an ObjectUpdate without obj")?;
        let kind = match update.child_text("kind").map(str::trim) {
            Some("enter") => UpdateKind::Enter,
            Some("modify") => UpdateKind::Modify,
            Some("leave") => UpdateKind::Leave,
            other => return Err(format!("ObjectUpdate of {obj}: unknown kind {other:?}")),
        };
        let mut changes = Vec::new();
        for change in update.children_named("changeSet") {
            let name = change.child_text("name").ok_or("a PropertyChange without a name")?.trim().to_owned();
            let op = match change.child_text("op").map(str::trim) {
                Some("assign") => ChangeOp::Assign,
                Some("add") => ChangeOp::Add,
                Some("remove") => ChangeOp::Remove,
                Some("indirectRemove") => ChangeOp::IndirectRemove,
                other => return Err(format!("PropertyChange {name} of {obj}: unknown op {other:?}")),
            };
            changes.push(PropertyChange { name, op, val: change.child("val").cloned() });
        }
        let missing = update
            .children_named("missingSet")
            .filter_map(|m| {
                let fault = m.child("fault").and_then(|f| f.child("fault")).map(fault_type).unwrap_or_default();
                Some((m.child_text("path")?.trim().to_owned(), fault))
            })
            .collect();
        objects.push(ObjectUpdate { kind, obj, changes, missing });
    }
    Ok(Some(UpdateSet { version, truncated, objects }))
}

/// The watched properties of every VM the filter reported, by reference
/// (VMs without a vmlet UID too: one may get it later).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Cache {
    objects: HashMap<MoRef, BTreeMap<String, Element>>,
}

impl Cache {
    /// Applies one answer; returns the VMs whose [`CHANGE_VERSION`] changed
    /// (to re-read). Errors: a `NotAuthenticated` in a `missingSet`, or a
    /// change below a watched path (this cache keeps whole values only):
    /// the cache must be built again.
    pub fn apply(&mut self, set: &UpdateSet) -> Result<Vec<MoRef>, String> {
        let watched = watched_paths();
        let mut reread = Vec::new();
        for update in &set.objects {
            if let Some((path, _)) = update.missing.iter().find(|(_, fault)| fault == "NotAuthenticated") {
                return Err(format!("{path} of {}: NotAuthenticated", update.obj));
            }
            let props = match update.kind {
                UpdateKind::Leave => {
                    self.objects.remove(&update.obj);
                    continue;
                }
                UpdateKind::Enter => {
                    let props = self.objects.entry(update.obj.clone()).or_default();
                    props.clear();
                    props
                }
                UpdateKind::Modify => self.objects.entry(update.obj.clone()).or_default(),
            };
            for change in &update.changes {
                if !watched.contains(&change.name.as_str()) {
                    if let Some(parent) = watched.iter().find(|w| is_below(&change.name, w)) {
                        return Err(format!("{} of {}: a change below watched path {parent}", change.name, update.obj));
                    }
                    continue;
                }
                match (change.op, &change.val) {
                    (ChangeOp::Assign | ChangeOp::Add, Some(val)) => {
                        props.insert(change.name.clone(), val.clone());
                    }
                    _ => {
                        props.remove(&change.name);
                    }
                }
                if update.kind == UpdateKind::Modify && change.name == CHANGE_VERSION {
                    reread.push(update.obj.clone());
                }
            }
            for (path, _) in &update.missing {
                props.remove(path);
            }
        }
        Ok(reread)
    }

    /// Replaces the properties of the VMs `asked` for with those of a
    /// direct read; an asked VM the read did not return is gone (its
    /// `leave` is on the way) and leaves the cache now.
    pub fn replace(&mut self, asked: &[MoRef], objects: &[ObjectContent]) {
        for vm in asked {
            self.objects.remove(vm);
        }
        for object in objects {
            self.objects.insert(object.obj.clone(), object.props.iter().cloned().collect());
        }
    }

    /// Every VM carrying a vmlet UID, sorted by name (as [`list_vms`]).
    pub fn vms(&self) -> Vec<Vm> {
        let objects: Vec<ObjectContent> = self
            .objects
            .iter()
            .map(|(obj, props)| ObjectContent {
                obj: obj.clone(),
                props: props.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                missing: Vec::new(),
            })
            .collect();
        vms_from_objects(&objects)
    }
}

/// Whether `name` is a path below `parent` (`parent.x`, `parent[k]`).
fn is_below(name: &str, parent: &str) -> bool {
    name.strip_prefix(parent).is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
}

/// What the follower knows, shared with readers.
#[derive(Debug, Default)]
struct State {
    cache: Cache,
    /// The cache is a full copy as of the last answer applied, and no call
    /// failed since.
    current: bool,
    /// How many tasks of the session had ended when the `WaitForUpdatesEx`
    /// whose answer was applied last was sent.
    tasks_seen: u64,
    /// Why the last follow failed, while the follower backs off or starts
    /// again; readers then read directly at once.
    failing: Option<String>,
}

/// The push cache of one [`VCenter`] and its follower task, started on
/// first use ([`owned_vms`]) and stopped when the `VCenter` is dropped.
#[derive(Debug)]
pub(crate) struct Updates {
    state: Mutex<State>,
    /// Bumped whenever `state` changes.
    changed: watch::Sender<u64>,
    follower: Mutex<Option<JoinHandle<()>>>,
}

impl Default for Updates {
    fn default() -> Self {
        Updates { state: Mutex::default(), changed: watch::Sender::new(0), follower: Mutex::default() }
    }
}

impl Drop for Updates {
    fn drop(&mut self) {
        if let Some(follower) = self.follower.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            follower.abort();
        }
    }
}

impl Updates {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, change: impl FnOnce(&mut State)) {
        change(&mut self.state());
        self.changed.send_modify(|n| *n += 1);
    }

    /// Starts the follower of `vcenter` unless it runs.
    fn ensure_following(&self, vcenter: &Arc<VCenter>) {
        let mut follower = self.follower.lock().unwrap_or_else(|e| e.into_inner());
        if follower.as_ref().is_none_or(JoinHandle::is_finished) {
            *follower = Some(tokio::spawn(follow_forever(Arc::downgrade(vcenter))));
        }
    }

    /// The cached VMs once the cache is current and has seen `tasks` ended
    /// tasks, waiting at most `patience`; `None` when it does not get there
    /// (or is failing).
    async fn current_vms(&self, tasks: u64, patience: Duration) -> Option<Vec<Vm>> {
        let until = Instant::now() + patience;
        let mut changed = self.changed.subscribe();
        loop {
            {
                let state = self.state();
                if state.current && state.tasks_seen >= tasks {
                    return Some(state.cache.vms());
                }
                if state.failing.is_some() {
                    return None;
                }
            }
            if tokio::time::timeout_at(until, changed.changed()).await.is_err() {
                return None;
            }
        }
    }
}

impl VCenter {
    /// The VMs carrying a vmlet UID as the push cache holds them now,
    /// sorted by name; `None` while the cache is not current (the first
    /// answer has not arrived, or the update stream broke and is being
    /// rebuilt). Never reads VMs from vSphere itself; starts following the
    /// vCenter on the first call (within a Tokio runtime).
    pub fn pushed_vms(self: &Arc<Self>) -> Option<Vec<Vm>> {
        self.updates.ensure_following(self);
        let state = self.updates.state();
        state.current.then(|| state.cache.vms())
    }
}

/// Every VM of `vcenter` carrying a vmlet UID, sorted by name: from the
/// push cache when it is current and has caught up with this session's
/// tasks (waiting at most [`CATCH_UP`]), else read directly ([`list_vms`]).
/// Starts the follower on first use.
///
/// Errors: those of [`VCenter::session`] and [`list_vms`].
pub(crate) async fn owned_vms(vcenter: &Arc<VCenter>) -> Result<Vec<Vm>, Error> {
    let session = vcenter.session().await?;
    let updates = &vcenter.updates;
    updates.ensure_following(vcenter);
    let tasks = *session.tasks_ended().borrow();
    if let Some(vms) = updates.current_vms(tasks, CATCH_UP).await {
        return Ok(vms);
    }
    tracing::debug!(vcenter = %vcenter.name(), "update cache not current: reading VMs directly");
    list_vms(session).await
}

/// Why a follow ended.
#[derive(Debug, thiserror::Error)]
enum FollowError {
    /// A call failed.
    #[error(transparent)]
    Call(#[from] Error),
    /// The session logged in again: its collector is gone.
    #[error("the session logged in again; its PropertyCollector died with the old one")]
    Relogin,
    /// An answer this module cannot apply.
    #[error("WaitForUpdatesEx: {0}")]
    Unreadable(String),
}

/// Follows `vcenter` until it is dropped: a follow per collector, with a
/// growing pause after each failure (reset after a follow that synced).
async fn follow_forever(vcenter: Weak<VCenter>) {
    let mut pause = BACKOFF.0;
    loop {
        let Some((error, synced)) = follow(&vcenter).await else { return };
        let Some(strong) = vcenter.upgrade() else { return };
        if synced {
            pause = BACKOFF.0;
        }
        tracing::warn!(vcenter = %strong.name(), error = %error, retry_in = ?pause, "vSphere update stream broken; reading VMs directly until it is back");
        strong.updates.update(|state| {
            state.current = false;
            state.failing = Some(error.to_string());
        });
        drop(strong);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(BACKOFF.1);
    }
}

/// One collector's life: creates it and its filter, applies answers until
/// a call fails. Returns `None` when the `VCenter` is gone, else the
/// failure and whether the cache was synced by this collector.
async fn follow(weak: &Weak<VCenter>) -> Option<(FollowError, bool)> {
    let (collector, mut logins) = {
        let vcenter = weak.upgrade()?;
        let session = match vcenter.session().await {
            Ok(session) => session,
            Err(error) => return Some((error.into(), false)),
        };
        let mut logins = session.logins();
        match create_collector(session, &mut logins).await {
            Ok(collector) => (collector, logins),
            Err(error) => return Some((error.into(), false)),
        }
    };
    let mut version = String::new();
    let mut synced = false;
    // The tasks count when the first request of a truncated run was sent.
    let mut run_tasks: Option<u64> = None;
    loop {
        let vcenter = weak.upgrade()?;
        let Ok(session) = vcenter.session().await else { return Some((FollowError::Relogin, synced)) };
        let mut tasks_ended = session.tasks_ended();
        let tasks = run_tasks.unwrap_or(*tasks_ended.borrow_and_update());
        // Readers wait for an answer to a request sent after a task ended;
        // the change may have come in the answer before: ask without waiting.
        let catching_up = synced && tasks > vcenter.updates.state().tasks_seen;
        let max_wait = if catching_up { 0 } else { MAX_WAIT_SECONDS };
        let answer = match wait(session, &collector, &version, max_wait, &mut tasks_ended, &mut logins).await {
            Ok(answer) => answer,
            Err(error) => {
                destroy_collector(session, &collector, &logins).await;
                return Some((error, synced));
            }
        };
        let set = match answer {
            Waited::Cancelled => continue,
            Waited::Nothing => {
                vcenter.updates.update(|state| state.tasks_seen = state.tasks_seen.max(tasks));
                continue;
            }
            Waited::Set(set) => set,
        };
        let fresh = version.is_empty();
        let applied = {
            let mut state = vcenter.updates.state();
            if fresh {
                state.cache = Cache::default();
            }
            state.cache.apply(&set)
        };
        let reread = match applied {
            Ok(reread) => reread,
            Err(reason) => {
                destroy_collector(session, &collector, &logins).await;
                return Some((FollowError::Unreadable(reason), synced));
            }
        };
        if !reread.is_empty() {
            match read_vms(session, &reread).await {
                Ok(objects) => vcenter.updates.state().cache.replace(&reread, &objects),
                Err(error) => {
                    destroy_collector(session, &collector, &logins).await;
                    return Some((error.into(), synced));
                }
            }
        }
        version = set.version;
        if set.truncated {
            run_tasks = Some(tasks);
            vcenter.updates.update(|_| {});
            continue;
        }
        run_tasks = None;
        if !synced {
            tracing::info!(vcenter = %vcenter.name(), vms = vcenter.updates.state().cache.objects.len(), "following VM changes by push");
        }
        synced = true;
        vcenter.updates.update(|state| {
            state.current = true;
            state.failing = None;
            state.tasks_seen = state.tasks_seen.max(tasks);
        });
    }
}

/// `CreatePropertyCollector`, then `CreateFilter` on it over every VM;
/// marks the logins seen when the collector exists (it lives as long as
/// that login).
async fn create_collector(session: &Session, logins: &mut watch::Receiver<u64>) -> Result<MoRef, Error> {
    let root = session.service_content().property_collector.clone();
    let response = session.call_until("CreatePropertyCollector", &root, "", Some(CALL_DEADLINE)).await?;
    logins.borrow_and_update();
    let collector = response.child("returnval").and_then(MoRef::from_element).ok_or_else(|| Error::Response {
        operation: "CreatePropertyCollector",
        status: 200,
        reason: "no PropertyCollector in the answer".into(),
    })?;
    let args = format!(
        "<spec>{}</spec><partialUpdates>false</partialUpdates>",
        filter_spec(&session.service_content().root_folder)
    );
    session.call_until("CreateFilter", &collector, &args, Some(CALL_DEADLINE)).await?;
    Ok(collector)
}

/// `DestroyPropertyCollector` (its filter goes with it), unless the session
/// logged in since (then it is gone already); a failure is only logged.
async fn destroy_collector(session: &Session, collector: &MoRef, logins: &watch::Receiver<u64>) {
    if logins.has_changed().unwrap_or(true) {
        return;
    }
    if let Err(error) = session.call_until("DestroyPropertyCollector", collector, "", Some(CALL_DEADLINE)).await {
        tracing::debug!(collector = %collector.value, error = %error, "could not destroy the PropertyCollector");
    }
}

/// What one `WaitForUpdatesEx` gave.
enum Waited {
    /// Changes since the version asked for.
    Set(UpdateSet),
    /// `maxWaitSeconds` passed without a change.
    Nothing,
    /// A task of the session ended and the wait was cancelled.
    Cancelled,
}

/// One `WaitForUpdatesEx` from `version`, waiting at most `max_wait`
/// seconds (0: answers at once). When a task of the session ends during a
/// wait, cancels it (`CancelWaitForUpdates`) so that the caller asks again
/// at once. Errors: [`FollowError::Relogin`] as soon as the session logs in
/// again (before or during the wait: the collector is gone).
async fn wait(
    session: &Session,
    collector: &MoRef,
    version: &str,
    max_wait: u64,
    tasks_ended: &mut watch::Receiver<u64>,
    logins: &mut watch::Receiver<u64>,
) -> Result<Waited, FollowError> {
    if logins.has_changed().unwrap_or(true) {
        return Err(FollowError::Relogin);
    }
    let args =
        format!("<version>{}</version><options><maxWaitSeconds>{max_wait}</maxWaitSeconds></options>", escape(version));
    let call = session.call_until("WaitForUpdatesEx", collector, &args, Some(WAIT_DEADLINE));
    tokio::pin!(call);
    let cancel = || async {
        if let Err(error) = session.call_until("CancelWaitForUpdates", collector, "", Some(CALL_DEADLINE)).await {
            tracing::debug!(error = %error, "CancelWaitForUpdates failed; the wait ends by itself");
        }
    };
    // A cancel that reaches the server before the wait does is lost: it is
    // repeated every CANCEL_AGAIN until the wait ends.
    let mut cancelling = max_wait == 0;
    let response = loop {
        tokio::select! {
            response = &mut call => break response,
            _ = logins.changed() => return Err(FollowError::Relogin),
            _ = tasks_ended.changed(), if !cancelling => {
                cancelling = true;
                cancel().await;
            }
            _ = tokio::time::sleep(CANCEL_AGAIN), if cancelling && max_wait > 0 => cancel().await,
        }
    };
    match response {
        Err(error) if error.fault() == Some("RequestCanceled") => Ok(Waited::Cancelled),
        Err(error) => Err(error.into()),
        Ok(response) => match update_set_from_response(&response).map_err(FollowError::Unreadable)? {
            Some(set) => Ok(Waited::Set(set)),
            None => Ok(Waited::Nothing),
        },
    }
}

/// The watched properties of those of `vms` that still exist, read
/// directly. A VM deleted since the answer that named it is left out, not
/// a failure of the whole read: the filter sets
/// `reportMissingObjectsInResults` (vim25 `PropertyFilterSpec`, API 6.0+),
/// with which vSphere reports such a VM in a `missingSet` (or, as govmomi's
/// simulator does, leaves it out) instead of faulting with
/// `ManagedObjectNotFound`.
async fn read_vms(session: &Session, vms: &[MoRef]) -> Result<Vec<ObjectContent>, Error> {
    let objects: String = vms.iter().map(|vm| object_set(vm, &[])).collect();
    let spec = prop_set("VirtualMachine", &watched_paths())
        + &objects
        + "<reportMissingObjectsInResults>true</reportMissingObjectsInResults>";
    let read = properties::retrieve(session, &spec).await?;
    Ok(read.into_iter().filter(|object| !object.is_gone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soap::parse_response;
    use crate::vms::PowerState;

    fn set_of(envelope: &[u8]) -> UpdateSet {
        update_set_from_response(&parse_response(envelope).unwrap().unwrap()).unwrap().expect("an UpdateSet")
    }

    #[test]
    fn the_first_answer_enters_every_vm_and_only_uid_carriers_are_vms() {
        let set = set_of(include_bytes!("../tests/fixtures/updates_enter.xml"));
        assert!(!set.truncated);
        let mut cache = Cache::default();
        assert_eq!(cache.apply(&set).unwrap(), Vec::<MoRef>::new());
        assert_eq!(cache.objects.len(), set.objects.len());
        let vms = cache.vms();
        assert_eq!(vms.len(), 1, "{vms:?}");
        let vm = &vms[0];
        assert_eq!((vm.name.as_str(), vm.uid.as_str()), ("DC0_C0_RP0_VM1", "00000000-0000-4000-8000-000000000001"));
        assert_eq!(vm.power_state, PowerState::PoweredOn);
        assert_eq!(vm.host.as_ref().map(|h| h.kind.as_str()), Some("HostSystem"));
        assert_eq!((vm.cpus, vm.memory_bytes), (Some(1), Some(32 << 20)));
    }

    #[test]
    fn a_modify_changes_the_power_state_and_a_leave_removes_the_vm() {
        let mut cache = Cache::default();
        cache.apply(&set_of(include_bytes!("../tests/fixtures/updates_enter.xml"))).unwrap();
        let off = set_of(include_bytes!("../tests/fixtures/updates_power_off.xml"));
        assert_eq!(off.objects[0].kind, UpdateKind::Modify);
        assert_eq!(cache.apply(&off).unwrap(), Vec::<MoRef>::new());
        assert_eq!(cache.vms()[0].power_state, PowerState::PoweredOff);
        let moref = cache.vms()[0].moref.clone();
        let leave = UpdateSet {
            version: "3".into(),
            truncated: false,
            objects: vec![ObjectUpdate { kind: UpdateKind::Leave, obj: moref, changes: vec![], missing: vec![] }],
        };
        cache.apply(&leave).unwrap();
        assert!(cache.vms().is_empty());
    }

    fn val(text: &str) -> Element {
        Element { name: "val".into(), text: text.into(), ..Element::default() }
    }

    fn modify(obj: &MoRef, changes: Vec<PropertyChange>) -> UpdateSet {
        UpdateSet {
            version: "2".into(),
            truncated: false,
            objects: vec![ObjectUpdate { kind: UpdateKind::Modify, obj: obj.clone(), changes, missing: vec![] }],
        }
    }

    #[test]
    fn a_re_read_replaces_the_asked_vms_and_one_vsphere_calls_gone_leaves_the_cache() {
        let mut cache = Cache::default();
        cache.apply(&set_of(include_bytes!("../tests/fixtures/updates_enter.xml"))).unwrap();
        let vm = cache.vms()[0].moref.clone();
        let others = cache.objects.len() - 1;
        // A vCenter reports a VM deleted before the re-read in a missingSet
        // (no path: the object itself), which read_vms leaves out.
        let answer = br#"<Envelope><Body><RetrievePropertiesExResponse><returnval><objects>
            <obj type="VirtualMachine">vm-gone</obj>
            <missingSet><fault><fault xsi:type="ManagedObjectNotFound"><obj type="VirtualMachine">vm-gone</obj></fault>
            <localizedMessage>The object has already been deleted</localizedMessage></fault></missingSet>
            </objects></returnval></RetrievePropertiesExResponse></Body></Envelope>"#;
        let read = properties::objects_of(&parse_response(answer).unwrap().unwrap());
        assert_eq!(read.len(), 1);
        assert!(read[0].is_gone(), "{read:?}");
        cache.replace(std::slice::from_ref(&vm), &[]);
        assert!(cache.vms().is_empty(), "the asked VM that the read did not return is gone");
        assert_eq!(cache.objects.len(), others, "the VMs not asked for stay");
    }

    #[test]
    fn remove_and_indirect_remove_unset_a_path_and_a_reconfiguration_asks_for_a_re_read() {
        let mut cache = Cache::default();
        cache.apply(&set_of(include_bytes!("../tests/fixtures/updates_enter.xml"))).unwrap();
        let vm = cache.vms()[0].moref.clone();
        let change = |name: &str, op, v: Option<&str>| PropertyChange { name: name.into(), op, val: v.map(val) };
        cache
            .apply(&modify(
                &vm,
                vec![
                    change("guest.ipAddress", ChangeOp::Assign, Some("10.0.0.9")),
                    change("config.hardware.numCPU", ChangeOp::Add, Some("4")),
                ],
            ))
            .unwrap();
        assert_eq!(cache.vms()[0].ip_address, Some("10.0.0.9".parse().unwrap()));
        assert_eq!(cache.vms()[0].cpus, Some(4));
        let reread = cache
            .apply(&modify(
                &vm,
                vec![
                    change("guest.ipAddress", ChangeOp::Remove, None),
                    change("config.hardware.numCPU", ChangeOp::IndirectRemove, None),
                    change(CHANGE_VERSION, ChangeOp::Assign, Some("1765000000")),
                    change("summary.runtime.powerState", ChangeOp::Assign, Some("poweredOff")),
                ],
            ))
            .unwrap();
        assert_eq!(reread, vec![vm.clone()]);
        let after = &cache.vms()[0];
        assert_eq!((after.ip_address, after.cpus, &after.power_state), (None, None, &PowerState::PoweredOn));
    }

    #[test]
    fn a_change_below_a_watched_path_or_an_expired_session_rebuilds_the_cache() {
        let mut cache = Cache::default();
        let vm = MoRef::new("VirtualMachine", "vm-1");
        let below = PropertyChange { name: "runtime.host.name".into(), op: ChangeOp::Assign, val: Some(val("x")) };
        assert!(cache.apply(&modify(&vm, vec![below])).unwrap_err().contains("below watched path runtime.host"));
        let mut expired = modify(&vm, vec![]);
        expired.objects[0].missing.push(("name".into(), "NotAuthenticated".into()));
        assert!(cache.apply(&expired).is_err());
    }

    #[test]
    fn no_returnval_is_nothing_changed_and_truncated_and_unknown_ops_are_read() {
        let nothing = br#"<Envelope><Body><WaitForUpdatesExResponse xmlns="urn:vim25"></WaitForUpdatesExResponse></Body></Envelope>"#;
        assert_eq!(update_set_from_response(&parse_response(nothing).unwrap().unwrap()), Ok(None));
        let truncated = br#"<Envelope><Body><WaitForUpdatesExResponse xmlns="urn:vim25"><returnval><version>7</version><filterSet><filter type="PropertyFilter">f-1</filter><objectSet><kind>leave</kind><obj type="VirtualMachine">vm-9</obj></objectSet></filterSet><truncated>true</truncated></returnval></WaitForUpdatesExResponse></Body></Envelope>"#;
        let set = set_of(truncated);
        assert_eq!((set.version.as_str(), set.truncated, set.objects.len()), ("7", true, 1));
        assert_eq!(set.objects[0].kind, UpdateKind::Leave);
        let unknown = br#"<Envelope><Body><WaitForUpdatesExResponse xmlns="urn:vim25"><returnval><version>8</version><filterSet><objectSet><kind>modify</kind><obj type="VirtualMachine">vm-9</obj><changeSet><name>name</name><op>rename</op></changeSet></objectSet></filterSet></returnval></WaitForUpdatesExResponse></Body></Envelope>"#;
        let error = update_set_from_response(&parse_response(unknown).unwrap().unwrap()).unwrap_err();
        assert_eq!(error, "PropertyChange name of VirtualMachine:vm-9: unknown op Some(\"rename\")");
    }

    #[test]
    fn a_cancelled_wait_is_vsphere_s_request_canceled_fault() {
        let fault = parse_response(include_bytes!("../tests/fixtures/updates_cancelled.xml")).unwrap().unwrap_err();
        assert_eq!(fault.kind, "RequestCanceled");
    }

    #[test]
    fn the_filter_watches_the_listed_paths_and_the_change_version_from_the_root_folder() {
        let spec = filter_spec(&MoRef::new("Folder", "group-d1"));
        assert!(spec.contains("<pathSet>runtime.powerState</pathSet>"), "{spec}");
        assert!(spec.contains("<pathSet>config.changeVersion</pathSet>"), "{spec}");
        assert!(spec.contains(r#"<obj type="Folder">group-d1</obj>"#), "{spec}");
        assert!(spec.contains("<path>vmFolder</path>"), "{spec}");
    }
}
