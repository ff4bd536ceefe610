//! Moving a VM to another host of the same backend: live (the guest keeps
//! running, its memory copied while it runs) or cold (an inactive VM's
//! definition moved).

use std::time::Duration;

use crate::{Result, VmId};

/// How a VM moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationMode {
    /// The running guest moves without a restart (libvirt peer-to-peer live
    /// migration, Nova `os-migrateLive`, vSphere vMotion).
    Live,
    /// An inactive VM's definition moves (libvirt offline migration, Nova
    /// `migrate`, vSphere relocate of a powered-off VM).
    Cold,
}

/// A host as the destination of a migration: what the source's backend needs
/// to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationTarget {
    /// The host's name in vmlet (its node name).
    pub host: String,
    /// How the source host's backend reaches it: a libvirt URI as the source
    /// daemon connects to it (`qemu+tcp://10.0.0.2/system`), a Nova hypervisor
    /// hostname, a vSphere HostSystem MoRef. Empty when the host knows no such
    /// address (a libvirt host reached as `qemu:///system` without a configured
    /// one): it cannot be a destination, and a migration to it fails with
    /// `InvalidInput`.
    pub address: String,
}

/// How far a running migration got, as the backend reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrationProgress {
    /// Bytes copied so far (memory and, where copied, storage).
    pub processed_bytes: u64,
    /// Bytes still to copy (may grow while a busy guest dirties memory).
    pub remaining_bytes: u64,
    /// Bytes in all, as far as known.
    pub total_bytes: u64,
}

/// The migration capability ([`crate::Provider::migration`]). Called on the
/// source host's provider.
#[async_trait::async_trait]
pub trait Migration: Send + Sync {
    /// This host as a migration destination, for other hosts' providers.
    fn target(&self) -> MigrationTarget;

    /// Move the VM to `to` and wait until that completed or failed, at most
    /// `timeout` (then the migration is aborted). On success the VM is defined
    /// persistently on the target (running when it ran, with the same backend
    /// id) and no longer defined here. On failure the VM stays here as it was:
    /// a live migration that fails leaves the guest running on this host.
    ///
    /// `Live` needs a running VM, `Cold` an inactive one (the caller shuts it
    /// down first). Errors: `NotFound` when this host has no such VM (it may
    /// have moved already: ask the target); `InvalidInput` when the VM's state
    /// does not fit the mode; `Transient` when the target cannot be reached or
    /// the timeout passed; `Unsupported` when this backend cannot move the VM
    /// this way.
    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()>;

    /// Progress of the VM's running outgoing migration; `None` when none runs.
    async fn progress(&self, id: &VmId) -> Result<Option<MigrationProgress>>;
}
