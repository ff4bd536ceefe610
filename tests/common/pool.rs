//! libvirt `dir` storage pools and StorageClasses of vmlet's provisioner
//! for a test: made on real libvirt daemons, removed on drop.

use super::deadline::{output_within, VIRSH};
use super::{qemu_uri, repo, storage_root, TestEnv};
use serde_json::json;
use std::process::Command;

/// `virsh -c <uri> <args>`: (success, trimmed stdout, or stderr on failure).
pub fn virsh_at(uri: &str, args: &[&str]) -> (bool, String) {
    let out = output_within(Command::new("virsh").arg("-c").arg(uri).args(args), VIRSH);
    let text = if out.status.success() { &out.stdout } else { &out.stderr };
    (out.status.success(), String::from_utf8_lossy(text).trim().to_owned())
}

/// The test's own `dir` storage pool, named after the namespace, with its
/// directory `<storage root>/pool`, defined and started on each of `uris`
/// (one host, or several hosts sharing the directory); and the
/// StorageClass of that name once [`Pool::class`] made it. Removed on drop
/// (the pool's directory goes with the test's storage root).
pub struct Pool {
    /// The pool's (and its first class's) name.
    pub name: String,
    uris: Vec<String>,
    classes: std::cell::RefCell<Vec<String>>,
}

impl Pool {
    /// The pool on the local libvirtd (`qemu:///system`).
    pub fn new(env: &TestEnv) -> Pool {
        Pool::on(env, &[qemu_uri()])
    }

    /// The pool on each daemon of `uris`, all at the same directory.
    pub fn on(env: &TestEnv, uris: &[String]) -> Pool {
        let name = env.ns.clone();
        let dir = storage_root(env).join("pool");
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.display().to_string();
        for uri in uris {
            for args in [&["pool-define-as", &name, "dir", "--target", &target][..], &["pool-start", &name]] {
                let (ok, out) = virsh_at(uri, args);
                assert!(ok, "virsh -c {uri} {args:?}: {out}");
            }
        }
        Pool { name, uris: uris.to_vec(), classes: Default::default() }
    }

    /// The pool's directory.
    pub fn dir(env: &TestEnv) -> std::path::PathBuf {
        storage_root(env).join("pool")
    }

    /// The volume names in the pool as the first daemon lists them, sorted
    /// (`virsh vol-list`'s first column, below its header).
    pub fn volumes(&self) -> Vec<String> {
        let uri = &self.uris[0];
        let (ok, out) = virsh_at(uri, &["pool-refresh", &self.name]);
        assert!(ok, "virsh pool-refresh {}: {out}", self.name);
        let (ok, out) = virsh_at(uri, &["vol-list", &self.name]);
        assert!(ok, "virsh vol-list {}: {out}", self.name);
        let rows = out.lines().skip_while(|l| !l.starts_with("---")).skip(1);
        let mut names: Vec<String> = rows.filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect();
        names.sort();
        names
    }

    /// The names of [`Pool::volumes`] made for claims named `claim`
    /// (vmlet names them `<namespace>_<claim>_<uid>[.qcow2]`).
    pub fn volumes_of(&self, claim: &str) -> Vec<String> {
        self.volumes().into_iter().filter(|v| v.split('_').nth(1) == Some(claim)).collect()
    }

    /// The shipped `CSIDriver` (the first object of deploy/storage.yaml)
    /// and a StorageClass of the pool's name: provisioner
    /// `libvirt.vmlet.io`, `WaitForFirstConsumer`, `reclaimPolicy: Delete`,
    /// with `pool` and `parameters` (e.g. `{"format": "qcow2"}`), and
    /// `allowVolumeExpansion` as `expansion`.
    pub fn class(&self, env: &TestEnv, parameters: serde_json::Value, expansion: bool) {
        self.class_named(env, &self.name, parameters, expansion)
    }

    /// Create claim `name` of `size` (a quantity, `1Gi`) in the test's
    /// namespace, of this pool's class, `ReadWriteOnce`.
    pub async fn claim(&self, env: &TestEnv, name: &str, size: &str) {
        use k8s_openapi::api::core::v1::PersistentVolumeClaim;
        let claims: kube::Api<PersistentVolumeClaim> = kube::Api::namespaced(env.client.clone(), &env.ns);
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"storageClassName": self.name, "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}}},
        }))
        .unwrap();
        claims.create(&Default::default(), &claim).await.unwrap_or_else(|e| panic!("create claim {name}: {e}"));
    }

    /// As [`Pool::class`], named `name`.
    pub fn class_named(&self, env: &TestEnv, name: &str, parameters: serde_json::Value, expansion: bool) {
        // The shipped CSIDriver, once per test binary: parallel tests that
        // apply it to an empty cluster would race to create it.
        static DRIVER: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        DRIVER.get_or_init(|| {
            let shipped = std::fs::read_to_string(repo().join("deploy/storage.yaml")).unwrap();
            let driver = shipped.split("\n---\n").next().unwrap();
            assert!(driver.contains("kind: CSIDriver"), "{driver}");
            let applied = env.apply(driver);
            assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
        });
        let mut all = json!({"pool": self.name});
        all.as_object_mut().unwrap().extend(parameters.as_object().cloned().unwrap_or_default());
        let class = json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": name}, "provisioner": "libvirt.vmlet.io", "parameters": all,
            "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete",
            "allowVolumeExpansion": expansion});
        let applied = env.apply(&class.to_string());
        assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
        self.classes.borrow_mut().push(name.to_owned());
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for uri in &self.uris {
            let _ = virsh_at(uri, &["pool-destroy", &self.name]);
            let _ = virsh_at(uri, &["pool-undefine", &self.name]);
        }
        let cluster = super::cluster();
        for class in self.classes.borrow().iter() {
            let mut kubectl = Command::new(cluster.bin.join("kubectl"));
            kubectl.env("KUBECONFIG", &cluster.kubeconfig);
            kubectl.args(["delete", &format!("storageclass/{class}"), "--ignore-not-found", "--wait=false"]);
            let _ = output_within(&mut kubectl, super::kubectl_deadline(&["delete"]));
        }
    }
}
