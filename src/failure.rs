//! What vmlet does about a failed provider call, decided in one place from the
//! error's kind ([`vmlet_provider::ErrorKind`]): when to try again, what the
//! pod shows, which reason names it (conditions, Events, later metric labels)
//! and which HTTP status the kubelet API answers.

use crate::events::Reason;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use vmlet_provider::ErrorKind;

/// When a failed pass runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// After the object's next backoff step ([`Backoff`]).
    Backoff,
    /// Only when the object changes (the user must act).
    OnChange,
}

/// What the pod shows while the failure lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodEffect {
    /// The container waits with the failure's reason and message (the pod is
    /// Pending, not Ready).
    Waiting,
    /// The last known status stays (a Running VM stays Running and Ready),
    /// plus the condition [`HOST_RESPONDING`] = False saying the host does
    /// not answer: a host that is down for a while is not a disruption.
    KeepLastKnown,
    /// The pod stays exactly as it is: the VM is only busy with something
    /// else (the Event says with what), and its status is still right.
    Unchanged,
}

/// Pod condition type set to False while the VM's host does not answer.
pub const HOST_RESPONDING: &str = "vmlet.io/HostResponding";

/// How a failure of one kind is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handling {
    /// When to try again.
    pub retry: Retry,
    /// What the pod shows.
    pub pod: PodEffect,
    /// The reason of conditions and Events.
    pub reason: Reason,
    /// The kubelet API's HTTP status.
    pub http_status: u16,
}

/// The one mapping from an error kind to its handling.
pub fn handling(kind: ErrorKind) -> Handling {
    use {PodEffect::*, Retry::*};
    let (retry, pod, reason, http_status) = match kind {
        ErrorKind::Transient => (Backoff, KeepLastKnown, Reason::HostNotResponding, 503),
        ErrorKind::InvalidInput => (OnChange, Waiting, Reason::InvalidSpec, 400),
        ErrorKind::Unsupported => (OnChange, Waiting, Reason::Unsupported, 501),
        ErrorKind::NotFound => (Backoff, Waiting, Reason::ProviderFailed, 404),
        ErrorKind::Conflict => (Backoff, Unchanged, Reason::ProviderBusy, 409),
        ErrorKind::PermissionDenied => (Backoff, Waiting, Reason::PermissionDenied, 403),
        ErrorKind::QuotaExceeded => (Backoff, Waiting, Reason::QuotaExceeded, 429),
        ErrorKind::Permanent => (Backoff, Waiting, Reason::ProviderFailed, 500),
    };
    Handling { retry, pod, reason, http_status }
}

/// Per-object exponential backoff: 1 s after the first failure, doubling to
/// at most 5 minutes, forgotten on success.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: Mutex<HashMap<String, u32>>,
}

/// First delay after a failure.
pub const BACKOFF_INITIAL: Duration = Duration::from_secs(1);
/// Longest delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);

impl Backoff {
    /// Count a failure of object `key` (e.g. a UID); returns the delay before
    /// its next try.
    pub fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().expect("backoff poisoned");
        let count = failures.entry(key.to_owned()).or_insert(0);
        let delay = BACKOFF_INITIAL.saturating_mul(1u32 << (*count).min(16)).min(BACKOFF_MAX);
        *count = count.saturating_add(1);
        delay
    }

    /// Object `key` succeeded: its next failure starts at 1 s again.
    pub fn succeeded(&self, key: &str) {
        self.failures.lock().expect("backoff poisoned").remove(key);
    }

    /// Forget every object's failures (the host answers again).
    pub fn reset(&self) {
        self.failures.lock().expect("backoff poisoned").clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_one_second_to_five_minutes_and_resets_on_success() {
        let backoff = Backoff::default();
        let delays: Vec<u64> = (0..12).map(|_| backoff.failed("pod-1").as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(backoff.failed("pod-2").as_secs(), 1, "each object has its own backoff");
        backoff.succeeded("pod-1");
        assert_eq!(backoff.failed("pod-1").as_secs(), 1);
    }

    #[test]
    fn a_host_that_does_not_answer_keeps_the_pod_as_it_was_and_is_retried() {
        let h = handling(ErrorKind::Transient);
        assert_eq!(
            (h.retry, h.pod, h.reason, h.http_status),
            (Retry::Backoff, PodEffect::KeepLastKnown, Reason::HostNotResponding, 503)
        );
    }

    #[test]
    fn input_the_user_must_change_waits_for_a_change() {
        for kind in [ErrorKind::InvalidInput, ErrorKind::Unsupported] {
            let h = handling(kind);
            assert_eq!((h.retry, h.pod), (Retry::OnChange, PodEffect::Waiting), "{kind:?}");
        }
        assert_eq!(handling(ErrorKind::Unsupported).http_status, 501);
    }

    #[test]
    fn a_busy_vm_keeps_its_status_while_denied_rights_and_spent_quota_say_so() {
        let busy = handling(ErrorKind::Conflict);
        assert_eq!((busy.retry, busy.pod, busy.http_status), (Retry::Backoff, PodEffect::Unchanged, 409));
        let denied = handling(ErrorKind::PermissionDenied);
        assert_eq!(
            (denied.pod, denied.reason, denied.http_status),
            (PodEffect::Waiting, Reason::PermissionDenied, 403)
        );
        let quota = handling(ErrorKind::QuotaExceeded);
        assert_eq!((quota.retry, quota.reason, quota.http_status), (Retry::Backoff, Reason::QuotaExceeded, 429));
    }

    #[test]
    fn other_failures_wait_and_back_off() {
        for kind in [ErrorKind::NotFound, ErrorKind::Permanent] {
            let h = handling(kind);
            assert_eq!((h.retry, h.pod, h.reason), (Retry::Backoff, PodEffect::Waiting, Reason::ProviderFailed));
        }
    }
}
