//! From Nova's terms to vmlet's: a server's state, size and addresses as a
//! [`VmStatus`], and the flavor that fits a size.
//!
//! # Power state
//!
//! | Nova `status` | `power_state` (OS-EXT-STS) | [`PowerState`] | stop reason |
//! |---|---|---|---|
//! | `ACTIVE` | any | `Running` | — |
//! | `SHUTOFF` | any | `Off` | `Unknown` (Nova does not tell a guest's own poweroff from `os-stop`) |
//! | `PAUSED`, `SUSPENDED` | any | `Paused` | — |
//! | `ERROR` | any | `Crashed` | `Crashed` |
//! | `MIGRATING`, `RESIZE`, `VERIFY_RESIZE`, `REVERT_RESIZE`, `REBOOT`, `HARD_REBOOT`, `PASSWORD`, `RESCUE` (a task on a server that exists on a host) | 1 RUNNING / 3 PAUSED, 7 SUSPENDED / 4 SHUTDOWN / other | `Running` / `Paused` / `Off` / `Unknown` | `Unknown` when `Off` |
//! | `BUILD`, `SHELVED`, `SHELVED_OFFLOADED`, `SOFT_DELETED`, `DELETED`, `UNKNOWN`, anything else | any | `Unknown` | — |
//!
//! # Identity
//!
//! vmlet's servers carry the VM's UID in their metadata under [`UID_KEY`]
//! (Nova's metadata keys allow only `[a-zA-Z0-9-_:. ]`, so `vmlet.io:uid`,
//! not `vmlet.io/uid`). Their name is [`vmlet_provider::VmSpec::backend_name`].

use std::net::IpAddr;

use vmlet_provider::{PowerState, Resources, StopReason, VmId, VmStatus};

use crate::compute::{Flavor, Server, ServerFlavor};

/// Server metadata key holding the VM's UID.
pub const UID_KEY: &str = "vmlet.io:uid";
/// Server metadata key holding the VM's namespace (for people reading Nova).
pub const NAMESPACE_KEY: &str = "vmlet.io:namespace";
/// Server metadata key holding the VM's name (for people reading Nova).
pub const NAME_KEY: &str = "vmlet.io:name";
/// Server metadata key holding the compute host vmlet created the server
/// on: where an unscheduled server (no `OS-EXT-SRV-ATTR:host` yet, or a
/// build that failed before reaching a host) belongs.
pub const HOST_KEY: &str = "vmlet.io:host";
/// Server metadata key recording that the user chose the flavor
/// (`spec.providerOptions.flavor`, its id): a resize keeps it while it
/// still fits the wanted size.
pub const FLAVOR_PIN_KEY: &str = "vmlet.io:flavor";
/// Server metadata key holding the id of the flavor a running server takes
/// at its next start (a resize that waits for a restart).
pub const NEXT_FLAVOR_KEY: &str = "vmlet.io:next-flavor";

const MIB: u64 = 1024 * 1024;

/// The power state and stop reason of a server (see the table above).
pub(crate) fn power_of(status: &str, power_state: Option<i64>) -> (PowerState, Option<StopReason>) {
    let from_power_state = || match power_state {
        Some(1) => (PowerState::Running, None),
        Some(3) | Some(7) => (PowerState::Paused, None),
        Some(4) => (PowerState::Off, Some(StopReason::Unknown)),
        _ => (PowerState::Unknown, None),
    };
    match status {
        "ACTIVE" => (PowerState::Running, None),
        "SHUTOFF" => (PowerState::Off, Some(StopReason::Unknown)),
        "PAUSED" | "SUSPENDED" => (PowerState::Paused, None),
        "ERROR" => (PowerState::Crashed, Some(StopReason::Crashed)),
        "MIGRATING" | "RESIZE" | "VERIFY_RESIZE" | "REVERT_RESIZE" | "REBOOT" | "HARD_REBOOT" | "PASSWORD"
        | "RESCUE" => from_power_state(),
        _ => (PowerState::Unknown, None),
    }
}

/// The VM's UID recorded in a server's metadata.
pub(crate) fn uid_of(server: &Server) -> Option<&str> {
    server.metadata.get(UID_KEY).map(String::as_str)
}

/// The compute host a server is on: Nova's `OS-EXT-SRV-ATTR:host`, or
/// before it has one, the host vmlet created it for ([`HOST_KEY`]).
pub(crate) fn host_of(server: &Server) -> Option<&str> {
    server.host.as_deref().filter(|h| !h.is_empty()).or_else(|| server.metadata.get(HOST_KEY).map(String::as_str))
}

/// The server's addresses as vmlet reports them (the pod's IPs): the fixed
/// addresses of its ports first, first port first (Nova lists them in the
/// order the server's networks were asked for), then floating addresses;
/// without loopback, link-local and unspecified addresses, each once.
pub(crate) fn addresses_of(server: &Server) -> Vec<IpAddr> {
    let all = || server.addresses.iter().flat_map(|(_, addresses)| addresses);
    let floating = |a: &&crate::compute::Address| a.kind.as_deref() == Some("floating");
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in all().filter(|a| !floating(a)).chain(all().filter(floating)).filter_map(|a| a.addr.parse().ok()) {
        if usable(&ip) && !out.contains(&ip) {
            out.push(ip);
        }
    }
    out
}

/// Whether another machine could reach the guest at `ip`: not loopback,
/// link-local (169.254/16, fe80::/10) or unspecified.
fn usable(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !(v4.is_loopback() || v4.is_link_local() || v4.is_unspecified()),
        IpAddr::V6(v6) => !(v6.is_loopback() || v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80),
    }
}

/// The size a flavor gives.
pub(crate) fn resources_of_flavor(vcpus: u32, ram_mib: u64) -> Resources {
    Resources { cpus: vcpus, memory_bytes: ram_mib * MIB }
}

/// A server as vmlet reports it. `next` is the flavor recorded under
/// [`NEXT_FLAVOR_KEY`] when it is known and differs from the current size.
/// Nova has no hot-plug: the ceilings are the current size.
pub(crate) fn status_of(server: &Server, next: Option<&Flavor>) -> VmStatus {
    let (power, stop_reason) = power_of(&server.status, server.power_state);
    let ServerFlavor { vcpus, ram, .. } = server.flavor;
    let memory_bytes = ram * MIB;
    let next_start = next.filter(|f| (f.vcpus, f.ram) != (vcpus, ram)).map(|f| resources_of_flavor(f.vcpus, f.ram));
    VmStatus {
        id: VmId(uid_of(server).unwrap_or_default().to_owned()),
        backend_name: server.name.clone(),
        backend_id: server.id.clone(),
        power,
        stop_reason: if power.is_active() { None } else { stop_reason },
        // Nova tells no hypervisor fault of a paused server apart from a pause asked for.
        fault: None,
        cpus: vcpus,
        memory_bytes,
        max_cpus: vcpus,
        max_memory_bytes: memory_bytes,
        next_start,
        addresses: addresses_of(server),
        network_interfaces: server.addresses.len(),
    }
}

/// Memory in whole MiB, rounded up.
pub(crate) fn mib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// The smallest enabled flavor with at least `cpus` vCPUs and `memory_bytes`
/// of RAM (rounded up to MiB): least RAM first, then fewest vCPUs, then least
/// disk, then name (so the choice is stable). `None` when none is big enough.
pub(crate) fn smallest_fitting(flavors: &[Flavor], cpus: u32, memory_bytes: u64) -> Option<&Flavor> {
    let ram = mib_ceil(memory_bytes);
    flavors
        .iter()
        .filter(|f| !f.disabled && f.vcpus >= cpus && f.ram >= ram)
        .min_by(|a, b| (a.ram, a.vcpus, a.disk, &a.name).cmp(&(b.ram, b.vcpus, b.disk, &b.name)))
}

/// The flavor a user named (`spec.providerOptions.flavor`): by id first,
/// then by name.
pub(crate) fn flavor_named<'a>(flavors: &'a [Flavor], name_or_id: &str) -> Option<&'a Flavor> {
    flavors.iter().find(|f| f.id == name_or_id).or_else(|| flavors.iter().find(|f| f.name == name_or_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::Address;

    fn flavor(id: &str, vcpus: u32, ram: u64, disk: u64) -> Flavor {
        Flavor { id: id.into(), name: format!("f-{id}"), vcpus, ram, disk, disabled: false }
    }

    #[test]
    fn nova_states_map_to_power_states() {
        use PowerState::*;
        let cases = [
            ("ACTIVE", Some(1), Running, None),
            ("SHUTOFF", Some(4), Off, Some(StopReason::Unknown)),
            ("PAUSED", Some(3), Paused, None),
            ("SUSPENDED", Some(7), Paused, None),
            ("ERROR", Some(0), Crashed, Some(StopReason::Crashed)),
            ("BUILD", Some(0), Unknown, None),
            ("MIGRATING", Some(1), Running, None),
            ("VERIFY_RESIZE", Some(4), Off, Some(StopReason::Unknown)),
            ("RESIZE", Some(1), Running, None),
            ("REBOOT", None, Unknown, None),
            ("SHELVED_OFFLOADED", Some(4), Unknown, None),
            ("SOMETHING_NEW", Some(1), Unknown, None),
        ];
        for (status, power_state, power, reason) in cases {
            assert_eq!(power_of(status, power_state), (power, reason), "{status} {power_state:?}");
        }
    }

    #[test]
    fn the_smallest_fitting_flavor_wins_ties_by_ram_then_vcpus_then_disk() {
        let flavors = [
            flavor("tiny", 1, 512, 1),
            flavor("small", 1, 2048, 20),
            flavor("wide", 4, 2048, 20),
            flavor("narrow-big-disk", 2, 2048, 40),
            flavor("narrow", 2, 2048, 20),
            flavor("medium", 2, 4096, 40),
        ];
        let pick = |cpus, mib: u64| smallest_fitting(&flavors, cpus, mib * MIB).map(|f| f.id.as_str());
        assert_eq!(pick(1, 256), Some("tiny"));
        assert_eq!(pick(1, 512), Some("tiny"));
        assert_eq!(pick(1, 513), Some("small"));
        assert_eq!(pick(2, 1024), Some("narrow"));
        assert_eq!(pick(3, 1024), Some("wide"));
        assert_eq!(pick(2, 3000), Some("medium"));
        assert_eq!(pick(8, 1024), None);
        // 1 byte above 512 MiB needs the next MiB.
        assert_eq!(smallest_fitting(&flavors, 1, 512 * MIB + 1).map(|f| f.id.as_str()), Some("small"));
    }

    #[test]
    fn disabled_flavors_are_never_chosen() {
        let mut off = flavor("off", 1, 256, 1);
        off.disabled = true;
        let flavors = [off, flavor("on", 1, 512, 1)];
        assert_eq!(smallest_fitting(&flavors, 1, MIB).map(|f| f.id.as_str()), Some("on"));
    }

    #[test]
    fn a_named_flavor_is_found_by_id_then_name() {
        let flavors = [flavor("1", 1, 512, 1), flavor("f-1", 2, 1024, 1)];
        assert_eq!(flavor_named(&flavors, "f-1").map(|f| f.vcpus), Some(2));
        assert_eq!(flavor_named(&flavors, "f-f-1").map(|f| f.vcpus), Some(2));
        assert_eq!(flavor_named(&flavors, "1").map(|f| f.vcpus), Some(1));
        assert!(flavor_named(&flavors, "nope").is_none());
    }

    #[test]
    fn status_reports_size_addresses_and_a_pending_flavor() {
        let mut server = Server {
            id: "sid".into(),
            name: "ns_vm".into(),
            status: "ACTIVE".into(),
            power_state: Some(1),
            flavor: ServerFlavor { original_name: "small".into(), vcpus: 1, ram: 2048, disk: 20 },
            ..Server::default()
        };
        server.metadata.insert(UID_KEY.into(), "uid-1".into());
        let address = |addr: &str| Address { addr: addr.into(), kind: Some("fixed".into()) };
        server.addresses.push(("net".into(), vec![address("10.0.0.5"), address("fd00::5")]));
        let status = status_of(&server, None);
        assert_eq!(status.id, VmId("uid-1".into()));
        assert_eq!(
            (status.cpus, status.memory_bytes, status.max_cpus, status.max_memory_bytes),
            (1, 2048 * MIB, 1, 2048 * MIB)
        );
        assert_eq!(status.addresses, vec!["10.0.0.5".parse::<IpAddr>().unwrap(), "fd00::5".parse().unwrap()]);
        assert_eq!(status.network_interfaces, 1);
        assert_eq!((status.power, status.stop_reason, status.next_start), (PowerState::Running, None, None));
        let bigger = flavor("m", 2, 4096, 40);
        assert_eq!(status_of(&server, Some(&bigger)).next_start, Some(Resources { cpus: 2, memory_bytes: 4096 * MIB }));
        let same = flavor("s2", 1, 2048, 40);
        assert_eq!(status_of(&server, Some(&same)).next_start, None);
    }

    #[test]
    fn fixed_addresses_come_first_in_port_order_then_floating_without_link_local() {
        let address = |addr: &str, kind: Option<&str>| Address { addr: addr.into(), kind: kind.map(Into::into) };
        let mut server = Server { id: "sid".into(), status: "ACTIVE".into(), ..Server::default() };
        server.addresses = vec![
            (
                "wan".into(),
                vec![
                    address("fe80::f816:3eff:fe00:1", Some("fixed")),
                    address("203.0.113.7", Some("floating")),
                    address("10.42.0.10", Some("fixed")),
                ],
            ),
            ("lan".into(), vec![address("169.254.0.3", None), address("192.168.1.10", None)]),
            ("dup".into(), vec![address("10.42.0.10", Some("fixed")), address("not an address", None)]),
        ];
        let status = status_of(&server, None);
        let want: Vec<IpAddr> =
            ["10.42.0.10", "192.168.1.10", "203.0.113.7"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(status.addresses, want);
        assert_eq!(status.network_interfaces, 3, "one per network Nova lists");
    }
}
