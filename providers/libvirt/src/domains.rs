//! Finding vmlet's domains on a host and reading their status. Blocking.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use virt::connect::Connect;
use virt::domain::{Domain, DomainInfo, DomainState, DomainStateEnum};
use virt::error::Error as VirtError;
use vmlet_provider::{Error, ErrorKind, Fault, PowerState, Resources, Result, StopReason, VmId, VmStatus};

use crate::error::{from_libvirt, is_no_domain, is_no_metadata};
use crate::xml::{interfaces, parse_identity, DomainInterface, Identity, Size, METADATA_NS};

/// Which domain carries which vmlet identity, remembered between calls so that
/// finding one VM costs one lookup instead of a scan of the host.
///
/// Entries are hints: every hit is verified against the domain's metadata, and a
/// miss or a stale entry falls back to a scan that rebuilds the whole map.
#[derive(Default)]
pub(crate) struct UuidCache {
    by_id: Mutex<HashMap<VmId, String>>,
}

impl UuidCache {
    pub(crate) fn get(&self, id: &VmId) -> Option<String> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }

    pub(crate) fn replace(&self, entries: HashMap<VmId, String>) {
        *self.by_id.lock().unwrap_or_else(PoisonError::into_inner) = entries;
    }

    pub(crate) fn insert(&self, id: VmId, uuid: String) {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner).insert(id, uuid);
    }

    /// The identity whose domain has `uuid`, if the cache knows it (a scan of
    /// the cache: one host holds few domains).
    pub(crate) fn id_of(&self, uuid: &str) -> Option<VmId> {
        let by_id = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
        by_id.iter().find(|(_, known)| known.as_str() == uuid).map(|(id, _)| id.clone())
    }

    pub(crate) fn remove(&self, id: &VmId) {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
    }
}

/// The vmlet identity recorded on `domain`, `None` when it has none.
pub(crate) fn identity_of(domain: &Domain) -> Result<Option<Identity>, VirtError> {
    match domain.metadata(virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32, Some(METADATA_NS), 0) {
        Ok(element) => Ok(parse_identity(&element)),
        Err(err) if is_no_metadata(&err) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Every domain on the host, defined or active, that carries a vmlet identity.
/// Rebuilds `cache`. Domains that disappear during the scan are skipped.
pub(crate) fn scan(conn: &Connect, cache: &UuidCache) -> Result<Vec<(Domain, Identity)>> {
    let all = conn.list_all_domains(0).map_err(|e| from_libvirt("list domains", e))?;
    let mut found = Vec::new();
    let mut uuids = HashMap::new();
    for domain in all {
        let identity = match identity_of(&domain) {
            Ok(Some(identity)) => identity,
            Ok(None) => continue,
            Err(err) if is_no_domain(&err) => continue,
            Err(err) => return Err(from_libvirt("read domain metadata", err)),
        };
        match domain.uuid_string() {
            Ok(uuid) => {
                uuids.insert(identity.id.clone(), uuid);
            }
            Err(err) if is_no_domain(&err) => continue,
            Err(err) => return Err(from_libvirt("read domain uuid", err)),
        }
        found.push((domain, identity));
    }
    cache.replace(uuids);
    Ok(found)
}

/// The domain carrying identity `id`, if the host has one: the cached UUID when
/// it still points at that identity, else a scan.
pub(crate) fn find(conn: &Connect, cache: &UuidCache, id: &VmId) -> Result<Option<Domain>> {
    if let Some(uuid) = cache.get(id) {
        match conn.lookup_domain_by_uuid_string(&uuid) {
            Ok(domain) => match identity_of(&domain) {
                Ok(Some(identity)) if identity.id == *id => return Ok(Some(domain)),
                Ok(_) => {}
                Err(err) if is_no_domain(&err) => {}
                Err(err) => return Err(from_libvirt("read domain metadata", err)),
            },
            Err(err) if is_no_domain(&err) => {}
            Err(err) => return Err(from_libvirt("look up domain", err)),
        }
    }
    Ok(scan(conn, cache)?.into_iter().find(|(_, identity)| identity.id == *id).map(|(d, _)| d))
}

/// What vmlet reports about `domain`: power state, UUID as backend id, size,
/// and for active domains the addresses libvirt's DHCP leases know (empty when
/// none or when the lookup fails).
///
/// Size: `virDomainGetInfo`'s vCPUs and memory (a running domain's current
/// balloon size, which lags behind a new balloon target while the guest's
/// driver moves it), the vCPU ceiling from `virDomainGetVcpusFlags(MAXIMUM)`
/// and the memory ceiling from `virDomainGetInfo`. For an active domain also its
/// persistent definition (`virDomainGetXMLDesc(INACTIVE)`), reported as
/// `next_start` when its vCPUs or memory differ from the running domain's,
/// and whose interfaces' MAC addresses say which guest addresses are the
/// VM's ([`guest_addresses`]); an inactive domain's definition is what it
/// has, so it costs no XML (and reports no interfaces).
///
/// A paused domain whose reason is an error ([`fault_of`]) reports it as
/// [`VmStatus::fault`], with the last error line of its QEMU log when
/// `qemu_logs` names the directory that holds it (a local host's).
pub(crate) fn status_of(domain: &Domain, identity: Identity, qemu_logs: Option<&Path>) -> Result<VmStatus> {
    let info = domain.info().map_err(|e| from_libvirt("read domain info", e))?;
    let backend_id = domain.uuid_string().map_err(|e| from_libvirt("read domain uuid", e))?;
    let backend_name = domain.name().map_err(|e| from_libvirt("read domain name", e))?;
    let power = power_from_libvirt(info.state);
    // AFFECT_CURRENT: the running domain's ceiling, or the definition's when inactive.
    let max_cpus = domain
        .vcpus_flags(virt::sys::VIR_DOMAIN_VCPU_MAXIMUM)
        .map_err(|e| from_libvirt("read domain vcpu ceiling", e))?;
    let (addresses, network_interfaces, stop_reason, next_start) = if power.is_active() {
        let definition = persistent_xml(domain)?;
        let persistent = Size::from_domain_xml(&definition).ok_or_else(no_size)?;
        let nics = interfaces(&definition);
        (guest_addresses(domain, &nics), nics.len(), None, next_start(&info, persistent))
    } else {
        let (_, reason) = domain.state().map_err(|e| from_libvirt("read domain state", e))?;
        (Vec::new(), 0, Some(stop_reason_from_libvirt(reason)), None)
    };
    let fault = if power == PowerState::Paused {
        let (_, reason) = domain.state().map_err(|e| from_libvirt("read domain state", e))?;
        fault_of(reason).map(|(reason, resumable)| Fault {
            reason: reason.to_owned(),
            detail: qemu_logs.and_then(|dir| last_error_line(&dir.join(format!("{backend_name}.log")))),
            resumable,
        })
    } else {
        None
    };
    Ok(VmStatus {
        id: identity.id,
        backend_name,
        backend_id,
        power,
        stop_reason,
        fault,
        cpus: info.nr_virt_cpu,
        memory_bytes: info.memory.saturating_mul(1024),
        max_cpus,
        max_memory_bytes: info.max_mem.saturating_mul(1024),
        next_start,
        addresses,
        network_interfaces,
    })
}

/// The size `domain`'s persistent definition gives it at its next start
/// (`virDomainGetXMLDesc(INACTIVE)`; a transient domain's is the running one).
/// Errors: the mapped libvirt error; `Permanent` when libvirt's XML states no
/// size.
pub(crate) fn persistent_size(domain: &Domain) -> Result<Size> {
    Size::from_domain_xml(&persistent_xml(domain)?).ok_or_else(no_size)
}

/// The persistent definition of `domain` (`virDomainGetXMLDesc(INACTIVE)`).
fn persistent_xml(domain: &Domain) -> Result<String> {
    domain.xml_desc(virt::sys::VIR_DOMAIN_XML_INACTIVE).map_err(|e| from_libvirt("read domain definition", e))
}

/// The error for a definition that states no size.
fn no_size() -> Error {
    Error::new(
        "read domain definition",
        ErrorKind::Permanent,
        "the domain's persistent XML states no <vcpu> or <memory>",
    )
}

/// The size a running domain gets at its next start when its persistent
/// definition's vCPUs or memory differ from what `info` says it runs with.
fn next_start(info: &DomainInfo, persistent: Size) -> Option<Resources> {
    (persistent.cpus != info.nr_virt_cpu || persistent.memory_kib != info.memory)
        .then(|| Resources { cpus: persistent.cpus, memory_bytes: persistent.memory_kib.saturating_mul(1024) })
}

/// The power state for a libvirt `virDomainState`.
pub(crate) fn power_from_libvirt(state: DomainStateEnum) -> PowerState {
    match state {
        DomainStateEnum::Known(DomainState::Running | DomainState::Blocked) => PowerState::Running,
        DomainStateEnum::Known(DomainState::Paused | DomainState::PMSuspended) => PowerState::Paused,
        DomainStateEnum::Known(DomainState::Shutdown) => PowerState::ShuttingDown,
        DomainStateEnum::Known(DomainState::Shutoff) => PowerState::Off,
        DomainStateEnum::Known(DomainState::Crashed) => PowerState::Crashed,
        DomainStateEnum::Known(DomainState::NoState) | DomainStateEnum::Unknown(_) => PowerState::Unknown,
    }
}

/// What a paused domain's state reason (`virDomainPausedReason`) says when
/// it is an error the hypervisor paused the guest for, in libvirt's words
/// (`virsh domstate --reason`) and what it usually means, and whether
/// resuming it once the cause is fixed continues the guest (an I/O error);
/// `None` for a pause someone asked for (suspend, migration, save, dump,
/// snapshot, start-up, post-copy, shutdown).
pub(crate) fn fault_of(reason: virt::domain::DomainStateReasonEnum) -> Option<(&'static str, bool)> {
    use virt::domain::{DomainPausedReason as P, DomainStateReason as R};
    use virt::enumutil::Enum;
    let Enum::Known(R::Paused(Enum::Known(paused))) = reason else { return None };
    Some(match paused {
        P::Unknown => ("paused (unknown): QEMU stopped the guest by itself, e.g. on a KVM internal error", false),
        P::IOError => {
            ("paused (I/O error): a disk failed (e.g. it is full) and its error policy stops the guest", true)
        }
        P::Watchdog => ("paused (watchdog): the guest's watchdog fired", false),
        P::Crashed => ("paused (crashed): the guest panicked", false),
        P::PostCopyFailed => ("paused (post-copy failed): a post-copy migration failed", false),
        P::APIError => ("paused (api error): a libvirt call on the domain failed", false),
        P::User
        | P::Migration
        | P::Save
        | P::Dump
        | P::FromSnapshot
        | P::ShuttingDown
        | P::Snapshot
        | P::StartingUp
        | P::PostCopy => return None,
    })
}

/// The most bytes of a QEMU log [`last_error_line`] reads, from its end.
const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// The most bytes of a log line a [`Fault`] carries.
const MAX_DETAIL_BYTES: usize = 512;

/// The last line of the QEMU log `path` that says `error` or `failure` (any
/// case) since libvirt's last `starting up` line (the VM's current run),
/// QEMU's command line left out,
/// looking at the log's last 64 KiB only; at most [`MAX_DETAIL_BYTES`],
/// cut at a character boundary. `None` when there is none or the file
/// cannot be read (no log here).
pub(crate) fn last_error_line(path: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    let length = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(length.saturating_sub(LOG_TAIL_BYTES))).ok()?;
    let mut tail = Vec::new();
    file.take(LOG_TAIL_BYTES).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    let run = text.rsplit_once("starting up").map_or(text.as_ref(), |(_, after)| after);
    // libvirt writes QEMU's command line first (`LC_ALL=C … \`, one
    // option per line), whose `werror=`/`rerror=` options are no errors.
    let command_line = |line: &str| line.starts_with('-') || line.ends_with('\\') || line.contains("LC_ALL=");
    let line = run.lines().rev().map(str::trim).filter(|line| !command_line(line)).find(|line| {
        let lower = line.to_ascii_lowercase();
        lower.contains("error") || lower.contains("failure")
    })?;
    let mut end = line.len().min(MAX_DETAIL_BYTES);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    Some(line[..end].to_owned())
}

/// Why an inactive domain stopped, from libvirt's state reason
/// (`virDomainShutoffReason`, `virDomainCrashedReason`).
pub(crate) fn stop_reason_from_libvirt(reason: virt::domain::DomainStateReasonEnum) -> StopReason {
    use virt::domain::{DomainShutoffReason as Off, DomainStateReason as R};
    use virt::enumutil::Enum;
    match reason {
        Enum::Known(R::Shutoff(Enum::Known(Off::Shutdown))) => StopReason::GuestShutdown,
        Enum::Known(R::Shutoff(Enum::Known(Off::Destroyed))) => StopReason::Destroyed,
        Enum::Known(R::Shutoff(Enum::Known(Off::Crashed | Off::Failed))) | Enum::Known(R::Crashed(_)) => {
            StopReason::Crashed
        }
        _ => StopReason::Unknown,
    }
}

/// The addresses of the guest's interfaces `nics`, in that order. An
/// interface on a libvirt network (`type='network'`) has only the address
/// libvirt's DHCP server leased to its MAC address: what the guest itself
/// says (the guest agent, the ARP replies it sends) is never taken for it,
/// so a guest cannot make its pod's IP another machine's. Interfaces on a
/// bridge or macvtap, whose DHCP is not libvirt's, take the host's ARP
/// table, then the guest agent: there the guest names its own address (see
/// the README's Networking section). Loopback, link-local, multicast,
/// broadcast and unspecified addresses are left out, and so are interfaces
/// that are not the domain's own (the agent also reports `lo` and any the
/// guest made itself). Errors of a source count as "none known"; no
/// interface, no call.
fn guest_addresses(domain: &Domain, nics: &[DomainInterface]) -> Vec<IpAddr> {
    use virt::sys::{
        VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT as AGENT, VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP as ARP,
        VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE as LEASE,
    };
    let mut found: Vec<Vec<IpAddr>> = vec![Vec::new(); nics.len()];
    for source in [LEASE, ARP, AGENT] {
        let wanting = |nic: &DomainInterface, addresses: &Vec<IpAddr>| {
            addresses.is_empty() && (source == LEASE || nic.kind != "network")
        };
        if !nics.iter().zip(&found).any(|(nic, addresses)| wanting(nic, addresses)) {
            continue;
        }
        let Ok(interfaces) = domain.interface_addresses(source, 0) else { continue };
        for interface in interfaces {
            let Some(hwaddr) = interface.hwaddr.as_deref() else { continue };
            let matching =
                |nic: &DomainInterface| nic.mac.as_deref().is_some_and(|mac| mac.eq_ignore_ascii_case(hwaddr));
            let Some(nic) = nics.iter().position(matching) else { continue };
            if !wanting(&nics[nic], &found[nic]) {
                continue;
            }
            found[nic] =
                interface.addrs.iter().filter_map(|address| address.addr.parse().ok()).filter(usable).collect();
        }
    }
    let mut addresses: Vec<IpAddr> = Vec::new();
    for address in found.into_iter().flatten() {
        if !addresses.contains(&address) {
            addresses.push(address);
        }
    }
    addresses
}

/// The addresses libvirt's own DHCP server leased to the running domain's
/// interfaces on libvirt networks (`type='network'`), matched by the MAC
/// address of the live definition, usable ones only ([`usable`]). Unlike
/// [`guest_addresses`], nothing the guest says (agent, ARP) is taken, for any
/// interface: these are addresses a caller may connect to on the VM's
/// behalf. Errors: the mapped libvirt error of reading the definition or
/// the leases.
pub(crate) fn leased_addresses(domain: &Domain) -> Result<Vec<IpAddr>> {
    let live = domain.xml_desc(0).map_err(|e| from_libvirt("read domain definition", e))?;
    let macs: Vec<String> =
        interfaces(&live).into_iter().filter(|nic| nic.kind == "network").filter_map(|nic| nic.mac).collect();
    if macs.is_empty() {
        return Ok(Vec::new());
    }
    let leases = domain
        .interface_addresses(virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE, 0)
        .map_err(|e| from_libvirt("read DHCP leases", e))?;
    let mut addresses = Vec::new();
    for mac in &macs {
        for interface in leases.iter().filter(|i| i.hwaddr.as_deref().is_some_and(|h| h.eq_ignore_ascii_case(mac))) {
            for address in interface.addrs.iter().filter_map(|a| a.addr.parse::<IpAddr>().ok()).filter(usable) {
                if !addresses.contains(&address) {
                    addresses.push(address);
                }
            }
        }
    }
    Ok(addresses)
}

/// Whether a guest address can stand for the VM (and be a pod IP): not
/// loopback, link-local, multicast, broadcast or unspecified.
fn usable(address: &IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => {
            !(v4.is_loopback() || v4.is_link_local() || v4.is_unspecified() || v4.is_multicast() || v4.is_broadcast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback() || v6.is_unspecified() || v6.is_multicast() || (v6.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_addresses_that_can_stand_for_a_vm_are_used() {
        for good in ["10.239.0.5", "192.0.2.1", "fd00::5", "2001:db8::1"] {
            assert!(usable(&good.parse().unwrap()), "{good}");
        }
        for bad in
            ["127.0.0.1", "169.254.1.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "ff02::1"]
        {
            assert!(!usable(&bad.parse().unwrap()), "{bad}");
        }
    }

    fn running(cpus: u32, memory_kib: u64) -> DomainInfo {
        DomainInfo {
            state: DomainStateEnum::Known(DomainState::Running),
            max_mem: 1 << 20,
            memory: memory_kib,
            nr_virt_cpu: cpus,
            cpu_time: 0,
        }
    }

    #[test]
    fn next_start_is_the_persistent_size_only_when_it_differs_from_the_running_one() {
        let persistent = Size { cpus: 2, max_cpus: 4, memory_kib: 262_144, max_memory_kib: 1 << 20 };
        assert_eq!(next_start(&running(2, 262_144), persistent), None);
        let differs = Some(Resources { cpus: 2, memory_bytes: 256 << 20 });
        assert_eq!(next_start(&running(1, 262_144), persistent), differs, "vCPUs differ");
        assert_eq!(next_start(&running(2, 393_216), persistent), differs, "memory differs");
        // Ceilings alone are not a size.
        let higher_ceilings = Size { max_cpus: 8, max_memory_kib: 2 << 20, ..persistent };
        assert_eq!(next_start(&running(2, 262_144), higher_ceilings), None);
    }

    #[test]
    fn power_state_follows_the_libvirt_state() {
        let cases = [
            (DomainState::Running, PowerState::Running),
            (DomainState::Blocked, PowerState::Running),
            (DomainState::Paused, PowerState::Paused),
            (DomainState::PMSuspended, PowerState::Paused),
            (DomainState::Shutdown, PowerState::ShuttingDown),
            (DomainState::Shutoff, PowerState::Off),
            (DomainState::Crashed, PowerState::Crashed),
            (DomainState::NoState, PowerState::Unknown),
        ];
        for (state, power) in cases {
            assert_eq!(power_from_libvirt(DomainStateEnum::Known(state)), power, "{state:?}");
        }
        assert_eq!(power_from_libvirt(DomainStateEnum::Unknown(99)), PowerState::Unknown);
    }

    #[test]
    fn the_last_error_of_the_current_run_is_the_faults_detail() {
        let dir = std::env::temp_dir().join(format!("vmlet-qemu-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("team-a_web.log");
        let text = "2026-12-03 10:00:00.000+0000: starting up libvirt version: 9.0.0\n\
                    KVM internal error. Suberror: 3 (an older run)\n\
                    2026-12-03 11:00:00.000+0000: starting up libvirt version: 9.0.0\n\
                    LC_ALL=C \\\n\
                    -blockdev '{\"driver\":\"file\",\"werror\":\"stop\"}' \\\n\
                    -msg timestamp=on\n\
                    char device redirected to /dev/pts/3 (label charserial0)\n\
                    KVM internal error. Suberror: 1\n\
                    emulation failure\n\
                    EAX=00000000 EBX=00000000\n";
        std::fs::write(&log, text).unwrap();
        assert_eq!(last_error_line(&log).as_deref(), Some("emulation failure"));
        std::fs::write(&log, "2026-12-03: starting up\nLC_ALL=C \\\n-drive werror=stop\n").unwrap();
        assert_eq!(last_error_line(&log), None, "the command line is no error");
        std::fs::write(&log, format!("starting up\nerror: {}\n", "é".repeat(400))).unwrap();
        let long = last_error_line(&log).unwrap();
        assert!(long.len() <= MAX_DETAIL_BYTES && long.starts_with("error: é"), "{long}");
        assert_eq!(last_error_line(&dir.join("no-such.log")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_a_pause_for_an_error_is_a_fault() {
        use virt::domain::{DomainPausedReason as P, DomainShutoffReason, DomainStateReason as R};
        use virt::enumutil::Enum;
        let paused = |reason| Enum::Known(R::Paused(Enum::Known(reason)));
        for reason in [P::Unknown, P::IOError, P::Watchdog, P::Crashed, P::PostCopyFailed, P::APIError] {
            let (text, resumable) = fault_of(paused(reason)).unwrap();
            assert!(text.starts_with("paused ("), "{reason:?}");
            assert_eq!(resumable, reason == P::IOError, "{reason:?}");
        }
        for reason in [P::User, P::Migration, P::Save, P::Snapshot, P::StartingUp, P::PostCopy] {
            assert_eq!(fault_of(paused(reason)), None, "{reason:?}");
        }
        assert_eq!(fault_of(Enum::Known(R::Shutoff(Enum::Known(DomainShutoffReason::Crashed)))), None);
    }
}
