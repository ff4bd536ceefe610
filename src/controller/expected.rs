//! Pods the controller created that its pod watch has not shown yet, so that
//! a pass which finds the VM's `status.podName` but not the pod in the cache
//! waits for the watch (whose event runs the pass again) instead of reading
//! the pod from the API server; and pods it asked the API server to delete,
//! so that a pass that still finds such a pod without its
//! `deletionTimestamp` (the watch lags behind the delete) does not delete it
//! again. client-go's controller "expectations" for creations and
//! deletions. An entry is trusted for [`EXPECTED_FOR`] only: a pod deleted
//! before the watch ever showed it is then read from the API server, and a
//! delete that the watch never showed is made again, as without this.

use crate::written::Recent;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a created pod is expected to show up in the watch.
pub const EXPECTED_FOR: Duration = Duration::from_secs(10);

/// How long a pod name the controller found taken is remembered: until a
/// pass has named another pod in the VM's status.
pub const TAKEN_FOR: Duration = Duration::from_secs(60);

/// What the controller wrote and its watch has not shown yet.
pub struct Expected {
    /// `namespace/name` of a created pod → when it was created.
    created: Mutex<HashMap<String, Instant>>,
    /// `namespace/name` whose create found a pod there already → when.
    taken: Mutex<HashMap<String, Instant>>,
    /// UIDs of pods whose delete the API server accepted.
    deleted: Recent,
}

impl Default for Expected {
    fn default() -> Self {
        Expected { created: Mutex::default(), taken: Mutex::default(), deleted: Recent::new(EXPECTED_FOR) }
    }
}

impl Expected {
    /// Remember that pod `name` of `namespace` was created just now.
    pub fn created(&self, namespace: &str, name: &str) {
        self.at(namespace, name, Instant::now());
    }

    fn at(&self, namespace: &str, name: &str, when: Instant) {
        let mut map = self.created.lock().expect("expected poisoned");
        // Entries of pods never seen are dropped as they age, not kept.
        map.retain(|_, created| created.elapsed() < EXPECTED_FOR);
        map.insert(format!("{namespace}/{name}"), when);
    }

    /// Whether pod `name` of `namespace`, which the watch cache does not
    /// hold, was created less than [`EXPECTED_FOR`] ago.
    pub fn pending(&self, namespace: &str, name: &str) -> bool {
        let map = self.created.lock().expect("expected poisoned");
        map.get(&format!("{namespace}/{name}")).is_some_and(|created| created.elapsed() < EXPECTED_FOR)
    }

    /// Remember that the controller's create of pod `name` of `namespace`
    /// (the name it had written in the VM's `status.podName`) found a pod
    /// there already: someone else made it, and it is never the VM's pod.
    pub fn taken(&self, namespace: &str, name: &str) {
        let mut map = self.taken.lock().expect("taken poisoned");
        map.retain(|_, when| when.elapsed() < TAKEN_FOR);
        map.insert(format!("{namespace}/{name}"), Instant::now());
    }

    /// Whether pod `name` of `namespace` was found taken by another's pod
    /// less than [`TAKEN_FOR`] ago ([`Expected::taken`]).
    pub fn is_taken(&self, namespace: &str, name: &str) -> bool {
        let map = self.taken.lock().expect("taken poisoned");
        map.get(&format!("{namespace}/{name}")).is_some_and(|when| when.elapsed() < TAKEN_FOR)
    }

    /// Forget pod `name` of `namespace`: the watch showed it.
    pub fn seen(&self, namespace: &str, name: &str) {
        let mut map = self.created.lock().expect("expected poisoned");
        map.remove(&format!("{namespace}/{name}"));
    }

    /// Remember that the API server accepted the delete of the pod with UID
    /// `uid` just now.
    pub fn deleted(&self, uid: &str) {
        self.deleted.mark(uid);
    }

    /// Whether the pod with UID `uid`, which the watch cache shows without a
    /// `deletionTimestamp`, was deleted less than [`EXPECTED_FOR`] ago
    /// ([`Expected::deleted`]): its delete is then on its way through the
    /// watch, and a second one would only cost a request (and an Event).
    pub fn deleting(&self, uid: &str) -> bool {
        self.deleted.contains(uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_deleted_a_moment_ago_is_not_deleted_again_but_another_is() {
        let expected = Expected::default();
        assert!(!expected.deleting("uid-1"));
        expected.deleted("uid-1");
        assert!(expected.deleting("uid-1"));
        assert!(!expected.deleting("uid-2"), "a replacement pod has its own UID");
    }

    #[test]
    fn a_name_found_taken_is_never_adopted_while_remembered() {
        let expected = Expected::default();
        expected.taken("team-a", "web-x7k2p");
        assert!(expected.is_taken("team-a", "web-x7k2p"));
        assert!(!expected.is_taken("team-b", "web-x7k2p"));
        assert!(!expected.pending("team-a", "web-x7k2p"), "taken is not created");
    }

    #[test]
    fn a_created_pod_is_expected_until_seen() {
        let expected = Expected::default();
        assert!(!expected.pending("ns", "web-abcde"), "nothing created yet");
        expected.created("ns", "web-abcde");
        assert!(expected.pending("ns", "web-abcde"));
        assert!(!expected.pending("other", "web-abcde"), "per namespace");
        expected.seen("ns", "web-abcde");
        assert!(!expected.pending("ns", "web-abcde"));
    }

    #[test]
    fn a_pod_never_seen_is_expected_for_a_while_only() {
        let expected = Expected::default();
        let long_ago = Instant::now().checked_sub(EXPECTED_FOR + Duration::from_secs(1)).expect("a monotonic past");
        expected.at("ns", "web-old", long_ago);
        assert!(!expected.pending("ns", "web-old"), "read from the API server after EXPECTED_FOR");
        expected.created("ns", "web-new");
        assert_eq!(expected.created.lock().unwrap().len(), 1, "the aged entry was dropped");
    }
}
