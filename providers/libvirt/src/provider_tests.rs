//! [`LibvirtProvider`] against libvirt's test driver, opened in-process from the
//! inventories in `test-vms/hosts/` (no daemon). Each open is a private copy of
//! the file, so every test starts from the inventory and none sees another's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use vmlet_provider::{
    ErrorKind, Location, Migration, MigrationMode, MigrationTarget, PowerState, Provider, ResizeScope, Resources, VmId,
    VmSpec, VmStatus,
};

use super::LibvirtProvider;
use crate::domains::identity_of;
use crate::xml::METADATA_NS;

const GIB: u64 = 1024 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;

/// `test:///<absolute path>` for one of the inventories in `test-vms/hosts/`.
fn host_uri(host: &str) -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../test-vms/hosts").join(format!("{host}.xml"));
    let path = path.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    format!("test://{}", path.display())
}

async fn host(host: &str) -> LibvirtProvider {
    LibvirtProvider::connect(&host_uri(host)).await.expect("open test driver")
}

/// A spec with a fresh uid: 1 vCPU, 256 MiB, no image.
fn vm(namespace: &str, name: &str) -> VmSpec {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    VmSpec {
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
        id: VmId(format!("00000000-0000-4000-8000-{n:012x}")),
        namespace: namespace.into(),
        name: name.into(),
        cpus: 1,
        memory_bytes: 256 * MIB,
        max_cpus: None,
        max_memory_bytes: None,
        image: None,
        image_backing_chain: None,
        kernel_boot: None,
    }
}

/// Define a domain on `provider`'s connection without vmlet's metadata, as
/// another tool would.
fn define_foreign_domain(provider: &LibvirtProvider, name: &str) {
    let xml = format!(
        "<domain type='test'><name>{name}</name><memory unit='KiB'>65536</memory>\
         <vcpu>1</vcpu><os><type>hvm</type></os></domain>"
    );
    provider.host.connection.with(|conn| conn.define_domain_xml(&xml).map(drop).map_err(|e| panic!("{e}"))).unwrap();
}

#[tokio::test]
async fn provider_kind_is_libvirt() {
    assert_eq!(host("host-a").await.kind(), "libvirt");
}

#[tokio::test]
async fn host_info_equals_the_inventory() {
    for (name, cpus, memory) in [("host-a", 8, 16 * GIB), ("host-b", 4, 8 * GIB), ("host-c", 16, 32 * GIB)] {
        let info = host(name).await.host_info().await.expect("host info");
        assert_eq!(info.cpus, cpus, "{name}");
        assert_eq!(info.memory_bytes, memory, "{name}");
        assert_eq!(info.architecture, "amd64", "{name}");
        let version = virt::connect::Connect::version().expect("libvirt version");
        let expected =
            format!("libvirt {}.{}.{} (TEST)", version / 1_000_000, version / 1_000 % 1_000, version % 1_000);
        assert_eq!(info.hypervisor, expected, "{name}");
    }
}

#[tokio::test]
async fn a_host_without_a_default_pool_reports_libvirts_images_directory_as_storage_root() {
    // The inventories in test-vms/hosts define no pool; test:///default has one
    // named `default-pool`, which is not the pool named `default`.
    for uri in [host_uri("host-a"), "test:///default".to_owned()] {
        let provider = LibvirtProvider::connect(&uri).await.expect("open test driver");
        let info = provider.host_info().await.expect("host info");
        assert_eq!(info.storage_roots, vec!["/var/lib/libvirt/images".to_owned()], "{uri}");
    }
}

#[tokio::test]
async fn a_host_with_a_default_pool_reports_its_target_directory_as_storage_root() {
    // A test-driver inventory whose storage pool `default` targets a directory
    // with an XML special in its name (libvirt escapes it in the pool's XML).
    let inventory = std::env::temp_dir().join(format!("vmlet-default-pool-{}.xml", std::process::id()));
    std::fs::write(
        &inventory,
        "<node>\n  <cpu><mhz>2400</mhz><model>x86_64</model><nodes>1</nodes><sockets>1</sockets>\
         <cores>1</cores><threads>1</threads><active>1</active></cpu>\n  <memory>1048576</memory>\n  \
         <pool type='dir'>\n    <name>default</name>\n    <target><path>/srv/vm&amp;images</path></target>\n  \
         </pool>\n</node>\n",
    )
    .expect("write inventory");
    let provider = LibvirtProvider::connect(&format!("test://{}", inventory.display())).await;
    let _ = std::fs::remove_file(&inventory);
    let info = provider.expect("open test driver").host_info().await.expect("host info");
    assert_eq!(info.storage_roots, vec!["/srv/vm&images".to_owned()]);
}

#[tokio::test]
async fn ping_answers_while_connected() {
    host("host-b").await.ping().await.expect("ping");
}

#[tokio::test]
async fn connecting_to_a_missing_inventory_fails() {
    let err = LibvirtProvider::connect("test:///nonexistent/vmlet-host.xml").await.err();
    let err = err.expect("missing inventory must not open");
    assert_eq!(err.operation, "connect to libvirt");
    assert!(err.source.is_some(), "libvirt error kept as source");
}

#[tokio::test]
async fn a_provider_option_is_refused_by_name_and_defines_nothing() {
    let provider = host("host-b").await;
    let mut spec = vm("team-a", "options");
    spec.options.insert("flavor".into(), "m1.small".into());
    let error = provider.ensure_defined(&spec).await.expect_err("libvirt reads no provider options");
    assert_eq!(error.kind, ErrorKind::InvalidInput);
    assert!(error.message.starts_with("spec.providerOptions.flavor: "), "{}", error.message);
    assert_eq!(provider.get(&spec.id).await.expect("get"), None);
}

#[tokio::test]
async fn the_test_driver_defines_a_vm_with_cloud_init_without_writing_a_seed() {
    let seeds = std::env::temp_dir().join(format!("vmlet-seeds-{}-test-driver", std::process::id()));
    let provider = host("host-b").await.with_seed_dir(seeds.clone());
    let mut spec = vm("team-a", "seeded");
    spec.cloud_init = Some(vmlet_provider::CloudInit {
        instance_id: spec.id.0.clone(),
        hostname: "seeded".into(),
        user_data: b"#cloud-config\n".to_vec(),
        network_config: None,
    });
    provider.ensure_defined(&spec).await.expect("define");
    assert!(!seeds.exists(), "a test-driver domain has no guest to read a seed");
}

#[tokio::test]
async fn ensure_defined_writes_name_shape_and_identity() {
    let provider = host("host-a").await;
    let mut spec = vm("team-a", "web.1-x");
    spec.cpus = 2;
    spec.memory_bytes = 512 * MIB + 1; // rounds up to the next KiB

    let status = provider.ensure_defined(&spec).await.expect("define");
    assert_eq!(status.id, spec.id);
    assert_eq!(status.backend_name, "team-a_web.1-x");
    assert_eq!(status.backend_id.len(), 36, "a UUID string: {}", status.backend_id);
    assert_eq!(status.power, PowerState::Off);
    assert_eq!(status.cpus, 2);
    assert_eq!(status.memory_bytes, 512 * MIB + 1024);
    assert!(status.addresses.is_empty());

    // The identity is in the domain's metadata, in vmlet's namespace.
    let element = provider
        .host
        .connection
        .with(|conn| {
            let domain = conn.lookup_domain_by_name("team-a_web.1-x").unwrap();
            Ok(domain.metadata(virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32, Some(METADATA_NS), 0).unwrap())
        })
        .unwrap();
    assert!(element.contains(&format!("uid=\"{}\"", spec.id)), "{element}");
    assert!(element.contains("namespace=\"team-a\""), "{element}");
    assert!(element.contains("name=\"web.1-x\""), "{element}");
}

#[tokio::test]
async fn identity_is_found_again_through_metadata_alone() {
    let provider = host("host-a").await;
    let spec = vm("team-a", "db");
    let defined = provider.ensure_defined(&spec).await.expect("define");

    // Forget the uid -> UUID cache, as a restarted vmlet would.
    provider.host.uuids.replace(HashMap::new());
    let found = provider.get(&spec.id).await.expect("get").expect("found by metadata");
    assert_eq!(found, defined);

    let identity = provider
        .host
        .connection
        .with(|conn| {
            let domain = conn.lookup_domain_by_uuid_string(&defined.backend_id).unwrap();
            Ok(identity_of(&domain).unwrap())
        })
        .unwrap()
        .expect("identity");
    assert_eq!((identity.id, identity.namespace, identity.name), (spec.id, "team-a".into(), "db".into()));
}

#[tokio::test]
async fn ensure_defined_again_returns_the_existing_domain_unchanged() {
    let provider = host("host-b").await;
    let spec = vm("ns", "app");
    let first = provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");

    let mut resized = spec.clone();
    resized.cpus = 4;
    resized.memory_bytes = GIB;
    let again = provider.ensure_defined(&resized).await.expect("define again");
    assert_eq!(again.backend_id, first.backend_id);
    assert_eq!(again.cpus, 1, "no resize");
    assert_eq!(again.memory_bytes, 256 * MIB, "no resize");
    assert_eq!(again.power, PowerState::Running, "no restart");
    assert_eq!(provider.list().await.expect("list").len(), 1);
}

#[tokio::test]
async fn lifecycle_operations_are_idempotent() {
    let provider = host("host-a").await;
    let spec = vm("ns", "cycle");
    let id = &spec.id;
    provider.ensure_defined(&spec).await.expect("define");
    let power = |p: &LibvirtProvider| {
        let p = p.clone();
        let id = id.clone();
        async move { p.get(&id).await.expect("get").expect("defined").power }
    };

    provider.start(id).await.expect("start");
    provider.start(id).await.expect("start a running VM");
    assert_eq!(power(&provider).await, PowerState::Running);

    provider.shutdown(id).await.expect("shutdown");
    assert_eq!(power(&provider).await, PowerState::Off, "the test driver stops at once");
    provider.shutdown(id).await.expect("shutdown a stopped VM");

    provider.start(id).await.expect("start again");
    provider.destroy(id).await.expect("destroy");
    provider.destroy(id).await.expect("destroy a stopped VM");
    assert_eq!(power(&provider).await, PowerState::Off);

    provider.undefine(id).await.expect("undefine");
    provider.undefine(id).await.expect("undefine a missing VM");
    assert_eq!(provider.get(id).await.expect("get"), None);
    assert!(provider.list().await.expect("list").is_empty());

    let err = provider.start(id).await.expect_err("start of an undefined VM");
    assert_eq!(err.kind, ErrorKind::NotFound);
    provider.shutdown(id).await.expect("shutdown of a missing VM is a no-op");
    provider.destroy(id).await.expect("destroy of a missing VM is a no-op");
}

#[tokio::test]
async fn undefine_refuses_an_active_vm() {
    let provider = host("host-a").await;
    let spec = vm("ns", "busy");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");

    let err = provider.undefine(&spec.id).await.expect_err("undefine while running");
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert_eq!(provider.get(&spec.id).await.expect("get").expect("still defined").power, PowerState::Running);
}

#[tokio::test]
async fn name_taken_by_a_foreign_domain_is_a_permanent_error() {
    let provider = host("host-a").await;
    define_foreign_domain(&provider, "ns_taken");

    let err = provider.ensure_defined(&vm("ns", "taken")).await.expect_err("name conflict");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(err.message.contains("ns_taken"), "{}", err.message);
    assert!(err.message.contains("no vmlet identity"), "{}", err.message);
    assert!(err.message.contains("virsh undefine"), "{}", err.message);
    assert!(provider.list().await.expect("list").is_empty());
}

#[tokio::test]
async fn name_taken_by_another_vm_identity_is_a_permanent_error() {
    let provider = host("host-a").await;
    let old = vm("ns", "reused");
    provider.ensure_defined(&old).await.expect("define");

    let new = vm("ns", "reused"); // same name, new uid: the object was recreated
    let err = provider.ensure_defined(&new).await.expect_err("name conflict");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(err.message.contains(&old.id.0), "{}", err.message);
    assert_eq!(provider.get(&new.id).await.expect("get"), None);
}

#[tokio::test]
async fn list_ignores_domains_without_vmlet_metadata() {
    // host-c's inventory holds "legacy-appliance", which vmlet did not create.
    let provider = host("host-c").await;
    define_foreign_domain(&provider, "hand-made");
    assert!(provider.list().await.expect("list").is_empty());

    let spec = vm("ns", "mine");
    provider.ensure_defined(&spec).await.expect("define");
    let listed = provider.list().await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, spec.id);
    assert_eq!(listed[0].backend_name, "ns_mine");
}

#[tokio::test]
async fn domain_undefined_behind_vmlets_back_is_gone() {
    let provider = host("host-b").await;
    let spec = vm("ns", "vanishing");
    let status = provider.ensure_defined(&spec).await.expect("define");

    provider
        .host
        .connection
        .with(|conn| {
            conn.lookup_domain_by_uuid_string(&status.backend_id).unwrap().undefine().unwrap();
            Ok(())
        })
        .unwrap();
    // The cached UUID is stale now; get must verify it, not trust it.
    assert_eq!(provider.get(&spec.id).await.expect("get"), None);
    // And the name is free again.
    let again = provider.ensure_defined(&spec).await.expect("define again");
    assert_ne!(again.backend_id, status.backend_id);
}

#[tokio::test]
async fn specs_libvirt_cannot_express_are_invalid_input() {
    let provider = host("host-a").await;
    let mut no_cpus = vm("ns", "zero");
    no_cpus.cpus = 0;
    let mut tiny = vm("ns", "tiny");
    tiny.memory_bytes = 4096;
    for spec in [no_cpus, tiny] {
        let err = provider.ensure_defined(&spec).await.expect_err("invalid spec");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{}", spec.name);
    }
    assert!(provider.list().await.expect("list").is_empty());
}

#[tokio::test]
async fn test_driver_has_no_console_and_no_guest_exec() {
    let provider = host("host-a").await;
    assert!(provider.console().is_none(), "the test driver has no console");
    assert!(provider.guest_exec().is_none(), "the test driver has no guest agent");
}

#[tokio::test]
async fn test_driver_reports_stats_of_running_vms() {
    let provider = host("host-a").await;
    let spec = vm("ns", "measured");
    provider.ensure_defined(&spec).await.expect("define");
    let stats = provider.stats().expect("stats on the test driver");
    let err = stats.stats(&spec.id).await.expect_err("stats of a stopped VM");
    assert_eq!(err.kind, ErrorKind::Transient);

    provider.start(&spec.id).await.expect("start");
    let usage = stats.stats(&spec.id).await.expect("stats");
    assert!(usage.memory_working_set_bytes > 0 && usage.memory_working_set_bytes <= 256 * MIB, "{usage:?}");

    let err = stats.stats(&VmId("00000000-0000-4000-8000-ffffffffffff".into())).await.expect_err("unknown VM");
    assert_eq!(err.kind, ErrorKind::NotFound);
}

#[tokio::test]
async fn locate_finds_a_vm_on_its_host_by_its_name_and_nowhere_else() {
    let a = host("host-a").await;
    let b = host("host-b").await;
    let spec = vm("team-a", "located");
    a.ensure_defined(&spec).await.expect("define");
    let name = spec.backend_name();
    match a.locate(&spec.id, &name).await.expect("locate on a") {
        Location::ThisHost(status) => assert_eq!(status.id, spec.id),
        other => panic!("expected ThisHost, got {other:?}"),
    }
    assert_eq!(b.locate(&spec.id, &name).await.expect("locate on b"), Location::NotOnThisHost);
    // The name alone is not enough: the domain must carry the identity.
    let other = vm("team-a", "other");
    assert_eq!(a.locate(&other.id, &name).await.expect("locate another id"), Location::NotOnThisHost);
}

/// [`vm`] with hot-plug ceilings: 1 vCPU of at most 2, 256 MiB of at most 512.
fn vm_with_ceilings(namespace: &str, name: &str) -> VmSpec {
    VmSpec { max_cpus: Some(2), max_memory_bytes: Some(512 * MIB), ..vm(namespace, name) }
}

fn resources(cpus: u32, memory_mib: u64) -> Resources {
    Resources { cpus, memory_bytes: memory_mib * MIB }
}

async fn status(provider: &LibvirtProvider, id: &VmId) -> VmStatus {
    provider.get(id).await.expect("get").expect("defined")
}

#[tokio::test]
async fn a_vm_defined_with_ceilings_reports_its_size_and_ceilings() {
    let provider = host("host-a").await;
    let spec = vm_with_ceilings("ns", "ceilings");
    let defined = provider.ensure_defined(&spec).await.expect("define");
    assert_eq!(
        (defined.cpus, defined.max_cpus, defined.memory_bytes, defined.max_memory_bytes, defined.next_start),
        (1, 2, 256 * MIB, 512 * MIB, None)
    );
    provider.start(&spec.id).await.expect("start");
    let running = status(&provider, &spec.id).await;
    assert_eq!(
        (running.cpus, running.max_cpus, running.memory_bytes, running.max_memory_bytes, running.next_start),
        (1, 2, 256 * MIB, 512 * MIB, None)
    );

    // Without ceilings, the size is the ceiling.
    let plain = provider.ensure_defined(&vm("ns", "plain")).await.expect("define");
    assert_eq!((plain.max_cpus, plain.max_memory_bytes), (plain.cpus, plain.memory_bytes));
}

#[tokio::test]
async fn live_resize_grows_and_shrinks_a_running_vm_within_its_ceilings() {
    let provider = host("host-a").await;
    let spec = vm_with_ceilings("ns", "grow");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");
    let resize = provider.resize().expect("resize on the test driver");

    resize.resize(&spec.id, resources(2, 384), resources(2, 512), ResizeScope::Live).await.expect("grow");
    let grown = status(&provider, &spec.id).await;
    assert_eq!((grown.cpus, grown.memory_bytes, grown.next_start), (2, 384 * MIB, None), "{grown:?}");
    assert_eq!((grown.max_cpus, grown.max_memory_bytes), (2, 512 * MIB), "ceilings unchanged");
    assert_eq!(grown.power, PowerState::Running, "no restart");

    // Idempotent.
    resize.resize(&spec.id, resources(2, 384), resources(2, 512), ResizeScope::Live).await.expect("again");
    assert_eq!(status(&provider, &spec.id).await, grown);

    // Up to the ceilings exactly, and back down (the test driver has no guest
    // whose memory use could forbid it).
    resize.resize(&spec.id, resources(2, 512), resources(2, 512), ResizeScope::Live).await.expect("to the ceiling");
    assert_eq!(status(&provider, &spec.id).await.memory_bytes, 512 * MIB);
    resize.resize(&spec.id, resources(1, 256), resources(2, 512), ResizeScope::Live).await.expect("shrink");
    let shrunk = status(&provider, &spec.id).await;
    assert_eq!((shrunk.cpus, shrunk.memory_bytes, shrunk.next_start), (1, 256 * MIB, None), "{shrunk:?}");

    // The definition changed too: the next start keeps the size.
    resize.resize(&spec.id, resources(2, 384), resources(2, 512), ResizeScope::Live).await.expect("grow again");
    provider.destroy(&spec.id).await.expect("destroy");
    provider.start(&spec.id).await.expect("start again");
    let restarted = status(&provider, &spec.id).await;
    assert_eq!((restarted.cpus, restarted.memory_bytes), (2, 384 * MIB), "{restarted:?}");
}

#[tokio::test]
async fn live_resize_beyond_a_ceiling_is_invalid_input_and_changes_nothing() {
    let provider = host("host-b").await;
    let spec = vm_with_ceilings("ns", "capped");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");
    let before = status(&provider, &spec.id).await;
    let resize = provider.resize().expect("resize");

    let err = resize.resize(&spec.id, resources(3, 256), resources(4, 512), ResizeScope::Live).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("ceiling of 2 vCPUs (maxCpu)") && err.message.contains("restarted"), "{err}");
    let err = resize.resize(&spec.id, resources(1, 513), resources(4, 1024), ResizeScope::Live).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("ceiling of 512 MiB (maxMemory)"), "{err}");
    assert_eq!(status(&provider, &spec.id).await, before);
}

#[tokio::test]
async fn live_resize_needs_a_running_vm_and_a_known_one() {
    let provider = host("host-a").await;
    let spec = vm_with_ceilings("ns", "stopped");
    provider.ensure_defined(&spec).await.expect("define");
    let resize = provider.resize().expect("resize");
    let err = resize.resize(&spec.id, resources(2, 256), resources(2, 512), ResizeScope::Live).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
    assert!(err.message.contains("not running"), "{err}");

    let unknown = VmId("00000000-0000-4000-8000-fffffffffffe".into());
    let err = resize.resize(&unknown, resources(1, 256), resources(1, 256), ResizeScope::NextStart).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
}

#[tokio::test]
async fn next_start_resize_shows_in_status_and_takes_effect_at_the_next_start() {
    let provider = host("host-c").await;
    let spec = vm_with_ceilings("ns", "later");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");
    let resize = provider.resize().expect("resize");

    // Beyond the running VM's ceilings: fine for the next start, with new ones.
    resize.resize(&spec.id, resources(3, 768), resources(4, 1024), ResizeScope::NextStart).await.expect("resize");
    let running = status(&provider, &spec.id).await;
    assert_eq!((running.cpus, running.memory_bytes), (1, 256 * MIB), "the running VM keeps its size");
    assert_eq!((running.max_cpus, running.max_memory_bytes), (2, 512 * MIB), "and its ceilings");
    assert_eq!(running.next_start, Some(resources(3, 768)));
    resize.resize(&spec.id, resources(3, 768), resources(4, 1024), ResizeScope::NextStart).await.expect("again");
    assert_eq!(status(&provider, &spec.id).await, running, "idempotent");

    provider.destroy(&spec.id).await.expect("destroy");
    provider.start(&spec.id).await.expect("start");
    let restarted = status(&provider, &spec.id).await;
    assert_eq!(
        (restarted.cpus, restarted.memory_bytes, restarted.max_cpus, restarted.max_memory_bytes, restarted.next_start),
        (3, 768 * MIB, 4, 1024 * MIB, None)
    );
}

#[tokio::test]
async fn next_start_resize_lowers_ceilings_and_raises_ceilings_below_the_size() {
    let provider = host("host-b").await;
    let mut spec = vm("ns", "lower");
    (spec.cpus, spec.memory_bytes, spec.max_cpus, spec.max_memory_bytes) = (2, 512 * MIB, Some(4), Some(GIB));
    provider.ensure_defined(&spec).await.expect("define");
    let resize = provider.resize().expect("resize");

    resize.resize(&spec.id, resources(1, 256), resources(1, 256), ResizeScope::NextStart).await.expect("lower");
    let lowered = status(&provider, &spec.id).await;
    assert_eq!(
        (lowered.cpus, lowered.memory_bytes, lowered.max_cpus, lowered.max_memory_bytes, lowered.next_start),
        (1, 256 * MIB, 1, 256 * MIB, None),
        "an inactive VM's definition is what it has"
    );

    // Ceilings below the size are the size.
    resize.resize(&spec.id, resources(2, 384), resources(1, 256), ResizeScope::NextStart).await.expect("raise");
    let raised = status(&provider, &spec.id).await;
    assert_eq!(
        (raised.cpus, raised.memory_bytes, raised.max_cpus, raised.max_memory_bytes),
        (2, 384 * MIB, 2, 384 * MIB)
    );
}

#[tokio::test]
async fn test_driver_cannot_migrate() {
    let provider = host("host-a").await;
    assert!(provider.migration().is_none(), "the test driver has no migration");
    let spec = vm("ns", "stay");
    provider.ensure_defined(&spec).await.expect("define");
    let to = MigrationTarget { host: "host-b".into(), address: "test:///default".into() };
    let err =
        Migration::migrate(&provider, &spec.id, &to, MigrationMode::Cold, Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
    assert!(provider.get(&spec.id).await.expect("get").is_some(), "still here");
}

/// `future`'s output if one poll gives it; `None` while it is pending (it
/// is kept, to be awaited later).
async fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> Option<F::Output> {
    tokio::select! {
        biased;
        output = future => Some(output),
        () = std::future::ready(()) => None,
    }
}

#[tokio::test]
async fn a_vm_whose_agent_calls_wait_takes_one_host_permit_and_others_get_theirs() {
    let provider = host("host-a").await;
    let (slow, other, third) = (VmId("slow".into()), VmId("other".into()), VmId("third".into()));
    let first = provider.agent_turn("test", &slow).await.unwrap();
    // A second call of the same VM waits for the first (its own queue), and
    // so holds no host permit while it waits.
    let mut second = Box::pin(provider.agent_turn("test", &slow));
    assert!(poll_once(&mut second).await.is_none(), "one call per VM at a time");
    let turn = poll_once(&mut Box::pin(provider.agent_turn("test", &other))).await;
    let turn = turn.expect("the host's second permit is free for another VM").unwrap();
    // Both host permits are taken now: a third VM waits its turn.
    let mut waiting = Box::pin(provider.agent_turn("test", &third));
    assert!(poll_once(&mut waiting).await.is_none());
    drop(turn);
    let _third = waiting.await.unwrap();
    drop(first);
    let _second = second.await.unwrap();
}

/// The next change `changes` pushes within 10 s (the test driver queues its
/// events on libvirt's event loop, which delivers them within milliseconds).
async fn next_change(changes: &mut tokio::sync::broadcast::Receiver<vmlet_provider::Change>) -> vmlet_provider::Change {
    tokio::time::timeout(Duration::from_secs(10), changes.recv())
        .await
        .expect("a change within 10 s")
        .expect("the channel is open and did not lag")
}

/// The changes pushed before `marker`'s: libvirt delivers a connection's
/// events in order, so once the change of `marker` (a VM vmlet knows, whose
/// power `flip` changes) arrives, every earlier event has been delivered.
async fn changes_before(
    changes: &mut tokio::sync::broadcast::Receiver<vmlet_provider::Change>,
    marker: &VmId,
    flip: impl std::future::Future<Output = vmlet_provider::Result<()>>,
) -> Vec<vmlet_provider::Change> {
    flip.await.expect("flip the marker VM's power");
    let mut before = Vec::new();
    loop {
        match next_change(changes).await {
            vmlet_provider::Change::Vm(id) if id == *marker => return before,
            change => before.push(change),
        }
    }
}

#[tokio::test]
async fn power_changes_are_pushed_even_when_made_behind_vmlets_back() {
    use vmlet_provider::Change;
    let provider = host("host-a").await;
    let mut changes = provider.changes().expect("the test driver has domain events");
    let marker = vm("ns", "marker");
    provider.ensure_defined(&marker).await.expect("define the marker");
    // Its definition's event, taken here so that no event of the marker is
    // still on its way when it serves as one below.
    assert_eq!(next_change(&mut changes).await, Change::Vm(marker.id.clone()), "the definition was pushed");

    let spec = vm("ns", "pushed");
    let status = provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("start");
    let before = changes_before(&mut changes, &marker.id, provider.start(&marker.id)).await;
    assert!(before.contains(&Change::Vm(spec.id.clone())), "its start was pushed: {before:?}");
    assert!(before.iter().all(|c| *c == Change::Vm(spec.id.clone())), "only its own changes: {before:?}");

    // Another tool stops the domain: the core hears of it without polling.
    provider
        .host
        .connection
        .with(|conn| {
            conn.lookup_domain_by_uuid_string(&status.backend_id).unwrap().destroy().unwrap();
            Ok(())
        })
        .unwrap();
    assert_eq!(next_change(&mut changes).await, Change::Vm(spec.id.clone()), "destroyed behind vmlet's back");
    assert_eq!(provider.get(&spec.id).await.unwrap().unwrap().power, PowerState::Off);

    // A domain that is not vmlet's is nobody's business here.
    define_foreign_domain(&provider, "foreign-pushed");
    let before = changes_before(&mut changes, &marker.id, provider.destroy(&marker.id)).await;
    assert_eq!(before, vec![], "nothing is pushed for a foreign domain");
}
