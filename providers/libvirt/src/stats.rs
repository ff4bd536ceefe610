//! [`Stats`]: CPU time and memory working set of a running domain.
//!
//! - CPU: `virDomainGetInfo`'s `cpuTime`, the nanoseconds of host CPU all vCPUs
//!   used since the domain started.
//! - Memory working set: what the guest itself uses, `actual - unused` from
//!   `virDomainMemoryStats` (balloon size minus the guest's free memory; page
//!   cache counts as used, as it is the guest's). Those need the guest's virtio
//!   balloon driver; without them the host's view, the QEMU process's resident
//!   set (`rss`), which includes QEMU's own overhead; where the driver has no
//!   memory statistics at all (the test driver), the domain's current memory.

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::MemoryStat;
use vmlet_provider::{Error, ErrorKind, Result, Stats, VmId, VmStats};

use crate::error::{from_libvirt, is_unsupported_flags};
use crate::provider::{Host, LibvirtProvider};

const OP: &str = "read domain stats";

impl Host {
    fn stats(&self, conn: &Connect, id: &VmId) -> Result<VmStats> {
        let domain = self.require(conn, OP, id)?;
        let info = domain.info().map_err(|e| from_libvirt(OP, e))?;
        if !domain.is_active().map_err(|e| from_libvirt(OP, e))? {
            return Err(Error::new(OP, ErrorKind::Transient, format!("VM {id} is not running")));
        }
        let memory = match domain.memory_stats(0) {
            Ok(stats) => working_set_kib(&stats),
            Err(err) if is_unsupported_flags(&err) => None,
            Err(err) => return Err(from_libvirt(OP, err)),
        };
        Ok(VmStats {
            cpu_usage_ns: info.cpu_time,
            memory_working_set_bytes: memory.unwrap_or(info.memory).saturating_mul(1024),
        })
    }
}

/// The working set in KiB from libvirt's memory statistics (see the module
/// docs); `None` when they hold neither guest nor host figures.
pub(crate) fn working_set_kib(stats: &[MemoryStat]) -> Option<u64> {
    let get = |tag: u32| stats.iter().find(|stat| stat.tag == tag).map(|stat| stat.val);
    let actual = get(virt::sys::VIR_DOMAIN_MEMORY_STAT_ACTUAL_BALLOON);
    let unused = get(virt::sys::VIR_DOMAIN_MEMORY_STAT_UNUSED);
    match (actual, unused) {
        (Some(actual), Some(unused)) => Some(actual.saturating_sub(unused)),
        _ => get(virt::sys::VIR_DOMAIN_MEMORY_STAT_RSS),
    }
}

#[async_trait::async_trait]
impl Stats for LibvirtProvider {
    /// See the module docs for what is measured. Errors: `NotFound`;
    /// `Transient` when the VM is not running.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn stats(&self, id: &VmId) -> Result<VmStats> {
        let id = id.clone();
        self.blocking(OP, move |host, conn| host.stats(conn, &id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(tag: u32, val: u64) -> MemoryStat {
        MemoryStat { tag, val }
    }

    #[test]
    fn working_set_prefers_the_guests_view_over_the_hosts() {
        let guest = [
            stat(virt::sys::VIR_DOMAIN_MEMORY_STAT_ACTUAL_BALLOON, 262_144),
            stat(virt::sys::VIR_DOMAIN_MEMORY_STAT_UNUSED, 186_984),
            stat(virt::sys::VIR_DOMAIN_MEMORY_STAT_RSS, 257_672),
        ];
        assert_eq!(working_set_kib(&guest), Some(75_160));
        let host_only = [
            stat(virt::sys::VIR_DOMAIN_MEMORY_STAT_ACTUAL_BALLOON, 262_144),
            stat(virt::sys::VIR_DOMAIN_MEMORY_STAT_RSS, 257_672),
        ];
        assert_eq!(working_set_kib(&host_only), Some(257_672));
        assert_eq!(working_set_kib(&[]), None);
    }
}
