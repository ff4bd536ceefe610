//! The provider conformance suite (`vmlet-provider-conformance`) against
//! libvirt: its test driver (two in-memory hosts from `test-vms/hosts/`) and
//! two real libvirtd with QEMU guests (mig-a and mig-b of `hack/hosts.sh`,
//! root only, as in `migration.rs`). Each run also checks the README's
//! capability matrix row for the subject (`VMLET_BLESS_MATRIX=1` rewrites it).

mod common;
use common::guest::{guest_accelerator, guest_dir, remove_leftovers, RunDir};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{Provider, VmSpec};
use vmlet_provider_conformance::{check_readme_row, run, Declared, Subject};

const MIB: u64 = 1 << 20;

fn readme() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")
}

fn test_driver_uri(host: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../test-vms/hosts").join(format!("{host}.xml"));
    format!("test://{}", path.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", path.display())).display())
}

/// A spec unique to this run in `namespace`: 1 vCPU, 256 MiB, ceilings 2 and
/// 512 MiB.
fn spec(namespace: &str, what: &str) -> VmSpec {
    VmSpec { max_cpus: Some(2), max_memory_bytes: Some(512 * MIB), ..common::unique_spec(namespace, what) }
}

#[tokio::test]
async fn the_test_driver_conforms() {
    let mut hosts: Vec<Arc<dyn Provider>> = Vec::new();
    for host in ["host-a", "host-b"] {
        let provider = LibvirtProvider::connect(&test_driver_uri(host)).await.expect("open the test driver");
        hosts.push(Arc::new(provider.with_host_name(host)));
    }
    let subject = Subject {
        name: "libvirt (test driver)".into(),
        hosts,
        new_spec: Box::new(|what| spec("conformance", what)),
        // Each connection to test:///<file> is a world of its own.
        reconnect: None,
        unreachable: None,
        denied: None,
        declared: Declared {
            soft_stop: true,
            sees_whole_backend: false,
            resize_live: true,
            resize_next_start: true,
            migrate_live: false,
            migrate_cold: false,
            console_output: false,
        },
        deadline: Duration::from_secs(30),
    };
    let report = run(&subject).await;
    println!("{report}");
    report.assert_passed();
    check_readme_row(&readme(), &report).unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_qemu_hosts_conform() {
    let Some((uri_a, uri_b)) = common::two_hosts("real_qemu_hosts_conform") else { return };
    let guest = guest_dir();
    let accelerator = guest_accelerator(&guest);
    let namespace = "vmlet-conformance";
    let connect = move |uris: [(String, &'static str); 2]| async move {
        let mut hosts: Vec<Arc<dyn Provider>> = Vec::new();
        for (uri, name) in uris {
            let provider = LibvirtProvider::connect_with(&uri, accelerator).await.expect("connect");
            hosts.push(Arc::new(provider.with_host_name(name)));
        }
        hosts
    };
    let uris = [(uri_a.clone(), "mig-a"), (uri_b.clone(), "mig-b")];
    for (uri, name) in &uris {
        let provider = LibvirtProvider::connect_with(uri, accelerator).await.expect("connect").with_host_name(*name);
        remove_leftovers(&provider, namespace).await;
    }
    // One copy of the guest's kernel and initramfs serves every VM of the run.
    let run_dir = Arc::new(RunDir::new(&guest, namespace, &["vmlinuz", "initrd.img"]));
    let boot = run_dir.kernel_boot(&guest);
    let subject = Subject {
        name: "libvirt (QEMU)".into(),
        hosts: connect(uris.clone()).await,
        new_spec: Box::new(move |what| VmSpec { kernel_boot: Some(boot.clone()), ..spec(namespace, what) }),
        reconnect: Some(Box::new(move || Box::pin(connect(uris.clone())))),
        // A libvirt provider exists only once connected; a closed port is
        // checked below, at connect.
        unreachable: None,
        denied: None,
        declared: Declared {
            soft_stop: true,
            sees_whole_backend: false,
            resize_live: true,
            resize_next_start: true,
            migrate_live: true,
            migrate_cold: true,
            console_output: true,
        },
        deadline: Duration::from_secs(180),
    };
    let report = run(&subject).await;
    println!("{report}");
    drop(run_dir);
    let closed = LibvirtProvider::connect_with("qemu+tcp://127.0.0.1:1/system", accelerator).await;
    assert_eq!(closed.err().map(|e| e.kind), Some(vmlet_provider::ErrorKind::Transient), "a closed port is Transient");
    report.assert_passed();
    check_readme_row(&readme(), &report).unwrap_or_else(|e| panic!("{e}"));
}
