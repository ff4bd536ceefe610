use super::clone::{hardware_of, has_hardware};
use super::resize::check_live;
use super::*;
use crate::soap::MoRef;

fn vm(power_state: PowerState, ip: Option<&str>) -> Vm {
    Vm {
        uid: "u-1".into(),
        name: "ns_web".into(),
        moref: MoRef::new("VirtualMachine", "vm-42"),
        host: Some(MoRef::new("HostSystem", "host-21")),
        power_state,
        cpus: Some(2),
        memory_bytes: Some(512 << 20),
        ip_address: ip.map(|i| i.parse().unwrap()),
        sizing: Default::default(),
    }
}

#[test]
fn a_running_vm_reports_its_size_moref_and_routable_address() {
    let status = status_of(&vm(PowerState::PoweredOn, Some("10.0.0.7")));
    assert_eq!((status.power, status.stop_reason), (VmPower::Running, None));
    assert_eq!((status.backend_id.as_str(), status.backend_name.as_str()), ("vm-42", "ns_web"));
    assert_eq!((status.cpus, status.memory_bytes, status.max_cpus), (2, 512 << 20, 2));
    assert_eq!(status.addresses, vec!["10.0.0.7".parse::<IpAddr>().unwrap()]);
    let link_local = status_of(&vm(PowerState::PoweredOn, Some("169.254.1.1")));
    assert!(link_local.addresses.is_empty());
}

#[test]
fn a_powered_off_vm_is_off_for_an_unknown_reason_and_suspended_is_paused() {
    let off = status_of(&vm(PowerState::PoweredOff, None));
    assert_eq!((off.power, off.stop_reason), (VmPower::Off, Some(StopReason::Unknown)));
    assert_eq!(status_of(&vm(PowerState::Suspended, None)).power, VmPower::Paused);
}

fn provider(templates: &[&str]) -> VsphereProvider {
    provider_with(templates, &[])
}

fn provider_with(templates: &[&str], library_items: &[&str]) -> VsphereProvider {
    let config = SessionConfig::new(
        "https://127.0.0.1:1/sdk",
        crate::Trust::Thumbprint("00".repeat(32).parse().unwrap()),
        "u",
        crate::Secret::new("p"),
    );
    let owned = |names: &[&str]| names.iter().map(|t| (*t).to_owned()).collect();
    let options =
        VCenterOptions { templates: owned(templates), library_items: owned(library_items), ..Default::default() };
    VsphereProvider::new(Arc::new(VCenter::new("vc1", config, options)), "DC0_C0_H0")
}

fn spec(image: &str) -> VmSpec {
    VmSpec {
        id: VmId("u-1".into()),
        namespace: "tenant".into(),
        name: "web".into(),
        cpus: 1,
        memory_bytes: 256 << 20,
        max_cpus: None,
        max_memory_bytes: None,
        image: Some(image.into()),
        image_backing_chain: None,
        kernel_boot: None,
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
    }
}

#[test]
fn a_template_the_config_does_not_allow_is_refused_naming_the_field_and_the_allowed_ones() {
    let p = provider(&["template-c0", "template-h0"]);
    assert_eq!(p.check_spec(&spec("template-c0")).unwrap(), "template-c0");
    let error = p.check_spec(&spec("DC0_C0_RP0_VM1")).unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidInput);
    assert_eq!(
        error.message,
        "spec.image: template \"DC0_C0_RP0_VM1\" is not one this vCenter allows (allowed: [template-c0, \
         template-h0]); use one of them, or ask vmlet's administrator to add it to vcenters[].templates (or, as \
         <library>/<item>, to vcenters[].libraryItems)"
    );
}

#[test]
fn a_listed_library_item_is_allowed_and_its_deployed_template_is_not_a_name_of_its_own() {
    let p = provider_with(&["template-c0"], &["vmlet-lib/ubuntu-lib"]);
    assert_eq!(p.check_spec(&spec("vmlet-lib/ubuntu-lib")).unwrap(), "vmlet-lib/ubuntu-lib");
    // The template vmlet deploys the item as is cloned through the item's
    // entry only; named directly (or another item of the library) it is
    // refused as any unlisted name.
    let deployed = library::library_template_name("vmlet-lib/ubuntu-lib");
    assert_eq!(deployed, "vmlet-library_vmlet-lib_ubuntu-lib");
    for image in [deployed.as_str(), "vmlet-lib/other", "vmlet-lib"] {
        let error = p.check_spec(&spec(image)).unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidInput, "{image}");
        assert!(error.message.contains("(allowed: [template-c0, vmlet-lib/ubuntu-lib])"), "{}", error.message);
    }
}

#[test]
fn a_restored_template_is_cloned_for_its_own_namespace_only() {
    let p = provider(&["template-c0"]);
    let uid = "6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a";
    let own = format!("tenant_web2_restored_{uid}");
    assert_eq!(p.check_spec(&spec(&own)).unwrap(), own);
    // A hostile tenant names another namespace's restore product, or a
    // VM of the vCenter: refused as any unlisted name, before a clone.
    for image in [format!("other_web2_restored_{uid}"), "other_web2".to_owned(), "tenant_web".to_owned()] {
        let error = p.check_spec(&spec(&image)).unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidInput, "{image}");
        assert!(
            error.message.starts_with(&format!("spec.image: template {image:?} is not one this vCenter allows")),
            "{image}: {}",
            error.message
        );
    }
}

#[test]
fn options_networks_and_long_names_are_refused_before_anything_is_cloned() {
    let p = provider(&["t"]);
    let mut with_option = spec("t");
    with_option.options.insert("folder".into(), "x".into());
    let error = p.check_spec(&with_option).unwrap_err();
    assert!(error.message.starts_with("spec.providerOptions.folder:"), "{}", error.message);
    let mut with_network = spec("t");
    with_network.networks.push(vmlet_provider::NetworkRequest { name: "lan".into(), mac: None });
    assert!(p.check_spec(&with_network).unwrap_err().message.starts_with("spec.networks[0].name:"));
    let mut with_datastore = spec("t");
    with_datastore.options.insert("datastore".into(), "LocalDS_0".into());
    let error = p.check_spec(&with_datastore).unwrap_err();
    assert!(error.message.starts_with("spec.providerOptions.datastore:"), "{}", error.message);
    let mut long = spec("t");
    long.name = "n".repeat(80);
    assert!(p.check_spec(&long).unwrap_err().message.starts_with("metadata.name:"));
    assert!(p.check_spec(&spec("")).unwrap_err().message.starts_with("spec.image:"));
}

fn offering(datastore: Option<&str>, datastores: &[&str]) -> VsphereProvider {
    let mut p = provider(&["t"]);
    let vcenter = Arc::get_mut(&mut p.vcenter).expect("not shared yet");
    vcenter.options.datastore = datastore.map(str::to_owned);
    vcenter.options.datastores = datastores.iter().map(|d| (*d).to_owned()).collect();
    vcenter.options.networks = vec![
        NetworkOffer { name: "lan".into(), network: "VM Network".into(), namespaces: None },
        NetworkOffer { name: "dmz".into(), network: "DC0_DVPG0".into(), namespaces: Some(vec!["web".into()]) },
    ];
    p
}

#[test]
fn a_network_or_datastore_the_config_does_not_allow_is_refused_naming_the_field_and_the_allowed_ones() {
    let p = offering(Some("LocalDS_0"), &["ds-bulk"]);
    let mut lan = spec("t");
    lan.networks.push(vmlet_provider::NetworkRequest { name: "lan".into(), mac: None });
    assert_eq!(p.check_spec(&lan).unwrap(), "t");
    assert_eq!(p.networks_of(&lan).unwrap()[0].network, "VM Network");
    // dmz is offered to namespace web only: a VM of namespace tenant is refused, and not told of it.
    let mut dmz = spec("t");
    dmz.networks.push(vmlet_provider::NetworkRequest { name: "dmz".into(), mac: None });
    let error = p.check_spec(&dmz).unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidInput);
    assert_eq!(
        error.message,
        "spec.networks[0].name: \"dmz\" is not offered to namespace tenant by this vCenter (allowed: [lan]); use \
         one of them, or ask vmlet's administrator to add it to vcenters[].networks"
    );
    dmz.namespace = "web".into();
    assert!(p.check_spec(&dmz).is_ok());
    let mut with_mac = lan.clone();
    with_mac.networks[0].mac = Some("00:50:56:00:00:01".into());
    assert!(p.check_spec(&with_mac).unwrap_err().message.starts_with("spec.networks[0].macAddress:"));

    assert_eq!(p.datastore_of(&spec("t")).unwrap(), Some("LocalDS_0"), "the configured default");
    let mut bulk = spec("t");
    bulk.options.insert("datastore".into(), "ds-bulk".into());
    assert_eq!(p.datastore_of(&bulk).unwrap(), Some("ds-bulk"));
    let mut other = spec("t");
    other.options.insert("datastore".into(), "tenant-owned".into());
    let error = p.check_spec(&other).unwrap_err();
    assert_eq!(error.kind, ErrorKind::InvalidInput);
    assert_eq!(
        error.message,
        "spec.providerOptions.datastore: datastore \"tenant-owned\" is not one this vCenter allows (allowed: \
         [LocalDS_0, ds-bulk]); use one of them, or ask vmlet's administrator to add it to vcenters[].datastores"
    );
    assert_eq!(offering(None, &[]).datastore_of(&spec("t")).unwrap(), None, "the template's datastore");
}

#[test]
fn ceilings_above_the_size_turn_hot_add_on_and_a_running_vm_grows_only_within_them() {
    let hardware = hardware_of(1, 256 << 20, Some(2), Some(510 << 20));
    assert_eq!(hardware, Hardware { cpus: 1, memory_mib: 256, max_cpus: 2, max_memory_mib: 512 });
    assert_eq!(hardware_of(2, 256 << 20, Some(1), None).max_cpus, 2, "a ceiling below the size is the size");

    let mut on = vm(PowerState::PoweredOn, None);
    on.cpus = Some(1);
    on.memory_bytes = Some(256 << 20);
    on.sizing = crate::Sizing {
        cpu_hot_add: true,
        memory_hot_add: true,
        max_cpus: Some(2),
        max_memory_bytes: Some(512 << 20),
        ..Default::default()
    };
    assert!(has_hardware(&on, &hardware));
    let status = status_of(&on);
    assert_eq!((status.max_cpus, status.max_memory_bytes), (2, 512 << 20));
    assert!(check_live(&on, 2, 512).is_ok());
    let above = check_live(&on, 3, 512).unwrap_err();
    assert_eq!(above.kind, ErrorKind::InvalidInput);
    assert!(above.message.contains("ceilings (2 vCPUs, 512 MiB)"), "{}", above.message);
    let shrink = check_live(&on, 1, 128).unwrap_err();
    assert_eq!(shrink.kind, ErrorKind::Unsupported);
    assert!(shrink.message.ends_with("applies at its next start"), "{}", shrink.message);

    // No hot-add: the ceilings are the size, and growing is for the next start.
    let mut plain = on.clone();
    plain.sizing = crate::Sizing::default();
    let status = status_of(&plain);
    assert_eq!((status.max_cpus, status.max_memory_bytes), (1, 256 << 20));
    let error = check_live(&plain, 2, 256).unwrap_err();
    assert_eq!(error.kind, ErrorKind::Unsupported);
    assert!(error.message.contains("has no CPU hot-add"), "{}", error.message);
    // A size recorded for the next start is reported until it is the size.
    plain.sizing.next_cpus = Some(2);
    plain.sizing.next_memory_bytes = Some(256 << 20);
    assert_eq!(status_of(&plain).next_start, Some(Resources { cpus: 2, memory_bytes: 256 << 20 }));
    plain.cpus = Some(2);
    assert_eq!(status_of(&plain).next_start, None);
    assert!(!has_hardware(&plain, &hardware_of(2, 256 << 20, None, None)), "the record is removed too");
    let mut off = on.clone();
    off.power_state = PowerState::PoweredOff;
    assert_eq!(check_live(&off, 2, 256).unwrap_err().kind, ErrorKind::Unsupported);
}

#[test]
fn memory_is_rounded_up_to_the_4_mib_multiple_vsphere_requires() {
    assert_eq!(memory_mib_of(256 << 20), 256);
    assert_eq!(memory_mib_of((257 << 20) - 1), 260);
    assert_eq!(memory_mib_of(1), 4);
}

#[test]
fn a_host_disconnected_not_responding_or_in_maintenance_is_not_ready_saying_which() {
    let host = |state: ConnectionState, maintenance: bool| Host {
        name: "esx-1".into(),
        moref: MoRef::new("HostSystem", "host-1"),
        cluster: None,
        datacenter: "DC0".into(),
        cpu_cores: Some(8),
        memory_bytes: Some(1 << 35),
        connection_state: state,
        in_maintenance_mode: maintenance,
        resource_pool: None,
    };
    assert_eq!(not_ready_reason(&host(ConnectionState::Connected, false)), None);
    assert_eq!(
        not_ready_reason(&host(ConnectionState::Connected, true)).as_deref(),
        Some("ESXi host esx-1 is in maintenance mode")
    );
    assert_eq!(
        not_ready_reason(&host(ConnectionState::Disconnected, false)).as_deref(),
        Some("ESXi host esx-1 is disconnected from vCenter")
    );
    assert_eq!(
        not_ready_reason(&host(ConnectionState::NotResponding, true)).as_deref(),
        Some("ESXi host esx-1 is not responding to vCenter")
    );
}

#[test]
fn a_host_is_named_with_its_vcenter() {
    assert_eq!(provider(&[]).backend_host().as_deref(), Some("vc1/DC0_C0_H0"));
}
