//! The session against a TLS stand-in for vCenter on loopback that replays
//! envelopes recorded from the simulator (tests/fixtures, record.sh): no
//! harness needed. A real server cannot be made to expire vmlet's session
//! on cue, nor show what it received before a handshake failed; this
//! stand-in can.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use vmlet_provider::ErrorKind;
use vmlet_vsphere::{list_hosts, power_on, Error, MoRef, Secret, Session, SessionConfig, Thumbprint, Trust};

const SERVICE_CONTENT: &str = include_str!("fixtures/service_content.xml");
const LOGIN: &str = include_str!("fixtures/login.xml");
const INVALID_LOGIN: &str = include_str!("fixtures/invalid_login.xml");
const NOT_AUTHENTICATED: &str = include_str!("fixtures/not_authenticated_fault.xml");
const HOSTS: &str = include_str!("fixtures/hosts.xml");
const LOGOUT: &str = include_str!("fixtures/logout.xml");
/// PowerOnVM_Task's answer as vcsim gives it.
const POWER_ON_TASK: &str = r#"<?xml version="1.0" encoding="UTF-8"?><soapenv:Envelope xmlns:soapenv="http://schemas.xmlsoap.org/soap/envelope/"><soapenv:Body><PowerOnVM_TaskResponse xmlns="urn:vim25"><returnval type="Task">task-79</returnval></PowerOnVM_TaskResponse></soapenv:Body></soapenv:Envelope>"#;
/// A task still running: task_invalid_power_state.xml before it ended (state
/// `running`, no `info.error`).
const TASK_RUNNING: &str = r#"<?xml version="1.0" encoding="UTF-8"?><soapenv:Envelope xmlns:soapenv="http://schemas.xmlsoap.org/soap/envelope/"><soapenv:Body><RetrievePropertiesExResponse xmlns="urn:vim25"><returnval><objects><obj type="Task">task-79</obj><propSet><name>info.state</name><val xmlns:X="http://www.w3.org/2001/XMLSchema-instance" X:type="TaskInfoState">running</val></propSet></objects></returnval></RetrievePropertiesExResponse></soapenv:Body></soapenv:Envelope>"#;

/// What the stand-in saw and how it behaves.
#[derive(Default)]
struct Script {
    /// TLS handshakes completed.
    handshakes: usize,
    /// (vim25 method, carried a cookie) of each request, in order.
    requests: Vec<(String, bool)>,
    /// Logins answered with a session.
    logins: usize,
    /// The cookie of the live session, if any.
    session: Option<String>,
    /// Refuse every session (NotAuthenticated even right after Login).
    refuse_sessions: bool,
}

struct StandIn {
    script: Arc<Mutex<Script>>,
    url: String,
    thumbprint: Thumbprint,
}

impl StandIn {
    async fn start() -> StandIn {
        let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).expect("certificate");
        let cert: CertificateDer<'static> = certified.cert.der().clone();
        let thumbprint = Thumbprint::of_certificate(&cert);
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der()));
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .expect("server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("https://{}/sdk", listener.local_addr().expect("addr"));
        let script = Arc::new(Mutex::new(Script::default()));
        let shared = script.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, script) = (acceptor.clone(), shared.clone());
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(stream).await else { return };
                    script.lock().unwrap().handshakes += 1;
                    serve(stream, &script).await;
                });
            }
        });
        StandIn { script, url, thumbprint }
    }

    fn config(&self) -> SessionConfig {
        SessionConfig::new(&self.url, Trust::Thumbprint(self.thumbprint), "vmlet", Secret::new("s3cret"))
    }

    fn methods(&self) -> Vec<String> {
        self.script.lock().unwrap().requests.iter().map(|(m, _)| m.clone()).collect()
    }

    fn expire_session(&self) {
        self.script.lock().unwrap().session = None;
    }
}

/// Answers HTTP/1.1 requests on one connection until the client closes it.
async fn serve<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: S, script: &Mutex<Script>) {
    let mut stream = BufReader::new(stream);
    loop {
        let (mut length, mut cookie) = (0usize, None::<String>);
        let mut line = String::new();
        loop {
            line.clear();
            if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(value) = lower.strip_prefix("content-length:") {
                length = value.trim().parse().unwrap_or(0);
            } else if lower.starts_with("cookie:") {
                cookie = Some(line["cookie:".len()..].trim().to_owned());
            } else if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        if stream.read_exact(&mut body).await.is_err() {
            return;
        }
        let body = String::from_utf8_lossy(&body).into_owned();
        let (status, extra, reply) = answer(&body, cookie, script);
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/xml; charset=utf-8\r\nContent-Length: {}\r\n{extra}\r\n{reply}",
            reply.len()
        );
        if stream.get_mut().write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The status line, extra header lines and body for one request.
fn answer(body: &str, cookie: Option<String>, script: &Mutex<Script>) -> (&'static str, String, &'static str) {
    let method =
        body.split("<soapenv:Body><").nth(1).and_then(|rest| rest.split([' ', '>']).next()).unwrap_or("?").to_owned();
    let mut script = script.lock().unwrap();
    script.requests.push((method.clone(), cookie.is_some()));
    let authenticated = !script.refuse_sessions && cookie.is_some() && cookie == script.session;
    match method.as_str() {
        "RetrieveServiceContent" => ("200 OK", String::new(), SERVICE_CONTENT),
        "Login" if body.contains("<password>s3cret</password>") => {
            script.logins += 1;
            let session = format!("vmware_soap_session=session-{}", script.logins);
            script.session = Some(session.clone());
            ("200 OK", format!("Set-Cookie: {session}; Path=/; HttpOnly\r\n"), LOGIN)
        }
        "Login" => ("500 Internal Server Error", String::new(), INVALID_LOGIN),
        _ if !authenticated => ("500 Internal Server Error", String::new(), NOT_AUTHENTICATED),
        "RetrievePropertiesEx" if body.contains("<type>Task</type>") => ("200 OK", String::new(), TASK_RUNNING),
        "RetrievePropertiesEx" => ("200 OK", String::new(), HOSTS),
        "PowerOnVM_Task" => ("200 OK", String::new(), POWER_ON_TASK),
        "Logout" => {
            script.session = None;
            ("200 OK", String::new(), LOGOUT)
        }
        _ => panic!("the stand-in does not know {method}"),
    }
}

#[tokio::test]
async fn a_wrong_thumbprint_ends_the_handshake_before_any_request() {
    let stand_in = StandIn::start().await;
    let wrong = Thumbprint([0x11; 32]);
    let config = SessionConfig { trust: Trust::Thumbprint(wrong), ..stand_in.config() };
    let error = Session::connect(config).await.expect_err("connected with a wrong thumbprint");
    match &error {
        Error::ThumbprintMismatch { actual, .. } => assert_eq!(actual, &stand_in.thumbprint.to_string()),
        other => panic!("want ThumbprintMismatch, got {other:?}"),
    }
    assert_eq!(error.kind(), ErrorKind::Permanent);
    let script = stand_in.script.lock().unwrap();
    assert_eq!((script.handshakes, script.requests.len()), (0, 0), "nothing may reach the server");
}

#[tokio::test]
async fn connect_reads_the_service_content_then_logs_in() {
    let stand_in = StandIn::start().await;
    let session = Session::connect(stand_in.config()).await.expect("connect");
    assert_eq!(session.service_content().root_folder.value, "group-d1");
    assert_eq!(session.service_content().full_name, "VMware vCenter Server 6.5.0 build-5973321");
    assert_eq!(stand_in.methods(), ["RetrieveServiceContent", "Login"]);
    assert_eq!(list_hosts(&session).await.expect("hosts").len(), 4);
    session.logout().await.expect("logout");
    let requests = stand_in.script.lock().unwrap().requests.clone();
    assert_eq!(requests[2..], [("RetrievePropertiesEx".to_owned(), true), ("Logout".to_owned(), true)]);
}

#[tokio::test]
async fn an_expired_session_is_renewed_once_and_the_call_repeated() {
    let stand_in = StandIn::start().await;
    let session = Session::connect(stand_in.config()).await.expect("connect");
    stand_in.expire_session();
    assert_eq!(list_hosts(&session).await.expect("hosts after expiry").len(), 4);
    assert_eq!(
        stand_in.methods(),
        ["RetrieveServiceContent", "Login", "RetrievePropertiesEx", "Login", "RetrievePropertiesEx"]
    );
}

#[tokio::test]
async fn concurrent_callers_of_an_expired_session_log_in_once() {
    let stand_in = StandIn::start().await;
    let session = Session::connect(stand_in.config()).await.expect("connect");
    stand_in.expire_session();
    let (a, b, c, d) =
        tokio::join!(list_hosts(&session), list_hosts(&session), list_hosts(&session), list_hosts(&session));
    for hosts in [a, b, c, d] {
        assert_eq!(hosts.expect("hosts").len(), 4);
    }
    assert_eq!(stand_in.script.lock().unwrap().logins, 2, "one login at connect, one after expiry");
}

#[tokio::test]
async fn a_session_refused_after_a_fresh_login_is_permission_denied() {
    let stand_in = StandIn::start().await;
    let session = Session::connect(stand_in.config()).await.expect("connect");
    stand_in.script.lock().unwrap().refuse_sessions = true;
    let error = list_hosts(&session).await.expect_err("hosts with a refused session");
    assert_eq!((error.fault(), error.kind()), (Some("NotAuthenticated"), ErrorKind::PermissionDenied), "{error}");
    assert_eq!(stand_in.script.lock().unwrap().logins, 2, "one re-login, not a loop");
}

#[tokio::test]
async fn a_wrong_password_is_the_recorded_invalid_login() {
    let stand_in = StandIn::start().await;
    let config = SessionConfig { password: Secret::new("wrong"), ..stand_in.config() };
    let error = Session::connect(config).await.expect_err("logged in with a wrong password");
    assert_eq!(error.to_string(), "Login: InvalidLogin: Login failure");
    assert_eq!(error.kind(), ErrorKind::PermissionDenied);
}

#[tokio::test]
async fn a_task_still_running_at_its_deadline_is_a_transient_timeout() {
    let stand_in = StandIn::start().await;
    let session = Session::connect(stand_in.config()).await.expect("connect");
    let vm = MoRef::new("VirtualMachine", "vm-71");
    // The stand-in's task never ends: only the deadline ends the wait (and
    // the outer one fails the test instead of hanging it, were it ignored).
    let error = tokio::time::timeout(Duration::from_secs(60), power_on(&session, &vm, Duration::from_millis(400)))
        .await
        .expect("power_on ignored its 400 ms deadline")
        .expect_err("a running task succeeded");
    match &error {
        Error::TaskTimeout { task, state, waited, .. } => {
            assert_eq!((task.as_str(), state.as_str()), ("task-79", "running"));
            assert!(*waited >= Duration::from_millis(400), "{waited:?}");
        }
        other => panic!("want TaskTimeout, got {other:?}"),
    }
    assert_eq!(error.kind(), ErrorKind::Transient);
    let polls = stand_in.methods().iter().filter(|m| *m == "RetrievePropertiesEx").count();
    assert!((2..=6).contains(&polls), "{polls} polls in 400 ms");
}
