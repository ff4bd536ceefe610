//! The session's token handling against a scripted Keystone + Nova on
//! loopback (no harness needed): renewal on 401 and before expiry, one token
//! request for many concurrent callers, the microversion header on every
//! compute call and the 2.87 pin of os-hypervisors. A real Keystone cannot be
//! made to expire or revoke vmlet's token on cue; this stand-in can.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmlet_openstack::{Cloud, CloudConfig, CloudOptions, OpenStackProvider};
use vmlet_provider::{ErrorKind, Provider};

/// What the stand-in saw and how it behaves.
#[derive(Default)]
struct Script {
    /// Token requests answered.
    tokens_issued: usize,
    /// Tokens Nova refuses with 401.
    revoked: HashSet<String>,
    /// Refuse every token (Nova misconfigured).
    refuse_all: bool,
    /// Revoke each token after it served one compute call.
    revoke_after_one_use: bool,
    /// Lifetime of issued tokens, seconds.
    lifetime_s: u64,
    /// (path, OpenStack-API-Version) of each compute call.
    compute_calls: Vec<(String, String)>,
}

struct StandIn {
    script: Arc<Mutex<Script>>,
    base: String,
}

impl StandIn {
    fn start(lifetime_s: u64) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let script = Arc::new(Mutex::new(Script { lifetime_s, ..Script::default() }));
        let (shared, compute) = (script.clone(), format!("{base}/v2.1"));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (script, compute) = (shared.clone(), compute.clone());
                std::thread::spawn(move || serve(stream, &script, &compute));
            }
        });
        StandIn { script, base }
    }

    fn config(&self) -> CloudConfig {
        let yaml = format!(
            "clouds: {{c: {{auth: {{auth_url: '{}/v3', username: u, password: p, user_domain_id: default, project_id: x}}}}}}",
            self.base
        );
        CloudConfig::from_bytes(yaml.as_bytes(), "c").expect("config")
    }

    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap()
    }
}

fn options() -> CloudOptions {
    CloudOptions { request_timeout: Duration::from_secs(5), ..CloudOptions::default() }
}

/// One request per connection (`Connection: close`).
fn serve(stream: TcpStream, script: &Mutex<Script>, compute: &str) {
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        head.push(line.trim_end().to_owned());
    }
    let Some(request_line) = head.first() else { return };
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned());
    let header = |name: &str| {
        head.iter()
            .find_map(|h| {
                h.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_default()
    };
    let length: usize = header("content-length").parse().unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok();
    let (status, extra, reply) =
        route(&method, &path, &header("x-auth-token"), &header("openstack-api-version"), script, compute);
    let mut out = stream;
    let _ = write!(
        out,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{reply}",
        reply.len()
    );
}

fn route(
    method: &str,
    path: &str,
    token: &str,
    version: &str,
    script: &Mutex<Script>,
    compute: &str,
) -> (u16, String, String) {
    let mut s = script.lock().unwrap();
    let path_only = path.split('?').next().unwrap_or(path);
    match (method, path_only) {
        ("POST", "/v3/auth/tokens") => {
            s.tokens_issued += 1;
            let token = format!("tok-{}", s.tokens_issued);
            let body = serde_json::json!({"token": {
                "issued_at": "2026-12-02T03:00:00.000000Z",
                "expires_at": jiff_free_add("2026-12-02T03:00:00", s.lifetime_s),
                "catalog": [{"type": "compute", "endpoints": [{"interface": "public", "region_id": "RegionOne", "url": compute}]}]
            }});
            (201, format!("X-Subject-Token: {token}\r\n"), body.to_string())
        }
        ("GET", "/v2.1/") => {
            (200, String::new(), r#"{"version": {"id": "v2.1", "version": "2.104", "min_version": "2.1"}}"#.into())
        }
        (_, p) if p.starts_with("/v2.1/") => {
            s.compute_calls.push((p.to_owned(), version.to_owned()));
            if s.refuse_all || s.revoked.contains(token) {
                return (401, String::new(), r#"{"error": {"code": 401, "message": "Unauthorized"}}"#.into());
            }
            if s.revoke_after_one_use {
                s.revoked.insert(token.to_owned());
            }
            match p {
                "/v2.1/servers/detail" => {
                    let server = |id: &str, host: &str, uid: Option<&str>| {
                        let metadata = uid.map_or(serde_json::json!({}), |u| serde_json::json!({"vmlet.io:uid": u}));
                        serde_json::json!({"id": id, "name": id, "status": "ACTIVE", "OS-EXT-STS:power_state": 1,
                            "OS-EXT-SRV-ATTR:host": host, "metadata": metadata,
                            "flavor": {"vcpus": 1, "ram": 256, "disk": 1, "original_name": "c1-m256"}})
                    };
                    let page = if path.contains("marker=s3") {
                        serde_json::json!({"servers": [server("s4", "h3", Some("u4"))]})
                    } else {
                        serde_json::json!({
                            "servers": [server("s1", "h1", Some("u1")), server("s2", "h2", Some("u2")), server("s3", "h1", None)],
                            "servers_links": [{"rel": "next", "href": format!("{compute}/servers/detail?all_tenants=1&limit=1000&marker=s3")}]
                        })
                    };
                    (200, String::new(), page.to_string())
                }
                "/v2.1/os-services" => {
                    (200, String::new(), r#"{"services": [{"host": "h1", "state": "up", "zone": "az9"}]}"#.into())
                }
                "/v2.1/os-hypervisors/detail" => (
                    200,
                    String::new(),
                    r#"{"hypervisors": [{"id": "6f0c1a7e-0000-4000-8000-000000000001", "hypervisor_hostname": "h1.example",
                        "state": "up", "status": "enabled", "hypervisor_type": "QEMU", "vcpus": 12, "memory_mb": 2048,
                        "cpu_info": {"arch": "aarch64"}, "service": {"host": "h1", "disabled_reason": null}}]}"#
                        .into(),
                ),
                _ => (404, String::new(), r#"{"itemNotFound": {"code": 404, "message": "no such thing"}}"#.into()),
            }
        }
        _ => (404, String::new(), "{}".into()),
    }
}

/// `start` (`YYYY-MM-DDTHH:MM:SS`, minutes and seconds below an hour) plus
/// `seconds` (< 1 h), as RFC 3339 with microseconds.
fn jiff_free_add(start: &str, seconds: u64) -> String {
    let (date_hour, rest) = start.split_at(14);
    let (m, s) = rest.split_once(':').unwrap();
    let total = m.parse::<u64>().unwrap() * 60 + s.parse::<u64>().unwrap() + seconds;
    format!("{date_hour}{:02}:{:02}.000000Z", total / 60, total % 60)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_renews_the_token_once_and_retries_the_call() {
    let stand_in = StandIn::start(3000);
    let cloud = Cloud::connect(stand_in.config(), options()).await.expect("connect");
    let provider = OpenStackProvider::new(cloud, "h1");
    stand_in.script().revoke_after_one_use = true;
    provider.ping().await.expect("first ping");
    provider.ping().await.expect("second ping: 401, renewal, retry");
    let s = stand_in.script();
    assert_eq!(s.tokens_issued, 2);
    assert_eq!(s.compute_calls.len(), 3, "{:?}", s.compute_calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_with_a_fresh_token_is_permission_denied() {
    let stand_in = StandIn::start(3000);
    let cloud = Cloud::connect(stand_in.config(), options()).await.expect("connect");
    stand_in.script().refuse_all = true;
    let err = OpenStackProvider::new(cloud, "h1").ping().await.expect_err("refused");
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("freshly renewed") && !err.message.contains("tok-"), "{err}");
    assert_eq!(stand_in.script().tokens_issued, 2, "one renewal, no more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_calls_share_one_token_request() {
    let stand_in = StandIn::start(3000);
    let cloud = Arc::new(Cloud::new(stand_in.config(), options()).expect("cloud"));
    let pings = (0..8).map(|_| {
        let provider = OpenStackProvider::new(cloud.clone(), "h1");
        tokio::spawn(async move { provider.ping().await })
    });
    for ping in pings.collect::<Vec<_>>() {
        ping.await.expect("join").expect("ping");
    }
    assert_eq!(stand_in.script().tokens_issued, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_close_to_expiry_is_renewed_before_it_is_used() {
    // 2 s lifetime: renewed once less than half of it (1 s) remains.
    let stand_in = StandIn::start(2);
    let cloud = Cloud::connect(stand_in.config(), options()).await.expect("connect");
    let provider = OpenStackProvider::new(cloud, "h1");
    provider.ping().await.expect("ping");
    assert_eq!(stand_in.script().tokens_issued, 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    provider.ping().await.expect("ping");
    assert_eq!(stand_in.script().tokens_issued, 2);
    let s = stand_in.script();
    assert!(s.compute_calls.iter().all(|(path, _)| path == "/v2.1/os-services"), "no call was refused first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_calls_carry_the_negotiated_microversion_and_hypervisors_pin_2_87() {
    let stand_in = StandIn::start(3000);
    let cloud = Cloud::connect(stand_in.config(), options()).await.expect("connect");
    assert_eq!(cloud.compute_microversion().await.expect("version").0.to_string(), "2.100");
    let hypervisors = cloud.hypervisors().await.expect("hypervisors");
    assert_eq!(hypervisors.len(), 1);
    let h = &hypervisors[0];
    assert_eq!((h.host.as_str(), h.hypervisor_hostname.as_str()), ("h1", "h1.example"));
    assert_eq!((h.cpus, h.memory_bytes, h.architecture.as_str()), (12, 2048 << 20, "arm64"));
    assert_eq!(h.availability_zone.as_deref(), Some("az9"));
    assert!(h.vcpu_inventory.is_none(), "no Placement in this catalog");
    let info = OpenStackProvider::new(cloud.clone(), "h1").host_info().await.expect("host_info");
    assert_eq!(info.hypervisor, "OpenStack Nova 2.104 (QEMU)");
    let s = stand_in.script();
    let header_of = |path: &str| s.compute_calls.iter().find(|(p, _)| p == path).map(|(_, v)| v.clone());
    assert_eq!(header_of("/v2.1/os-hypervisors/detail").as_deref(), Some("compute 2.87"));
    assert_eq!(header_of("/v2.1/os-services").as_deref(), Some("compute 2.100"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_hosts_share_one_paginated_listing_of_vmlet_s_servers() {
    let stand_in = StandIn::start(3000);
    let cloud = Cloud::connect(stand_in.config(), options()).await.expect("connect");
    let lists = ["h1", "h2", "h3"].map(|host| {
        let provider = OpenStackProvider::new(cloud.clone(), host);
        tokio::spawn(async move { provider.list().await })
    });
    let mut seen = Vec::new();
    for list in lists {
        let statuses = list.await.expect("join").expect("list");
        seen.push(statuses.iter().map(|s| s.backend_id.clone()).collect::<Vec<_>>());
    }
    // s3 has no vmlet.io:uid: not vmlet's. s4 came from the second page.
    assert_eq!(seen, [vec!["s1".to_owned()], vec!["s2".to_owned()], vec!["s4".to_owned()]]);
    let s = stand_in.script();
    let listings: Vec<&String> =
        s.compute_calls.iter().map(|(p, _)| p).filter(|p| p.as_str() == "/v2.1/servers/detail").collect();
    assert_eq!(listings.len(), 2, "one listing of two pages for three hosts: {:?}", s.compute_calls);
}
