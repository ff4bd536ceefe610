//! Changing a VM's size: vCPUs and memory, live where the backend and the VM's
//! ceilings allow, else in the persistent definition for the next start.

use crate::{Result, VmId};

/// A VM's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resources {
    /// Virtual CPUs (at least 1).
    pub cpus: u32,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

/// Where a resize takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizeScope {
    /// The running VM now (vCPU hot-plug, balloon) and its persistent
    /// definition, within the ceilings the VM was defined with.
    Live,
    /// Only the persistent definition: the running VM keeps its size until it
    /// is started again.
    NextStart,
}

/// The resize capability ([`crate::Provider::resize`]).
#[async_trait::async_trait]
pub trait Resize: Send + Sync {
    /// Give the VM `to`.
    ///
    /// - [`ResizeScope::Live`]: the running VM and its persistent definition;
    ///   `ceilings` is ignored (the ceilings are fixed at definition). Errors:
    ///   `InvalidInput` when `to` exceeds the VM's ceilings, or when shrinking
    ///   memory would take what the guest uses (the message says how much it
    ///   uses: a resize never makes a guest run out of memory); `Unsupported`
    ///   when the VM is not running or the backend cannot resize it live.
    /// - [`ResizeScope::NextStart`]: the persistent definition only, with its
    ///   ceilings set to `ceilings` (raised to `to` where lower).
    ///
    /// Idempotent: a VM that has the size already is left alone. Errors also:
    /// `NotFound` when the host has no such VM, `Transient`.
    async fn resize(&self, id: &VmId, to: Resources, ceilings: Resources, scope: ResizeScope) -> Result<()>;
}
