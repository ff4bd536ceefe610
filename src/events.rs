//! Kubernetes Events for what vmlet does and what fails, with one PascalCase
//! reason per action (shown by `kubectl describe` and `kubectl get events`).

use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::debug;

/// Every Event reason vmlet emits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The controller created a VM's pod in place of an earlier one (the first
    /// pod gets no Event: on the way from create to Running the scheduler's
    /// `Scheduled` is the one Event, and the conditions tell the rest).
    CreatedPod,
    /// The controller deleted a VM's pod (stop, delete or replacement).
    DeletedPod,
    /// The VM's spec cannot become a pod, or its pod's name is taken.
    InvalidSpec,
    /// The controller released a deleted VM without touching its IaaS VM.
    ReleasedVm,
    /// The agent powered on a VM its host held already (a start after a
    /// stop, or a restart); a VM it defined on the way to Running gets none.
    Started,
    /// The agent asked the guest to shut down.
    ShuttingDown,
    /// The agent powered the VM off (after the grace period, or `Hard`);
    /// the pod's deletion completes without a `Stopped` after it.
    Destroyed,
    /// The VM is off (it shut down, or was off already); the pod's
    /// deletion is complete.
    Stopped,
    /// The agent removed the VM's definition from its host.
    Undefined,
    /// The agent keeps an evicted VM running because it still should run.
    EvictionHeld,
    /// A provider call failed.
    ProviderFailed,
    /// A pod that is not a VM pod was bound to a virtual node.
    NotAVirtualMachine,
    /// A VM names a file outside its host's storage roots; it was not defined.
    StorageNotAllowed,
    /// A VM's pod was bound to a host other than the one that holds the VM.
    PlacedOnAnotherHost,
    /// The hypervisor stopped a VM's guest for an error and holds it
    /// ([`vmlet_provider::Fault`]).
    Faulted,
    /// The VM's host does not answer (a transient provider failure).
    HostNotResponding,
    /// The back end is busy with another operation on the VM.
    ProviderBusy,
    /// The back end refused vmlet's credentials the right to act.
    PermissionDenied,
    /// The back end's quota for vmlet's project is used up.
    QuotaExceeded,
    /// The back end lacks what the VM needs.
    Unsupported,
    /// The VM stopped by itself and its restart policy leaves it off.
    LeftOff,
    /// The running VM was resized live (vCPU hot-plug, memory balloon).
    Resized,
    /// The VM's definition has its new size; the running VM gets it at its
    /// next start.
    RestartRequired,
    /// A resize cannot be applied now or at all (infeasible, deferred, or
    /// refused by the backend).
    ResizeNotApplied,
    /// The VM's pod was evicted and the VM moves to another host.
    Migrating,
    /// The VM now runs on the target host.
    Migrated,
    /// A migration attempt failed; the VM runs on where it was.
    MigrationFailed,
    /// A migration ended before it moved anything.
    MigrationCancelled,
    /// A migration's target pod has no host: the scheduler found none (the
    /// note is its message), so the drain that asked for it waits.
    TargetUnschedulable,
    /// A claim's volume was made and its PersistentVolume created.
    ProvisioningSucceeded,
    /// A claim of a vmlet StorageClass gets no volume (the note says why).
    ProvisioningFailed,
    /// A claim's volume grew to the size the claim asks for (as
    /// external-resizer reports it).
    VolumeResizeSuccessful,
    /// A claim's volume could not grow (the note says why).
    VolumeResizeFailed,
    /// The node did not admit a VM pod bound to it (its placement fields).
    Rejected,
}

impl Reason {
    /// The PascalCase reason string.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CreatedPod => "CreatedPod",
            Reason::DeletedPod => "DeletedPod",
            Reason::InvalidSpec => "InvalidSpec",
            Reason::ReleasedVm => "ReleasedVm",
            Reason::Started => "Started",
            Reason::ShuttingDown => "ShuttingDown",
            Reason::Destroyed => "Destroyed",
            Reason::Stopped => "Stopped",
            Reason::Undefined => "Undefined",
            Reason::EvictionHeld => "EvictionHeld",
            Reason::ProviderFailed => "ProviderFailed",
            Reason::NotAVirtualMachine => "NotAVirtualMachine",
            Reason::StorageNotAllowed => "StorageNotAllowed",
            Reason::PlacedOnAnotherHost => "PlacedOnAnotherHost",
            Reason::Faulted => "Faulted",
            Reason::HostNotResponding => "HostNotResponding",
            Reason::ProviderBusy => "ProviderBusy",
            Reason::PermissionDenied => "PermissionDenied",
            Reason::QuotaExceeded => "QuotaExceeded",
            Reason::Unsupported => "Unsupported",
            Reason::LeftOff => "LeftOff",
            Reason::Resized => "Resized",
            Reason::RestartRequired => "RestartRequired",
            Reason::ResizeNotApplied => "ResizeNotApplied",
            Reason::Migrating => "Migrating",
            Reason::Migrated => "Migrated",
            Reason::MigrationFailed => "MigrationFailed",
            Reason::TargetUnschedulable => "TargetUnschedulable",
            Reason::MigrationCancelled => "MigrationCancelled",
            Reason::ProvisioningSucceeded => "ProvisioningSucceeded",
            Reason::ProvisioningFailed => "ProvisioningFailed",
            Reason::VolumeResizeSuccessful => "VolumeResizeSuccessful",
            Reason::VolumeResizeFailed => "VolumeResizeFailed",
            Reason::Rejected => "Rejected",
        }
    }

    fn is_warning(self) -> bool {
        matches!(
            self,
            Reason::ProviderFailed
                | Reason::NotAVirtualMachine
                | Reason::EvictionHeld
                | Reason::InvalidSpec
                | Reason::StorageNotAllowed
                | Reason::PlacedOnAnotherHost
                | Reason::Faulted
                | Reason::HostNotResponding
                | Reason::ProviderBusy
                | Reason::PermissionDenied
                | Reason::QuotaExceeded
                | Reason::Unsupported
                | Reason::RestartRequired
                | Reason::ResizeNotApplied
                | Reason::MigrationFailed
                | Reason::TargetUnschedulable
                | Reason::ProvisioningFailed
                | Reason::VolumeResizeFailed
                | Reason::Rejected
        )
    }
}

/// Publishes Events as one reporting component. Failures to publish are logged at
/// debug level and otherwise ignored: an Event is never worth failing an action.
///
/// The same Event (object, reason, note) is published once per
/// [`REPEAT_AFTER`]: a failure retried with backoff, or a pod refused again at
/// every pass, does not flood `kubectl get events`.
#[derive(Clone)]
pub struct EventSink {
    recorder: Recorder,
    recent: Arc<Mutex<HashMap<EventKey, Instant>>>,
}

/// An Event's identity for [`REPEAT_AFTER`]: the object's UID, the reason, a
/// hash of the note.
type EventKey = (String, Reason, u64);

/// How long an identical Event is not published again.
pub const REPEAT_AFTER: Duration = Duration::from_secs(600);

impl EventSink {
    /// A sink reporting as `component` (e.g. `vmlet-controller`, `vmlet/host-a`).
    pub fn new(client: Client, component: &str) -> Self {
        let reporter = Reporter {
            controller: component.to_owned(),
            instance: hostname::get().ok().and_then(|h| h.into_string().ok()),
        };
        EventSink { recorder: Recorder::new(client, reporter), recent: Arc::default() }
    }

    /// Whether this Event was published within [`REPEAT_AFTER`]; records it
    /// as published now otherwise.
    fn seen_recently(&self, object: &str, reason: Reason, note: &str) -> bool {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut hasher = DefaultHasher::new();
        note.hash(&mut hasher);
        let key = (object.to_owned(), reason, hasher.finish());
        let mut recent = self.recent.lock().expect("events poisoned");
        if recent.get(&key).is_some_and(|at| at.elapsed() < REPEAT_AFTER) {
            return true;
        }
        if recent.len() >= 10_000 {
            recent.retain(|_, at| at.elapsed() < REPEAT_AFTER);
        }
        recent.insert(key, Instant::now());
        false
    }

    /// Publish `reason` with `note` (at most 1 KiB is kept) about `object`,
    /// unless the same was published within [`REPEAT_AFTER`]. Returns at once:
    /// the Event is written in the background (as the kubelet's event
    /// broadcaster does), so a pass never waits for it; a failed write is
    /// logged at debug level and dropped.
    pub fn publish<K: Resource<DynamicType = ()>>(&self, object: &K, reason: Reason, note: &str) {
        let object_ref = object.object_ref(&());
        let identity =
            object_ref.uid.clone().unwrap_or_else(|| format!("{:?}/{:?}", object_ref.namespace, object_ref.name));
        if self.seen_recently(&identity, reason, note) {
            return;
        }
        let mut note = note.to_owned();
        if note.len() > 1024 {
            let mut end = 1021;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
            note.push_str("...");
        }
        let event = Event {
            type_: if reason.is_warning() { EventType::Warning } else { EventType::Normal },
            reason: reason.as_str().to_owned(),
            note: Some(note),
            action: reason.as_str().to_owned(),
            secondary: None,
        };
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &object_ref).await {
                debug!(error = %e, reason = event.reason, "event not published");
            }
        });
    }
}
