//! The OpenStack provider against the real Nova API of the harness
//! (`hack/nova.sh up`): hosts, define, power, locate, restart, console,
//! undefine, refusals. Each test uses a namespace of its own and first
//! removes what an earlier run of it left there.

mod common;
use common::{count_everywhere, harness, remove, remove_leftovers, wait_power, MIB};

use std::time::Duration;

use vmlet_openstack::{HostState, HostStatus};
use vmlet_provider::{ErrorKind, ImageReference, Location, PowerState, Provider};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hypervisors_are_listed_with_capacity_zone_and_state() {
    let Some(h) = harness("hypervisors_are_listed_with_capacity_zone_and_state") else { return };
    let cloud = h.cloud().await;
    let hypervisors = cloud.hypervisors().await.expect("hypervisors");
    // The harness's fake driver (hack/nova/vmlet_fake_driver.py) gives each
    // host these, unless its environment says otherwise.
    let vcpus: u32 = std::env::var("VMLET_NOVA_HOST_VCPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let ram_mb: u64 = std::env::var("VMLET_NOVA_HOST_RAM_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(16384);
    for host in &h.hosts {
        let hv = hypervisors.iter().find(|hv| &hv.host == host).unwrap_or_else(|| panic!("{host} in {hypervisors:?}"));
        assert_eq!((hv.state, hv.status), (HostState::Up, HostStatus::Enabled), "{hv:?}");
        assert_eq!((hv.cpus, hv.memory_bytes), (vcpus, ram_mb * MIB), "{hv:?}");
        assert_eq!(hv.architecture, "amd64");
        assert_eq!(hv.hypervisor_type, "fake");
        let vcpu = hv.vcpu_inventory.expect("the harness has Placement");
        assert_eq!(vcpu.total, vcpus as u64);
        assert!(vcpu.allocation_ratio > 0.0, "{vcpu:?}");
        assert!(hv.availability_zone.is_some(), "{hv:?}");
    }
    // VMLET_NOVA_ZONES, e.g. nova-a=az1,nova-b=az1,nova-c=az2.
    if let Ok(zones) = std::env::var("VMLET_NOVA_ZONES") {
        for pair in zones.split(',') {
            let (host, zone) = pair.split_once('=').expect("host=zone");
            let hv = hypervisors.iter().find(|hv| hv.host == host).expect("host listed");
            assert_eq!(hv.availability_zone.as_deref(), Some(zone), "{hv:?}");
        }
    }
    let providers = h.providers(&cloud);
    let info = providers[0].host_info().await.expect("host_info");
    assert_eq!((info.cpus, info.memory_bytes, info.architecture.as_str()), (vcpus, ram_mb * MIB, "amd64"));
    assert!(info.hypervisor.starts_with("OpenStack Nova 2.") && info.hypervisor.ends_with("(fake)"), "{info:?}");
    assert!(info.storage_roots.is_empty() && info.accelerator.is_none());
    assert_eq!(providers[0].image_reference(), ImageReference::Catalog);
    for p in &providers {
        p.ping().await.unwrap_or_else(|e| panic!("ping {}: {e}", p.host()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defining_twice_gives_one_server_that_starts_stops_and_starts_again_with_the_same_id() {
    let Some(h) = harness("defining_twice_gives_one_server") else { return };
    const NS: &str = "vmlet-os-define";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let a = &providers[0];
    let spec = h.spec(NS, "twice");

    let first = common::define(a, &spec).await;
    let second = common::define(a, &spec).await;
    assert_eq!(first.backend_id, second.backend_id);
    assert_eq!(first.backend_name, spec.backend_name());
    assert_eq!(first.id, spec.id);
    assert_eq!(count_everywhere(&providers, &spec.id).await, 1);
    // 1 vCPU, 256 MiB: the harness's c1-m256 flavor is the smallest that fits.
    assert_eq!((first.cpus, first.memory_bytes), (1, 256 * MIB));
    // The spec's providerOptions.networks: one port, its fixed IP the address.
    assert_eq!((first.network_interfaces, first.addresses.len()), (1, 1), "{first:?}");
    // Nova boots what it creates; the provider stops it: defined means off.
    assert_eq!(first.power, PowerState::Off, "{first:?}");
    a.start(&spec.id).await.expect("first start");
    assert_eq!(a.get(&spec.id).await.expect("get").expect("here").power, PowerState::Running);

    a.shutdown(&spec.id).await.expect("shutdown");
    a.shutdown(&spec.id).await.expect("shutdown again (idempotent)");
    let off = wait_power(a, &spec.id, PowerState::Off).await;
    a.destroy(&spec.id).await.expect("destroy of a stopped server");
    a.start(&spec.id).await.expect("start");
    a.start(&spec.id).await.expect("start again (idempotent)");
    let on = a.get(&spec.id).await.expect("get").expect("here");
    assert_eq!(on.power, PowerState::Running);
    a.destroy(&spec.id).await.expect("destroy");
    let off_again = a.get(&spec.id).await.expect("get").expect("here");
    assert_eq!(off_again.power, PowerState::Off);
    a.start(&spec.id).await.expect("start after destroy");
    let on_again = wait_power(a, &spec.id, PowerState::Running).await;
    for status in [&off, &on, &off_again, &on_again] {
        assert_eq!(status.backend_id, first.backend_id, "the same server throughout");
    }

    // Crashed behind vmlet's back (Nova's ERROR): reported as Crashed, and
    // start brings it back (Nova refuses os-start in ERROR: a hard reboot).
    common::nova_action_behind_vmlet(&first.backend_id, serde_json::json!({"os-resetState": {"state": "error"}})).await;
    let crashed = wait_power(a, &spec.id, PowerState::Crashed).await;
    assert_eq!(crashed.stop_reason, Some(vmlet_provider::StopReason::Crashed));
    a.shutdown(&spec.id).await.expect("shutdown of a crashed server: nothing to do");
    a.start(&spec.id).await.expect("start from ERROR");
    assert_eq!(a.get(&spec.id).await.expect("get").expect("here").power, PowerState::Running);

    // Active: undefine refuses.
    let err = a.undefine(&spec.id).await.expect_err("undefine of a running server");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    remove(a, &spec.id).await;
    assert_eq!(a.get(&spec.id).await.expect("get"), None);
    assert_eq!(a.locate(&spec.id, &spec.backend_name()).await.expect("locate"), Location::Nowhere);
    a.undefine(&spec.id).await.expect("undefine of a deleted server is success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_host_locates_a_server_and_a_restarted_session_finds_all_without_creating() {
    let Some(h) = harness("every_host_locates_a_server") else { return };
    const NS: &str = "vmlet-os-locate";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let (a, b) = (&providers[0], &providers[1]);
    let on_a = h.spec(NS, "on-a");
    let on_b = h.spec(NS, "on-b");
    let defined_a = common::define(a, &on_a).await;
    let defined_b = common::define(b, &on_b).await;

    match a.locate(&on_a.id, &on_a.backend_name()).await.expect("locate") {
        Location::ThisHost(status) => assert_eq!(status.backend_id, defined_a.backend_id),
        other => panic!("{other:?}"),
    }
    assert_eq!(b.locate(&on_a.id, "").await.expect("locate"), Location::OtherHost(a.backend_host().unwrap()));
    assert_eq!(a.locate(&on_b.id, "").await.expect("locate"), Location::OtherHost(b.backend_host().unwrap()));
    assert_eq!(b.get(&on_a.id).await.expect("get"), None, "a's server is not b's");
    // Defining a's VM on b would make a twin: refused.
    let err = b.ensure_defined(&on_a).await.expect_err("twin on b");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    let err = b.start(&on_a.id).await.expect_err("start on the wrong host");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

    // vmlet restarts: a new session and new providers find both, create nothing.
    let restarted = h.cloud().await;
    let again = h.providers(&restarted);
    let listed_a: Vec<_> = again[0].list().await.expect("list a").into_iter().filter(|s| s.id == on_a.id).collect();
    let listed_b: Vec<_> = again[1].list().await.expect("list b").into_iter().filter(|s| s.id == on_b.id).collect();
    assert_eq!(listed_a.len(), 1);
    assert_eq!(listed_b.len(), 1);
    assert_eq!(listed_a[0].backend_id, defined_a.backend_id);
    assert_eq!(listed_b[0].backend_id, defined_b.backend_id);
    let redefined = common::define(&again[0], &on_a).await;
    assert_eq!(redefined.backend_id, defined_a.backend_id);
    assert_eq!(count_everywhere(&again, &on_a.id).await, 1);
    assert_eq!(count_everywhere(&again, &on_b.id).await, 1);

    remove(&again[0], &on_a.id).await;
    remove(&again[1], &on_b.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_output_is_nova_s_log_sliced_by_offset_with_a_boot_that_changes_on_start() {
    let Some(h) = harness("console_output_is_nova_s_log") else { return };
    const NS: &str = "vmlet-os-console";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    let a = &providers[0];
    let spec = h.spec(NS, "console");
    common::define(a, &spec).await;
    a.start(&spec.id).await.expect("start");
    let console = a.console().expect("console capability");

    let whole = console.console_output(&spec.id, 0, 1 << 20).await.expect("output");
    assert!(!whole.data.is_empty(), "{whole:?}");
    assert_eq!(whole.next_offset, whole.data.len() as u64);
    let text = String::from_utf8_lossy(&whole.data).into_owned();
    println!("console of {}: {text:?} (boot {})", spec.backend_name(), whole.boot);
    let part = console.console_output(&spec.id, 5, 4).await.expect("slice");
    assert_eq!(part.data, whole.data[5..9].to_vec());
    assert_eq!(part.next_offset, 9);
    assert_eq!(part.boot, whole.boot);
    let past = console.console_output(&spec.id, whole.next_offset, 100).await.expect("at the end");
    assert!(past.data.is_empty());

    a.destroy(&spec.id).await.expect("stop");
    a.start(&spec.id).await.expect("start");
    let rebooted = console.console_output(&spec.id, 0, 1 << 20).await.expect("output after start");
    assert_ne!(rebooted.boot, whole.boot, "a new boot after os-start");

    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    let io = vmlet_provider::StreamIo { stdin: None, stdout: Some(tx), stderr: None, tty: false, resize: None };
    let err = console.attach(&spec.id, io).await.expect_err("no attach");
    assert_eq!(err.kind, ErrorKind::Unsupported);
    assert!(err.message.starts_with("not supported by Nova: "), "{err}");
    assert!(a.guest_exec().is_none() && a.stats().is_none());
    remove(a, &spec.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_option_or_kernel_boot_is_refused_naming_the_field_and_nothing_is_created() {
    let Some(h) = harness("an_unknown_option_is_refused") else { return };
    const NS: &str = "vmlet-os-refuse";
    let cloud = h.cloud().await;
    let providers = h.providers(&cloud);
    let a = &providers[0];
    let mut spec = h.spec(NS, "typo");
    spec.options.insert("flavour".into(), "c1-m256".into());
    let err = a.ensure_defined(&spec).await.expect_err("unknown key");
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("spec.providerOptions.flavour"), "{err}");

    let mut spec = h.spec(NS, "kernel");
    spec.kernel_boot = Some(vmlet_provider::KernelBoot { kernel: "/boot/vmlinuz".into(), initrd: None, cmdline: None });
    let err = a.ensure_defined(&spec).await.expect_err("kernel boot");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");

    let mut spec = h.spec(NS, "no-flavor");
    spec.options.insert("flavor".into(), "no-such-flavor".into());
    let err = a.ensure_defined(&spec).await.expect_err("unknown flavor");
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("spec.providerOptions.flavor"), "{err}");

    let mut spec = h.spec(NS, "huge");
    spec.cpus = 64;
    let err = a.ensure_defined(&spec).await.expect_err("no flavor that big");
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("64 vCPUs"), "{err}");

    // An image by name: resolved when one image has it (the harness has no
    // Glance endpoint: through Nova's image proxy), refused when none or
    // several have it.
    for (name, why) in [("no-such-image", "no image named"), ("fakeimage123456", "images are named")] {
        let mut spec = h.spec(NS, "image");
        spec.image = Some(name.into());
        let err = a.ensure_defined(&spec).await.expect_err(name);
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains("spec.image") && err.message.contains(why), "{err}");
    }
    let mut spec = h.spec(NS, "by-name");
    spec.image = Some("fakeimage6".into());
    common::define(a, &spec).await;
    remove(a, &spec.id).await;

    // A named flavor must be the VM's size: a bigger one would run more
    // than Kubernetes counts (scheduler, ResourceQuota).
    let mut spec = h.spec(NS, "named");
    spec.options.insert("flavor".into(), "c2-m512".into());
    let refused = a.ensure_defined(&spec).await.expect_err("a flavor of another size");
    assert_eq!(refused.kind, ErrorKind::InvalidInput);
    assert!(refused.message.starts_with("spec.providerOptions.flavor: c2-m512 has 2 vCPUs and 512 MiB"), "{refused}");
    (spec.cpus, spec.memory_bytes) = (2, 512 * MIB);
    let named = common::define(a, &spec).await;
    assert_eq!((named.cpus, named.memory_bytes), (2, 512 * MIB));
    remove(a, &spec.id).await;
    assert!(a.list().await.expect("list").iter().all(|s| !s.backend_name.starts_with(NS)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_permission_denied_naming_keystone() {
    let Some(h) = harness("a_wrong_password_is_permission_denied") else { return };
    let mut config = h.config();
    if let vmlet_openstack::Credentials::Password { password, .. } = &mut config.credentials {
        *password = vmlet_openstack::Secret::new("certainly-not-the-password");
    } else {
        panic!("the harness cloud uses a password");
    }
    let err = vmlet_openstack::Cloud::connect(config, common::test_options()).await.expect_err("wrong password");
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("Keystone") && err.message.contains("401"), "{err}");
    assert!(!err.to_string().contains("certainly-not-the-password"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_opened_at_once_with_right_and_wrong_passwords_each_get_their_own_answer() {
    // Keystone records failed logins on the user and clears them on the next
    // good one: concurrent logins write the same row. Each session must still
    // see its own answer, never a server error turned into Transient.
    let Some(h) = harness("sessions_opened_at_once") else { return };
    let mut logins = tokio::task::JoinSet::new();
    for i in 0..12 {
        let mut config = h.config();
        let wrong = i % 3 == 0;
        if wrong {
            if let vmlet_openstack::Credentials::Password { password, .. } = &mut config.credentials {
                *password = vmlet_openstack::Secret::new("certainly-not-the-password");
            }
        }
        logins.spawn(async move { (wrong, vmlet_openstack::Cloud::connect(config, common::test_options()).await) });
    }
    let (mut accepted, mut refused) = (0, 0);
    while let Some(joined) = logins.join_next().await {
        match joined.expect("login task") {
            (false, Ok(_)) => accepted += 1,
            (true, Err(err)) if err.kind == ErrorKind::PermissionDenied => refused += 1,
            (wrong, Err(err)) => panic!("wrong password: {wrong}; {err}"),
            (true, Ok(_)) => panic!("a wrong password was accepted"),
        }
    }
    assert_eq!((accepted, refused), (8, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_transient_and_names_it() {
    // Needs no harness: a port on loopback where nothing listens.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let yaml = format!(
        "clouds: {{c: {{auth: {{auth_url: 'http://127.0.0.1:{port}/v3', username: u, password: p, user_domain_id: default, project_id: x}}}}}}"
    );
    let config = vmlet_openstack::CloudConfig::from_bytes(yaml.as_bytes(), "c").expect("config");
    let options = vmlet_openstack::CloudOptions { request_timeout: Duration::from_secs(5), ..Default::default() };
    let err = vmlet_openstack::Cloud::connect(config, options).await.expect_err("nothing listens");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains(&format!("127.0.0.1:{port}")) && err.message.contains("Keystone"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_failure_is_transient_and_says_tls_and_names_the_endpoint() {
    // Needs no harness: a loopback server that answers a TLS handshake with
    // plain text.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut stream, _)) = listener.accept() {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut hello = [0u8; 512];
            let _ = stream.read(&mut hello);
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let yaml = format!(
        "clouds: {{c: {{auth: {{auth_url: 'https://127.0.0.1:{port}/v3', username: u, password: p, user_domain_id: default, project_id: x}}}}}}"
    );
    let config = vmlet_openstack::CloudConfig::from_bytes(yaml.as_bytes(), "c").expect("config");
    let options = vmlet_openstack::CloudOptions { request_timeout: Duration::from_secs(5), ..Default::default() };
    let err = vmlet_openstack::Cloud::connect(config, options).await.expect_err("not TLS");
    server.join().expect("server thread");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.starts_with("TLS with Keystone at https://127.0.0.1:"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_2_74_a_server_is_placed_on_its_host_through_the_zone_form() {
    let Some(h) = harness("below_2_74_a_server_is_placed_through_the_zone_form") else { return };
    const NS: &str = "vmlet-os-zonehost";
    let options = vmlet_openstack::CloudOptions {
        max_microversion: vmlet_openstack::Microversion::parse("2.73"),
        ..common::test_options()
    };
    let cloud = vmlet_openstack::Cloud::connect(h.config(), options).await.expect("connect");
    assert_eq!(cloud.compute_microversion().await.expect("version").0.to_string(), "2.73");
    let providers = h.providers(&cloud);
    remove_leftovers(&providers, NS).await;
    // The last host: placement must come from the request, not luck.
    let last = providers.last().expect("hosts");
    let spec = h.spec(NS, "zone");
    let defined = common::define(last, &spec).await;
    assert_eq!(last.get(&spec.id).await.expect("get").map(|s| s.backend_id), Some(defined.backend_id));
    remove(last, &spec.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_user_is_told_that_vmlet_needs_the_admin_role() {
    let Some(h) = harness("a_member_user_is_told_that_vmlet_needs_the_admin_role") else { return };
    let (Ok(user), Ok(password), Ok(project)) = (
        std::env::var("VMLET_NOVA_USER_USERNAME"),
        std::env::var("VMLET_NOVA_USER_PASSWORD"),
        std::env::var("VMLET_NOVA_USER_PROJECT_NAME"),
    ) else {
        panic!("VMLET_NOVA_USER_* unset: `eval \"$(hack/nova.sh env)\"` sets them");
    };
    let admin = h.config();
    let yaml = format!(
        "clouds: {{m: {{auth: {{auth_url: '{}', username: {user}, password: {password:?}, user_domain_name: Default, \
         project_name: {project}, project_domain_name: Default}}, region_name: {}}}}}",
        admin.auth_url,
        admin.region.clone().unwrap_or_default()
    );
    let config = vmlet_openstack::CloudConfig::from_bytes(yaml.as_bytes(), "m").expect("member config");
    let cloud = vmlet_openstack::Cloud::connect(config, common::test_options()).await.expect("a member authenticates");
    let err = cloud.hypervisors().await.expect_err("os-hypervisors needs admin");
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("admin role"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_credential_authenticates_and_a_wrong_secret_is_refused() {
    let Some(h) = harness("an_application_credential_authenticates") else { return };
    let name = format!("vmlet-test-{}-{}", std::process::id(), common::unique_uid().1 % 1_000_000);
    let (id, secret) = common::create_application_credential(&name).await;
    let auth_url = std::env::var("OS_AUTH_URL").expect("OS_AUTH_URL");
    let clouds = |secret: &str| {
        format!(
            "clouds:\n  appcred:\n    auth_type: v3applicationcredential\n    auth:\n      auth_url: {auth_url}\n      \
             application_credential_id: {id}\n      application_credential_secret: {secret:?}\n    \
             region_name: RegionOne\n    interface: public\n"
        )
    };
    let config = vmlet_openstack::CloudConfig::from_bytes(clouds(&secret).as_bytes(), "appcred").expect("parse");
    assert!(!format!("{config:?}").contains(&secret), "the secret is redacted");
    let cloud = vmlet_openstack::Cloud::connect(config, common::test_options()).await.expect("authenticate");
    let hosts: Vec<String> = cloud.hypervisors().await.expect("hypervisors").iter().map(|hv| hv.host.clone()).collect();
    for host in &h.hosts {
        assert!(hosts.contains(host), "{host} in {hosts:?}");
    }
    let wrong =
        vmlet_openstack::CloudConfig::from_bytes(clouds("not-the-secret").as_bytes(), "appcred").expect("parse");
    let Err(refused) = vmlet_openstack::Cloud::connect(wrong, common::test_options()).await else {
        panic!("a wrong application credential secret was accepted")
    };
    assert_eq!(refused.kind, ErrorKind::PermissionDenied, "{refused}");
}
