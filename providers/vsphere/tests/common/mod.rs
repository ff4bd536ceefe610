//! Shared by the tests against the real vSphere API server that
//! `hack/vsphere.sh up` runs (govmomi's simulator: datacenter DC0, cluster
//! DC0_C0 of hosts DC0_C0_H0..H2, standalone host DC0_H0).
//!
//! The server comes from the `VMLET_VSPHERE_*` variables that
//! `hack/vsphere.sh env` prints. Without them a test fails, saying how to
//! start the simulator, unless `VMLET_SKIP_VSPHERE=1`.

#![allow(dead_code)] // not every test binary uses every helper

use std::path::PathBuf;

use vmlet_provider::{VmId, VmSpec};
use vmlet_vsphere::{Secret, SessionConfig, Thumbprint, Trust};

/// A VM of `namespace` named `name` with UID `uid`, cloned from template
/// `image`: 1 vCPU, 256 MiB, no ceilings, no networks, disks or cloud-init
/// (a test changes the fields it is about).
pub fn vm_spec(namespace: &str, name: &str, uid: &str, image: &str) -> VmSpec {
    VmSpec {
        id: VmId(uid.into()),
        namespace: namespace.into(),
        name: name.into(),
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

/// The simulator as the tests see it.
pub struct Harness {
    pub url: String,
    pub username: String,
    pub password: String,
    pub thumbprint: Thumbprint,
    pub ca_file: PathBuf,
    /// The `vmlet.io.uid` of the one VM the harness made vmlet's (DC0_C0_RP0_VM1).
    pub owned_uid: String,
}

impl Harness {
    /// A session config trusting the server by its thumbprint.
    pub fn config(&self) -> SessionConfig {
        SessionConfig::new(&self.url, Trust::Thumbprint(self.thumbprint), &self.username, Secret::new(&self.password))
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn required(name: &str) -> String {
    var(name).unwrap_or_else(|| {
        panic!(
            "{name} is unset: no vSphere to test against. Start the simulator with `hack/vsphere.sh up && eval \
             \"$(hack/vsphere.sh env)\"`, then run the tests again; or set VMLET_SKIP_VSPHERE=1 to skip them knowingly"
        )
    })
}

/// The harness, or `None` (after saying so loudly) with `VMLET_SKIP_VSPHERE=1`.
/// Panics with how to start the simulator when it is not configured.
pub fn harness(test: &str) -> Option<Harness> {
    if var("VMLET_SKIP_VSPHERE").as_deref() == Some("1") {
        eprintln!("\n*** SKIPPED {test}: VMLET_SKIP_VSPHERE=1 ***\n");
        return None;
    }
    let thumbprint = required("VMLET_VSPHERE_THUMBPRINT");
    Some(Harness {
        url: required("VMLET_VSPHERE_URL"),
        username: required("VMLET_VSPHERE_USERNAME"),
        password: required("VMLET_VSPHERE_PASSWORD"),
        thumbprint: thumbprint.parse().unwrap_or_else(|e| panic!("VMLET_VSPHERE_THUMBPRINT: {e}")),
        ca_file: required("VMLET_VSPHERE_CA_FILE").into(),
        owned_uid: required("VMLET_VSPHERE_OWNED_UID"),
    })
}
