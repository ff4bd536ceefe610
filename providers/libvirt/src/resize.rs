//! [`Resize`]: a VM's vCPUs and memory, changed live within the ceilings it was
//! defined with, or in its persistent definition for its next start.
//!
//! - [`ResizeScope::Live`]: `virDomainSetVcpusFlags` (vCPU hot-plug) and
//!   `virDomainSetMemoryFlags` (the balloon's target) with `LIVE|CONFIG`, each
//!   only where the running domain or its definition differs from the target.
//!   The ceilings are the running domain's (`<vcpu>` and `<memory>`, fixed at
//!   its start); beyond them the resize is refused. Before memory shrinks, the
//!   guest's use is read from the balloon's statistics (`actual - unused`, the
//!   working set [`Stats`](vmlet_provider::Stats) reports; QEMU's resident set
//!   when the guest sends none) and a target below it is refused: a resize
//!   never takes memory the guest uses. New vCPUs are brought online in the
//!   guest through its agent (`VIR_DOMAIN_VCPU_GUEST`), as a guest without a
//!   udev rule for it leaves them offline; a guest without an agent must do
//!   that itself.
//! - [`ResizeScope::NextStart`]: the same calls with `CONFIG` only, after (or,
//!   when they shrink, before) setting the definition's ceilings
//!   (`VIR_DOMAIN_VCPU_MAXIMUM`, `VIR_DOMAIN_MEM_MAXIMUM`).
//!
//! The balloon moves after the call returns: a running VM's reported memory
//! reaches the new size as the guest's driver gets there.

use std::time::{Duration, Instant};

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::{Error as VirtError, ErrorNumber};
use vmlet_provider::{Error, ErrorKind, Resize, ResizeScope, Resources, Result, VmId};

use crate::domains::persistent_size;
use crate::error::{from_libvirt, is_operation_invalid, is_unsupported_flags};
use crate::provider::{is_active, Host, LibvirtProvider};
use crate::stats::working_set_kib;
use crate::xml::{DomainKind, Size};

const OP: &str = "resize domain";

/// How long one resize may take: a few libvirt calls, one vCPU hot-plug and
/// the agent bringing vCPUs online.
const RESIZE_DEADLINE: Duration = Duration::from_secs(120);

/// How long the guest gets to see hot-plugged vCPUs before vmlet stops asking
/// its agent to bring them online.
const GUEST_ONLINE_WAIT: Duration = Duration::from_secs(10);

// One code path sets vCPUs and memory: both flag sets share these values.
const LIVE: u32 = virt::sys::VIR_DOMAIN_AFFECT_LIVE;
const CONFIG: u32 = virt::sys::VIR_DOMAIN_AFFECT_CONFIG;
const MAXIMUM: u32 = virt::sys::VIR_DOMAIN_VCPU_MAXIMUM;
const LIVE_AND_CONFIG: u32 = LIVE | CONFIG;
const _: () = assert!(
    virt::sys::VIR_DOMAIN_VCPU_LIVE == LIVE
        && virt::sys::VIR_DOMAIN_MEM_LIVE == LIVE
        && virt::sys::VIR_DOMAIN_VCPU_CONFIG == CONFIG
        && virt::sys::VIR_DOMAIN_MEM_CONFIG == CONFIG
        && virt::sys::VIR_DOMAIN_MEM_MAXIMUM == MAXIMUM
);

const MIB_IN_KIB: u64 = 1024;

/// What a resize changes: vCPUs or memory (KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Quantity {
    Vcpus,
    Memory,
}

impl Quantity {
    /// `virDomainSetVcpusFlags` or `virDomainSetMemoryFlags` with `flags`.
    fn set(self, domain: &Domain, value: u64, flags: u32) -> Result<(), VirtError> {
        match self {
            Quantity::Vcpus => domain.set_vcpus_flags(u32::try_from(value).unwrap_or(u32::MAX), flags),
            Quantity::Memory => domain.set_memory_flags(value, flags),
        }
    }

    /// [`Quantity::set`] with `LIVE|CONFIG` in one call where the driver takes
    /// both (QEMU), as two calls, the running domain first, where it takes one
    /// at a time (the test driver).
    fn set_live_and_config(self, domain: &Domain, value: u64) -> Result<(), VirtError> {
        match self.set(domain, value, LIVE | CONFIG) {
            Err(err) if is_unsupported_flags(&err) => {
                self.set(domain, value, LIVE)?;
                self.set(domain, value, CONFIG)
            }
            result => result,
        }
    }

    /// `(current, maximum)` of this quantity in `size`.
    fn of(self, size: &Size) -> (u64, u64) {
        match self {
            Quantity::Vcpus => (size.cpus.into(), size.max_cpus.into()),
            Quantity::Memory => (size.memory_kib, size.max_memory_kib),
        }
    }
}

impl Host {
    fn resize(&self, conn: &Connect, id: &VmId, to: Resources, ceilings: Resources, scope: ResizeScope) -> Result<()> {
        let wanted = wanted_size(to, ceilings)?;
        let domain = self.require(conn, OP, id)?;
        match scope {
            ResizeScope::Live => self.resize_live(&domain, id, wanted),
            ResizeScope::NextStart => resize_next_start(&domain, wanted),
        }
    }

    /// The running domain and its definition to `wanted`'s size, within the
    /// running domain's ceilings (`wanted`'s are ignored).
    fn resize_live(&self, domain: &Domain, id: &VmId, wanted: Size) -> Result<()> {
        if !is_active(domain, OP)? {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!("VM {id} is not running, so it cannot be resized live; resize it for its next start"),
            ));
        }
        let running = running_size(domain)?;
        let persistent = persistent_size(domain)?;
        check_within_ceilings(id, wanted, running)?;
        if wanted.memory_kib < running.memory_kib {
            self.check_guest_keeps_its_memory(domain, id, wanted.memory_kib)?;
        }
        for quantity in [Quantity::Vcpus, Quantity::Memory] {
            let (to, _) = quantity.of(&wanted);
            let (now, _) = quantity.of(&running);
            let (defined, defined_max) = quantity.of(&persistent);
            let mut flags = 0;
            if now != to {
                flags |= LIVE;
            }
            if defined != to {
                flags |= CONFIG;
                if defined_max < to {
                    quantity.set(domain, to, CONFIG | MAXIMUM).map_err(resize_error)?;
                }
            }
            match flags {
                0 => continue,
                LIVE_AND_CONFIG => quantity.set_live_and_config(domain, to),
                flags => quantity.set(domain, to, flags),
            }
            .map_err(resize_error)?;
            tracing::info!(vm.uid = %id, ?quantity, from = now, to, config_only = flags == CONFIG, "resized");
        }
        if wanted.cpus > running.cpus && self.kind.is_qemu() {
            online_guest_vcpus(domain, id, wanted.cpus);
        }
        Ok(())
    }

    /// Refuse to shrink the balloon below what the guest uses (see the module
    /// docs for the figure).
    fn check_guest_keeps_its_memory(&self, domain: &Domain, id: &VmId, target_kib: u64) -> Result<()> {
        let used_kib = match domain.memory_stats(0) {
            Ok(stats) => working_set_kib(&stats),
            Err(err) if is_unsupported_flags(&err) => None,
            Err(err) => return Err(from_libvirt(OP, err)),
        };
        let Some(used_kib) = used_kib else {
            if self.kind == DomainKind::Test {
                // The test driver has no guest that could run out of memory.
                return Ok(());
            }
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "VM {id}: libvirt reports neither the guest's memory use nor QEMU's, so shrinking its memory \
                     could take memory the guest uses; resize it for its next start instead"
                ),
            ));
        };
        if target_kib < used_kib {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "VM {id} uses {} MiB of memory now, more than the {} MiB asked for: shrinking it would take \
                     memory the guest uses; free memory in the guest or ask for at least {} MiB",
                    used_kib.div_ceil(MIB_IN_KIB),
                    target_kib / MIB_IN_KIB,
                    used_kib.div_ceil(MIB_IN_KIB),
                ),
            ));
        }
        Ok(())
    }
}

/// The size `to` and `ceilings` ask for, each ceiling raised to the size where
/// lower. Errors: `InvalidInput` for no vCPU or less than 1 MiB.
fn wanted_size(to: Resources, ceilings: Resources) -> Result<Size> {
    let invalid = |message: String| Err(Error::new(OP, ErrorKind::InvalidInput, message));
    if to.cpus == 0 {
        return invalid("cpus must be at least 1".into());
    }
    if to.memory_bytes < 1024 * 1024 {
        return invalid(format!("memory must be at least 1 MiB, got {} bytes", to.memory_bytes));
    }
    let memory_kib = to.memory_bytes.div_ceil(1024);
    Ok(Size {
        cpus: to.cpus,
        max_cpus: ceilings.cpus.max(to.cpus),
        memory_kib,
        max_memory_kib: ceilings.memory_bytes.div_ceil(1024).max(memory_kib),
    })
}

/// Refuse a live size beyond the running domain's ceilings, naming the ceiling
/// and what to do.
fn check_within_ceilings(id: &VmId, wanted: Size, running: Size) -> Result<()> {
    let refuse = |message: String| Err(Error::new(OP, ErrorKind::InvalidInput, message));
    if wanted.cpus > running.max_cpus {
        return refuse(format!(
            "{} vCPUs exceed VM {id}'s ceiling of {} vCPUs (maxCpu), which is fixed while it runs: the VM must \
             be restarted with a larger maxCpu to grow beyond it",
            wanted.cpus, running.max_cpus
        ));
    }
    if wanted.memory_kib > running.max_memory_kib {
        return refuse(format!(
            "{} MiB of memory exceed VM {id}'s ceiling of {} MiB (maxMemory), which is fixed while it runs: the \
             VM must be restarted with a larger maxMemory to grow beyond it",
            wanted.memory_kib.div_ceil(MIB_IN_KIB),
            running.max_memory_kib / MIB_IN_KIB
        ));
    }
    Ok(())
}

/// The definition to `wanted` (size and ceilings), leaving the running domain
/// alone. Each ceiling is set before its size when it grows, after it when it
/// shrinks, so that no step leaves a size above its ceiling.
fn resize_next_start(domain: &Domain, wanted: Size) -> Result<()> {
    let persistent = persistent_size(domain)?;
    for quantity in [Quantity::Vcpus, Quantity::Memory] {
        let (to, to_max) = quantity.of(&wanted);
        let (defined, defined_max) = quantity.of(&persistent);
        let set_size = || {
            if defined == to {
                return Ok(());
            }
            quantity.set(domain, to, CONFIG).map_err(resize_error)
        };
        let set_ceiling = || {
            if defined_max == to_max {
                return Ok(());
            }
            quantity.set(domain, to_max, CONFIG | MAXIMUM).map_err(resize_error)
        };
        if to_max >= defined_max {
            set_ceiling()?;
            set_size()?;
        } else {
            set_size()?;
            set_ceiling()?;
        }
    }
    Ok(())
}

/// The running domain's size: vCPUs and balloon from `virDomainGetInfo`, the
/// vCPU ceiling from `virDomainGetVcpusFlags(LIVE|MAXIMUM)`.
fn running_size(domain: &Domain) -> Result<Size> {
    let info = domain.info().map_err(|e| from_libvirt(OP, e))?;
    let max_cpus = domain.vcpus_flags(LIVE | MAXIMUM).map_err(resize_error)?;
    Ok(Size { cpus: info.nr_virt_cpu, max_cpus, memory_kib: info.memory, max_memory_kib: info.max_mem })
}

/// Ask the guest's agent to bring `cpus` vCPUs online (`VIR_DOMAIN_VCPU_GUEST`),
/// retried while the guest has not seen the hot-plugged ones yet, for at most
/// [`GUEST_ONLINE_WAIT`]. Best effort: without an agent the guest decides.
fn online_guest_vcpus(domain: &Domain, id: &VmId, cpus: u32) {
    let deadline = Instant::now() + GUEST_ONLINE_WAIT;
    loop {
        match domain.set_vcpus_flags(cpus, virt::sys::VIR_DOMAIN_VCPU_GUEST) {
            Ok(()) => return,
            // Not a guest that is still catching up: no agent channel, or a
            // driver without the call.
            Err(err) if err.code().is_any(vec![ErrorNumber::ArgumentUnsupported, ErrorNumber::NoSupport]) => {
                tracing::info!(vm.uid = %id, error = %err, "no guest agent to bring the hot-plugged vCPUs online");
                return;
            }
            Err(err) if Instant::now() < deadline => {
                tracing::debug!(vm.uid = %id, error = %err, "guest agent did not bring the vCPUs online yet");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(err) => {
                tracing::info!(
                    vm.uid = %id,
                    cpus,
                    error = %err,
                    "the guest agent did not bring the hot-plugged vCPUs online; the guest must (udev rule or chcpu -e)"
                );
                return;
            }
        }
    }
}

/// The provider error for a failed resize call: a domain that stopped meanwhile
/// is `Unsupported` (a live resize needs a running VM).
fn resize_error(err: VirtError) -> Error {
    let mut error = from_libvirt(OP, err);
    if error.source.as_ref().and_then(|s| s.downcast_ref::<VirtError>()).is_some_and(is_operation_invalid) {
        error.kind = ErrorKind::Unsupported;
    }
    error
}

#[async_trait::async_trait]
impl Resize for LibvirtProvider {
    /// See the module docs. Errors as [`Resize::resize`] documents; also
    /// `Transient` when libvirt does not answer within two minutes.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn resize(&self, id: &VmId, to: Resources, ceilings: Resources, scope: ResizeScope) -> Result<()> {
        let id = id.clone();
        self.blocking_within(OP, RESIZE_DEADLINE, move |host, conn| host.resize(conn, &id, to, ceilings, scope)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn wanted_ceilings_are_raised_to_the_size() {
        let to = Resources { cpus: 2, memory_bytes: 384 * MIB };
        let lower = Resources { cpus: 1, memory_bytes: 256 * MIB };
        assert_eq!(
            wanted_size(to, lower).unwrap(),
            Size { cpus: 2, max_cpus: 2, memory_kib: 384 * 1024, max_memory_kib: 384 * 1024 }
        );
        let higher = Resources { cpus: 4, memory_bytes: 512 * MIB + 1 };
        assert_eq!(
            wanted_size(to, higher).unwrap(),
            Size { cpus: 2, max_cpus: 4, memory_kib: 384 * 1024, max_memory_kib: 512 * 1024 + 1 }
        );
        for bad in [Resources { cpus: 0, memory_bytes: MIB }, Resources { cpus: 1, memory_bytes: MIB - 1 }] {
            assert_eq!(wanted_size(bad, bad).unwrap_err().kind, ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn a_live_size_beyond_a_ceiling_names_the_ceiling() {
        let id = VmId("u-1".into());
        let running = Size { cpus: 1, max_cpus: 2, memory_kib: 256 * 1024, max_memory_kib: 512 * 1024 };
        assert!(check_within_ceilings(&id, running, running).is_ok());
        let err = check_within_ceilings(&id, Size { cpus: 3, ..running }, running).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(err.message.contains("ceiling of 2 vCPUs (maxCpu)"), "{}", err.message);
        assert!(err.message.contains("restarted with a larger maxCpu"), "{}", err.message);
        let err = check_within_ceilings(&id, Size { memory_kib: 640 * 1024, ..running }, running).unwrap_err();
        assert!(err.message.contains("640 MiB of memory exceed"), "{}", err.message);
        assert!(err.message.contains("ceiling of 512 MiB (maxMemory)"), "{}", err.message);
    }
}
