//! The provider conformance suite (`vmlet-provider-conformance`) against the
//! real vSphere API server of `hack/vsphere.sh` (govmomi's simulator: hosts
//! DC0_C0_H0 and DC0_C0_H1 of cluster DC0_C0, template `template-c0`).
//! Also checks the README's capability matrix row (`VMLET_BLESS_MATRIX=1`
//! rewrites it).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vmlet_provider::{Provider, VmId, VmSpec};
use vmlet_provider_conformance::{check_readme_row, run, Declared, Subject};
use vmlet_vsphere::{Secret, SessionConfig, VCenter, VCenterOptions, VsphereProvider};

const NS: &str = "vmlet-vs-conformance";
const HOSTS: [&str; 2] = ["DC0_C0_H0", "DC0_C0_H1"];
const TEMPLATE: &str = "template-c0";

fn options() -> VCenterOptions {
    VCenterOptions {
        datacenter: Some("DC0".into()),
        templates: vec![TEMPLATE.into(), "template-h0".into()],
        clone_timeout: Duration::from_secs(60),
        task_timeout: Duration::from_secs(30),
        ..VCenterOptions::default()
    }
}

fn providers(config: SessionConfig) -> Vec<Arc<dyn Provider>> {
    let vcenter = Arc::new(VCenter::new("vcsim", config, options()));
    HOSTS.iter().map(|h| Arc::new(VsphereProvider::new(vcenter.clone(), *h)) as Arc<dyn Provider>).collect()
}

/// A UUID-shaped UID unique to this run.
fn unique_uid() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos() as u64;
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}-{:04x}-4000-8000-{:012x}", std::process::id(), n & 0xffff, nanos & 0xffff_ffff_ffff)
}

fn spec(what: &str) -> VmSpec {
    let uid = unique_uid();
    VmSpec {
        name: format!("{what}-{}", &uid[uid.len() - 8..]),
        id: VmId(uid),
        namespace: NS.into(),
        cpus: 1,
        memory_bytes: 256 << 20,
        max_cpus: Some(2),
        max_memory_bytes: Some(512 << 20),
        image: Some(TEMPLATE.into()),
        image_backing_chain: None,
        kernel_boot: None,
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
    }
}

/// Removes VMs of this suite's namespace that an interrupted run left.
async fn remove_leftovers(hosts: &[Arc<dyn Provider>]) {
    for host in hosts {
        for vm in host.list().await.expect("list") {
            if vm.backend_name.starts_with(&format!("{NS}_")) {
                let _ = host.destroy(&vm.id).await;
                host.undefine(&vm.id).await.expect("remove a leftover VM");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vsphere_conforms() {
    let Some(h) = common::harness("vsphere_conforms") else { return };
    let h = Arc::new(h);
    let hosts = providers(h.config());
    remove_leftovers(&hosts).await;

    // A closed port: the session connects at the first call, which fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let mut unreachable = h.config();
    unreachable.url = format!("https://127.0.0.1:{closed}/sdk");
    unreachable.request_timeout = Duration::from_secs(5);
    let mut denied = h.config();
    denied.password = Secret::new("not-the-password");

    let reconnect_harness = h.clone();
    let subject = Subject {
        name: "vSphere (vcsim)".into(),
        hosts,
        new_spec: Box::new(spec),
        reconnect: Some(Box::new(move || {
            let config = reconnect_harness.config();
            Box::pin(async move { providers(config) })
        })),
        unreachable: Some(providers(unreachable).remove(0)),
        denied: Some(providers(denied).remove(0)),
        declared: Declared {
            // ShutdownGuest: the simulator's guests run Tools and power off.
            soft_stop: true,
            sees_whole_backend: true,
            resize_live: true,
            resize_next_start: true,
            migrate_live: true,
            migrate_cold: true,
            console_output: false,
        },
        deadline: Duration::from_secs(60),
    };
    let report = run(&subject).await;
    println!("{report}");
    remove_leftovers(&subject.hosts).await;
    report.assert_passed();
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    check_readme_row(&readme, &report).unwrap_or_else(|e| panic!("{e}"));
}
