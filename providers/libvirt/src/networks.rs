//! The networks a libvirt host offers its VMs, and the `<interface>` each of a
//! VM's network interfaces gets.
//!
//! A VM names networks ([`VmSpec::networks`]); the host's administrator says
//! what each name is on this host ([`OfferedNetwork`]): a libvirt network, a
//! host bridge, or macvtap on a host device
//! (<https://libvirt.org/formatdomain.html#network-interfaces>). A VM never
//! names a libvirt object itself, and QEMU's user-mode networking (which hands
//! the guest the host's loopback at 10.0.2.2) is never offered.

use std::fmt::Write as _;

use vmlet_provider::{Error, ErrorKind, Result, VmSpec};

use crate::xml::escape;

/// One network this host offers VMs, under the name VMs give in
/// `spec.networks[].name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfferedNetwork {
    /// The name VMs use (a DNS label, e.g. `lan`).
    pub name: String,
    /// What the name is on this host.
    pub attachment: Attachment,
    /// The namespaces whose VMs may join it; `None`: every namespace.
    pub namespaces: Option<Vec<String>>,
}

impl OfferedNetwork {
    /// Whether VMs of `namespace` may join this network.
    pub fn offered_to(&self, namespace: &str) -> bool {
        self.namespaces.as_ref().is_none_or(|namespaces| namespaces.iter().any(|n| n == namespace))
    }
}

/// How a VM's interface joins an [`OfferedNetwork`] on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// A libvirt network by name (`<interface type='network'>`): NAT, routed
    /// or isolated, with libvirt's DHCP (dnsmasq) when the network has it.
    /// The guest reaches the host at the network's own address on the host
    /// (DHCP and DNS, and whatever else listens there), never its loopback.
    Network(String),
    /// A bridge device on the host (`<interface type='bridge'>`): the guest
    /// shares the bridge's layer-2 segment and reaches the host only where
    /// the host has an address on that bridge.
    Bridge(String),
    /// macvtap on a host device in bridge mode (`<interface type='direct'>`):
    /// the guest is on the device's segment and cannot reach the host itself
    /// through it (macvtap does not pass traffic between guest and host).
    Macvtap(String),
}

/// One network interface of a VM, resolved against what the host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Nic {
    /// Where it joins.
    pub(crate) attachment: Attachment,
    /// The fixed MAC address, lower case; `None`: libvirt picks one at define.
    pub(crate) mac: Option<String>,
}

/// The interfaces `spec` gets from the networks in `offered`, in order:
/// those it names, or with none named the first network offered to its
/// namespace (none when the host offers it none).
///
/// Errors: `InvalidInput` naming `spec.networks[<i>].name` (with the names
/// the host offers the VM's namespace) for a name the host does not offer
/// it, or `spec.networks[<i>].macAddress` for a MAC address that is not six
/// hex octets or not unicast.
pub(crate) fn resolve(offered: &[OfferedNetwork], spec: &VmSpec) -> Result<Vec<Nic>> {
    const OP: &str = "define domain";
    let open: Vec<&OfferedNetwork> = offered.iter().filter(|network| network.offered_to(&spec.namespace)).collect();
    if spec.networks.is_empty() {
        return Ok(open
            .first()
            .map(|network| Nic { attachment: network.attachment.clone(), mac: None })
            .into_iter()
            .collect());
    }
    let mut nics = Vec::with_capacity(spec.networks.len());
    for (i, request) in spec.networks.iter().enumerate() {
        let Some(network) = open.iter().find(|network| network.name == request.name) else {
            let names: Vec<&str> = open.iter().map(|network| network.name.as_str()).collect();
            let offered = if names.is_empty() {
                format!("this host offers namespace {} no network", spec.namespace)
            } else {
                format!("this host offers namespace {}: {}", spec.namespace, names.join(", "))
            };
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.networks[{i}].name: network {:?} is not offered to this VM ({offered}); name one of \
                     those, or ask vmlet's administrator to offer it (hosts[].networks)",
                    request.name
                ),
            ));
        };
        let mac = match &request.mac {
            None => None,
            Some(mac) => Some(unicast_mac(mac).ok_or_else(|| {
                Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!(
                        "spec.networks[{i}].macAddress: {mac:?} is not a unicast MAC address; give six hex octets \
                         separated by colons with an even first octet, e.g. 52:54:00:12:34:56"
                    ),
                )
            })?),
        };
        nics.push(Nic { attachment: network.attachment.clone(), mac });
    }
    Ok(nics)
}

/// `mac` in lower case when it is six two-digit hex octets separated by
/// colons and unicast (the least significant bit of the first octet clear).
fn unicast_mac(mac: &str) -> Option<String> {
    let octets: Vec<&str> = mac.split(':').collect();
    let valid = octets.len() == 6 && octets.iter().all(|o| o.len() == 2 && o.chars().all(|c| c.is_ascii_hexdigit()));
    let first = u8::from_str_radix(octets.first()?, 16).ok()?;
    (valid && first & 1 == 0).then(|| mac.to_ascii_lowercase())
}

/// The `<interface>` element of `nic`, indented for `<devices>`: a virtio
/// NIC, with its MAC address when fixed.
pub(crate) fn interface_xml(nic: &Nic) -> String {
    let (kind, source) = match &nic.attachment {
        Attachment::Network(name) => ("network", format!("<source network='{}'/>", escape(name))),
        Attachment::Bridge(bridge) => ("bridge", format!("<source bridge='{}'/>", escape(bridge))),
        Attachment::Macvtap(device) => ("direct", format!("<source dev='{}' mode='bridge'/>", escape(device))),
    };
    let mut xml = format!("    <interface type='{kind}'>\n");
    if let Some(mac) = &nic.mac {
        let _ = writeln!(xml, "      <mac address='{}'/>", escape(mac));
    }
    let _ = writeln!(xml, "      {source}");
    xml.push_str("      <model type='virtio'/>\n    </interface>\n");
    xml
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmlet_provider::{NetworkRequest, VmId};

    fn offered() -> Vec<OfferedNetwork> {
        vec![
            OfferedNetwork {
                name: "lan".into(),
                attachment: Attachment::Network("vmlet-lan".into()),
                namespaces: Some(vec!["team-a".into()]),
            },
            OfferedNetwork { name: "shared".into(), attachment: Attachment::Bridge("br0".into()), namespaces: None },
            OfferedNetwork { name: "edge".into(), attachment: Attachment::Macvtap("eth1".into()), namespaces: None },
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

    #[test]
    fn without_names_a_vm_gets_the_first_network_its_namespace_may_use() {
        let nics = resolve(&offered(), &spec("team-a", &[])).unwrap();
        assert_eq!(nics, vec![Nic { attachment: Attachment::Network("vmlet-lan".into()), mac: None }]);
        let nics = resolve(&offered(), &spec("team-b", &[])).unwrap();
        assert_eq!(nics, vec![Nic { attachment: Attachment::Bridge("br0".into()), mac: None }], "lan is team-a's");
        assert_eq!(resolve(&[], &spec("team-a", &[])).unwrap(), vec![], "no network offered: no NIC");
    }

    #[test]
    fn named_networks_come_in_order_with_their_macs() {
        let nics = resolve(&offered(), &spec("team-a", &[("edge", None), ("lan", Some("52:54:00:AB:cd:01"))])).unwrap();
        assert_eq!(
            nics,
            vec![
                Nic { attachment: Attachment::Macvtap("eth1".into()), mac: None },
                Nic { attachment: Attachment::Network("vmlet-lan".into()), mac: Some("52:54:00:ab:cd:01".into()) },
            ]
        );
    }

    #[test]
    fn a_network_of_another_namespace_is_refused_naming_the_field_and_the_offered_names() {
        let err = resolve(&offered(), &spec("team-b", &[("shared", None), ("lan", None)])).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        let message = err.to_string();
        assert!(message.contains("spec.networks[1].name"), "{message}");
        assert!(message.contains("\"lan\""), "{message}");
        assert!(message.contains("offers namespace team-b: shared, edge"), "{message}");
        let err = resolve(&[], &spec("team-b", &[("lan", None)])).unwrap_err();
        assert!(err.to_string().contains("offers namespace team-b no network"), "{err}");
    }

    #[test]
    fn multicast_or_malformed_macs_are_refused() {
        for mac in
            ["01:00:5e:00:00:01", "52:54:00:12:34", "52-54-00-12-34-56", "52:54:00:12:34:5g", "525:4:00:12:34:56"]
        {
            let err = resolve(&offered(), &spec("team-a", &[("lan", Some(mac))])).unwrap_err();
            assert!(err.to_string().contains("spec.networks[0].macAddress"), "{mac}: {err}");
        }
    }

    #[test]
    fn each_attachment_gets_its_libvirt_interface_type() {
        let nic = |attachment, mac: Option<&str>| Nic { attachment, mac: mac.map(Into::into) };
        assert_eq!(
            interface_xml(&nic(Attachment::Network("vmlet-lan".into()), Some("52:54:00:00:00:01"))),
            "    <interface type='network'>\n      <mac address='52:54:00:00:00:01'/>\n      \
             <source network='vmlet-lan'/>\n      <model type='virtio'/>\n    </interface>\n"
        );
        assert!(interface_xml(&nic(Attachment::Bridge("br'0".into()), None))
            .contains("<interface type='bridge'>\n      <source bridge='br&apos;0'/>"));
        assert!(interface_xml(&nic(Attachment::Macvtap("eth1".into()), None))
            .contains("<interface type='direct'>\n      <source dev='eth1' mode='bridge'/>"));
    }
}
