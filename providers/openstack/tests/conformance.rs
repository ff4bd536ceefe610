//! The provider conformance suite (`vmlet-provider-conformance`) against the
//! real Nova API of the harness (`hack/nova.sh up`: Keystone, Placement,
//! Nova with fake computes). Also checks the README's capability matrix row
//! (`VMLET_BLESS_MATRIX=1` rewrites it).

mod common;
use common::{harness, remove_leftovers};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use vmlet_openstack::{Cloud, CloudOptions, Credentials, OpenStackProvider, Secret};
use vmlet_provider::{Provider, VmSpec};
use vmlet_provider_conformance::{check_readme_row, run, Declared, Subject};

const NS: &str = "vmlet-os-conformance";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nova_conforms() {
    let Some(h) = harness("nova_conforms") else { return };
    let h = Arc::new(h);
    let cloud = h.cloud().await;
    remove_leftovers(&h.providers(&cloud), NS).await;
    let hosts_of = |cloud: &Arc<Cloud>, h: &common::Harness| -> Vec<Arc<dyn Provider>> {
        h.providers(cloud).into_iter().map(|p| Arc::new(p) as Arc<dyn Provider>).collect()
    };
    let reconnect_harness = h.clone();

    // A closed port: the session authenticates on its first call, which fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let mut unreachable = h.config();
    unreachable.auth_url = format!("http://127.0.0.1:{closed}/v3");
    let options = CloudOptions { request_timeout: Duration::from_secs(5), ..common::test_options() };
    let unreachable = Cloud::new(unreachable, options.clone()).expect("cloud");
    let mut denied = h.config();
    if let Credentials::Password { password, .. } = &mut denied.credentials {
        *password = Secret::new("not-the-password");
    }
    let denied = Cloud::new(denied, options).expect("cloud");

    let spec_harness = h.clone();
    let subject = Subject {
        name: "OpenStack Nova (fake computes)".into(),
        hosts: hosts_of(&cloud, &h),
        new_spec: Box::new(move |what| -> VmSpec { spec_harness.spec(NS, what) }),
        reconnect: Some(Box::new(move || {
            let h = reconnect_harness.clone();
            Box::pin(async move {
                let cloud = h.cloud().await;
                h.providers(&cloud).into_iter().map(|p| Arc::new(p) as Arc<dyn Provider>).collect()
            })
        })),
        unreachable: Some(Arc::new(OpenStackProvider::new(Arc::new(unreachable), &h.hosts[0]))),
        denied: Some(Arc::new(OpenStackProvider::new(Arc::new(denied), &h.hosts[0]))),
        declared: Declared {
            // Nova's os-stop asks the guest first (the fake driver stops at once).
            soft_stop: true,
            sees_whole_backend: true,
            resize_live: false,
            resize_next_start: true,
            migrate_live: true,
            migrate_cold: true,
            console_output: true,
        },
        deadline: Duration::from_secs(120),
    };
    let report = run(&subject).await;
    println!("{report}");
    remove_leftovers(&h.providers(&cloud), NS).await;
    report.assert_passed();
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    check_readme_row(&readme, &report).unwrap_or_else(|e| panic!("{e}"));
}
