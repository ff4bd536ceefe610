//! The remote-command protocol over WebSocket (`v4.channel.k8s.io`,
//! `v5.channel.k8s.io`), server side.
//!
//! Every message is binary; its first byte is the channel: 0 stdin, 1 stdout,
//! 2 stderr, 3 error (a `metav1.Status` JSON), 4 resize (`{"Width","Height"}`
//! JSON). v5 adds channel 255, the close signal: `[255, n]` means the sender
//! will write no more on channel `n` (the client sends `[255, 0]` at the end
//! of its stdin). As the kubelet does, the server first sends an empty message
//! on the lowest channel it writes (stdout, else stderr, else error) so that
//! the client knows the session is established, and ends with the status on
//! channel 3 and a normal close.

use super::{plain, Outcome, Pipes, ResizeDecoder, StreamOptions, Version, DRAIN_TIMEOUT};
use axum::body::Body;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::FromRequest;
use axum::http::{header, Request, Response, StatusCode};
use futures::{SinkExt, StreamExt};
use std::future::Future;
use tokio::sync::mpsc;
use vmlet_provider::{StreamIo, TermSize};

/// Channel numbers.
pub mod channel {
    /// Client input.
    pub const STDIN: u8 = 0;
    /// Output.
    pub const STDOUT: u8 = 1;
    /// Error output.
    pub const STDERR: u8 = 2;
    /// The outcome, as `metav1.Status` JSON.
    pub const ERROR: u8 = 3;
    /// Terminal size changes.
    pub const RESIZE: u8 = 4;
    /// v5 close signal: `[CLOSE, channel]`.
    pub const CLOSE: u8 = 255;
}

/// Subprotocols served, in order of preference.
pub const SUPPORTED: [Version; 2] = [Version::V5, Version::V4];

/// A message on `channel` carrying `data`.
pub fn encode(channel: u8, data: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(data.len() + 1);
    message.push(channel);
    message.extend_from_slice(data);
    message
}

/// What a client message means.
#[derive(Debug, PartialEq, Eq)]
pub enum Inbound<'a> {
    /// Bytes on a channel.
    Data(u8, &'a [u8]),
    /// v5: the client closed its side of a channel.
    Close(u8),
    /// An empty message (carries no channel).
    Empty,
}

/// Read a client message under `version` (channel 255 means "close" only in v5).
pub fn decode(version: Version, message: &[u8]) -> Inbound<'_> {
    match message {
        [] => Inbound::Empty,
        [channel::CLOSE, which, ..] if version >= Version::V5 => Inbound::Close(*which),
        [ch, rest @ ..] => Inbound::Data(*ch, rest),
    }
}

pub(super) async fn upgrade<F, Fut>(req: Request<Body>, opts: StreamOptions, run: F) -> Response<Body>
where
    F: FnOnce(StreamIo) -> Fut + Send + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    let offered: Vec<String> = req
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_owned())
        .collect();
    let Some(version) = SUPPORTED.into_iter().find(|v| offered.iter().any(|o| o == v.name())) else {
        return plain(
            StatusCode::BAD_REQUEST,
            &format!(
                "unable to upgrade: no supported WebSocket subprotocol in {offered:?}; this server speaks {} and {}",
                Version::V5.name(),
                Version::V4.name()
            ),
        );
    };
    let ws = match WebSocketUpgrade::from_request(req, &()).await {
        Ok(ws) => ws,
        Err(rejection) => return axum::response::IntoResponse::into_response(rejection),
    };
    let response = ws.protocols([version.name()]).on_upgrade(move |socket| serve(socket, version, opts, run));
    axum::response::IntoResponse::into_response(response)
}

/// Run one remote-command session on an open WebSocket.
pub async fn serve<F, Fut>(socket: WebSocket, version: Version, opts: StreamOptions, run: F)
where
    F: FnOnce(StreamIo) -> Fut,
    Fut: Future<Output = Outcome>,
{
    let began = std::time::Instant::now();
    let (mut sink, source) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(32);
    let writer = tokio::spawn(async move {
        while let Some(message) = out_rx.recv().await {
            let close = matches!(message, Message::Close(_));
            if sink.send(message).await.is_err() || close {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let send = |channel: u8, data: &[u8]| {
        let out = out_tx.clone();
        let message = Message::Binary(encode(channel, data).into());
        async move { out.send(message).await.is_ok() }
    };

    let first = if opts.stdout {
        channel::STDOUT
    } else if opts.stderr && !opts.tty {
        channel::STDERR
    } else {
        channel::ERROR
    };
    send(first, &[]).await;

    let pipes = Pipes::new(opts, true);
    let reader = tokio::spawn(read_loop(source, version, pipes.stdin, pipes.resize));
    let mut outputs = Vec::new();
    for (ch, rx) in [(channel::STDOUT, pipes.stdout), (channel::STDERR, pipes.stderr)] {
        if let Some(mut rx) = rx {
            let out = out_tx.clone();
            outputs.push(tokio::spawn(async move {
                while let Some(data) = rx.recv().await {
                    if out.send(Message::Binary(encode(ch, &data).into())).await.is_err() {
                        return;
                    }
                }
            }));
        }
    }

    let outcome = run(pipes.io).await;
    let ran_ms = began.elapsed().as_secs_f64() * 1e3;
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        for pump in outputs {
            let _ = pump.await;
        }
    })
    .await;
    send(channel::ERROR, &outcome.encode(version)).await;
    let _ = out_tx.send(Message::Close(Some(CloseFrame { code: 1000, reason: "".into() }))).await;
    drop(out_tx);
    let _ = writer.await;
    reader.abort();
    tracing::debug!(
        ran_ms,
        closed_ms = began.elapsed().as_secs_f64() * 1e3,
        "remote-command session over WebSocket: command done, session closed (ms from the upgrade)"
    );
}

async fn read_loop(
    mut source: futures::stream::SplitStream<WebSocket>,
    version: Version,
    mut stdin: Option<mpsc::Sender<Vec<u8>>>,
    resize: Option<mpsc::Sender<TermSize>>,
) {
    let mut sizes = ResizeDecoder::default();
    while let Some(Ok(message)) = source.next().await {
        let data = match message {
            Message::Binary(data) => data,
            Message::Close(_) => break,
            // Pings are answered by the WebSocket layer; text is not part of
            // the binary channel protocols.
            _ => continue,
        };
        match decode(version, &data) {
            Inbound::Data(channel::STDIN, bytes) => {
                if let Some(tx) = &stdin {
                    if !bytes.is_empty() && tx.send(bytes.to_vec()).await.is_err() {
                        stdin = None;
                    }
                }
            }
            Inbound::Data(channel::RESIZE, bytes) => {
                if let Some(tx) = &resize {
                    for size in sizes.feed(bytes) {
                        // A provider that ignores resizes must not stall stdin.
                        let _ = tx.try_send(size);
                    }
                }
            }
            Inbound::Close(channel::STDIN) => stdin = None,
            _ => {}
        }
    }
}
