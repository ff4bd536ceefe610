//! The remote-command protocol over SPDY/3.1, server side (what a kubelet
//! answers to the API server).
//!
//! Handshake: the client sends `Connection: Upgrade`, `Upgrade: SPDY/3.1` and
//! the versions it speaks in `X-Stream-Protocol-Version`; the server picks the
//! first of the client's it supports and answers `101` with that version
//! (no common version: `403` listing ours in
//! `X-Accepted-Stream-Protocol-Versions`). The client then opens one SPDY
//! stream per channel, each with header `streamType`: `error` always, `stdin`,
//! `stdout`, `stderr` (not with a tty) as requested, `resize` with a tty from
//! v3 on. Once all expected streams are open the session runs; at the end the
//! server half-closes stdout/stderr, writes the outcome on the error stream,
//! and closes the connection.

use super::spdy::session::{RecvHalf, SendHalf, Session, SpdyStream};
use super::spdy::{frame, UPGRADE};
use super::{plain, Outcome, Pipes, ResizeDecoder, StreamOptions, Version, DRAIN_TIMEOUT, STREAM_CREATION_TIMEOUT};
use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::future::Future;
use tokio::sync::mpsc;
use vmlet_provider::StreamIo;

/// `X-Stream-Protocol-Version`.
pub const PROTOCOL_HEADER: &str = "X-Stream-Protocol-Version";
/// `X-Accepted-Stream-Protocol-Versions`.
pub const ACCEPTED_HEADER: &str = "X-Accepted-Stream-Protocol-Versions";
/// Versions served over SPDY, in the order offered.
pub const SUPPORTED: [Version; 5] = [Version::V5, Version::V4, Version::V3, Version::V2, Version::V1];

/// Pick the first of the client's versions (comma-separated, over all header
/// values) that we serve.
pub fn negotiate<'a>(client: impl IntoIterator<Item = &'a str>) -> Result<Version, String> {
    let offered: Vec<&str> =
        client.into_iter().flat_map(|v| v.split(',')).map(str::trim).filter(|v| !v.is_empty()).collect();
    if offered.is_empty() {
        return Err(format!("unable to upgrade: header {PROTOCOL_HEADER} is missing or empty"));
    }
    offered.iter().find_map(|name| Version::from_name(name)).ok_or_else(|| {
        let ours: Vec<&str> = SUPPORTED.iter().map(|v| v.name()).collect();
        format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server accepts {ours:?}")
    })
}

pub(super) fn upgrade<F, Fut>(mut req: Request<Body>, opts: StreamOptions, run: F) -> Response<Body>
where
    F: FnOnce(StreamIo) -> Fut + Send + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let values = req.headers().get_all(PROTOCOL_HEADER).iter().filter_map(|v| v.to_str().ok());
    let version = match negotiate(values) {
        Ok(v) => v,
        Err(message) => {
            let missing = req.headers().get(PROTOCOL_HEADER).is_none();
            let mut response = plain(if missing { StatusCode::BAD_REQUEST } else { StatusCode::FORBIDDEN }, &message);
            for v in SUPPORTED {
                response.headers_mut().append(ACCEPTED_HEADER, HeaderValue::from_static(v.name()));
            }
            return response;
        }
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => serve(Session::start(TokioIo::new(upgraded)), version, opts, run).await,
            Err(e) => tracing::debug!(error = %e, "SPDY upgrade did not complete"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, UPGRADE)
        .header(PROTOCOL_HEADER, version.name())
        .body(Body::empty())
        .expect("a 101 response builds")
}

/// The client's streams, by type.
#[derive(Default)]
struct Streams {
    error: Option<SpdyStream>,
    stdin: Option<SpdyStream>,
    stdout: Option<SpdyStream>,
    stderr: Option<SpdyStream>,
    resize: Option<SpdyStream>,
}

impl Streams {
    fn complete(&self, opts: StreamOptions, version: Version) -> bool {
        self.error.is_some()
            && (!opts.stdin || self.stdin.is_some())
            && (!opts.stdout || self.stdout.is_some())
            && (!opts.stderr || opts.tty || self.stderr.is_some())
            && (!(opts.tty && version >= Version::V3) || self.resize.is_some())
    }
}

/// Run one remote-command session on an established SPDY session.
pub async fn serve<F, Fut>(mut session: Session, version: Version, opts: StreamOptions, run: F)
where
    F: FnOnce(StreamIo) -> Fut,
    Fut: Future<Output = Outcome>,
{
    let began = std::time::Instant::now();
    let mut streams = Streams::default();
    let collected = tokio::time::timeout(STREAM_CREATION_TIMEOUT, async {
        while !streams.complete(opts, version) {
            let Some(stream) = session.accept().await else { return false };
            let kind = frame::header(&stream.headers, "streamtype").unwrap_or("").to_owned();
            let slot = match kind.as_str() {
                "error" => &mut streams.error,
                "stdin" => &mut streams.stdin,
                "stdout" => &mut streams.stdout,
                "stderr" => &mut streams.stderr,
                "resize" => &mut streams.resize,
                _ => {
                    tracing::debug!(stream.kind = %kind, "unexpected SPDY stream type; resetting it");
                    stream.send.reset().await;
                    continue;
                }
            };
            *slot = Some(stream);
        }
        true
    })
    .await;
    if !matches!(collected, Ok(true)) {
        tracing::debug!("the client did not open the expected streams; closing");
        if let Some(error) = &streams.error {
            let failure = Outcome::Failure {
                code: 400,
                reason: "BadRequest".into(),
                message: "timed out waiting for the client to create streams".into(),
            };
            let _ = error.send.write(&failure.encode(version)).await;
        }
        session.close().await;
        return;
    }

    let pipes = Pipes::new(opts, version >= Version::V3);
    let mut pumps = Vec::new();
    if let (Some(tx), Some(stream)) = (pipes.stdin, streams.stdin.take()) {
        pumps.push(tokio::spawn(stdin_pump(stream.recv, stream.send, tx)));
    }
    if let (Some(tx), Some(stream)) = (pipes.resize, streams.resize.take()) {
        tokio::spawn(resize_pump(stream.recv, tx));
    }
    let mut outputs = Vec::new();
    for (rx, stream) in [(pipes.stdout, streams.stdout.take()), (pipes.stderr, streams.stderr.take())] {
        match (rx, stream) {
            (Some(rx), Some(stream)) => outputs.push(tokio::spawn(output_pump(rx, stream.send))),
            // A stream opened but not wanted (stderr with a tty): close our half.
            (None, Some(stream)) => {
                let _ = stream.send.finish().await;
            }
            _ => {}
        }
    }

    let streams_ms = began.elapsed().as_secs_f64() * 1e3;
    let outcome = run(pipes.io).await;
    let ran_ms = began.elapsed().as_secs_f64() * 1e3;
    // The handler is done: what it wrote is queued in the pumps, which end when
    // its senders are gone.
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        for pump in outputs {
            let _ = pump.await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::debug!("output still pending after the session ended; dropping it");
    }
    let error = streams.error.take().expect("the error stream was collected");
    let message = outcome.encode(version);
    if !message.is_empty() {
        let _ = error.send.write(&message).await;
    }
    let _ = error.send.finish().await;
    for pump in pumps {
        pump.abort();
    }
    session.close().await;
    tracing::debug!(
        streams_ms,
        ran_ms,
        closed_ms = began.elapsed().as_secs_f64() * 1e3,
        "remote-command session over SPDY: streams created, command done, session closed (ms from the upgrade)"
    );
}

/// Client stdin → the handler, until the client's FIN; then our half of the
/// stdin stream is closed too (the v2+ client waits for that).
async fn stdin_pump(mut recv: RecvHalf, send: SendHalf, tx: mpsc::Sender<Vec<u8>>) {
    while let Some(data) = recv.read().await {
        if tx.send(data).await.is_err() {
            break;
        }
    }
    drop(tx);
    let _ = send.finish().await;
}

async fn resize_pump(mut recv: RecvHalf, tx: mpsc::Sender<vmlet_provider::TermSize>) {
    let mut decoder = ResizeDecoder::default();
    while let Some(data) = recv.read().await {
        for size in decoder.feed(&data) {
            // A provider that ignores resizes must not stall the session.
            if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(size) {
                return;
            }
        }
    }
}

/// Handler output → the client; FIN when the handler drops its sender.
async fn output_pump(mut rx: mpsc::Receiver<Vec<u8>>, send: SendHalf) {
    while let Some(data) = rx.recv().await {
        if send.write(&data).await.is_err() {
            // The client is gone: drop the receiver so the handler's sends fail.
            return;
        }
    }
    let _ = send.finish().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_takes_the_clients_first_supported_version() {
        assert_eq!(negotiate(["v5.channel.k8s.io,v4.channel.k8s.io"]), Ok(Version::V5));
        assert_eq!(negotiate(["v6.channel.k8s.io", "v4.channel.k8s.io, v3.channel.k8s.io"]), Ok(Version::V4));
        assert_eq!(negotiate(["channel.k8s.io"]), Ok(Version::V1));
        assert!(negotiate(["v9.channel.k8s.io"]).unwrap_err().contains("unable to negotiate"));
        assert!(negotiate([]).is_err());
    }
}
