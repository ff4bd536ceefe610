//! The kubelet API over real sockets: TLS with client certificates against the
//! cluster CA, authentication and authorization against the real API server
//! (TokenReview, SubjectAccessReview), exec over WebSocket v5 and SPDY/3.1,
//! and console logs. The provider is a small fake (Console + GuestExec +
//! Stats): these tests check the protocols, not a guest.

mod common;

use http_body_util::BodyExt;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_util::sync::CancellationToken;
use vmlet::api::{ApiConfig, PodDirectory, PodEntry, Server};
use vmlet::streams::spdy::frame::{Frame, FrameDecoder, FrameEncoder, FLAG_FIN};
use vmlet_provider::{
    Console, ConsoleChunk, Error, ErrorKind, GuestExec, HostInfo, Provider, Stats, StreamIo, VmId, VmSpec, VmStats,
    VmStatus,
};

// ---------------------------------------------------------------- fakes

/// A provider whose guest answers a few commands; `capable: false` has none
/// of the optional capabilities.
struct FakeProvider {
    capable: bool,
}

#[async_trait::async_trait]
impl Provider for FakeProvider {
    fn kind(&self) -> &'static str {
        "fake"
    }
    async fn ping(&self) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn host_info(&self) -> vmlet_provider::Result<HostInfo> {
        Ok(HostInfo {
            cpus: 1,
            memory_bytes: 1 << 30,
            architecture: "amd64".into(),
            hypervisor: "fake".into(),
            accelerator: None,
            storage_roots: vec![],
        })
    }
    async fn list(&self) -> vmlet_provider::Result<Vec<VmStatus>> {
        Ok(vec![])
    }
    async fn get(&self, _: &VmId) -> vmlet_provider::Result<Option<VmStatus>> {
        Ok(None)
    }
    async fn ensure_defined(&self, _: &VmSpec) -> vmlet_provider::Result<VmStatus> {
        Err(Error::new("define", ErrorKind::Unsupported, "fake"))
    }
    async fn start(&self, _: &VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn shutdown(&self, _: &VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn destroy(&self, _: &VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn undefine(&self, _: &VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    fn console(&self) -> Option<&dyn Console> {
        self.capable.then_some(self as &dyn Console)
    }
    fn guest_exec(&self) -> Option<&dyn GuestExec> {
        self.capable.then_some(self as &dyn GuestExec)
    }
    fn stats(&self) -> Option<&dyn Stats> {
        self.capable.then_some(self as &dyn Stats)
    }
}

#[async_trait::async_trait]
impl GuestExec for FakeProvider {
    /// `echo ARGS…`, `exit N`, `cat` (stdin to stdout), `big N` (N bytes of
    /// `x`), `warn MSG` (stderr, exit 2).
    async fn exec(&self, _: &VmId, command: &[String], mut io: StreamIo) -> vmlet_provider::Result<i32> {
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        let out = io.stdout.take();
        match args.as_slice() {
            ["echo", rest @ ..] => {
                out.unwrap().send(format!("{}\n", rest.join(" ")).into_bytes()).await.unwrap();
                Ok(0)
            }
            ["exit", code] => Ok(code.parse().unwrap()),
            ["cat"] => {
                let mut stdin = io.stdin.take().unwrap();
                let out = out.unwrap();
                while let Some(data) = stdin.recv().await {
                    out.send(data).await.unwrap();
                }
                Ok(0)
            }
            ["big", n] => {
                let out = out.unwrap();
                let mut left: usize = n.parse().unwrap();
                while left > 0 {
                    let chunk = left.min(10_000);
                    out.send(vec![b'x'; chunk]).await.unwrap();
                    left -= chunk;
                }
                Ok(0)
            }
            ["warn", msg] => {
                io.stderr.take().unwrap().send(msg.as_bytes().to_vec()).await.unwrap();
                Ok(2)
            }
            _ => Err(Error::new("exec", ErrorKind::InvalidInput, format!("unknown command {args:?}"))),
        }
    }
}

#[async_trait::async_trait]
impl Console for FakeProvider {
    async fn console_output(&self, _: &VmId, _: u64, _: usize) -> vmlet_provider::Result<ConsoleChunk> {
        Ok(ConsoleChunk { boot: "0".into(), data: vec![], next_offset: 0 })
    }
    /// Echoes the input upper-cased until stdin closes.
    async fn attach(&self, _: &VmId, mut io: StreamIo) -> vmlet_provider::Result<()> {
        let out = io.stdout.take().unwrap();
        let mut stdin = io.stdin.take().unwrap();
        while let Some(data) = stdin.recv().await {
            out.send(data.to_ascii_uppercase()).await.unwrap();
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Stats for FakeProvider {
    async fn stats(&self, _: &VmId) -> vmlet_provider::Result<VmStats> {
        Ok(VmStats { cpu_usage_ns: 2_500_000_000, memory_working_set_bytes: 256 << 20 })
    }
}

struct Directory {
    pods: HashMap<(String, String), PodEntry>,
}

impl PodDirectory for Directory {
    fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry> {
        self.pods.get(&(namespace.to_owned(), name.to_owned())).cloned()
    }
    fn pods(&self) -> Vec<PodEntry> {
        self.pods.values().cloned().collect()
    }
}

// ---------------------------------------------------------------- harness

const CONSOLE: &str = "\
2024-05-01T10:00:00Z stdout F first boot
2024-05-01T11:00:00Z stdout F Linux version 6.1
2024-05-01T11:00:01.25Z stdout P login:\x20
2024-05-01T11:00:05Z stdout F root
2024-05-01T11:00:06Z stdout F # uptime
";

fn pki() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/vmlet/cluster/pki")
}

struct Kubelet {
    addr: SocketAddr,
    serving_cert: CertificateDer<'static>,
    _dir: tempfile::TempDir,
    stop: CancellationToken,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Start the API on 127.0.0.1:0 with a self-signed serving certificate (files)
/// and the cluster CA as client CA, serving pods `vm-1` (capable provider,
/// console history on disk) and `plain` (provider without capabilities).
async fn start_kubelet() -> Kubelet {
    start_kubelet_with(None, &[]).await
}

/// As [`start_kubelet`], serving with `serving` (cert and key files) instead of
/// a fresh self-signed certificate, and with `extra` VM pods `(namespace, name,
/// node)`.
async fn start_kubelet_with(serving: Option<(PathBuf, PathBuf)>, extra: &[(&str, &str, &str)]) -> Kubelet {
    start_kubelet_tuned(serving, extra, |_| {}).await
}

/// As [`start_kubelet_with`], with `tune` applied to the API's config.
async fn start_kubelet_tuned(
    serving: Option<(PathBuf, PathBuf)>,
    extra: &[(&str, &str, &str)],
    tune: impl FnOnce(&mut ApiConfig),
) -> Kubelet {
    common::cluster();
    let client = common::client().await;
    let dir = tempfile::tempdir().unwrap();
    let (cert_file, key_file, serving_cert) = match serving {
        Some((cert, key)) => {
            let der = CertificateDer::from_pem_file(&cert).unwrap();
            (cert, key, der)
        }
        None => {
            let serving = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
            std::fs::write(dir.path().join("tls.crt"), serving.cert.pem()).unwrap();
            std::fs::write(dir.path().join("tls.key"), serving.signing_key.serialize_pem()).unwrap();
            (dir.path().join("tls.crt"), dir.path().join("tls.key"), serving.cert.der().clone())
        }
    };
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let (previous, current) = CONSOLE.split_at(CONSOLE.find('\n').unwrap() + 1);
    std::fs::write(logs.join("0.log"), previous).unwrap();
    std::fs::write(logs.join("1.log"), current).unwrap();

    let pod = |ns: &str, name: &str, node: &str| -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}")},
                "spec": {"nodeName": node, "containers": [{"name": "vm", "image": "vmlet.io/virtual-machine"}]},
                "status": {"startTime": "2024-05-01T11:00:00Z"},
            }))
            .unwrap(),
        )
    };
    let entry = |ns: &str, name: &str, node: &str, capable: bool| PodEntry {
        pod: pod(ns, name, node),
        node: node.into(),
        provider: Arc::new(FakeProvider { capable }),
        vm: Some(VmId(format!("uid-{name}"))),
        task: false,
        log_dir: logs.clone(),
    };
    let mut pods = HashMap::from([
        (("ns".into(), "vm-1".into()), entry("ns", "vm-1", "host-a", true)),
        (("ns".into(), "plain".into()), entry("ns", "plain", "host-a", false)),
    ]);
    for (ns, name, node) in extra {
        pods.insert((ns.to_string(), name.to_string()), entry(ns, name, node, true));
    }
    // A pod on the node that failed the ownership check (crate::identity): a
    // copy of another namespace's VM pod, say. Its provider could do anything.
    pods.insert(
        ("attacker".into(), "forged".into()),
        PodEntry { vm: None, ..entry("attacker", "forged", "host-a", true) },
    );
    let directory = Directory { pods };
    let mut config = ApiConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        tls_cert_file: Some(cert_file),
        tls_key_file: Some(key_file),
        client_ca_file: Some(pki().join("ca.crt")),
        ..ApiConfig::default()
    };
    tune(&mut config);
    let server = Server::bind(config, Arc::new(directory), client).await.expect("bind the kubelet API");
    let addr = server.local_addr();
    let stop = CancellationToken::new();
    tokio::spawn(server.run(stop.clone()));
    Kubelet { addr, serving_cert, _dir: dir, stop }
}

/// How the test client authenticates.
#[derive(Clone, Copy)]
enum Credentials<'a> {
    None,
    /// The API server's kubelet-client certificate (system:masters).
    ApiServerCert,
    Token(&'a str),
}

impl Kubelet {
    async fn connect(&self, creds: Credentials<'_>) -> TlsStream<TcpStream> {
        self.try_connect(creds).await.expect("TLS handshake")
    }

    /// A TLS connection, or why the handshake failed.
    async fn try_connect(&self, creds: Credentials<'_>) -> std::io::Result<TlsStream<TcpStream>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.serving_cert.clone()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match creds {
            Credentials::ApiServerCert => {
                let chain: Vec<_> = CertificateDer::pem_file_iter(pki().join("kubelet-client.crt"))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
                let key = PrivateKeyDer::from_pem_file(pki().join("kubelet-client.key")).unwrap();
                builder.with_client_auth_cert(chain, key).unwrap()
            }
            _ => builder.with_no_client_auth(),
        };
        let tcp = TcpStream::connect(self.addr).await.unwrap();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        connector.connect(ServerName::try_from("127.0.0.1").unwrap(), tcp).await
    }

    /// Poll `path` (a new connection each time; a refused one is tried
    /// again) until its status satisfies `wanted`, to a generous deadline;
    /// that status and body.
    async fn wait_for_answer(
        &self,
        what: &str,
        creds: Credentials<'_>,
        path: &str,
        wanted: impl Fn(u16) -> bool,
    ) -> (u16, String) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            if let Ok(stream) = self.try_connect(creds).await {
                if let Some((status, body)) = Self::request(stream, creds, path).await {
                    if wanted(status) {
                        return (status, body);
                    }
                }
            }
            assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// One request on `stream`: status and body, or `None` when the
    /// connection broke.
    async fn request(stream: TlsStream<TcpStream>, creds: Credentials<'_>, path: &str) -> Option<(u16, String)> {
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
        tokio::spawn(conn);
        let mut req = hyper::Request::get(path).header("host", "127.0.0.1");
        if let Credentials::Token(token) = creds {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        let response =
            sender.send_request(req.body(http_body_util::Empty::<axum::body::Bytes>::new()).unwrap()).await.ok()?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// A plain request: status and body.
    async fn get(&self, creds: Credentials<'_>, path: &str) -> (u16, String) {
        let stream = self.connect(creds).await;
        Self::request(stream, creds, path).await.expect("a response")
    }
}

// ---------------------------------------------------------------- connection limits

/// Read from `stream` until the server closes it; panics past a generous
/// deadline (a hang guard, not a measurement).
async fn wait_closed_by_server(stream: &mut TlsStream<TcpStream>, what: &str) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    read.await.unwrap_or_else(|_| panic!("the server never closed {what}"));
}

#[tokio::test]
async fn connections_past_the_limit_are_closed_at_once_and_freed_slots_serve_again() {
    let kubelet = start_kubelet_tuned(None, &[], |c| c.max_connections = Some(2)).await;
    let first = kubelet.connect(Credentials::ApiServerCert).await;
    let second = kubelet.connect(Credentials::ApiServerCert).await;
    // Both slots are held by clients that say nothing: a third is closed
    // before its TLS handshake completes.
    assert!(kubelet.try_connect(Credentials::ApiServerCert).await.is_err(), "a third connection was served");
    drop(first);
    // Once the server saw the first go, its slot serves a request.
    let (_, served) =
        kubelet.wait_for_answer("a freed slot to serve /pods", Credentials::ApiServerCert, "/pods", |s| s == 200).await;
    assert!(served.contains("\"vm-1\""), "{served}");
    drop(second);
}

#[tokio::test]
async fn a_client_that_sends_no_or_half_a_request_header_is_cut_off() {
    let kubelet = start_kubelet_tuned(None, &[], |c| c.request_header_timeout_seconds = Some(2)).await;
    let mut silent = kubelet.connect(Credentials::ApiServerCert).await;
    let mut slow = kubelet.connect(Credentials::ApiServerCert).await;
    tokio::io::AsyncWriteExt::write_all(&mut slow, b"GET /pods HTTP/1.1\r\nhost: 127.0.0.1\r\n").await.unwrap();
    wait_closed_by_server(&mut silent, "a connection that sent nothing").await;
    wait_closed_by_server(&mut slow, "a connection that sent half a header").await;
    // An ordinary request is unaffected.
    assert_eq!(kubelet.get(Credentials::ApiServerCert, "/pods").await.0, 200);
}

#[tokio::test]
async fn exec_and_attach_past_the_pod_and_process_caps_get_429_until_a_stream_ends() {
    let kubelet = start_kubelet_tuned(None, &[("ns", "vm-2", "host-a")], |c| {
        c.max_streams = Some(3);
        c.max_streams_per_pod = Some(2);
    })
    .await;
    let cat = |pod: &str| format!("/exec/ns/{pod}/vm?command=cat&stdin=1&stdout=1");
    let first = websocket(&kubelet, &cat("vm-1")).await;
    let _second = websocket(&kubelet, "/attach/ns/vm-1/vm?stdin=1&stdout=1").await;
    // The pod's cap: refused before any upgrade, with why.
    let (status, message) = kubelet.get(Credentials::ApiServerCert, &cat("vm-1")).await;
    assert_eq!(status, 429, "{message}");
    assert!(message.contains("pod ns/vm-1 has 2 exec/attach/port-forward streams open"), "{message}");
    // Another pod has its own, until the process's cap.
    let _third = websocket(&kubelet, &cat("vm-2")).await;
    let (status, message) = kubelet.get(Credentials::ApiServerCert, "/attach/ns/vm-2/vm?stdout=1").await;
    assert_eq!(status, 429, "{message}");
    assert!(message.contains("this vmlet serves 3 exec/attach/port-forward streams"), "{message}");
    // A stream that ends frees its slot.
    drop(first);
    let (status, message) = kubelet
        .wait_for_answer("a slot of pod vm-1 to free", Credentials::ApiServerCert, &cat("vm-1"), |s| s != 429)
        .await;
    assert_eq!(status, 400, "without upgrade headers, past the caps: {message}");
}

#[tokio::test]
async fn metrics_count_requests_by_route_and_code_and_pods_by_node_and_phase() {
    let kubelet = start_kubelet().await;
    assert_eq!(kubelet.get(Credentials::ApiServerCert, "/pods").await.0, 200);
    assert_eq!(kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/nobody/vm").await.0, 404);
    assert_eq!(kubelet.get(Credentials::None, "/pods").await.0, 401);
    let (status, text) = kubelet.get(Credentials::ApiServerCert, "/metrics").await;
    assert_eq!(status, 200, "{text}");
    // Counters are process-wide and other tests of this binary count too:
    // each series is there with at least this test's requests.
    let value = |series: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("vmlet_kubelet_api_requests_total{route=\"/pods\",code=\"200\"}") >= 1);
    assert!(value("vmlet_kubelet_api_requests_total{route=\"/pods\",code=\"401\"}") >= 1);
    let logs = "vmlet_kubelet_api_requests_total{route=\"/containerLogs/{namespace}/{pod}/{container}\",code=\"404\"}";
    assert!(value(logs) >= 1);
    // The fake directory's pods have no phase.
    assert_eq!(value("vmlet_pods{node=\"host-a\",phase=\"Unknown\"}"), 3);
    assert!(text.contains("# TYPE vmlet_kubelet_api_streams_open gauge"), "{text}");
    // A client without nodes/metrics rights gets none.
    assert_eq!(kubelet.get(Credentials::None, "/metrics").await.0, 401);
}

// ---------------------------------------------------------------- authn/authz

#[tokio::test]
async fn requests_without_credentials_get_401() {
    let kubelet = start_kubelet().await;
    for path in ["/pods", "/healthz", "/containerLogs/ns/vm-1/vm", "/exec/ns/vm-1/vm?command=ls&stdout=1"] {
        let (status, _) = kubelet.get(Credentials::None, path).await;
        assert_eq!(status, 401, "{path}");
    }
    let (status, _) = kubelet.get(Credentials::Token("not-a-token"), "/pods").await;
    assert_eq!(status, 401, "an invalid token is no credential");
}

#[tokio::test]
async fn the_api_servers_client_certificate_is_authorized_by_subject_access_review() {
    let kubelet = start_kubelet().await;
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/pods").await;
    assert_eq!(status, 200, "{body}");
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["kind"], "PodList");
    let mut names: Vec<&str> =
        list["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap()).collect();
    names.sort();
    // Every pod bound to the nodes, as the kubelet lists them: also the one
    // that is no VM's own (it is listed, never served).
    assert_eq!(names, ["forged", "plain", "vm-1"]);
}

#[tokio::test]
async fn a_service_account_without_nodes_proxy_gets_403() {
    let kubelet = start_kubelet().await;
    let env = common::TestEnv::new("kubelet-api").await;
    let accounts: Api<ServiceAccount> = Api::namespaced(env.client.clone(), &env.ns);
    let account = serde_json::from_value(serde_json::json!({"metadata": {"name": "nobody"}})).unwrap();
    accounts.create(&PostParams::default(), &account).await.unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() }),
        ..Default::default()
    };
    let token = accounts.create_token_request("nobody", &PostParams::default(), &request).await.unwrap();
    let token = token.status.unwrap().token.unwrap();

    let (status, body) = kubelet.get(Credentials::Token(&token), "/pods").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(&format!("user=system:serviceaccount:{}:nobody", env.ns)), "{body}");
    assert!(body.contains("verb=get") && body.contains("pods proxy"), "{body}");
    let (status, body) = kubelet.get(Credentials::Token(&token), "/containerLogs/ns/vm-1/vm").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("subresource(s)=[proxy]"), "{body}");
}

// ---------------------------------------------------------------- logs

#[tokio::test]
async fn container_logs_tail_the_current_boot_with_timestamps() {
    let kubelet = start_kubelet().await;
    let (status, body) =
        kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/vm?tailLines=3&timestamps=true").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "2024-05-01T11:00:01.250000000Z login: root\n2024-05-01T11:00:06.000000000Z # uptime\n");

    let (_, body) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/vm").await;
    assert_eq!(body, "Linux version 6.1\nlogin: root\n# uptime\n");
    let (_, body) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/vm?previous=true").await;
    assert_eq!(body, "first boot\n");
    let (_, body) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/vm?limitBytes=5").await;
    assert_eq!(body, "Linux");

    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/other").await;
    assert_eq!(status, 404);
    assert!(body.contains("container \"other\" not found"), "{body}");
    let (status, _) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/nope/vm").await;
    assert_eq!(status, 404);
    let (status, _) = kubelet.get(Credentials::ApiServerCert, "/containerLogs/ns/vm-1/vm?tailLines=-1").await;
    assert_eq!(status, 422);
}

#[tokio::test]
async fn stats_and_metrics_come_from_the_providers_stats() {
    let kubelet = start_kubelet().await;
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/stats/summary").await;
    assert_eq!(status, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
    let pods = summary["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 1, "only the provider with stats reports: {body}");
    assert_eq!(pods[0]["podRef"]["name"], "vm-1");
    assert_eq!(pods[0]["containers"][0]["cpu"]["usageCoreNanoSeconds"], 2_500_000_000u64);
    assert_eq!(pods[0]["memory"]["workingSetBytes"], 256u64 << 20);
    let (status, text) = kubelet.get(Credentials::ApiServerCert, "/metrics/resource").await;
    assert_eq!(status, 200);
    assert!(
        text.contains("container_cpu_usage_seconds_total{container=\"vm\",namespace=\"ns\",pod=\"vm-1\"} 2.5 "),
        "{text}"
    );
    assert!(
        text.contains("container_memory_working_set_bytes{container=\"vm\",namespace=\"ns\",pod=\"vm-1\"} 268435456 "),
        "{text}"
    );
}

// ---------------------------------------------------------------- capabilities

#[tokio::test]
async fn a_provider_without_capabilities_answers_501_with_a_message() {
    let kubelet = start_kubelet().await;
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/exec/ns/plain/vm?command=ls&stdout=1").await;
    assert_eq!(status, 501);
    assert!(body.contains("fake provider of host host-a") && body.contains("guest exec"), "{body}");
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/attach/ns/plain/vm?stdin=1&stdout=1").await;
    assert_eq!(status, 501);
    assert!(body.contains("no serial console"), "{body}");
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/portForward/ns/plain?port=80").await;
    assert_eq!(status, 501);
    assert!(body.contains("fake provider of host host-a cannot reach guest ports"), "{body}");
}

#[tokio::test]
async fn port_forward_to_another_pod_uid_is_not_found() {
    let kubelet = start_kubelet().await;
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/portForward/ns/vm-1/some-other-uid").await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/portForward/ns/nothing").await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test]
async fn a_pod_that_is_not_a_vms_own_gets_403_for_exec_attach_logs_and_port_forward() {
    let kubelet = start_kubelet().await;
    for path in [
        "/portForward/attacker/forged?port=22",
        "/exec/attacker/forged/vm?command=cat&command=/proc/version&stdout=1",
        "/attach/attacker/forged/vm?stdin=1&stdout=1",
        "/containerLogs/attacker/forged/vm",
        "/containerLogs/attacker/forged/vm?follow=true",
    ] {
        let (status, body) = kubelet.get(Credentials::ApiServerCert, path).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("is not a VirtualMachine's pod"), "{path}: {body}");
    }
}

// ---------------------------------------------------------------- WebSocket

use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

async fn websocket(kubelet: &Kubelet, path: &str) -> tokio_tungstenite::WebSocketStream<TlsStream<TcpStream>> {
    let stream = kubelet.connect(Credentials::ApiServerCert).await;
    let mut request = format!("wss://127.0.0.1{path}").into_client_request().unwrap();
    request.headers_mut().insert("Sec-WebSocket-Protocol", "v5.channel.k8s.io, v4.channel.k8s.io".parse().unwrap());
    let (ws, response) = tokio_tungstenite::client_async(request, stream).await.expect("WebSocket upgrade");
    assert_eq!(response.headers()["sec-websocket-protocol"], "v5.channel.k8s.io");
    ws
}

/// Read until the server closes: bytes per channel.
async fn read_channels(ws: &mut tokio_tungstenite::WebSocketStream<TlsStream<TcpStream>>) -> HashMap<u8, Vec<u8>> {
    use futures::StreamExt;
    let mut channels: HashMap<u8, Vec<u8>> = HashMap::new();
    while let Some(message) = ws.next().await {
        match message.expect("WebSocket message") {
            Message::Binary(data) => channels.entry(data[0]).or_default().extend_from_slice(&data[1..]),
            Message::Close(_) => break,
            _ => {}
        }
    }
    channels
}

#[tokio::test]
async fn websocket_v5_exec_streams_stdout_and_reports_exit_codes() {
    use futures::SinkExt;
    let kubelet = start_kubelet().await;

    let mut ws = websocket(&kubelet, "/exec/ns/vm-1/vm?command=echo&command=hello&command=world&stdout=1").await;
    let channels = read_channels(&mut ws).await;
    assert_eq!(channels[&1], b"hello world\n");
    let status: serde_json::Value = serde_json::from_slice(&channels[&3]).unwrap();
    assert_eq!(status["status"], "Success");

    let mut ws = websocket(&kubelet, "/exec/ns/vm-1/vm?command=exit&command=3&stdout=1&stderr=1").await;
    let status: serde_json::Value = serde_json::from_slice(&read_channels(&mut ws).await[&3]).unwrap();
    assert_eq!(status["reason"], "NonZeroExitCode");
    assert_eq!(status["details"]["causes"][0], serde_json::json!({"reason": "ExitCode", "message": "3"}));

    // stdin, then the v5 close signal ends it.
    let mut ws = websocket(&kubelet, "/exec/ns/vm-1/vm?command=cat&stdin=1&stdout=1").await;
    ws.send(Message::Binary([&[0u8][..], b"ping\n"].concat().into())).await.unwrap();
    ws.send(Message::Binary(vec![255u8, 0].into())).await.unwrap();
    let channels = read_channels(&mut ws).await;
    assert_eq!(channels[&1], b"ping\n");

    // attach: the live console, both ways.
    let mut ws = websocket(&kubelet, "/attach/ns/vm-1/vm?stdin=1&stdout=1&tty=1").await;
    ws.send(Message::Binary([&[4u8][..], br#"{"Width":120,"Height":40}"#].concat().into())).await.unwrap();
    ws.send(Message::Binary([&[0u8][..], b"ls\r"].concat().into())).await.unwrap();
    ws.send(Message::Binary(vec![255u8, 0].into())).await.unwrap();
    let channels = read_channels(&mut ws).await;
    assert_eq!(channels[&1], b"LS\r");
}

// ---------------------------------------------------------------- SPDY

/// A minimal SPDY/3.1 client, as the API server's: upgrade, open streams,
/// collect data per stream until every stream has FIN.
struct SpdyClient {
    stream: TlsStream<TcpStream>,
    encoder: FrameEncoder,
    decoder: FrameDecoder,
    buf: Vec<u8>,
}

impl SpdyClient {
    async fn upgrade(kubelet: &Kubelet, path: &str, versions: &str) -> (SpdyClient, String) {
        let mut stream = kubelet.connect(Credentials::ApiServerCert).await;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\
             X-Stream-Protocol-Version: {versions}\r\nContent-Length: 0\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        let version = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("x-stream-protocol-version: ").map(str::to_owned))
            .expect("negotiated version");
        (SpdyClient { stream, encoder: FrameEncoder::new(), decoder: FrameDecoder::new(), buf: Vec::new() }, version)
    }

    async fn send(&mut self, frame: Frame) {
        let mut wire = Vec::new();
        self.encoder.encode(&frame, &mut wire);
        self.stream.write_all(&wire).await.unwrap();
    }

    async fn next(&mut self) -> Option<Frame> {
        loop {
            if let Some((frame, used)) = self.decoder.decode(&self.buf).unwrap() {
                self.buf.drain(..used);
                return Some(frame);
            }
            let mut chunk = [0u8; 16384];
            let n = self.stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn open(&mut self, id: u32, stream_type: &str) {
        let headers = vec![("streamtype".to_owned(), stream_type.to_owned())];
        self.send(Frame::SynStream { stream_id: id, associated_to: 0, priority: 0, flags: 0, headers }).await;
    }
}

#[tokio::test]
async fn spdy_exec_streams_stdout_and_reports_a_non_zero_exit_code() {
    let kubelet = start_kubelet().await;
    let (mut spdy, version) = SpdyClient::upgrade(
        &kubelet,
        "/exec/ns/vm-1/vm?command=big&command=200000&stdout=1",
        "v5.channel.k8s.io,v4.channel.k8s.io,v3.channel.k8s.io",
    )
    .await;
    assert_eq!(version, "v5.channel.k8s.io");
    spdy.open(1, "error").await;
    spdy.open(3, "stdout").await;
    spdy.send(Frame::Ping { id: 1 }).await;

    let (mut replies, mut pongs) = (Vec::new(), 0);
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut finished = Vec::new();
    while finished.len() < 2 {
        match spdy.next().await.expect("the session ended before both streams finished") {
            Frame::SynReply { stream_id, .. } => replies.push(stream_id),
            Frame::Ping { id } => {
                assert_eq!(id, 1);
                pongs += 1;
            }
            Frame::Data { stream_id, flags, data: bytes } => {
                data.entry(stream_id).or_default().extend(bytes);
                if flags & FLAG_FIN != 0 {
                    finished.push(stream_id);
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    replies.sort();
    assert_eq!(replies, [1, 3]);
    assert_eq!(pongs, 1, "the PING is echoed");
    assert_eq!(data[&3].len(), 200_000, "all of stdout, past the 64 KiB default window");
    let status: serde_json::Value = serde_json::from_slice(&data[&1]).unwrap();
    assert_eq!(status["status"], "Success");

    let (mut spdy, version) =
        SpdyClient::upgrade(&kubelet, "/exec/ns/vm-1/vm?command=warn&command=oops&stderr=1", "v4.channel.k8s.io").await;
    assert_eq!(version, "v4.channel.k8s.io");
    spdy.open(1, "error").await;
    spdy.open(3, "stderr").await;
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut finished = 0;
    while finished < 2 {
        if let Frame::Data { stream_id, flags, data: bytes } = spdy.next().await.expect("frames") {
            data.entry(stream_id).or_default().extend(bytes);
            finished += usize::from(flags & FLAG_FIN != 0);
        }
    }
    assert_eq!(data[&3], b"oops");
    let status: serde_json::Value = serde_json::from_slice(&data[&1]).unwrap();
    assert_eq!(status["reason"], "NonZeroExitCode");
    assert_eq!(status["details"]["causes"][0]["message"], "2");
}

#[tokio::test]
async fn spdy_v2_reports_errors_as_text_and_stdin_flows_with_window_updates() {
    let kubelet = start_kubelet().await;
    let (mut spdy, version) =
        SpdyClient::upgrade(&kubelet, "/exec/ns/vm-1/vm?command=cat&stdin=1&stdout=1", "v2.channel.k8s.io").await;
    assert_eq!(version, "v2.channel.k8s.io");
    spdy.open(1, "error").await;
    spdy.open(3, "stdin").await;
    spdy.open(5, "stdout").await;
    spdy.send(Frame::Data { stream_id: 3, flags: 0, data: b"hello spdy".to_vec() }).await;
    spdy.send(Frame::Data { stream_id: 3, flags: FLAG_FIN, data: vec![] }).await;
    let (mut stdout, mut window_credit, mut error_fin) = (Vec::new(), 0u32, false);
    while !error_fin {
        match spdy.next().await.expect("frames") {
            Frame::Data { stream_id: 5, data, .. } => stdout.extend(data),
            Frame::Data { stream_id: 1, flags, data } => {
                assert!(data.is_empty(), "v2 success writes nothing on the error stream");
                error_fin = flags & FLAG_FIN != 0;
            }
            Frame::WindowUpdate { stream_id: 3, delta } => window_credit += delta,
            _ => {}
        }
    }
    assert_eq!(stdout, b"hello spdy");
    assert_eq!(window_credit, 10, "consumed stdin is credited back");

    let (status, body) = kubelet.get(Credentials::ApiServerCert, "/exec/ns/vm-1/vm?command=x&stdout=1").await;
    assert_eq!(status, 400, "no upgrade headers: {body}");
}

// ---------------------------------------------------------------- through the API server

/// kubectl → API server → this kubelet API, with the API server's own client
/// certificate, its verification of our serving certificate, its SPDY client
/// (moby/spdystream) and its WebSocket-to-SPDY translator.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_exec_and_logs_reach_the_vm_through_the_api_server() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{DeleteParams, Patch, PatchParams};
    let env = common::TestEnv::new("kubelet-e2e").await;
    let node = env.ns.clone();
    let kubelet = start_kubelet_with(
        Some((pki().join("kubelet-serving.crt"), pki().join("kubelet-serving.key"))),
        &[(&env.ns, "vm-e2e", &node)],
    )
    .await;
    let nodes: Api<Node> = Api::all(env.client.clone());
    let object =
        serde_json::from_value(serde_json::json!({"metadata": {"name": node, "labels": {"vmlet.io/test": env.ns}}}))
            .unwrap();
    nodes.create(&PostParams::default(), &object).await.unwrap();
    let status = serde_json::json!({"status": {
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.addr.port()}},
    }});
    nodes.patch_status(&node, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    let pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "vm-e2e"},
        "spec": {"nodeName": node, "containers": [{"name": "vm", "image": "vmlet.io/virtual-machine"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();

    let ns = env.ns.clone();
    let run = move |websockets: bool, args: Vec<&'static str>, stdin: Option<&'static str>| {
        let cluster = common::cluster();
        let ns = ns.clone();
        tokio::task::spawn_blocking(move || {
            let mut kubectl = std::process::Command::new(cluster.bin.join("kubectl"));
            kubectl
                .env("KUBECONFIG", &cluster.kubeconfig)
                .env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", websockets.to_string())
                .args(["-n", &ns])
                .args(&args);
            common::deadline::run_with_stdin(&mut kubectl, stdin.unwrap_or("").as_bytes(), common::deadline::KUBECTL)
                .unwrap_or_else(|timed_out| panic!("{timed_out}"))
        })
    };
    for websockets in [true, false] {
        let out = run(websockets, vec!["exec", "vm-e2e", "-c", "vm", "--", "echo", "hi", "there"], None).await.unwrap();
        assert!(out.status.success(), "websockets={websockets}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi there\n");

        let out = run(websockets, vec!["exec", "vm-e2e", "--", "exit", "3"], None).await.unwrap();
        assert_eq!(out.status.code(), Some(3), "websockets={websockets}: {}", String::from_utf8_lossy(&out.stderr));

        let out = run(websockets, vec!["exec", "-i", "vm-e2e", "--", "cat"], Some("typed\n")).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "typed\n",
            "websockets={websockets}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Two file lines: the tail starts after the partial `login: ` record.
    let out = run(true, vec!["logs", "vm-e2e", "--tail=2", "--timestamps"], None).await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "2024-05-01T11:00:05.000000000Z root\n2024-05-01T11:00:06.000000000Z # uptime\n"
    );
    let out = run(true, vec!["logs", "vm-e2e", "--previous"], None).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "first boot\n");
    let _ = nodes.delete(&node, &DeleteParams::default()).await;
}
