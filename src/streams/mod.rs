//! Kubernetes remote-command streams (exec, attach) over SPDY/3.1 and
//! WebSocket, turned into a transport-neutral [`StreamIo`].
//!
//! A handler decides what to run and calls [`upgrade`] with a closure that
//! receives the [`StreamIo`] and returns an [`Outcome`]; this module answers
//! the upgrade, negotiates the protocol version, waits for the client's
//! streams, pumps bytes both ways and reports the outcome the way the client
//! expects (a `metav1.Status` on the error stream for v4 and later, plain text
//! before). Handlers never see SPDY or WebSocket.
//!
//! Protocols, as the API server (or kubectl) speaks them towards a kubelet:
//! - SPDY/3.1 with `X-Stream-Protocol-Version` `v5.channel.k8s.io` …
//!   `channel.k8s.io` ([`remotecommand`]);
//! - WebSocket with subprotocol `v5.channel.k8s.io` or `v4.channel.k8s.io`
//!   ([`websocket`]), which a 1.36+ API server passes through when the Node
//!   declares `ExtendWebSocketsToKubelet`.
//!
//! Port forwarding has its own protocol over the same transports (a pair of
//! streams per forwarded connection instead of fixed channels), in
//! [`portforward`], on the same SPDY session code.

pub mod portforward;
pub mod remotecommand;
pub mod spdy;
pub mod websocket;

use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;
use vmlet_provider::{StreamIo, TermSize};

/// The remote-command protocol versions, oldest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    /// `channel.k8s.io`: no resize, errors as text.
    V1,
    /// `v2.channel.k8s.io`: errors as text.
    V2,
    /// `v3.channel.k8s.io`: adds resize.
    V3,
    /// `v4.channel.k8s.io`: errors and exit codes as `metav1.Status` JSON.
    V4,
    /// `v5.channel.k8s.io`: adds the close signal (WebSocket channel 255).
    V5,
}

impl Version {
    /// The subprotocol name.
    pub fn name(self) -> &'static str {
        match self {
            Version::V1 => "channel.k8s.io",
            Version::V2 => "v2.channel.k8s.io",
            Version::V3 => "v3.channel.k8s.io",
            Version::V4 => "v4.channel.k8s.io",
            Version::V5 => "v5.channel.k8s.io",
        }
    }

    /// The version with this subprotocol name.
    pub fn from_name(name: &str) -> Option<Version> {
        [Version::V5, Version::V4, Version::V3, Version::V2, Version::V1].into_iter().find(|v| v.name() == name)
    }

    /// Whether the error stream carries `metav1.Status` JSON (v4+).
    pub fn status_json(self) -> bool {
        self >= Version::V4
    }
}

/// Which streams the client asked for: the kubelet's query parameters `input`,
/// `output`, `error`, `tty` (what the API server sends, value `1`); the pod
/// API's names `stdin`, `stdout`, `stderr` and the value `true` are accepted too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamOptions {
    /// The client sends input.
    pub stdin: bool,
    /// The client wants output.
    pub stdout: bool,
    /// The client wants error output (never with a tty: merged into stdout).
    pub stderr: bool,
    /// The client wants a terminal.
    pub tty: bool,
}

impl StreamOptions {
    /// Read the options from decoded query pairs. Errors: none of stdin,
    /// stdout, stderr requested (as the kubelet: "you must specify at least 1
    /// of stdin, stdout, stderr").
    pub fn from_query(query: &[(String, String)]) -> Result<StreamOptions, String> {
        let flag = |names: &[&str]| query.iter().any(|(k, v)| names.contains(&k.as_str()) && (v == "1" || v == "true"));
        let tty = flag(&["tty"]);
        let stderr = flag(&["error", "stderr"]);
        let opts = StreamOptions {
            stdin: flag(&["input", "stdin"]),
            stdout: flag(&["output", "stdout"]),
            stderr: stderr && !tty,
            tty,
        };
        if !opts.stdin && !opts.stdout && !stderr {
            return Err("you must specify at least 1 of stdin, stdout, stderr".into());
        }
        Ok(opts)
    }
}

/// How a session ended, as reported on the error stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Exit code 0, or a detach from a console.
    Success,
    /// The command exited with this non-zero code.
    ExitCode(i32),
    /// The session could not run; `code` is the HTTP status the same failure
    /// would have had before the upgrade (501 for a missing capability).
    Failure {
        /// HTTP-style code.
        code: u16,
        /// PascalCase reason, e.g. `NotImplemented`, `InternalError`.
        reason: String,
        /// What happened, for the user.
        message: String,
    },
}

impl Outcome {
    /// The `metav1.Status` JSON the kubelet writes on the error stream (v4+).
    pub fn status_json(&self) -> Vec<u8> {
        let status = match self {
            Outcome::Success => serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            }),
            Outcome::ExitCode(code) => serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure",
                "message": format!("command terminated with non-zero exit code: exit status {code}"),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
            }),
            Outcome::Failure { code, reason, message } => serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": message, "reason": reason, "code": code,
            }),
        };
        serde_json::to_vec(&status).expect("a Status serializes")
    }

    /// The plain-text error of protocols v1–v3 (empty on success).
    pub fn status_text(&self) -> Vec<u8> {
        match self {
            Outcome::Success => Vec::new(),
            Outcome::ExitCode(code) => {
                format!("command terminated with non-zero exit code: exit status {code}").into_bytes()
            }
            Outcome::Failure { message, .. } => message.clone().into_bytes(),
        }
    }

    /// What to write on the error stream for `version`.
    pub fn encode(&self, version: Version) -> Vec<u8> {
        if version.status_json() {
            self.status_json()
        } else {
            self.status_text()
        }
    }
}

/// How long to wait for the client's streams (the kubelet's
/// `DefaultStreamCreationTimeout`).
pub const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// After the handler returns, how long output still queued may take to drain.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Answer an exec or attach request: upgrade it to SPDY/3.1 or WebSocket and
/// run `run` with the client's streams. Returns the `101 Switching Protocols`
/// response (or a 400/403 when the request is not a usable upgrade); the
/// session runs on a spawned task.
pub async fn upgrade<F, Fut>(req: Request<Body>, opts: StreamOptions, run: F) -> Response<Body>
where
    F: FnOnce(StreamIo) -> Fut + Send + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let upgrade = req.headers().get(header::UPGRADE).and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase();
    if upgrade.contains("websocket") {
        tracing::info!(stream.transport = "websocket", "stream session");
        websocket::upgrade(req, opts, run).await
    } else if upgrade.contains(&spdy::UPGRADE.to_ascii_lowercase()) {
        tracing::info!(stream.transport = "spdy", "stream session");
        remotecommand::upgrade(req, opts, run)
    } else {
        plain(
            StatusCode::BAD_REQUEST,
            "unable to upgrade: missing upgrade headers in request (want Upgrade: SPDY/3.1 or websocket)",
        )
    }
}

/// A plain-text response.
pub(crate) fn plain(status: StatusCode, message: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Body::from(format!("{message}\n")))
        .expect("a plain response builds")
}

/// The channel ends of one session: the handler's [`StreamIo`] and the
/// protocol's opposite ends.
pub(crate) struct Pipes {
    pub io: StreamIo,
    pub stdin: Option<mpsc::Sender<Vec<u8>>>,
    pub stdout: Option<mpsc::Receiver<Vec<u8>>>,
    pub stderr: Option<mpsc::Receiver<Vec<u8>>>,
    pub resize: Option<mpsc::Sender<TermSize>>,
}

impl Pipes {
    /// Channels for the streams in `opts`; resize only with a tty and `resize`.
    pub fn new(opts: StreamOptions, resize: bool) -> Pipes {
        fn pair<T>(on: bool, n: usize) -> (Option<mpsc::Sender<T>>, Option<mpsc::Receiver<T>>) {
            if on {
                let (tx, rx) = mpsc::channel(n);
                (Some(tx), Some(rx))
            } else {
                (None, None)
            }
        }
        let (stdin_tx, stdin_rx) = pair(opts.stdin, 16);
        let (stdout_tx, stdout_rx) = pair(opts.stdout, 16);
        let (stderr_tx, stderr_rx) = pair(opts.stderr && !opts.tty, 16);
        let (resize_tx, resize_rx) = pair(opts.tty && resize, 4);
        Pipes {
            io: StreamIo { stdin: stdin_rx, stdout: stdout_tx, stderr: stderr_tx, tty: opts.tty, resize: resize_rx },
            stdin: stdin_tx,
            stdout: stdout_rx,
            stderr: stderr_rx,
            resize: resize_tx,
        }
    }
}

/// Parses terminal sizes from a byte stream of concatenated JSON objects
/// `{"Width":80,"Height":24}` (the resize stream's format). What it keeps of
/// an unfinished object is bounded ([`MAX_PENDING_RESIZE_BYTES`]): a client
/// that sends an object without end (`{` and then spaces), or one that is
/// not a size, has its resize stream ignored from then on, as the kubelet
/// stops reading resizes at the first bad object.
#[derive(Default)]
pub(crate) struct ResizeDecoder {
    buf: Vec<u8>,
    /// The stream sent something no size is made of: the rest is ignored.
    broken: bool,
}

/// The most bytes of an unfinished resize object kept, 4 KiB (a size is
/// about 30 bytes).
pub(crate) const MAX_PENDING_RESIZE_BYTES: usize = 4096;

#[derive(serde::Deserialize)]
struct Size {
    #[serde(rename = "Width", default)]
    width: u16,
    #[serde(rename = "Height", default)]
    height: u16,
}

impl ResizeDecoder {
    /// Feed bytes; returns the complete sizes they finish. Malformed input is
    /// dropped (the kubelet stops reading resizes at the first bad object).
    pub fn feed(&mut self, data: &[u8]) -> Vec<TermSize> {
        if self.broken {
            return Vec::new();
        }
        self.buf.extend_from_slice(data);
        let mut sizes = Vec::new();
        let mut used = 0;
        let mut iter = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Size>();
        loop {
            match iter.next() {
                Some(Ok(s)) => {
                    used = iter.byte_offset();
                    sizes.push(TermSize { width: s.width, height: s.height });
                }
                Some(Err(e)) if e.is_eof() => break,
                Some(Err(_)) => {
                    self.broken = true;
                    used = self.buf.len();
                    break;
                }
                None => {
                    used = self.buf.len();
                    break;
                }
            }
        }
        self.buf.drain(..used);
        if self.buf.len() > MAX_PENDING_RESIZE_BYTES {
            self.broken = true;
        }
        if self.broken {
            self.buf = Vec::new();
        }
        sizes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_zero_exit_is_a_status_kubectl_decodes_to_the_exit_code() {
        let status: serde_json::Value = serde_json::from_slice(&Outcome::ExitCode(3).status_json()).unwrap();
        assert_eq!(status["status"], "Failure");
        assert_eq!(status["reason"], "NonZeroExitCode");
        assert_eq!(status["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(status["details"]["causes"][0]["message"], "3");
    }

    #[test]
    fn success_is_a_success_status_and_empty_text() {
        let status: serde_json::Value = serde_json::from_slice(&Outcome::Success.encode(Version::V5)).unwrap();
        assert_eq!(status["status"], "Success");
        assert!(Outcome::Success.encode(Version::V3).is_empty());
    }

    #[test]
    fn failures_carry_their_message_in_both_encodings() {
        let failure = Outcome::Failure {
            code: 501,
            reason: "NotImplemented".into(),
            message: "the libvirt provider of host a has no guest agent".into(),
        };
        let status: serde_json::Value = serde_json::from_slice(&failure.encode(Version::V4)).unwrap();
        assert_eq!(status["message"], "the libvirt provider of host a has no guest agent");
        assert_eq!(status["code"], 501);
        assert_eq!(failure.encode(Version::V2), b"the libvirt provider of host a has no guest agent");
    }

    #[test]
    fn stream_options_follow_the_kubelet() {
        let q = |s: &str| -> Vec<(String, String)> {
            s.split('&').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
        };
        let o = StreamOptions::from_query(&q("command=ls&stdin=1&stdout=true&stderr=1&tty=1")).unwrap();
        assert_eq!(o, StreamOptions { stdin: true, stdout: true, stderr: false, tty: true });
        assert!(StreamOptions::from_query(&q("command=ls")).is_err());
        assert!(StreamOptions::from_query(&q("stderr=1")).unwrap().stderr);
        // What the API server sends to a kubelet.
        let o = StreamOptions::from_query(&q("command=ls&input=1&output=1&error=1")).unwrap();
        assert_eq!(o, StreamOptions { stdin: true, stdout: true, stderr: true, tty: false });
    }

    #[test]
    fn versions_round_trip_their_names() {
        for v in [Version::V1, Version::V2, Version::V3, Version::V4, Version::V5] {
            assert_eq!(Version::from_name(v.name()), Some(v));
        }
        assert_eq!(Version::from_name("v6.channel.k8s.io"), None);
    }

    #[test]
    fn an_endless_or_bad_resize_object_is_bounded_and_ends_the_resizes() {
        let mut d = ResizeDecoder::default();
        assert!(d.feed(b"{").is_empty());
        for _ in 0..10_000 {
            assert!(d.feed(&[b' '; 64]).is_empty());
            assert!(d.buf.len() <= MAX_PENDING_RESIZE_BYTES + 64, "{}", d.buf.len());
        }
        assert!(d.broken && d.buf.capacity() == 0, "the buffer is freed");
        assert!(d.feed(br#"{"Width":80,"Height":24}"#).is_empty(), "ignored from then on");
        let mut bad = ResizeDecoder::default();
        assert!(bad.feed(br#""wide"{"Width":80,"Height":24}"#).is_empty());
        assert!(bad.feed(br#"{"Width":80,"Height":24}"#).is_empty());
    }

    #[test]
    fn resize_objects_may_arrive_split_and_concatenated() {
        let mut d = ResizeDecoder::default();
        assert!(d.feed(br#"{"Width":80,"Hei"#).is_empty());
        assert_eq!(
            d.feed(br#"ght":24}{"Width":100,"Height":30}"#),
            vec![TermSize { width: 80, height: 24 }, TermSize { width: 100, height: 30 }]
        );
    }
}
