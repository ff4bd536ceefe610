//! Pods the controller created that its pod watch has not shown yet, so that
//! a pass which finds the VM's `status.podName` but not the pod in the cache
//! waits for the watch (whose event runs the pass again) instead of reading
//! the pod from the API server. client-go's controller "expectations" for
//! creations. An entry is trusted for [`EXPECTED_FOR`] only: a pod deleted
//! before the watch ever showed it is then read from the API server, as
//! without this.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a created pod is expected to show up in the watch.
pub const EXPECTED_FOR: Duration = Duration::from_secs(10);

/// `namespace/name` of a created pod → when it was created.
#[derive(Default)]
pub struct Expected(Mutex<HashMap<String, Instant>>);

impl Expected {
    /// Remember that pod `name` of `namespace` was created just now.
    pub fn created(&self, namespace: &str, name: &str) {
        self.at(namespace, name, Instant::now());
    }

    fn at(&self, namespace: &str, name: &str, when: Instant) {
        let mut map = self.0.lock().expect("expected poisoned");
        // Entries of pods never seen are dropped as they age, not kept.
        map.retain(|_, created| created.elapsed() < EXPECTED_FOR);
        map.insert(format!("{namespace}/{name}"), when);
    }

    /// Whether pod `name` of `namespace`, which the watch cache does not
    /// hold, was created less than [`EXPECTED_FOR`] ago.
    pub fn pending(&self, namespace: &str, name: &str) -> bool {
        let map = self.0.lock().expect("expected poisoned");
        map.get(&format!("{namespace}/{name}")).is_some_and(|created| created.elapsed() < EXPECTED_FOR)
    }

    /// Forget pod `name` of `namespace`: the watch showed it.
    pub fn seen(&self, namespace: &str, name: &str) {
        let mut map = self.0.lock().expect("expected poisoned");
        map.remove(&format!("{namespace}/{name}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(expected.0.lock().unwrap().len(), 1, "the aged entry was dropped");
    }
}
