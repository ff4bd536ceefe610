//! `vmlet bootstrap` against the real control plane: a bootstrap identity
//! that holds only `system:node-bootstrapper` (deploy/bootstrap-rbac.yaml,
//! a token minted for its ServiceAccount) obtains a host's client
//! certificate and the kubelet API's serving certificate; kube-controller-
//! manager signs what `kubectl certificate approve` approved. Each test uses
//! host names of its own, so the tests run in parallel.

mod common;

use common::deadline::{output_within, wait_within, KUBECTL};
use common::DEADLINE;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, ListParams};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long `vmlet bootstrap` may wait for each certificate in these tests;
/// the test's own deadlines are longer, so a failure names the CSR.
const WAIT_SECONDS: &str = "300";

/// Deadline of an `openssl x509` call.
const OPENSSL: Duration = Duration::from_secs(30);

/// How long a whole `vmlet bootstrap` run may take here.
const BOOTSTRAP_RUN: Duration = Duration::from_secs(2 * 300 + 60);

/// kubectl with the cluster's admin kubeconfig.
fn kubectl(args: &[&str]) -> String {
    let cluster = common::cluster();
    let out = output_within(
        Command::new(cluster.bin.join("kubectl")).env("KUBECONFIG", &cluster.kubeconfig).args(args),
        common::kubectl_deadline(args),
    );
    assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A host name no other test uses.
fn unique_host(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}-{:x}{:x}", std::process::id(), nanos)
}

/// A kubeconfig for the ServiceAccount kube-system/vmlet-bootstrap of
/// deploy/bootstrap-rbac.yaml (applied here, once per test binary: two
/// client-side applies racing on an empty cluster both try to create, and
/// one fails with AlreadyExists), with a fresh token: the bootstrap identity
/// an administrator would hand to a host.
fn bootstrap_kubeconfig(dir: &Path) -> PathBuf {
    static APPLIED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    APPLIED.get_or_init(|| {
        kubectl(&["apply", "-f", common::repo().join("deploy/bootstrap-rbac.yaml").to_str().unwrap()]);
    });
    let token = kubectl(&["-n", "kube-system", "create", "token", "vmlet-bootstrap", "--duration=30m"]);
    let admin = kube::config::Kubeconfig::read_from(&common::cluster().kubeconfig).unwrap();
    let cluster = admin.clusters[0].cluster.as_ref().unwrap();
    let ca = cluster.certificate_authority.as_ref().expect("the admin kubeconfig names its CA file");
    let path = dir.join("bootstrap-kubeconfig");
    let yaml = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": cluster.server, "certificate-authority": ca}}],
        "users": [{"name": "bootstrap", "user": {"token": token.trim()}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "bootstrap"}}],
        "current-context": "c",
    });
    std::fs::write(&path, serde_yaml::to_string(&yaml).unwrap()).unwrap();
    path
}

/// `vmlet bootstrap` for `host` into `out`, started (its output in files
/// under `out`'s parent).
fn start_bootstrap(kubeconfig: Option<&Path>, host: &str, out: &Path, extra: &[&str]) -> Child {
    let logs = out.parent().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_vmlet"));
    command.arg("bootstrap").args(["--host", host, "--out-dir"]).arg(out);
    command.args(["--wait-seconds", WAIT_SECONDS]).args(extra).env_remove("VMLET_BOOTSTRAP_KUBECONFIG");
    if let Some(kubeconfig) = kubeconfig {
        command.arg("--bootstrap-kubeconfig").arg(kubeconfig);
    }
    command
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(logs.join(format!("{host}.stdout"))).unwrap())
        .stderr(std::fs::File::create(logs.join(format!("{host}.stderr"))).unwrap())
        .spawn()
        .expect("start vmlet bootstrap")
}

/// What the run for `host` wrote to stderr.
fn stderr_of(out: &Path, host: &str) -> String {
    std::fs::read_to_string(out.parent().unwrap().join(format!("{host}.stderr"))).unwrap_or_default()
}

/// The CertificateSigningRequests made for `host` (by their annotation).
async fn requests_of(host: &str) -> Vec<CertificateSigningRequest> {
    let api: Api<CertificateSigningRequest> = Api::all(common::client().await);
    let all = api.list(&ListParams::default()).await.expect("list CSRs");
    all.items
        .into_iter()
        .filter(|csr| {
            csr.metadata.annotations.as_ref().and_then(|a| a.get(vmlet::bootstrap::request::HOST_ANNOTATION))
                == Some(&host.to_owned())
        })
        .collect()
}

/// Until `child` exits: `decide` each new request of `host` with kubectl
/// (`approve` or `deny`). Returns the exit status and the requests decided.
async fn decide_until_exit(child: &mut Child, host: &str, decide: &str, out: &Path) -> (ExitStatus, Vec<String>) {
    let start = Instant::now();
    let mut decided = Vec::new();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, decided);
        }
        for csr in requests_of(host).await {
            let name = csr.metadata.name.unwrap();
            if !decided.contains(&name) {
                kubectl(&["certificate", decide, &name]);
                decided.push(name);
            }
        }
        if start.elapsed() > BOOTSTRAP_RUN {
            let status = common::deadline::kill_and_reap(child, Duration::from_secs(10));
            panic!("vmlet bootstrap for {host} still runs ({status:?}); stderr:\n{}", stderr_of(out, host));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Who the kubeconfig authenticates as: (username, groups).
fn whoami(kubeconfig: &Path) -> (String, Vec<String>) {
    let cluster = common::cluster();
    let out = output_within(
        Command::new(cluster.bin.join("kubectl")).env("KUBECONFIG", kubeconfig).args(["auth", "whoami", "-o", "json"]),
        KUBECTL,
    );
    assert!(out.status.success(), "kubectl auth whoami: {}", String::from_utf8_lossy(&out.stderr));
    let review: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let user = &review["status"]["userInfo"];
    let groups = user["groups"].as_array().unwrap().iter().map(|g| g.as_str().unwrap().to_owned()).collect();
    (user["username"].as_str().unwrap().to_owned(), groups)
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).permissions().mode() & 0o777
}

#[tokio::test]
async fn an_approved_host_authenticates_as_itself_and_serves_with_its_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = bootstrap_kubeconfig(dir.path());
    let out = dir.path().join("etc-vmlet");
    let host = unique_host("bt-ok");
    let flags = ["--serving", "--serving-san", "127.0.0.1", "--serving-san", "kvm.example"];
    let mut child = start_bootstrap(Some(&kubeconfig), &host, &out, &flags);
    let (status, requests) = decide_until_exit(&mut child, &host, "approve", &out).await;
    assert!(status.success(), "vmlet bootstrap failed ({status}):\n{}", stderr_of(&out, &host));
    assert_eq!(requests.len(), 2, "one client and one serving request: {requests:?}");

    // The client certificate is the host's identity, in the vmlets' group.
    let (user, groups) = whoami(&out.join("kubeconfig"));
    assert_eq!(user, format!("system:vmlet:{host}"));
    assert!(groups.contains(&"system:vmlets".to_owned()), "{groups:?}");
    assert_eq!(mode(&out.join("kubeconfig")), 0o600);
    assert_eq!(mode(&out.join("pki/vmlet-client.key")), 0o600);
    assert_eq!(mode(&out.join("pki/kubelet-serving.key")), 0o600);

    // The serving certificate names the node and its addresses.
    let text = output_within(
        Command::new("openssl")
            .args(["x509", "-noout", "-nameopt", "RFC2253", "-subject", "-ext", "subjectAltName", "-in"])
            .arg(out.join("pki/kubelet-serving.crt")),
        OPENSSL,
    );
    assert!(text.status.success(), "openssl x509: {}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains(&format!("CN=system:node:{host}")) && text.contains("O=system:nodes"), "{text}");
    // The signer writes DNS names before IP addresses.
    let mut sans: Vec<&str> = text.lines().last().unwrap().trim().split(", ").collect();
    sans.sort_unstable();
    let node = format!("DNS:{host}");
    assert_eq!(sans, [node.as_str(), "DNS:kvm.example", "IP Address:127.0.0.1"]);

    // A rerun finds both current: no request, no bootstrap identity needed,
    // nothing rewritten.
    let before = std::fs::read(out.join("kubeconfig")).unwrap();
    let mut again = start_bootstrap(None, &host, &out, &flags);
    let status = wait_within(&mut again, BOOTSTRAP_RUN).expect("the rerun exits");
    assert!(status.success(), "rerun failed ({status}):\n{}", stderr_of(&out, &host));
    assert_eq!(std::fs::read(out.join("kubeconfig")).unwrap(), before);
    assert_eq!(requests_of(&host).await.len(), 2, "the rerun made no request");

    for name in requests {
        kubectl(&["delete", "csr", &name, "--ignore-not-found"]);
    }
}

#[tokio::test]
async fn a_denied_request_fails_the_bootstrap_naming_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = bootstrap_kubeconfig(dir.path());
    let out = dir.path().join("etc-vmlet");
    let host = unique_host("bt-denied");
    let mut child = start_bootstrap(Some(&kubeconfig), &host, &out, &[]);
    let (status, requests) = decide_until_exit(&mut child, &host, "deny", &out).await;
    assert!(!status.success(), "a denied request must fail the bootstrap");
    let stderr = stderr_of(&out, &host);
    assert!(stderr.contains("was denied: KubectlDeny"), "{stderr}");
    assert!(stderr.contains(&requests[0]), "the message names the request: {stderr}");
    assert!(!out.join("kubeconfig").exists(), "nothing is written for a denied request");
    for name in requests {
        kubectl(&["delete", "csr", &name, "--ignore-not-found"]);
    }
}

#[tokio::test]
async fn a_first_run_without_bootstrap_kubeconfig_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("etc-vmlet");
    let host = unique_host("bt-nocreds");
    let mut child = start_bootstrap(None, &host, &out, &[]);
    let status = wait_within(&mut child, DEADLINE).expect("vmlet bootstrap exits");
    assert_eq!(status.code(), Some(64), "{}", stderr_of(&out, &host));
    assert!(stderr_of(&out, &host).contains("--bootstrap-kubeconfig is required"));
}
