//! `spec.networks` on Nova, against the real Nova API of the harness
//! (`hack/nova.sh up`: networks `private` = `VMLET_NOVA_NETWORK`,
//! 192.168.1.0/24, and `lan2` = `VMLET_NOVA_NETWORK_2`, 10.42.0.0/24): the
//! cloud offers them by name, a VM's names become the server's ports, the
//! ports' fixed IPs its addresses; names the cloud does not offer the VM's
//! namespace are refused before any server exists.

mod common;
use common::{define, harness, remove, remove_leftovers, test_options, wait_power, Harness};

use std::net::IpAddr;
use std::sync::Arc;

use vmlet_openstack::{Cloud, CloudOptions, OfferedNetwork, OpenStackProvider};
use vmlet_provider::{ErrorKind, NetworkRequest, PowerState, Provider, VmSpec};

/// The namespace `lan2` is offered to (besides `lan`, offered to all).
const NS: &str = "vmlet-os-nets";
/// A namespace offered `lan` only.
const OTHER_NS: &str = "vmlet-os-nets-other";

/// The harness's second network, or a panic saying how to get it.
fn network_2(h: &Harness) -> String {
    h.network_2.clone().unwrap_or_else(|| {
        panic!(
            "VMLET_NOVA_NETWORK_2 is unset: this harness predates its second network; restart it (hack/nova.sh up) \
             and eval \"$(hack/nova.sh env)\" again"
        )
    })
}

/// A session whose cloud offers `lan2` (to [`NS`] only) and `lan` (to
/// every namespace), in that order, and no network by UUID alone.
async fn cloud_offering_names(h: &Harness) -> Arc<Cloud> {
    let options = CloudOptions {
        allowed_networks: Some(vec![]),
        offered_networks: vec![
            OfferedNetwork { name: "lan2".into(), uuid: network_2(h), namespaces: Some(vec![NS.into()]) },
            OfferedNetwork { name: "lan".into(), uuid: h.network.clone(), namespaces: None },
        ],
        ..test_options()
    };
    Cloud::connect(h.config(), options).await.expect("connect to the harness cloud")
}

/// A harness spec without providerOptions.networks, naming `networks`.
fn spec_naming(h: &Harness, namespace: &str, what: &str, networks: &[(&str, Option<&str>)]) -> VmSpec {
    let mut spec = h.spec(namespace, what);
    spec.options.remove("networks");
    spec.networks =
        networks.iter().map(|(name, mac)| NetworkRequest { name: (*name).into(), mac: mac.map(Into::into) }).collect();
    spec
}

fn in_subnet(ip: &IpAddr, prefix: &str) -> bool {
    ip.to_string().starts_with(prefix)
}

/// The names of vmlet's servers of `namespace` on any host.
async fn servers_of(providers: &[OpenStackProvider], namespace: &str) -> Vec<String> {
    let mut names = Vec::new();
    for provider in providers {
        for vm in provider.list().await.expect("list") {
            if vm.backend_name.starts_with(&format!("{namespace}_")) {
                names.push(vm.backend_name);
            }
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_networks_become_the_servers_ports_and_their_fixed_ips_its_addresses() {
    let Some(h) = harness("named_networks_become_the_servers_ports_and_their_fixed_ips_its_addresses") else { return };
    let cloud = cloud_offering_names(&h).await;
    let providers: Vec<OpenStackProvider> =
        h.hosts.iter().map(|host| OpenStackProvider::new(cloud.clone(), host)).collect();
    remove_leftovers(&providers, NS).await;
    remove_leftovers(&providers, OTHER_NS).await;
    let a = &providers[0];

    // Both names, lan first: the first address is the lan port's.
    let both = spec_naming(&h, NS, "both", &[("lan", None), ("lan2", None)]);
    define(a, &both).await;
    a.start(&both.id).await.expect("start");
    let running = wait_power(a, &both.id, PowerState::Running).await;
    assert_eq!(running.network_interfaces, 2, "{running:?}");
    assert_eq!(running.addresses.len(), 2, "one fixed IP per port: {running:?}");
    assert!(in_subnet(&running.addresses[0], "192.168.1."), "lan's fixed IP first: {running:?}");
    assert!(in_subnet(&running.addresses[1], "10.42.0."), "then lan2's: {running:?}");

    // No names in NS: the first network the cloud offers NS (lan2); in
    // OTHER_NS, lan2 is not offered, so lan.
    let default_here = spec_naming(&h, NS, "default", &[]);
    let status = define(a, &default_here).await;
    assert_eq!(status.network_interfaces, 1, "{status:?}");
    assert!(status.addresses.iter().all(|ip| in_subnet(ip, "10.42.0.")), "lan2 only: {status:?}");
    assert_eq!(status.addresses.len(), 1, "{status:?}");
    let default_other = spec_naming(&h, OTHER_NS, "default", &[]);
    let status = define(a, &default_other).await;
    assert!(status.addresses.len() == 1 && in_subnet(&status.addresses[0], "192.168.1."), "lan only: {status:?}");
    for spec in [&both, &default_here, &default_other] {
        remove(a, &spec.id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_not_offered_macs_and_both_network_fields_are_refused_before_any_server_exists() {
    let Some(h) = harness("names_not_offered_macs_and_both_network_fields_are_refused") else { return };
    let cloud = cloud_offering_names(&h).await;
    let providers: Vec<OpenStackProvider> =
        h.hosts.iter().map(|host| OpenStackProvider::new(cloud.clone(), host)).collect();
    const REFUSED_NS: &str = "vmlet-os-nets-refused";
    remove_leftovers(&providers, REFUSED_NS).await;
    let a = &providers[0];

    let refused = |networks: &[(&str, Option<&str>)]| spec_naming(&h, REFUSED_NS, "refused", networks);
    let mut both_fields = refused(&[("lan", None)]);
    both_fields.options.insert("networks".into(), h.network.clone());
    let cases = [
        (refused(&[("lan", None), ("nope", None)]), "spec.networks[1].name: network \"nope\""),
        // lan2 is NS's only.
        (refused(&[("lan2", None)]), "spec.networks[0].name: network \"lan2\""),
        (refused(&[("lan", Some("52:54:00:12:34:56"))]), "spec.networks[0].macAddress:"),
        (both_fields, "spec.networks and spec.providerOptions.networks are both given"),
    ];
    for (spec, message) in cases {
        let err = a.ensure_defined(&spec).await.expect_err(message);
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains(message), "want {message:?} in: {err}");
        if message.contains(".name") {
            assert!(err.message.contains(&format!("offers namespace {REFUSED_NS}: lan)")), "{err}");
        }
        assert_eq!(servers_of(&providers, REFUSED_NS).await, Vec::<String>::new(), "nothing created for {message}");
    }
    // By UUID in providerOptions, lan2 is NS's only too.
    let mut by_uuid = h.spec(REFUSED_NS, "by-uuid");
    by_uuid.options.insert("networks".into(), network_2(&h));
    let err = a.ensure_defined(&by_uuid).await.expect_err("lan2's UUID from another namespace");
    assert!(err.message.starts_with("spec.providerOptions.networks:"), "{err}");
    assert_eq!(servers_of(&providers, REFUSED_NS).await, Vec::<String>::new());
}
