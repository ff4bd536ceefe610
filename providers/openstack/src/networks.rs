//! Which Neutron networks a new server joins: the VM's `spec.networks`
//! ([`VmSpec::networks`]) by the names the cloud's administrator offers
//! ([`OfferedNetwork`]), or the older `spec.providerOptions.networks`.
//!
//! | `spec.networks` | `providerOptions.networks` | the server's networks |
//! |---|---|---|
//! | names | absent | one port on each named network, in order |
//! | names | given | refused: choose one of the two |
//! | empty | given | as given (`auto`, `none`, UUIDs the cloud allows) |
//! | empty | absent | the first named network offered to the VM's namespace; `auto` when the cloud offers it none |
//!
//! The last row matches the libvirt back end (the first network the host
//! offers) wherever the cloud offers named networks, and keeps today's
//! `auto` for clouds configured with UUIDs only.
//!
//! A name is never a Neutron name or id the tenant picks: vmlet's user is
//! the cloud's admin and could join any project's network, so only what the
//! administrator listed is reachable. Nova's `POST /servers` cannot give a
//! port a MAC address (that needs a Neutron port made beforehand, which
//! vmlet does not do), so `spec.networks[].macAddress` is refused here.

use vmlet_provider::{Error, ErrorKind, Result, VmSpec};

use crate::options::Networks;

const OP: &str = "define server";

/// One Neutron network a cloud offers VMs under a name
/// ([`crate::CloudOptions::offered_networks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfferedNetwork {
    /// The name VMs give in `spec.networks[].name` (a DNS label, e.g. `lan`).
    pub name: String,
    /// The Neutron network's UUID.
    pub uuid: String,
    /// The namespaces whose VMs may join it; `None`: every namespace.
    pub namespaces: Option<Vec<String>>,
}

impl OfferedNetwork {
    /// Whether VMs of `namespace` may join this network.
    pub fn offered_to(&self, namespace: &str) -> bool {
        self.namespaces.as_ref().is_none_or(|namespaces| namespaces.iter().any(|n| n == namespace))
    }
}

/// The `networks` of the create request for `spec` (see the table above).
/// `from_options` is `spec.providerOptions.networks` when given; `allowed`
/// the UUIDs the cloud lets any VM name there (`None`: any), to which the
/// UUIDs of the named networks offered to the VM's namespace are added.
///
/// Errors (`InvalidInput`, before anything is created): both fields given;
/// `spec.networks[<i>].name` not offered to the VM's namespace (naming the
/// names that are); `spec.networks[<i>].macAddress` given; a UUID in
/// `spec.providerOptions.networks` the cloud does not allow.
pub(crate) fn server_networks(
    spec: &VmSpec,
    from_options: Option<&Networks>,
    offered: &[OfferedNetwork],
    allowed: Option<&[String]>,
) -> Result<Networks> {
    let open: Vec<&OfferedNetwork> = offered.iter().filter(|n| n.offered_to(&spec.namespace)).collect();
    if !spec.networks.is_empty() {
        if from_options.is_some() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                "spec.networks and spec.providerOptions.networks are both given; keep spec.networks (the same on \
                 every back end) and remove spec.providerOptions.networks",
            ));
        }
        let mut uuids = Vec::with_capacity(spec.networks.len());
        for (i, request) in spec.networks.iter().enumerate() {
            let Some(network) = open.iter().find(|n| n.name == request.name) else {
                let names: Vec<&str> = open.iter().map(|n| n.name.as_str()).collect();
                let offered = if names.is_empty() {
                    format!("this cloud offers namespace {} no named network", spec.namespace)
                } else {
                    format!("this cloud offers namespace {}: {}", spec.namespace, names.join(", "))
                };
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.networks[{i}].name: network {:?} is not offered to this VM ({offered}); name one of \
                         those, or ask vmlet's administrator to offer it (clouds[].networks)",
                        request.name
                    ),
                ));
            };
            if let Some(mac) = &request.mac {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.networks[{i}].macAddress: {mac:?} cannot be set on Nova: a server's networks get ports \
                         whose MAC address Neutron picks (a fixed MAC needs a Neutron port made beforehand, which \
                         vmlet does not do); remove macAddress for VMs on this cloud"
                    ),
                ));
            }
            uuids.push(network.uuid.clone());
        }
        return Ok(Networks::Uuids(uuids));
    }
    match from_options {
        Some(Networks::Uuids(ids)) => {
            if let Some(allowed) = allowed {
                let mut may: Vec<&str> = allowed.iter().map(String::as_str).collect();
                may.extend(open.iter().map(|n| n.uuid.as_str()));
                if let Some(refused) = ids.iter().find(|id| !may.contains(&id.as_str())) {
                    return Err(Error::new(
                        OP,
                        ErrorKind::InvalidInput,
                        format!(
                            "spec.providerOptions.networks: network {refused} is not one this cloud allows for VMs of \
                             namespace {} (allowed: auto, none, [{}]); ask vmlet's administrator to add it to the \
                             cloud's networks in vmlet's config",
                            spec.namespace,
                            may.join(", ")
                        ),
                    ));
                }
            }
            Ok(Networks::Uuids(ids.clone()))
        }
        Some(other) => Ok(other.clone()),
        None => Ok(open.first().map_or(Networks::Auto, |n| Networks::Uuids(vec![n.uuid.clone()]))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::{NetworkRequest, VmId};

    const LAN: &str = "3cb9bc59-5699-4588-a4b1-b87f96708bc6";
    const DMZ: &str = "c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42";
    const PLAIN: &str = "a1b2c3d4-0000-4000-8000-000000000001";

    fn offered() -> Vec<OfferedNetwork> {
        vec![
            OfferedNetwork { name: "dmz".into(), uuid: DMZ.into(), namespaces: Some(vec!["team-a".into()]) },
            OfferedNetwork { name: "lan".into(), uuid: LAN.into(), namespaces: None },
        ]
    }

    fn spec(namespace: &str, networks: &[(&str, Option<&str>)]) -> VmSpec {
        VmSpec {
            id: VmId("u".into()),
            namespace: namespace.into(),
            name: "web".into(),
            cpus: 1,
            memory_bytes: 1 << 28,
            max_cpus: None,
            max_memory_bytes: None,
            image: None,
            image_backing_chain: None,
            kernel_boot: None,
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: networks
                .iter()
                .map(|(name, mac)| NetworkRequest { name: (*name).into(), mac: mac.map(Into::into) })
                .collect(),
        }
    }

    fn resolve(spec: &VmSpec, from_options: Option<Networks>) -> Result<Networks> {
        let allowed = [PLAIN.to_owned()];
        server_networks(spec, from_options.as_ref(), &offered(), Some(&allowed))
    }

    #[test]
    fn named_networks_become_one_port_each_in_order() {
        let networks = resolve(&spec("team-a", &[("lan", None), ("dmz", None)]), None).unwrap();
        assert_eq!(networks, Networks::Uuids(vec![LAN.into(), DMZ.into()]));
    }

    #[test]
    fn a_name_not_offered_to_the_namespace_is_refused_naming_the_field_and_the_offered_names() {
        let err = resolve(&spec("team-b", &[("lan", None), ("dmz", None)]), None).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(err.message.starts_with("spec.networks[1].name: network \"dmz\""), "{}", err.message);
        assert!(err.message.contains("offers namespace team-b: lan)"), "{}", err.message);
        let err = server_networks(&spec("team-b", &[("lan", None)]), None, &[], None).unwrap_err();
        assert!(err.message.contains("offers namespace team-b no named network"), "{}", err.message);
    }

    #[test]
    fn a_mac_address_is_refused_on_nova_saying_why() {
        let err = resolve(&spec("team-a", &[("lan", None), ("lan", Some("52:54:00:12:34:56"))]), None).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        assert!(err.message.starts_with("spec.networks[1].macAddress:"), "{}", err.message);
        assert!(err.message.contains("Neutron port"), "{}", err.message);
    }

    #[test]
    fn spec_networks_and_provider_options_networks_together_are_refused() {
        for options in [Networks::Auto, Networks::None, Networks::Uuids(vec![LAN.into()])] {
            let err = resolve(&spec("team-a", &[("lan", None)]), Some(options)).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidInput);
            assert!(
                err.message.contains("spec.networks and spec.providerOptions.networks are both given"),
                "{}",
                err.message
            );
        }
    }

    #[test]
    fn without_spec_networks_provider_options_decide_then_the_first_offered_name_then_auto() {
        assert_eq!(resolve(&spec("team-a", &[]), Some(Networks::None)).unwrap(), Networks::None);
        assert_eq!(resolve(&spec("team-a", &[]), Some(Networks::Auto)).unwrap(), Networks::Auto);
        assert_eq!(resolve(&spec("team-a", &[]), None).unwrap(), Networks::Uuids(vec![DMZ.into()]));
        assert_eq!(resolve(&spec("team-b", &[]), None).unwrap(), Networks::Uuids(vec![LAN.into()]), "dmz: team-a's");
        let only_plain = server_networks(&spec("team-a", &[]), None, &[], Some(&[PLAIN.to_owned()])).unwrap();
        assert_eq!(only_plain, Networks::Auto, "a cloud of plain UUIDs keeps today's default");
    }

    #[test]
    fn provider_options_uuids_are_the_plain_ones_or_those_offered_to_the_namespace() {
        let uuids = |ids: &[&str]| Some(Networks::Uuids(ids.iter().map(|id| (*id).to_owned()).collect()));
        assert!(resolve(&spec("team-a", &[]), uuids(&[PLAIN, DMZ, LAN])).is_ok());
        let err = resolve(&spec("team-b", &[]), uuids(&[PLAIN, DMZ])).unwrap_err();
        assert!(err.message.starts_with(&format!("spec.providerOptions.networks: network {DMZ}")), "{}", err.message);
        let anything = server_networks(&spec("team-b", &[]), uuids(&[DMZ]).as_ref(), &offered(), None).unwrap();
        assert_eq!(anything, Networks::Uuids(vec![DMZ.into()]), "no allowed list: any UUID (tests, one tenant)");
    }
}
