//! A loop's own last write per object (a VirtualMachine, a pod), so that a
//! pass whose watch cache has not caught up with it is skipped instead of
//! redoing work from a stale view (which only ends in a 409 Conflict, a
//! fresh read and a retry). The same idea as client-go's controller
//! "expectations", for one object. Keyed by UID, so one map serves objects of
//! several kinds.
//!
//! Compares resourceVersions as numbers: the API server documents them as
//! opaque, but etcd-backed ones are its revision; a version that does not
//! parse is never "behind", so the worst case is the old behaviour.

use kube::{Resource, ResourceExt};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Object UID → resourceVersion of the loop's last write of it.
#[derive(Default)]
pub struct Written(Mutex<HashMap<String, u64>>);

impl Written {
    /// Remember `written`, the object a write returned.
    pub fn record(&self, written: &impl Resource) {
        if let (Some(uid), Some(version)) = (written.uid(), revision(written)) {
            let mut map = self.0.lock().expect("written poisoned");
            let entry = map.entry(uid).or_insert(version);
            *entry = (*entry).max(version);
        }
    }

    /// Whether `cached` is older than the loop's last write of it; forgets
    /// the write once the cache has caught up.
    pub fn behind(&self, cached: &impl Resource) -> bool {
        let (Some(uid), Some(version)) = (cached.uid(), revision(cached)) else { return false };
        let mut map = self.0.lock().expect("written poisoned");
        match map.get(&uid) {
            Some(&last) if version < last => true,
            Some(_) => {
                map.remove(&uid);
                false
            }
            None => false,
        }
    }
}

/// Keys (object UIDs) a loop acted on lately: a write whose effect the watch
/// has not shown yet (a delete, a finalizer released), so that a pass that
/// still sees the object as it was does not make the write again. An entry is
/// trusted for the period given at construction only, and dropped with age,
/// so a write the watch never showed (the object gone meanwhile) is neither
/// kept forever nor skipped for good.
pub struct Recent {
    within: Duration,
    at: Mutex<HashMap<String, Instant>>,
}

impl Recent {
    /// Entries trusted for `within`.
    pub fn new(within: Duration) -> Recent {
        Recent { within, at: Mutex::default() }
    }

    /// Remember that the loop acted on `key` just now.
    pub fn mark(&self, key: &str) {
        let mut map = self.at.lock().expect("recent poisoned");
        map.retain(|_, when| when.elapsed() < self.within);
        map.insert(key.to_owned(), Instant::now());
    }

    /// Whether the loop acted on `key` less than the period ago.
    pub fn contains(&self, key: &str) -> bool {
        let map = self.at.lock().expect("recent poisoned");
        map.get(key).is_some_and(|when| when.elapsed() < self.within)
    }
}

fn revision(object: &impl Resource) -> Option<u64> {
    object.resource_version()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::VmBuilder;
    use crate::v1alpha1::VirtualMachine;

    fn at(version: &str) -> VirtualMachine {
        let mut vm = VmBuilder::new("web").build();
        vm.metadata.resource_version = Some(version.into());
        vm
    }

    #[test]
    fn a_recent_mark_is_trusted_for_its_period_only() {
        let recent = Recent::new(Duration::from_secs(10));
        assert!(!recent.contains("uid-1"));
        recent.mark("uid-1");
        assert!(recent.contains("uid-1") && !recent.contains("uid-2"));
        // An old mark counts no longer, and the next mark drops it.
        recent.at.lock().unwrap().insert("uid-3".into(), Instant::now() - Duration::from_secs(11));
        assert!(!recent.contains("uid-3"));
        recent.mark("uid-4");
        assert!(!recent.at.lock().unwrap().contains_key("uid-3"));
    }

    #[test]
    fn a_cache_older_than_our_write_is_behind_until_it_catches_up() {
        let written = Written::default();
        assert!(!written.behind(&at("10")), "nothing written yet");
        written.record(&at("12"));
        assert!(written.behind(&at("11")));
        assert!(!written.behind(&at("12")));
        assert!(!written.behind(&at("11")), "forgotten once caught up");
    }

    #[test]
    fn an_opaque_resource_version_is_never_behind() {
        let written = Written::default();
        written.record(&at("12"));
        assert!(!written.behind(&at("abc")));
    }
}
