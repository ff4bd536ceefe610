//! Harness for integration tests against the real local control plane
//! (`hack/cluster.sh`) and real libvirt: each test gets its own namespace, its
//! own host (node) names and its own vmlet process, so tests run in parallel
//! without seeing each other.
#![allow(dead_code)] // each test binary uses a different part of the harness

/// Deadlines for external commands; every command a test runs goes through it.
#[path = "../support/deadline.rs"]
pub mod deadline;
pub mod disk;
pub mod kubelet;
pub mod pool;
pub mod tenant;

use deadline::{kill_and_reap, output_within, run_echoing, run_with_stdin, wait_within, GUEST_BUILD, KUBECTL};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::json;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vmlet::v1alpha1::VirtualMachine;

/// The number in environment variable `name` (a benchmark's setting), or
/// `default` when it is unset; panics naming a value that is no number.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a valid number")),
        Err(_) => default,
    }
}

/// Default deadline for a condition to hold: generous, CI machines are slow
/// (two cores; test binaries run side by side, and a guest emulated by TCG
/// while another binary's guests run took over 3 minutes to boot).
pub const DEADLINE: Duration = Duration::from_secs(300);

/// Deadline of `hack/cluster.sh up`: the first run builds the control plane
/// from Go modules (about 15 minutes on 2 cores); later runs take seconds.
const CLUSTER_UP: Duration = Duration::from_secs(30 * 60);

/// How long a SIGKILLed vmlet may take to be reaped.
const VMLET_EXIT: Duration = Duration::from_secs(30);

/// The deadline of a kubectl call with `args`: [`KUBECTL`], or the `--timeout`
/// it waits for itself (`delete --wait`, `wait`, `drain`) plus 30 s when longer.
pub fn kubectl_deadline(args: &[&str]) -> Duration {
    let own = args.iter().find_map(|a| a.strip_prefix("--timeout=")).map(|t| {
        let (number, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
        let number: u64 = number.parse().unwrap_or_else(|_| panic!("kubectl --timeout={t}: not a whole duration"));
        let seconds = match unit {
            "" | "s" => number,
            "m" => number * 60,
            "h" => number * 3600,
            _ => panic!("kubectl --timeout={t}: use s, m or h"),
        };
        Duration::from_secs(seconds) + Duration::from_secs(30)
    });
    own.map_or(KUBECTL, |own| own.max(KUBECTL))
}

/// `what` failed: its exit status and the end of its stderr.
fn failed(what: &str, out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
    format!("{what} failed ({}):\n{}", out.status, tail.join("\n"))
}

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

/// Where a test's VM files live: `/var/lib/vmlet/test-guests/<ns>`, a place
/// QEMU (user libvirt-qemu, which cannot enter /root) can read. It is the one
/// storage root of every host a test's vmlet serves ([`TestEnv::start_vmlet`]).
pub fn storage_root(env: &TestEnv) -> PathBuf {
    PathBuf::from("/var/lib/vmlet/test-guests").join(&env.ns)
}

/// The built test guest (cached by test-vms/guest/build.sh), copied into the
/// test's [`storage_root`], with a disk of the test's own.
pub fn guest_for(env: &TestEnv) -> PathBuf {
    let script = repo().join("test-vms/guest/build.sh");
    // Its progress shows live, as a build's should.
    let out = run_echoing(&mut Command::new(&script), GUEST_BUILD).unwrap_or_else(|timed_out| panic!("{timed_out}"));
    assert!(out.status.success(), "{}", failed("test-vms/guest/build.sh", &out));
    let built = PathBuf::from(String::from_utf8(out.stdout).unwrap().lines().last().unwrap().trim());
    probe_accelerator(&built);
    let dir = storage_root(env);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["vmlinuz", "initrd.img", "disk.qcow2", "cmdline", "kernel-release", "accelerator"] {
        std::fs::copy(built.join(file), dir.join(file)).unwrap_or_else(|e| panic!("copy {file}: {e}"));
    }
    let readable = output_within(
        Command::new("chmod").args(["-R", "a+rX", "/var/lib/vmlet/test-guests"]),
        Duration::from_secs(60),
    );
    assert!(readable.status.success(), "{}", failed("chmod -R a+rX /var/lib/vmlet/test-guests", &readable));
    dir
}

/// Run `test-vms/guest/accelerator.sh` on the built guest in `built`: it writes
/// `built/accelerator` (`kvm` when KVM boots the guest's kernel here, else `tcg`).
pub fn probe_accelerator(built: &Path) {
    let script = repo().join("test-vms/guest/accelerator.sh");
    let out = run_echoing(Command::new(&script).arg(built), Duration::from_secs(120))
        .unwrap_or_else(|timed_out| panic!("{timed_out}"));
    assert!(out.status.success(), "{}", failed("test-vms/guest/accelerator.sh", &out));
}

/// The `accelerator` host setting for a VM that boots the test guest in
/// `guest` (see [`guest_for`]): `kvm` where KVM boots its kernel on this
/// machine, `tcg` where it does not (nested KVM that runs firmware only).
pub fn guest_accelerator(guest: &Path) -> &'static str {
    match std::fs::read_to_string(guest.join("accelerator")).unwrap_or_default().trim() {
        "kvm" => "kvm",
        _ => "tcg",
    }
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
        // Its progress shows live: the first run builds for a quarter of an hour.
        let up = run_echoing(Command::new(&script).arg("up"), CLUSTER_UP).unwrap_or_else(|t| panic!("{t}"));
        assert!(up.status.success(), "{}", failed("hack/cluster.sh up", &up));
        let env = output_within(Command::new(&script).arg("env"), Duration::from_secs(60));
        assert!(env.status.success(), "{}", failed("hack/cluster.sh env", &env));
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
        // The finalizer at create, as an installation has it (one request
        // per VM fewer for the controller); the script waits until the API
        // server applies it, as VM creates fail with 503 before that.
        let path = format!("{}:{}", cluster.bin.display(), std::env::var("PATH").unwrap_or_default());
        let mut admission = Command::new(repo().join("hack/admission.sh"));
        admission.env("KUBECONFIG", &cluster.kubeconfig).env("PATH", path);
        let admitted = output_within(&mut admission, Duration::from_secs(300));
        assert!(admitted.status.success(), "{}", failed("hack/admission.sh", &admitted));
        cluster
    })
}

/// Deadline of `hack/metrics-server.sh up`: the first run builds
/// metrics-server from its Go module (minutes on 2 cores); later runs reuse
/// the running one in seconds.
const METRICS_SERVER_UP: Duration = Duration::from_secs(30 * 60);

/// Bring metrics-server up beside the control plane, once per test binary
/// (`hack/metrics-server.sh up`, idempotent: a running one is reused), so
/// that the metrics.k8s.io API (`kubectl top`) serves vmlet's nodes.
pub fn metrics_server() {
    static UP: OnceLock<()> = OnceLock::new();
    UP.get_or_init(|| {
        cluster();
        let script = repo().join("hack/metrics-server.sh");
        let up = run_echoing(Command::new(&script).arg("up"), METRICS_SERVER_UP).unwrap_or_else(|t| panic!("{t}"));
        assert!(up.status.success(), "{}", failed("hack/metrics-server.sh up", &up));
    });
}

/// The kubeconfig vmlet processes of the tests run with (unless a test sets
/// [`TestEnv::vmlet_kubeconfig`]): ServiceAccount kube-system/vmlet with the
/// agent's and the controller's ClusterRoles of `deploy/rbac.yaml`, not the
/// cluster admin, so that a permission the roles lack fails a test.
pub fn vmlet_identity() -> &'static PathBuf {
    static KUBECONFIG: OnceLock<PathBuf> = OnceLock::new();
    KUBECONFIG.get_or_init(|| service_account_kubeconfig("vmlet"))
}

/// The kubeconfig of a vmlet that runs no controller
/// ([`TestEnv::start_split`]'s agent): ServiceAccount kube-system/vmlet-agent,
/// with the agent's ClusterRole of `deploy/rbac.yaml` only.
pub fn agent_identity() -> &'static PathBuf {
    static KUBECONFIG: OnceLock<PathBuf> = OnceLock::new();
    KUBECONFIG.get_or_init(|| service_account_kubeconfig("vmlet-agent"))
}

/// The kubeconfig of a vmlet that serves no host and runs only the
/// controllers ([`TestEnv::start_split`]'s controller): ServiceAccount
/// kube-system/vmlet-controller, with the controller's ClusterRole of
/// `deploy/rbac.yaml` only.
pub fn controller_identity() -> &'static PathBuf {
    static KUBECONFIG: OnceLock<PathBuf> = OnceLock::new();
    KUBECONFIG.get_or_init(|| service_account_kubeconfig("vmlet-controller"))
}

/// A kubeconfig with a 12 h token of ServiceAccount kube-system/`account`,
/// after applying `deploy/rbac.yaml` and deleting what its upgrade note says
/// an older revision left (once per test binary): a cluster that outlived an
/// older revision must not keep rights this one no longer grants.
fn service_account_kubeconfig(account: &str) -> PathBuf {
    static APPLIED: OnceLock<()> = OnceLock::new();
    let cluster = cluster();
    APPLIED.get_or_init(|| {
        let applied = kubectl_raw(cluster, &["apply", "-f"], &[&repo().join("deploy/rbac.yaml")]);
        assert!(applied.status.success(), "applying deploy/rbac.yaml: {}", String::from_utf8_lossy(&applied.stderr));
        for legacy in [
            &["delete", "clusterrolebinding", "vmlet", "vmlet-hosts", "--ignore-not-found"][..],
            &["delete", "clusterrole", "vmlet", "--ignore-not-found"],
        ] {
            let deleted = kubectl_raw(cluster, legacy, &[]);
            assert!(deleted.status.success(), "kubectl {legacy:?}: {}", String::from_utf8_lossy(&deleted.stderr));
        }
    });
    let token = kubectl_raw(cluster, &["create", "token", account, "-n", "kube-system", "--duration", "12h"], &[]);
    assert!(token.status.success(), "a token for kube-system/{account}: {}", String::from_utf8_lossy(&token.stderr));
    let dir = repo().join("target/it");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{account}-sa-{}.kubeconfig", std::process::id()));
    kubeconfig_with_token(&path, String::from_utf8_lossy(&token.stdout).trim());
    path
}

/// The admin's kubeconfig with its user replaced by bearer `token`, written
/// to `path` (mode 0600).
pub fn kubeconfig_with_token(path: &Path, token: &str) {
    use std::os::unix::fs::PermissionsExt;
    let admin = std::fs::read_to_string(&cluster().kubeconfig).expect("read the admin kubeconfig");
    let mut config: serde_yaml::Value = serde_yaml::from_str(&admin).expect("kubeconfig YAML");
    config["users"] = serde_yaml::to_value(json!([{"name": "vmlet", "user": {"token": token}}])).unwrap();
    for context in config["contexts"].as_sequence_mut().expect("contexts") {
        context["context"]["user"] = "vmlet".into();
    }
    std::fs::write(path, serde_yaml::to_string(&config).unwrap()).expect("write the kubeconfig");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn kubectl_raw(cluster: &ClusterEnv, args: &[&str], paths: &[&Path]) -> Output {
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(args).args(paths);
    output_within(&mut kubectl, kubectl_deadline(args))
}

/// A Kubernetes client for the local control plane: vmlet's own stack
/// (`vmlet::api_client`), which sets TCP_NODELAY as kubectl's Go transport
/// does, so that what the tests and benches time is what kubectl would see.
pub async fn client() -> Client {
    let cluster = cluster();
    let kubeconfig = kube::config::Kubeconfig::read_from(&cluster.kubeconfig).expect("read kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("kubeconfig");
    vmlet::api_client::client(config).expect("client")
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
    /// `accelerator` (`auto`, `kvm`, `tcg`); `None` leaves the default, auto.
    pub accelerator: Option<&'static str>,
    /// More fields of the host's config (e.g. `migrationUri`), set last.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl<'a> Host<'a> {
    /// A host without overcommit.
    pub fn new(suffix: &'a str, uri: String) -> Self {
        Host { suffix, uri, cpu_allocation_ratio: 1.0, accelerator: None, extra: Default::default() }
    }

    /// This host with config field `key` (camelCase) set to `value`.
    pub fn with(mut self, key: &str, value: serde_json::Value) -> Self {
        self.extra.insert(key.to_owned(), value);
        self
    }

    /// The real libvirtd (`qemu:///system`), its CPUs overcommitted 8 times so
    /// that ten 1-cpu VMs fit on a 2-core machine, as on a real VM host.
    pub fn qemu(suffix: &'a str) -> Self {
        Host { suffix, uri: qemu_uri(), cpu_allocation_ratio: 8.0, accelerator: None, extra: Default::default() }
    }
}

/// Condition `type_` of `pod`: (status, message).
pub fn pod_condition(pod: &Pod, type_: &str) -> Option<(String, String)> {
    let c = pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.message.clone().unwrap_or_default()))
}

/// kill -9 a vmlet process, as a crash would, and reap it (within
/// [`VMLET_EXIT`]: panics, unless already panicking, if it is still not gone
/// then).
fn kill_vmlet_process(child: Option<Child>) {
    if let Some(mut child) = child {
        let pid = child.id();
        if kill_and_reap(&mut child, VMLET_EXIT).is_none() && !std::thread::panicking() {
            panic!("vmlet (pid {pid}) was not gone {VMLET_EXIT:?} after SIGKILL");
        }
    }
}

/// The most nodes one vmlet process of a test serves: each has a kubelet
/// API port of its own, the first's + its index.
pub const MAX_NODES_PER_PROCESS: u16 = 8;

/// The `kubeletApi` section of a test's vmlet listening on
/// `127.0.0.1:<port>`: served with the cluster's kubelet-serving
/// certificate (so the API server, and `common::kubelet`, verify it
/// against the cluster CA), accepting the API server's client certificate.
pub fn kubelet_api_config(port: u16) -> serde_json::Value {
    let pki = cluster().kubeconfig.parent().unwrap().join("pki");
    json!({
        "listen": format!("127.0.0.1:{port}"),
        "tlsCertFile": pki.join("kubelet-serving.crt"),
        "tlsKeyFile": pki.join("kubelet-serving.key"),
        "clientCaFile": pki.join("ca.crt"),
    })
}

/// Where [`free_port_range`] looks: below Linux's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768–60999 by default), so that no
/// outgoing connection of any process takes a vmlet's port while it is
/// down (a test restarts vmlet on the same port; test binaries run side by
/// side, hack/run-tests.py).
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// The first of `count` consecutive ports free on 127.0.0.1 now (each
/// bound and released once to find out), at a random place in
/// [`TEST_PORTS`].
pub fn free_port_range(count: u16) -> u16 {
    use rand::RngExt as _;
    let mut rng = rand::rng();
    for _ in 0..200 {
        let first = rng.random_range(TEST_PORTS.start..TEST_PORTS.end - count);
        if (first..first + count).all(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()) {
            return first;
        }
    }
    panic!("no {count} consecutive free ports on 127.0.0.1 in {TEST_PORTS:?} in 200 tries");
}

/// How [`TestEnv::write_vmlet_on_vcenter`]'s vmlet trusts the vCenter's
/// certificate: `vcenters[].thumbprint` or `vcenters[].caFile`.
pub enum VCenterTrust {
    /// The server certificate's SHA-256 thumbprint (`AB:CD:…`).
    Thumbprint(String),
    /// A PEM file of the CA that signed it.
    CaFile(PathBuf),
}

impl VCenterTrust {
    /// The simulator's thumbprint (`VMLET_VSPHERE_THUMBPRINT`).
    pub fn thumbprint_from_env() -> VCenterTrust {
        VCenterTrust::Thumbprint(std::env::var("VMLET_VSPHERE_THUMBPRINT").expect("VMLET_VSPHERE_THUMBPRINT"))
    }

    /// The simulator's CA file (`VMLET_VSPHERE_CA_FILE`).
    pub fn ca_file_from_env() -> VCenterTrust {
        VCenterTrust::CaFile(std::env::var("VMLET_VSPHERE_CA_FILE").expect("VMLET_VSPHERE_CA_FILE").into())
    }
}

/// One test's namespace, hosts and vmlet.
pub struct TestEnv {
    pub ns: String,
    pub client: Client,
    pub dir: PathBuf,
    vmlet: Option<Child>,
    /// A second vmlet that runs only the controller ([`TestEnv::start_split`]).
    controller: Option<Child>,
    /// More vmlet processes of the test by name ([`TestEnv::start_member`]).
    members: Vec<(String, Child)>,
    nodes: Vec<String>,
    /// Port of this vmlet's first node's kubelet API on 127.0.0.1; node `i`
    /// of its config listens on this + `i` ([`TestEnv::kubelet_port_of`]).
    pub kubelet_port: u16,
    /// Whether the test's namespace is left out of vmlet's
    /// `trustedNamespaces` (set before `start_vmlet`): its VMs may then name
    /// no host file and boot only catalogue images. Default: trusted.
    pub untrusted: bool,
    /// The kubeconfig vmlet processes of this test start with (set before
    /// they start); [`vmlet_identity`]'s when `None`.
    pub vmlet_kubeconfig: Option<PathBuf>,
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
        TestEnv {
            ns,
            client,
            dir,
            vmlet: None,
            controller: None,
            members: vec![],
            nodes: vec![],
            kubelet_port: 0,
            untrusted: false,
            vmlet_kubeconfig: None,
        }
    }

    /// The identity of the vmlet process `name` of this test (`vmlet` for
    /// [`TestEnv::start_vmlet`]'s, `controller` for the controller of
    /// [`TestEnv::start_split`], a member's name): fixed, so that a restarted
    /// process takes its own node and election Leases back at once.
    pub fn identity(&self, name: &str) -> String {
        format!("{}-{name}", self.ns)
    }

    /// The kubelet API port of the `index`th host (0 first) of the config
    /// [`TestEnv::start_vmlet`] started: each node has a listener of its own.
    pub fn kubelet_port_of(&self, index: usize) -> u16 {
        assert!(
            index < usize::from(MAX_NODES_PER_PROCESS),
            "a test process serves at most {MAX_NODES_PER_PROCESS} nodes"
        );
        self.kubelet_port + index as u16
    }

    /// The node name of a host suffix.
    pub fn node(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.ns)
    }

    /// Write a config for `hosts` (labelled `vmlet.io/test=<ns>`, VMs of this
    /// namespace only, VM files only from the test's [`storage_root`]) and
    /// start vmlet with it; its log is `<dir>/vmlet.log`.
    pub fn start_vmlet(&mut self, hosts: &[Host<'_>]) {
        let config = self.vmlet_config(hosts, true, "vmlet");
        std::fs::write(self.dir.join("vmlet.yaml"), serde_yaml::to_string(&config).unwrap()).unwrap();
        self.restart_vmlet();
    }

    /// Like [`TestEnv::start_vmlet`], but the controller runs in a second
    /// vmlet process ([`TestEnv::start_controller`], log
    /// `<dir>/controller.log`, no hosts), so that a test can stop the
    /// controller alone. Each runs with its role of `deploy/rbac.yaml` only:
    /// the agent as ServiceAccount kube-system/vmlet-agent
    /// ([`agent_identity`]), the controller as kube-system/vmlet-controller
    /// ([`controller_identity`]).
    pub fn start_split(&mut self, hosts: &[Host<'_>]) {
        self.start_agent(hosts);
        let port = self.kubelet_port;
        let mut controller = self.vmlet_config(&[], true, "controller");
        controller["stateDir"] = json!(self.dir.join("controller-state"));
        self.kubelet_port = port;
        self.nodes = hosts.iter().map(|h| self.node(h.suffix)).collect();
        std::fs::write(self.dir.join("controller.yaml"), serde_yaml::to_string(&controller).unwrap()).unwrap();
        self.start_controller();
    }

    /// Start vmlet serving `hosts` with `controller: false`, as
    /// ServiceAccount kube-system/vmlet-agent ([`agent_identity`]) unless
    /// [`TestEnv::vmlet_kubeconfig`] names another: the hosts' agent of a
    /// fleet whose controllers run elsewhere. Its log is `<dir>/vmlet.log`.
    pub fn start_agent(&mut self, hosts: &[Host<'_>]) {
        let config = self.vmlet_config(hosts, false, "vmlet");
        std::fs::write(self.dir.join("vmlet.yaml"), serde_yaml::to_string(&config).unwrap()).unwrap();
        if self.vmlet_kubeconfig.is_none() {
            self.vmlet_kubeconfig = Some(agent_identity().clone());
        }
        self.restart_vmlet();
    }

    /// Start the controller process of [`TestEnv::start_split`] (again).
    pub fn start_controller(&mut self) {
        self.controller = Some(self.spawn_vmlet("controller.yaml", "controller.log", controller_identity()));
    }

    /// kill -9 the controller process of [`TestEnv::start_split`] and reap it.
    pub fn kill_controller(&mut self) {
        kill_vmlet_process(self.controller.take());
    }

    /// Start member `name`, a controller replica as `deploy/controller.yaml`
    /// runs it: `vmlet <args>` (the Deployment's container arguments, whose
    /// `--config` value is replaced by `<dir>/<name>.yaml`, where `config`
    /// is written) as ServiceAccount kube-system/vmlet-controller
    /// ([`controller_identity`]). The caller makes `config` fit the test
    /// (namespace, listen address, state directory). Stopped like any
    /// member ([`TestEnv::terminate_member`], [`TestEnv::kill_member`]).
    pub fn start_controller_replica(&mut self, name: &str, config: &serde_json::Value, args: &[String]) {
        let path = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&path, serde_yaml::to_string(config).unwrap()).unwrap();
        let at = args.iter().position(|a| a == "--config").expect("the Deployment's args give --config") + 1;
        let mut args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        args[at] = path.into_os_string();
        let child = self.spawn_vmlet_with(&args, &format!("{name}.log"), controller_identity());
        self.members.push((name.to_owned(), child));
    }

    /// `vmlet run --config <dir>/<config>` as `kubeconfig`'s identity, its
    /// log appended to `<dir>/<log>`.
    fn spawn_vmlet(&self, config: &str, log: &str, kubeconfig: &Path) -> Child {
        let args = ["run".into(), "--config".into(), self.dir.join(config).into_os_string()];
        self.spawn_vmlet_with(&args, log, kubeconfig)
    }

    /// `vmlet <args>` as `kubeconfig`'s identity, its log appended to
    /// `<dir>/<log>`.
    fn spawn_vmlet_with(&self, args: &[std::ffi::OsString], log: &str, kubeconfig: &Path) -> Child {
        let line = args.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join(log)).unwrap();
        Command::new(env!("CARGO_BIN_EXE_vmlet"))
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("VMLET_LOG", "info,vmlet=debug,kube=warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("vmlet {line}: {e}"))
    }

    /// The config of a vmlet serving `hosts` (labelled `vmlet.io/test=<ns>`,
    /// VMs of this namespace only), with a kubelet API port of its own (the
    /// API server reaches it through the Node's daemonEndpoints and checks
    /// its serving certificate against the cluster CA).
    /// `identity` names the process ([`TestEnv::identity`]).
    fn vmlet_config(&mut self, hosts: &[Host<'_>], controller: bool, identity: &str) -> serde_json::Value {
        let hosts_yaml: Vec<_> = hosts
            .iter()
            .map(|h| {
                let mut host = json!({"name": self.node(h.suffix), "provider": "libvirt", "uri": h.uri,
                       "labels": {"vmlet.io/test": self.ns}, "cpuAllocationRatio": h.cpu_allocation_ratio,
                       "storageRoots": [storage_root(self)]});
                if let Some(accelerator) = h.accelerator {
                    host["accelerator"] = json!(accelerator);
                }
                for (key, value) in &h.extra {
                    host[key] = value.clone();
                }
                host
            })
            .collect();
        self.nodes = hosts.iter().map(|h| self.node(h.suffix)).collect();
        let port = free_port_range(MAX_NODES_PER_PROCESS);
        self.kubelet_port = port;
        json!({
            "namespace": self.ns,
            "trustedNamespaces": if self.untrusted { json!([]) } else { json!([self.ns]) },
            "controller": controller,
            "identity": self.identity(identity),
            "stateDir": self.dir.join("state"),
            "kubeletPort": port,
            "kubeletApi": kubelet_api_config(port),
            "hosts": hosts_yaml,
        })
    }

    /// Start vmlet serving the compute hosts `hosts` of cloud `cloud` of
    /// `clouds_yaml` (written to `<dir>/clouds.yaml`, mode 0600) as nodes
    /// `<ns>-<host>`, with no libvirt host: the `clouds` section of the
    /// config, as a user writes it, with `allowed` (`{images, networks}`).
    pub fn start_vmlet_on_cloud(
        &mut self,
        clouds_yaml: &str,
        cloud: &str,
        hosts: &[String],
        allowed: serde_json::Value,
    ) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join("clouds.yaml");
        std::fs::write(&path, clouds_yaml).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut config = self.vmlet_config(&[], true, "vmlet");
        config["clouds"] = json!([{
            "provider": "openstack", "cloud": cloud, "cloudsFile": path, "hosts": hosts,
            "nodeNamePrefix": format!("{}-", self.ns), "labels": {"vmlet.io/test": self.ns},
        }]);
        for (key, value) in allowed.as_object().expect("{images, networks}") {
            config["clouds"][0][key] = value.clone();
        }
        self.nodes = hosts.iter().map(|h| self.node(h)).collect();
        std::fs::write(self.dir.join("vmlet.yaml"), serde_yaml::to_string(&config).unwrap()).unwrap();
        self.restart_vmlet();
    }

    /// Where [`TestEnv::start_vmlet_on_vcenter`] keeps the vCenter's password
    /// (mode 0600): a test rewrites it and restarts vmlet to change it.
    pub fn vcenter_password_file(&self) -> PathBuf {
        self.dir.join("vsphere-password")
    }

    /// Write `<dir>/vmlet.yaml` for vmlet serving the ESXi hosts `hosts` of
    /// the vSphere simulator (`VMLET_VSPHERE_URL`, `_USERNAME`, `_PASSWORD`
    /// from `hack/vsphere.sh env`) as nodes `<ns>-<host in lower case>`,
    /// with no libvirt host: a `vcenters` entry as a user writes it, the
    /// password in [`TestEnv::vcenter_password_file`], the certificate
    /// trusted by `trust`, and `templates` the only ones `spec.image` may
    /// name. Does not start vmlet.
    pub fn write_vmlet_on_vcenter(&mut self, hosts: &[&str], templates: &[&str], trust: &VCenterTrust) {
        self.write_vmlet_on_vcenter_with(hosts, templates, trust, json!({}));
    }

    /// [`TestEnv::write_vmlet_on_vcenter`] with further `vcenters[0]` fields
    /// (`extra`, an object such as `{"datastore": "LocalDS_0", "networks":
    /// [...]}`) set as a user writes them.
    pub fn write_vmlet_on_vcenter_with(
        &mut self,
        hosts: &[&str],
        templates: &[&str],
        trust: &VCenterTrust,
        extra: serde_json::Value,
    ) {
        use std::os::unix::fs::PermissionsExt;
        let var = |name: &str| {
            std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| {
                panic!("{name} is unset: start the simulator (`hack/vsphere.sh up && eval \"$(hack/vsphere.sh env)\"`)")
            })
        };
        let password_file = self.vcenter_password_file();
        std::fs::write(&password_file, format!("{}\n", var("VMLET_VSPHERE_PASSWORD"))).unwrap();
        std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut config = self.vmlet_config(&[], true, "vmlet");
        let mut entry = json!({
            "name": "vcsim", "url": var("VMLET_VSPHERE_URL"), "username": var("VMLET_VSPHERE_USERNAME"),
            "passwordFile": password_file, "datacenter": "DC0", "hosts": hosts, "templates": templates,
            "nodeNamePrefix": format!("{}-", self.ns), "labels": {"vmlet.io/test": self.ns},
        });
        match trust {
            VCenterTrust::Thumbprint(thumbprint) => entry["thumbprint"] = json!(thumbprint),
            VCenterTrust::CaFile(file) => entry["caFile"] = json!(file),
        }
        for (key, value) in extra.as_object().expect("extra vcenters[] fields: an object") {
            entry[key] = value.clone();
        }
        config["vcenters"] = json!([entry]);
        self.nodes = hosts.iter().map(|h| self.node(&vmlet::vcenters::node_name_of_host(h))).collect();
        std::fs::write(self.dir.join("vmlet.yaml"), serde_yaml::to_string(&config).unwrap()).unwrap();
    }

    /// [`TestEnv::write_vmlet_on_vcenter`], then start vmlet with it.
    pub fn start_vmlet_on_vcenter(&mut self, hosts: &[&str], templates: &[&str], trust: &VCenterTrust) {
        self.write_vmlet_on_vcenter(hosts, templates, trust);
        self.restart_vmlet();
    }

    /// [`TestEnv::write_vmlet_on_vcenter_with`], then start vmlet with it.
    pub fn start_vmlet_on_vcenter_with(
        &mut self,
        hosts: &[&str],
        templates: &[&str],
        trust: &VCenterTrust,
        extra: serde_json::Value,
    ) {
        self.write_vmlet_on_vcenter_with(hosts, templates, trust, extra);
        self.restart_vmlet();
    }

    /// Run vmlet with `<dir>/vmlet.yaml` until it exits by itself (within
    /// [`VMLET_EXIT`]; panics if it does not): its exit status and its log
    /// (`<dir>/exit.log`).
    pub fn run_vmlet_to_exit(&mut self) -> (ExitStatus, String) {
        self.kill_vmlet();
        let mut child = self.spawn_vmlet("vmlet.yaml", "exit.log", vmlet_identity());
        let status = wait_within(&mut child, VMLET_EXIT);
        if status.is_none() {
            let _ = kill_and_reap(&mut child, VMLET_EXIT);
        }
        let log = std::fs::read_to_string(self.dir.join("exit.log")).unwrap_or_default();
        (status.unwrap_or_else(|| panic!("vmlet still ran {VMLET_EXIT:?} after it started:\n{log}")), log)
    }

    /// Start vmlet again with the same config (after [`TestEnv::kill_vmlet`]).
    pub fn restart_vmlet(&mut self) {
        let kubeconfig = self.vmlet_kubeconfig.clone().unwrap_or_else(|| vmlet_identity().clone());
        self.vmlet = Some(self.spawn_vmlet("vmlet.yaml", "vmlet.log", &kubeconfig));
    }

    /// The running vmlet's process id.
    pub fn vmlet_pid(&self) -> u32 {
        self.vmlet.as_ref().expect("vmlet running").id()
    }

    /// kill -9 vmlet, as a crash would, and reap it (within [`VMLET_EXIT`]:
    /// panics, unless already panicking, if it is still not gone then).
    pub fn kill_vmlet(&mut self) {
        kill_vmlet_process(self.vmlet.take());
    }

    /// The config of member `name` serving `hosts` (state in
    /// `<dir>/<name>-state`), written to `<dir>/<name>.yaml`; its hosts join
    /// the test's nodes (removed at the end). Returns its kubelet API port.
    fn write_member_config(&mut self, name: &str, hosts: &[Host<'_>]) -> u16 {
        let (port, nodes) = (self.kubelet_port, self.nodes.clone());
        let mut config = self.vmlet_config(hosts, true, name);
        config["stateDir"] = json!(self.dir.join(format!("{name}-state")));
        let member_port = self.kubelet_port;
        self.kubelet_port = port;
        self.nodes = nodes.into_iter().chain(hosts.iter().map(|h| self.node(h.suffix))).collect();
        std::fs::write(self.dir.join(format!("{name}.yaml")), serde_yaml::to_string(&config).unwrap()).unwrap();
        member_port
    }

    /// Start another vmlet process of this test, `name`, serving `hosts`,
    /// that takes part in the controllers' election like every other
    /// (config `<dir>/<name>.yaml`, log `<dir>/<name>.log`, identity
    /// [`TestEnv::identity`]`(name)`). Returns its kubelet API port.
    pub fn start_member(&mut self, name: &str, hosts: &[Host<'_>]) -> u16 {
        let port = self.write_member_config(name, hosts);
        let child = self.spawn_vmlet(&format!("{name}.yaml"), &format!("{name}.log"), vmlet_identity());
        self.members.push((name.to_owned(), child));
        port
    }

    /// Run vmlet process `name` serving `hosts` until it exits by itself
    /// (within [`VMLET_EXIT`]; panics if it does not): its exit status and
    /// its log.
    pub fn run_member_to_exit(&mut self, name: &str, hosts: &[Host<'_>]) -> (ExitStatus, String) {
        self.write_member_config(name, hosts);
        let log = format!("{name}.log");
        let mut child = self.spawn_vmlet(&format!("{name}.yaml"), &log, vmlet_identity());
        let status = wait_within(&mut child, VMLET_EXIT);
        if status.is_none() {
            let _ = kill_and_reap(&mut child, VMLET_EXIT);
        }
        let log = std::fs::read_to_string(self.dir.join(log)).unwrap_or_default();
        (status.unwrap_or_else(|| panic!("vmlet {name} still ran {VMLET_EXIT:?} after it started:\n{log}")), log)
    }

    fn take_member(&mut self, name: &str) -> Child {
        let at = self.members.iter().position(|(n, _)| n == name).unwrap_or_else(|| panic!("no member {name}"));
        self.members.remove(at).1
    }

    /// Send `signal` (`STOP`, `CONT`, ...) to member `name`, which keeps
    /// running as far as the harness is concerned.
    pub fn signal_member(&self, name: &str, signal: &str) {
        let (_, child) = self.members.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no member {name}"));
        let mut kill = Command::new("kill");
        kill.args([format!("-{signal}"), child.id().to_string()]);
        let sent = output_within(&mut kill, Duration::from_secs(10));
        assert!(sent.status.success(), "kill -{signal} {}: {}", child.id(), String::from_utf8_lossy(&sent.stderr));
    }

    /// kill -9 member `name`, as a crash would, and reap it.
    pub fn kill_member(&mut self, name: &str) {
        kill_vmlet_process(Some(self.take_member(name)));
    }

    /// Stop member `name` as systemd would (SIGTERM) and reap it: its exit
    /// status (panics if it is not gone within [`VMLET_EXIT`]).
    pub fn terminate_member(&mut self, name: &str) -> ExitStatus {
        let mut child = self.take_member(name);
        let terminated = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        assert!(terminated.is_ok_and(|s| s.success()), "kill -TERM {}", child.id());
        match wait_within(&mut child, VMLET_EXIT) {
            Some(status) => status,
            None => {
                let _ = kill_and_reap(&mut child, VMLET_EXIT);
                panic!("vmlet {name} was not gone {VMLET_EXIT:?} after SIGTERM");
            }
        }
    }

    /// Run kubectl in this namespace; panics with its stderr unless it succeeds.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let out = self.kubectl_output(args);
        assert!(out.status.success(), "{}", failed(&format!("kubectl {args:?}"), &out));
        String::from_utf8(out.stdout).unwrap()
    }

    /// A kubectl command for this namespace (`KUBECONFIG` and `-n` set), to
    /// which the caller adds arguments and environment, and runs through
    /// [`deadline`].
    pub fn kubectl_command(&self) -> Command {
        let cluster = cluster();
        let mut kubectl = Command::new(cluster.bin.join("kubectl"));
        kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(["-n", &self.ns]);
        kubectl
    }

    /// Run kubectl in this namespace and return its output, successful or not;
    /// panics if it does not finish within [`kubectl_deadline`].
    pub fn kubectl_output(&self, args: &[&str]) -> Output {
        output_within(self.kubectl_command().args(args), kubectl_deadline(args))
    }

    /// [`TestEnv::kubectl_output`] that returns a timeout instead of panicking:
    /// for [`TestEnv::diagnostics`] and cleanup in `Drop`, which may run while
    /// the test is already panicking (a second panic would abort the binary).
    fn kubectl_unless_timed_out(&self, args: &[&str]) -> Result<Output, deadline::TimedOut> {
        deadline::run(self.kubectl_command().args(args), kubectl_deadline(args))
    }

    /// kubectl for cleanup: a timeout is reported on stderr, not a panic.
    fn cleanup_kubectl(&self, args: &[&str]) -> Option<Output> {
        self.kubectl_unless_timed_out(args)
            .map_err(|timed_out| eprintln!("cleanup of namespace {}: {timed_out}", self.ns))
            .ok()
    }

    /// `kubectl apply -f -` of `yaml` in this namespace, within [`KUBECTL`].
    pub fn apply(&self, yaml: &str) -> Output {
        run_with_stdin(self.kubectl_command().args(["apply", "-f", "-"]), yaml.as_bytes(), KUBECTL)
            .unwrap_or_else(|timed_out| panic!("{timed_out}"))
    }

    /// A VirtualMachine `name` pinned to this test's hosts, with `spec` merged
    /// over `{replicas: 1, shutdownTimeoutSeconds: 2}`.
    pub fn vm_object(&self, name: &str, spec: &serde_json::Value) -> serde_json::Value {
        let mut full = json!({"replicas": 1, "shutdownTimeoutSeconds": 2, "nodeSelector": {"vmlet.io/test": self.ns}});
        for (k, v) in spec.as_object().unwrap() {
            full[k] = v.clone();
        }
        json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "metadata": {"name": name}, "spec": full})
    }

    /// Apply a VirtualMachine `name` (see [`TestEnv::vm_object`]).
    pub fn apply_vm(&self, name: &str, spec: serde_json::Value) {
        let vm = self.vm_object(name, &spec);
        let out = self.apply(&serde_yaml::to_string(&vm).unwrap());
        assert!(out.status.success(), "apply VM {name}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Apply VirtualMachines `names`, all with `spec`, in one `kubectl apply`
    /// (one List), so that they reach vmlet at once.
    pub fn apply_vms(&self, names: &[String], spec: serde_json::Value) {
        let items: Vec<_> = names.iter().map(|name| self.vm_object(name, &spec)).collect();
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        let out = self.apply(&serde_yaml::to_string(&list).unwrap());
        assert!(out.status.success(), "apply {} VMs: {}", names.len(), String::from_utf8_lossy(&out.stderr));
    }

    /// The VirtualMachine API of this namespace.
    pub fn vms(&self) -> Api<VirtualMachine> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The Pod API of this namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// What the guest of `pod` prints for the shell script `script`
    /// (`kubectl exec <pod> -- sh -c <script>`, trimmed), once it runs it:
    /// retried until it succeeds (the guest agent answers some seconds
    /// after the VM runs).
    pub async fn exec_stdout(&self, pod: &str, script: &str) -> String {
        self.wait_for(&format!("the guest of {pod} to run {script:?}"), || {
            let out = self.kubectl_output(&["exec", pod, "--", "sh", "-c", script]);
            async move { out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()) }
        })
        .await
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

    /// The message the container of VM `vm`'s pod waits with, once it
    /// waits with `reason`.
    pub async fn wait_waiting(&self, vm: &str, reason: &str) -> String {
        let pod = self.pod_of(vm).await;
        let pods = self.pods();
        self.wait_for(&format!("the pod of VM {vm} to wait with reason {reason}"), || {
            let (pods, pod) = (pods.clone(), pod.clone());
            async move {
                let status = pods.get_opt(&pod).await.ok()??.status?;
                let waiting = status.container_statuses?.first()?.state.clone()?.waiting?;
                (waiting.reason.as_deref() == Some(reason)).then(|| waiting.message.unwrap_or_default())
            }
        })
        .await
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

    /// Wait until pod `name` of `pods` (any namespace's pod API) is Failed;
    /// returns its status reason (`NotAVirtualMachine` for a refused pod).
    pub async fn wait_pod_failed(&self, pods: &Api<Pod>, name: &str) -> Option<String> {
        self.wait_for(&format!("pod {name} to be Failed"), || {
            let pods = pods.clone();
            async move {
                let status = pods.get(name).await.ok()?.status?;
                (status.phase.as_deref() == Some("Failed")).then_some(status.reason)
            }
        })
        .await
    }

    /// The name of VM `vm`'s current pod (`status.podName`, `<vm>-<suffix>`),
    /// once the controller has named one and the pod exists.
    pub async fn pod_of(&self, vm: &str) -> String {
        let (vms, pods) = (self.vms(), self.pods());
        self.wait_for(&format!("a pod of VirtualMachine {vm}"), || {
            let (vms, pods) = (vms.clone(), pods.clone());
            async move {
                let name = vms.get_opt(vm).await.ok()??.status?.pod_name?;
                pods.get_opt(&name).await.ok()??;
                Some(name)
            }
        })
        .await
    }

    /// VM `vm`'s current pod, once it has one.
    pub async fn vm_pod(&self, vm: &str) -> Pod {
        let name = self.pod_of(vm).await;
        self.pods().get(&name).await.expect("the VM's current pod")
    }

    /// Wait until Node `name` exists and is Ready; returns it.
    pub async fn wait_node_ready(&self, name: &str) -> Node {
        let nodes = self.nodes_api();
        self.wait_for(&format!("node {name} Ready"), || {
            let nodes = nodes.clone();
            async move {
                let node = nodes.get_opt(name).await.ok()??;
                let ready =
                    node.status.as_ref()?.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
                ready.then_some(node)
            }
        })
        .await
    }

    /// Wait until pod `name` is Running on a node; returns the node.
    pub async fn wait_pod_running(&self, name: &str) -> String {
        let pods = self.pods();
        self.wait_for(&format!("pod {name} Running"), || {
            let pods = pods.clone();
            async move {
                let pod = pods.get_opt(name).await.ok()??;
                let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
                running.then_some(pod.spec?.node_name?)
            }
        })
        .await
    }

    /// Wait until VM `vm` has no pod left (label `vmlet.io/vm=<vm>`).
    pub async fn wait_vm_pods_gone(&self, vm: &str) {
        let pods = self.pods();
        let selector = format!("vmlet.io/vm={vm}");
        self.wait_for(&format!("the pods of VirtualMachine {vm} gone"), || {
            let pods = pods.clone();
            let params = kube::api::ListParams::default().labels(&selector);
            async move { pods.list(&params).await.ok().and_then(|l| l.items.is_empty().then_some(())) }
        })
        .await
    }

    /// vmlet's log and where the control plane's logs are.
    pub fn diagnostics(&self) -> String {
        let tail_of = |file: &str, lines: usize| {
            let log = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(lines).collect::<Vec<_>>().into_iter().rev().collect();
            tail.join("\n")
        };
        let members: String = self
            .members
            .iter()
            .map(|(name, _)| format!("--- last lines of {name}.log:\n{}\n", tail_of(&format!("{name}.log"), 30)))
            .collect();
        let pods = match self.kubectl_unless_timed_out(&["get", "vm,pods,events", "-o", "wide"]) {
            Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
            Err(timed_out) => timed_out.to_string(),
        };
        format!(
            "--- kubectl get vm,pods,events -n {}:\n{}\n--- last lines of {}:\n{}\n{members}--- control plane logs: {}",
            self.ns,
            pods,
            self.dir.join("vmlet.log").display(),
            tail_of("vmlet.log", 60),
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
    /// Every kubectl call has its deadline; one that times out is reported on
    /// stderr and cleanup goes on.
    fn drop(&mut self) {
        if self.vmlet.is_some() || !self.members.is_empty() {
            self.cleanup_kubectl(&["delete", "virtualmachines", "--all", "--wait=true", "--timeout=90s"]);
        }
        self.kill_vmlet();
        self.kill_controller();
        for (_, member) in std::mem::take(&mut self.members) {
            kill_vmlet_process(Some(member));
        }
        let leftover = self.cleanup_kubectl(&["get", "virtualmachines", "-o", "name"]).map(|out| out.stdout);
        for vm in String::from_utf8_lossy(&leftover.unwrap_or_default()).lines() {
            self.cleanup_kubectl(&["patch", vm, "--type=merge", "-p", r#"{"metadata":{"finalizers":null}}"#]);
        }
        self.cleanup_kubectl(&["delete", "namespace", &self.ns, "--wait=false"]);
        for node in &self.nodes {
            self.cleanup_kubectl(&["delete", "node", node, "--wait=false"]);
        }
    }
}

/// A guest script that prints the device (`vdb`) whose virtio serial is
/// `name`: the serial udev names `/dev/disk/by-id/virtio-<name>` after (the
/// test guest has no udev, so it reads the kernel's attribute).
pub fn device_named(name: &str) -> String {
    format!(
        r#"for d in /sys/block/vd*; do if [ "$(cat $d/serial 2>/dev/null)" = {name} ]; then echo ${{d##*/}}; fi; done"#
    )
}

/// A cluster-scoped `VirtualMachineImage` of the catalogue that a test made
/// as an administrator; deleted on drop (with kubectl: a drop cannot wait
/// for the test's runtime).
pub struct CatalogueImage(pub String);

impl CatalogueImage {
    /// Create `VirtualMachineImage` `name` with `spec` as the administrator.
    pub fn create(env: &TestEnv, name: &str, spec: serde_json::Value) -> CatalogueImage {
        let image = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineImage",
                           "metadata": {"name": name}, "spec": spec});
        let applied = env.apply(&image.to_string());
        assert!(applied.status.success(), "VirtualMachineImage {name}: {}", String::from_utf8_lossy(&applied.stderr));
        CatalogueImage(name.to_owned())
    }
}

impl Drop for CatalogueImage {
    fn drop(&mut self) {
        let cluster = cluster();
        let mut kubectl = Command::new(cluster.bin.join("kubectl"));
        kubectl.env("KUBECONFIG", &cluster.kubeconfig);
        kubectl.args(["delete", &format!("virtualmachineimage/{}", self.0), "--ignore-not-found", "--wait=false"]);
        let _ = deadline::output_within(&mut kubectl, kubectl_deadline(&["delete"]));
    }
}
