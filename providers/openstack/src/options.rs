//! The VirtualMachine's `spec.providerOptions` keys the OpenStack provider
//! reads ([`vmlet_provider::VmSpec::options`]); any other key is refused
//! with `InvalidInput` naming it.
//!
//! | key | value | default |
//! |---|---|---|
//! | `flavor` | a flavor id or name | the smallest flavor with at least the VM's vCPUs and memory |
//! | `networks` | `auto` (Nova allocates a network), `none`, or comma-separated Neutron network UUIDs | see `networks.rs`: the first named network offered to the VM's namespace, else `auto` |
//!
//! `networks` is the older form of the backend-neutral `spec.networks`
//! (names the cloud offers); a VM gives one or the other, never both.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use vmlet_provider::{Error, ErrorKind, Result};

/// The keys this provider reads.
pub const KNOWN_KEYS: [&str; 2] = ["flavor", "networks"];

/// Which networks a new server gets (`networks` of `POST /servers`, 2.37+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Networks {
    /// `"auto"`: Nova gives the project's network, or allocates one.
    Auto,
    /// `"none"`: no network.
    None,
    /// One port on each of these networks, in order.
    Uuids(Vec<String>),
}

impl Networks {
    /// The `networks` value of a create request.
    pub(crate) fn to_json(&self) -> Value {
        match self {
            Networks::Auto => json!("auto"),
            Networks::None => json!("none"),
            Networks::Uuids(ids) => Value::Array(ids.iter().map(|id| json!({ "uuid": id })).collect()),
        }
    }
}

/// The provider options of one VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServerOptions {
    /// `flavor`, when given.
    pub(crate) flavor: Option<String>,
    /// `networks`, when given.
    pub(crate) networks: Option<Networks>,
}

/// Read `options`. Errors: `InvalidInput` naming `spec.providerOptions.<key>`
/// for an unknown key or a bad value.
pub(crate) fn parse(options: &BTreeMap<String, String>) -> Result<ServerOptions> {
    const OP: &str = "read provider options";
    if let Some(key) = options.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "spec.providerOptions.{key}: the OpenStack back end does not know this option; it reads {}",
                KNOWN_KEYS.join(", ")
            ),
        ));
    }
    let flavor = options.get("flavor").map(|f| f.trim().to_owned());
    if flavor.as_deref() == Some("") {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            "spec.providerOptions.flavor: empty; give a flavor id or name",
        ));
    }
    let networks = match options.get("networks").map(|n| n.trim()) {
        None => None,
        Some("auto") => Some(Networks::Auto),
        Some("none") => Some(Networks::None),
        Some(list) => {
            let ids: Vec<String> = list.split(',').map(|id| id.trim().to_owned()).filter(|id| !id.is_empty()).collect();
            if ids.is_empty() {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    "spec.providerOptions.networks: empty; give auto, none, or network UUIDs separated by commas",
                ));
            }
            if let Some(bad) = ids.iter().find(|id| uuid::Uuid::parse_str(id).is_err()) {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.providerOptions.networks: {bad:?} is not a network UUID; give auto, none, or network \
                         UUIDs separated by commas"
                    ),
                ));
            }
            Some(Networks::Uuids(ids))
        }
    };
    Ok(ServerOptions { flavor, networks })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_are_no_networks_and_no_flavor() {
        assert_eq!(parse(&options(&[])).unwrap(), ServerOptions { flavor: None, networks: None });
        assert_eq!(parse(&options(&[("networks", " auto ")])).unwrap().networks, Some(Networks::Auto));
    }

    #[test]
    fn flavor_and_network_uuids_are_read() {
        let a = "3cb9bc59-5699-4588-a4b1-b87f96708bc6";
        let b = "a1b2c3d4-0000-4000-8000-000000000001";
        let parsed = parse(&options(&[("flavor", "m1.small"), ("networks", &format!("{a}, {b}"))])).unwrap();
        assert_eq!(parsed.flavor.as_deref(), Some("m1.small"));
        assert_eq!(parsed.networks, Some(Networks::Uuids(vec![a.into(), b.into()])));
        assert_eq!(parsed.networks.unwrap().to_json(), json!([{"uuid": a}, {"uuid": b}]));
        assert_eq!(parse(&options(&[("networks", "none")])).unwrap().networks.unwrap().to_json(), json!("none"));
    }

    #[test]
    fn an_unknown_key_or_bad_value_is_refused_by_name() {
        for (pairs, field) in [
            (&[("flavour", "m1.small")][..], "spec.providerOptions.flavour:"),
            (&[("networks", "private")][..], "spec.providerOptions.networks:"),
            (&[("networks", " , ")][..], "spec.providerOptions.networks:"),
            (&[("flavor", "")][..], "spec.providerOptions.flavor:"),
        ] {
            let err = parse(&options(pairs)).expect_err("refused");
            assert_eq!(err.kind, ErrorKind::InvalidInput);
            assert!(err.message.starts_with(field), "{}", err.message);
        }
    }
}
