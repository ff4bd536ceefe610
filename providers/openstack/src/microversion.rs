//! Compute API microversions: which one this crate speaks with a given Nova.
//!
//! Nova's version document (`GET <compute endpoint>` or the root, see
//! <https://docs.openstack.org/api-guide/compute/microversions.html>) names the
//! range the server supports (`min_version`..`version`). vmlet uses the highest
//! version both sides know: min(server maximum, [`HIGHEST_IMPLEMENTED`]), and
//! refuses a Nova whose maximum is below [`LOWEST_SUPPORTED`]. Individual calls
//! pin a lower version where a field they read moved (see
//! [`HYPERVISOR_CAPACITY`]).

use std::fmt;

/// A compute API microversion `2.<minor>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Microversion {
    /// Major version (2).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Microversion {
    /// `major.minor`.
    pub const fn new(major: u32, minor: u32) -> Self {
        Microversion { major, minor }
    }

    /// Parse `"2.87"`; `None` for anything else (an empty string is what a
    /// Nova without microversions sends).
    pub fn parse(text: &str) -> Option<Self> {
        let (major, minor) = text.trim().split_once('.')?;
        Some(Microversion { major: major.parse().ok()?, minor: minor.parse().ok()? })
    }
}

impl fmt::Display for Microversion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The highest microversion this crate implements (Nova 2025.1 "Epoxy"
/// and later offer it): the server fields it reads keep their shape up to here.
pub const HIGHEST_IMPLEMENTED: Microversion = Microversion::new(2, 100);

/// The lowest Nova maximum vmlet works with (Nova 17 "Queens"): the embedded
/// flavor in servers (2.47), UUID ids of hypervisors and services (2.53),
/// `migrate` with a host (2.56), os-migrations filtered by server (2.59).
pub const LOWEST_SUPPORTED: Microversion = Microversion::new(2, 60);

/// From this version on, server create takes `host` (and
/// `hypervisor_hostname`) to place a server on a compute host; below it, the
/// `availability_zone: "<zone>:<host>"` form does.
pub const CREATE_WITH_HOST: Microversion = Microversion::new(2, 74);

/// The last version whose `os-hypervisors` shows capacity (`vcpus`,
/// `memory_mb`, `cpu_info`); 2.88 removed them (Placement has them).
pub const HYPERVISOR_CAPACITY: Microversion = Microversion::new(2, 87);

/// The last version with Nova's image proxy (`GET /images`), used to resolve
/// an image name when the catalog has no image service.
pub const IMAGE_PROXY: Microversion = Microversion::new(2, 35);

/// The version to speak with a Nova that supports `server_min..=server_max`.
/// `Err` says why none fits, for the user.
pub fn negotiate(server_min: Microversion, server_max: Microversion) -> Result<Microversion, String> {
    if server_max < LOWEST_SUPPORTED {
        return Err(format!(
            "Nova's highest compute API microversion is {server_max}; vmlet needs at least {LOWEST_SUPPORTED} \
             (Nova 17, Queens): upgrade Nova"
        ));
    }
    let chosen = server_max.min(HIGHEST_IMPLEMENTED);
    if chosen < server_min {
        return Err(format!(
            "Nova's lowest compute API microversion is {server_min}, above the highest vmlet implements \
             ({HIGHEST_IMPLEMENTED}): use a vmlet release that knows this Nova"
        ));
    }
    Ok(chosen)
}

/// `version` lowered to `cap` (for calls that read fields later versions
/// removed).
pub fn pinned(version: Microversion, cap: Microversion) -> Microversion {
    version.min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(text: &str) -> Microversion {
        Microversion::parse(text).expect(text)
    }

    #[test]
    fn versions_parse_and_order_numerically() {
        assert_eq!(v("2.104"), Microversion::new(2, 104));
        assert!(v("2.9") < v("2.10"));
        assert!(v("2.100") > v("2.99"));
        assert_eq!(Microversion::parse(""), None);
        assert_eq!(Microversion::parse("2"), None);
        assert_eq!(v("2.87").to_string(), "2.87");
    }

    #[test]
    fn the_highest_version_both_sides_know_is_chosen() {
        assert_eq!(negotiate(v("2.1"), v("2.104")), Ok(HIGHEST_IMPLEMENTED));
        assert_eq!(negotiate(v("2.1"), v("2.79")), Ok(v("2.79")));
        assert_eq!(negotiate(v("2.1"), v("2.60")), Ok(v("2.60")));
    }

    #[test]
    fn an_old_or_too_new_nova_is_refused_with_a_reason() {
        let err = negotiate(v("2.1"), v("2.38")).expect_err("too old");
        assert!(err.contains("2.38") && err.contains("upgrade Nova"), "{err}");
        let err = negotiate(v("2.101"), v("2.120")).expect_err("too new");
        assert!(err.contains("2.101"), "{err}");
    }

    #[test]
    fn create_with_host_starts_at_2_74_and_capacity_reads_pin_2_87() {
        assert!(v("2.73") < CREATE_WITH_HOST && v("2.74") >= CREATE_WITH_HOST);
        assert_eq!(pinned(v("2.100"), HYPERVISOR_CAPACITY), v("2.87"));
        assert_eq!(pinned(v("2.79"), HYPERVISOR_CAPACITY), v("2.79"));
    }
}
