//! The disk jobs this process runs on a host: backups, restores and snapshot
//! operations, one at a time per VM (and per restore target), so that a second
//! one is refused at once (`Conflict`) instead of queueing behind libvirt's job
//! lock, fighting over a qemu-img image lock, or writing the same file.
//!
//! This covers what libvirt cannot see: an inactive VM's disk copied or
//! restored with qemu-img is no libvirt job. Jobs libvirt runs (a migration, a
//! block copy started with virsh) are checked where they matter, through
//! [`crate::jobs`].

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};

use vmlet_provider::VmId;

/// The disk jobs running in this process, per host.
#[derive(Default)]
pub(crate) struct InFlight {
    /// VMs with a backup, an in-place restore or a snapshot operation running.
    pub(crate) vms: Mutex<HashSet<VmId>>,
    /// Files a restore is writing ([`vmlet_provider::Backup::restore_disk`]'s
    /// targets).
    pub(crate) targets: Mutex<HashSet<String>>,
}

/// An entry in one of [`InFlight`]'s sets, removed on drop.
pub(crate) struct Claim<'a, K: Eq + Hash> {
    set: &'a Mutex<HashSet<K>>,
    key: K,
}

impl<'a, K: Eq + Hash + Clone> Claim<'a, K> {
    /// Insert `key` into `set`; `None` when it is there already.
    pub(crate) fn take(set: &'a Mutex<HashSet<K>>, key: &K) -> Option<Self> {
        let inserted = set.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone());
        inserted.then(|| Claim { set, key: key.clone() })
    }
}

impl<K: Eq + Hash> Drop for Claim<'_, K> {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_exclusive_until_dropped() {
        let id = VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into());
        let set = Mutex::new(HashSet::new());
        let first = Claim::take(&set, &id).expect("first");
        assert!(Claim::take(&set, &id).is_none(), "second while the first is held");
        drop(first);
        assert!(Claim::take(&set, &id).is_some(), "again once dropped");
    }
}
