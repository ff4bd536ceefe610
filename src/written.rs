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
