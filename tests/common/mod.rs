//! Harness for integration tests against the real local control plane
//! (`hack/cluster.sh`) and real libvirt: each test gets its own namespace, its
//! own host (node) names and its own vmlet process, so tests run in parallel
//! without seeing each other.
#![allow(dead_code)] // each test binary uses a different part of the harness

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::json;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vmlet::v1alpha1::VirtualMachine;

/// Default deadline for a condition to hold: generous, CI machines are slow.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// Repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `test:///<abs>` URI of a test-driver inventory in test-vms/hosts.
pub fn test_driver_uri(host_file: &str) -> String {
    format!("test://{}", repo().join("test-vms/hosts").join(host_file).display())
}

/// The real libvirtd's URI (`hack/test.sh` starts it and sets the variable).
pub fn qemu_uri() -> String {
    std::env::var("VMLET_LIBVIRT_QEMU_URI")
        .ok()
        .filter(|u| !u.is_empty())
        .expect("VMLET_LIBVIRT_QEMU_URI is unset: run the tests with hack/test.sh, which starts libvirtd and sets it")
}

/// The built test guest (cached by test-vms/guest/build.sh), copied where QEMU
/// (user libvirt-qemu, which cannot enter /root) can read it, with a disk of the
/// test's own: `/var/lib/vmlet/test-guests/<ns>/`.
pub fn guest_for(env: &TestEnv) -> PathBuf {
    let script = repo().join("test-vms/guest/build.sh");
    let out = Command::new(&script).stderr(Stdio::inherit()).output().expect("run test-vms/guest/build.sh");
    assert!(out.status.success(), "test-vms/guest/build.sh failed");
    let built = PathBuf::from(String::from_utf8(out.stdout).unwrap().lines().last().unwrap().trim());
    let dir = PathBuf::from("/var/lib/vmlet/test-guests").join(&env.ns);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["vmlinuz", "initrd.img", "disk.qcow2", "cmdline", "kernel-release"] {
        std::fs::copy(built.join(file), dir.join(file)).unwrap_or_else(|e| panic!("copy {file}: {e}"));
    }
    let readable = Command::new("chmod").args(["-R", "a+rX", "/var/lib/vmlet/test-guests"]).status().unwrap();
    assert!(readable.success());
    dir
}

/// The spec of a VM that boots the test guest in `guest` (see [`guest_for`]).
pub fn guest_vm_spec(guest: &Path) -> serde_json::Value {
    let path = |f: &str| guest.join(f).display().to_string();
    let cmdline = std::fs::read_to_string(guest.join("cmdline")).unwrap().trim().to_owned();
    json!({
        "resources": {"cpu": 1, "memory": "256Mi"},
        "image": path("disk.qcow2"),
        "kernelBoot": {"kernel": path("vmlinuz"), "initrd": path("initrd.img"), "cmdline": cmdline},
    })
}

/// Where the control plane's kubeconfig, kubectl and logs are.
pub struct ClusterEnv {
    pub kubeconfig: PathBuf,
    pub bin: PathBuf,
    pub logs: PathBuf,
}

/// Bring the control plane up once per test binary (idempotent: a running one is
/// reused) and install the CRD.
pub fn cluster() -> &'static ClusterEnv {
    static CLUSTER: OnceLock<ClusterEnv> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let script = repo().join("hack/cluster.sh");
        let up = Command::new(&script).arg("up").status().expect("run hack/cluster.sh up");
        assert!(up.success(), "hack/cluster.sh up failed");
        let env = Command::new(&script).arg("env").output().expect("hack/cluster.sh env");
        let text = String::from_utf8(env.stdout).unwrap();
        let var = |name: &str| {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("{name} missing from `hack/cluster.sh env`: {text}"))
                .to_owned()
        };
        let bin = PathBuf::from(var("PATH").split(':').next().unwrap());
        let cluster = ClusterEnv { kubeconfig: var("KUBECONFIG").into(), bin, logs: var("VMLET_CLUSTER_LOGS").into() };
        let applied =
            kubectl_raw(&cluster, &["apply", "--server-side", "--force-conflicts", "-f"], &[&repo().join("crds")]);
        assert!(applied.status.success(), "applying crds/: {}", String::from_utf8_lossy(&applied.stderr));
        let established = kubectl_raw(
            &cluster,
            &["wait", "--for=condition=established", "--timeout=60s", "crd/virtualmachines.vmlet.io"],
            &[],
        );
        assert!(established.status.success(), "CRD not established: {}", String::from_utf8_lossy(&established.stderr));
        cluster
    })
}

fn kubectl_raw(cluster: &ClusterEnv, args: &[&str], paths: &[&Path]) -> Output {
    Command::new(cluster.bin.join("kubectl"))
        .env("KUBECONFIG", &cluster.kubeconfig)
        .args(args)
        .args(paths)
        .output()
        .expect("run kubectl")
}

/// A Kubernetes client for the local control plane.
pub async fn client() -> Client {
    let cluster = cluster();
    let kubeconfig = kube::config::Kubeconfig::read_from(&cluster.kubeconfig).expect("read kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("kubeconfig");
    Client::try_from(config).expect("client")
}

fn unique_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.write_u32(std::process::id());
    format!("{:06x}", h.finish() & 0xff_ffff)
}

/// A host for the vmlet config; the node is named `<ns>-<suffix>`.
pub struct Host<'a> {
    pub suffix: &'a str,
    pub uri: String,
    /// `cpuAllocationRatio` (1.0: none).
    pub cpu_allocation_ratio: f64,
}

impl<'a> Host<'a> {
    /// A host without overcommit.
    pub fn new(suffix: &'a str, uri: String) -> Self {
        Host { suffix, uri, cpu_allocation_ratio: 1.0 }
    }
}

/// One test's namespace, hosts and vmlet.
pub struct TestEnv {
    pub ns: String,
    pub client: Client,
    pub dir: PathBuf,
    vmlet: Option<Child>,
    nodes: Vec<String>,
    /// Port of this vmlet's kubelet API on 127.0.0.1.
    pub kubelet_port: u16,
}

impl TestEnv {
    /// A fresh namespace `<prefix>-<random>`.
    pub async fn new(prefix: &str) -> TestEnv {
        let ns = format!("{prefix}-{}", unique_suffix());
        let client = client().await;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        namespaces.create(&PostParams::default(), &namespace).await.expect("create namespace");
        let dir = repo().join("target/it").join(&ns);
        std::fs::create_dir_all(&dir).unwrap();
        TestEnv { ns, client, dir, vmlet: None, nodes: vec![], kubelet_port: 0 }
    }

    /// The node name of a host suffix.
    pub fn node(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.ns)
    }

    /// Write a config for `hosts` (labelled `vmlet.io/test=<ns>`, VMs of this
    /// namespace only) and start vmlet with it; its log is `<dir>/vmlet.log`.
    pub fn start_vmlet(&mut self, hosts: &[Host<'_>]) {
        let hosts_yaml: Vec<_> = hosts
            .iter()
            .map(|h| {
                json!({"name": self.node(h.suffix), "provider": "libvirt", "uri": h.uri,
                       "labels": {"vmlet.io/test": self.ns}, "cpuAllocationRatio": h.cpu_allocation_ratio})
            })
            .collect();
        self.nodes = hosts.iter().map(|h| self.node(h.suffix)).collect();
        // Each test's vmlet has a kubelet API port of its own; the API server
        // reaches it through the Node's daemonEndpoints and checks its serving
        // certificate against the cluster CA.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        self.kubelet_port = port;
        let pki = cluster().kubeconfig.parent().unwrap().join("pki");
        let config = json!({
            "namespace": self.ns,
            "stateDir": self.dir.join("state"),
            "kubeletPort": port,
            "kubeletApi": {
                "listen": format!("127.0.0.1:{port}"),
                "tlsCertFile": pki.join("kubelet-serving.crt"),
                "tlsKeyFile": pki.join("kubelet-serving.key"),
                "clientCaFile": pki.join("ca.crt"),
            },
            "hosts": hosts_yaml,
        });
        let path = self.dir.join("vmlet.yaml");
        std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
        self.restart_vmlet();
    }

    /// Start vmlet again with the same config (after [`TestEnv::kill_vmlet`]).
    pub fn restart_vmlet(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("vmlet.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vmlet"))
            .args(["run", "--config"])
            .arg(self.dir.join("vmlet.yaml"))
            .env("KUBECONFIG", &cluster().kubeconfig)
            .env("VMLET_LOG", "info,vmlet=debug,kube=warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start vmlet");
        self.vmlet = Some(child);
    }

    /// The running vmlet's process id.
    pub fn vmlet_pid(&self) -> u32 {
        self.vmlet.as_ref().expect("vmlet running").id()
    }

    /// kill -9 vmlet, as a crash would.
    pub fn kill_vmlet(&mut self) {
        if let Some(mut child) = self.vmlet.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Run kubectl in this namespace; panics with its stderr unless it succeeds.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let out = self.kubectl_output(args);
        assert!(out.status.success(), "kubectl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Run kubectl in this namespace and return its output, successful or not.
    pub fn kubectl_output(&self, args: &[&str]) -> Output {
        let cluster = cluster();
        Command::new(cluster.bin.join("kubectl"))
            .env("KUBECONFIG", &cluster.kubeconfig)
            .args(["-n", &self.ns])
            .args(args)
            .output()
            .expect("run kubectl")
    }

    /// `kubectl apply -f -` of `yaml` in this namespace.
    pub fn apply(&self, yaml: &str) -> Output {
        let cluster = cluster();
        let mut child = Command::new(cluster.bin.join("kubectl"))
            .env("KUBECONFIG", &cluster.kubeconfig)
            .args(["-n", &self.ns, "apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kubectl");
        use std::io::Write;
        child.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    }

    /// Apply a VirtualMachine `name` pinned to this test's hosts, with `spec`
    /// merged over `{replicas: 1, shutdownTimeoutSeconds: 2}`.
    pub fn apply_vm(&self, name: &str, spec: serde_json::Value) {
        let mut full = json!({"replicas": 1, "shutdownTimeoutSeconds": 2, "nodeSelector": {"vmlet.io/test": self.ns}});
        for (k, v) in spec.as_object().unwrap() {
            full[k] = v.clone();
        }
        let vm = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
                        "metadata": {"name": name}, "spec": full});
        let out = self.apply(&serde_yaml::to_string(&vm).unwrap());
        assert!(out.status.success(), "apply VM {name}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The VirtualMachine API of this namespace.
    pub fn vms(&self) -> Api<VirtualMachine> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The Pod API of this namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Poll `check` every 250 ms until it returns `Some`, up to [`DEADLINE`];
    /// on timeout, panic naming `what` and showing vmlet's log tail.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let start = Instant::now();
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if start.elapsed() > DEADLINE {
                panic!("timed out after {:?} waiting for {what}\n{}", DEADLINE, self.diagnostics());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Wait until VM `name` reports `phase`; returns it.
    pub async fn wait_vm_phase(&self, name: &str, phase: &str) -> VirtualMachine {
        let vms = self.vms();
        self.wait_for(&format!("VirtualMachine {name} phase {phase}"), || {
            let vms = vms.clone();
            async move {
                let vm = vms.get_opt(name).await.ok()??;
                let now = serde_json::to_value(vm.status.as_ref()?.phase?).ok()?;
                (now == phase).then_some(vm)
            }
        })
        .await
    }

    /// Wait until pod `name` is gone.
    pub async fn wait_pod_gone(&self, name: &str) {
        let pods = self.pods();
        self.wait_for(&format!("pod {name} gone"), || {
            let pods = pods.clone();
            async move { pods.get_opt(name).await.ok().and_then(|p| p.is_none().then_some(())) }
        })
        .await
    }

    /// vmlet's log and where the control plane's logs are.
    pub fn diagnostics(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("vmlet.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect();
        let pods = self.kubectl_output(&["get", "vm,pods,events", "-o", "wide"]);
        format!(
            "--- kubectl get vm,pods,events -n {}:\n{}\n--- last lines of {}:\n{}\n--- control plane logs: {}",
            self.ns,
            String::from_utf8_lossy(&pods.stdout),
            self.dir.join("vmlet.log").display(),
            tail.join("\n"),
            cluster().logs.display()
        )
    }

    /// Nodes of this test.
    pub fn nodes_api(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }
}

impl Drop for TestEnv {
    /// Delete the namespace's VMs while vmlet still runs (so domains are cleaned
    /// up by the product itself), then stop vmlet and remove what is left.
    fn drop(&mut self) {
        if self.vmlet.is_some() {
            let _ = self.kubectl_output(&["delete", "virtualmachines", "--all", "--wait=true", "--timeout=90s"]);
        }
        self.kill_vmlet();
        let leftover = self.kubectl_output(&["get", "virtualmachines", "-o", "name"]);
        for vm in String::from_utf8_lossy(&leftover.stdout).lines() {
            let _ = self.kubectl_output(&["patch", vm, "--type=merge", "-p", r#"{"metadata":{"finalizers":null}}"#]);
        }
        let _ = self.kubectl_output(&["delete", "namespace", &self.ns, "--wait=false"]);
        for node in &self.nodes {
            let _ = self.kubectl_output(&["delete", "node", node, "--wait=false"]);
        }
    }
}
