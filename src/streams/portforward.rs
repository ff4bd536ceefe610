//! The port-forward protocol, server side (what a kubelet answers for
//! `/portForward/{namespace}/{pod}`), in its three transports:
//!
//! - **SPDY/3.1** (`Upgrade: SPDY/3.1`, `X-Stream-Protocol-Version:
//!   portforward.k8s.io`, or no version at all from old clients; another
//!   version only gets 403): what an API server sends a kubelet when it
//!   forwards kubectl's SPDY request, or translates kubectl's WebSocket
//!   for a Node that does not declare `ExtendWebSocketsToKubelet`.
//! - **SPDY/3.1 tunnelled in a WebSocket** (subprotocol
//!   `SPDY/3.1+portforward.k8s.io`): the same SPDY bytes, carried in binary
//!   WebSocket messages. kubectl 1.31+ speaks this to the API server; a
//!   1.36+ API server (`kube-apiserver` 1.37: `PortForwardREST.Connect`)
//!   passes it straight through to a Node that declares
//!   `ExtendWebSocketsToKubelet`, as vmlet's Nodes do, so this is what
//!   `kubectl port-forward` reaches vmlet with.
//! - **WebSocket channels** (subprotocol `v4.channel.k8s.io`, or none): the
//!   older WebSocket protocol, which an API server passes through to the
//!   kubelet as it is (it translates only the tunnelling subprotocol). The
//!   ports are the request's `port` query parameters (repeated or
//!   comma-separated); port `i` has data channel `2i` and error channel
//!   `2i+1`, the server first writes the port (2 bytes, little endian) on
//!   both, then the data; a connect failure is text on the error channel.
//!   One connection per port for the whole session. The base64 variant
//!   (`v4.base64.channel.k8s.io`) is not served: no Kubernetes client
//!   offers it for port forwarding alone.
//!
//! On SPDY (plain or tunnelled) the client opens, per forwarded connection,
//! an `error` stream and a `data` stream (header `streamType`), both with
//! header `port` and the same `requestID`. Once both of a request are
//! open, the server connects to the port ([`Dial`]) and copies bytes both
//! ways; a connect failure is written as text on the error stream. The data
//! stream ends (FIN) when the guest closes; the client's FIN half-closes the
//! guest connection; the error stream is closed when the forwarding ends,
//! which is what the client waits for. A pair not complete within
//! [`super::STREAM_CREATION_TIMEOUT`] gets "timed out waiting for streams"
//! on its error stream and is dropped. Handlers never see SPDY or WebSocket.
//!
//! Memory: each stream buffers at most
//! [`super::spdy::session::STREAM_BUFFER_BYTES`], as exec's do, and a
//! session holds at most [`MAX_CONNECTIONS`] forwarded connections (twice
//! as many streams) at once; streams past that are refused (RST_STREAM), and
//! a finished connection's streams are released.

use super::spdy::frame::{self, Headers};
use super::spdy::session::{RecvHalf, SendHalf, Session, SpdyStream};
use super::spdy::UPGRADE;
use super::{plain, STREAM_CREATION_TIMEOUT};
use axum::body::Body;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::FromRequest;
use axum::http::{header, Request, Response, StatusCode};
use futures::future::BoxFuture;
use futures::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use vmlet_provider::GuestConnection;

/// The port-forward protocol's name (`X-Stream-Protocol-Version`).
pub const PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol that tunnels SPDY port forwarding.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// The WebSocket channel subprotocol (binary) of port forwarding.
pub const CHANNEL_PROTOCOL: &str = "v4.channel.k8s.io";
/// Forwarded connections one session carries at once; a SPDY session
/// accepts twice as many streams, a WebSocket session as many ports.
pub const MAX_CONNECTIONS: usize = 16;
/// Bytes read from the guest per read, at most (also the largest WebSocket
/// message sent).
const CHUNK: usize = 32 * 1024;
/// Largest WebSocket message accepted from the client: a SPDY frame of the
/// largest size the session accepts plus its header, with room.
const MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;
/// How often pairs waiting for their second stream are checked.
const PAIR_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Opens a connection to a port of the pod's guest. The error is the text
/// the client shows (written on the error stream or channel); it should
/// name the port and the pod. The session holds the `Dial` until its last
/// connection ends, so whatever it captures (a stream slot) lives as long.
pub type Dial = Arc<dyn Fn(u16) -> BoxFuture<'static, Result<Box<dyn GuestConnection>, String>> + Send + Sync>;

/// Which of a request's two streams a SPDY stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// Bytes to and from the port.
    Data,
    /// The server's error text, if any; closed when the forwarding ends.
    Error,
}

/// What a stream's headers say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamHeader {
    /// `streamType`.
    pub kind: StreamKind,
    /// `requestID`; for clients that send none, derived from the stream id
    /// (see [`stream_header`]).
    pub request_id: String,
    /// `port`, unparsed (only the data stream's is used).
    pub port: Option<String>,
}

/// Read the headers of SPDY stream `id`. A client that sends no `requestID`
/// (kubectl before 1.4) opens a connection's error stream and then its data
/// stream as consecutive odd ids, so the error stream's id, and the data
/// stream's id minus 2, pair them (as the kubelet does; wrong only when such
/// a client opens connections concurrently). Errors: a missing or unknown
/// `streamType`.
pub fn stream_header(id: u32, headers: &Headers) -> Result<StreamHeader, String> {
    let kind = match frame::header(headers, "streamtype") {
        Some("data") => StreamKind::Data,
        Some("error") => StreamKind::Error,
        Some(other) => {
            return Err(format!("unknown stream type {other:?}; port forwarding has \"data\" and \"error\""))
        }
        None => return Err("stream without a streamType header".into()),
    };
    let request_id = match frame::header(headers, "requestid").filter(|v| !v.is_empty()) {
        Some(v) => v.to_owned(),
        None => match kind {
            StreamKind::Error => id.to_string(),
            StreamKind::Data => id.saturating_sub(2).to_string(),
        },
    };
    Ok(StreamHeader { kind, request_id, port: frame::header(headers, "port").map(str::to_owned) })
}

/// A port number as the `port` header or query parameter gives it: decimal,
/// 1..=65535. Errors: the message for the client.
pub fn parse_port(value: &str) -> Result<u16, String> {
    match value.trim().parse::<u16>() {
        Ok(0) => Err("port 0 is no port to forward to".into()),
        Ok(port) => Ok(port),
        Err(_) => Err(format!("invalid port {value:?}: want a number from 1 to 65535")),
    }
}

/// The ports of a WebSocket channel request: every `port` query parameter,
/// each one port or several separated by commas. Errors: none given, one
/// invalid, or more than [`MAX_CONNECTIONS`].
pub fn ports_from_query(query: &[(String, String)]) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for (_, value) in query.iter().filter(|(k, _)| k == "port") {
        for part in value.split(',') {
            ports.push(parse_port(part)?);
        }
    }
    if ports.is_empty() {
        return Err("query parameter \"port\" is required".into());
    }
    if ports.len() > MAX_CONNECTIONS {
        return Err(format!("{} ports asked; at most {MAX_CONNECTIONS} per session", ports.len()));
    }
    Ok(ports)
}

/// Streams waiting for the other stream of their request, by `requestID`.
pub struct Pairs<T> {
    waiting: HashMap<String, Half<T>>,
}

struct Half<T> {
    data: Option<T>,
    error: Option<T>,
    since: Instant,
}

/// What [`Pairs::add`] made of a stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Added<T> {
    /// Kept until the other stream of its request opens.
    Waiting,
    /// Both streams of the request are open: `(data, error)`.
    Complete(T, T),
    /// The request already has a stream of this kind: this one is returned
    /// to be reset.
    Duplicate(T),
}

impl<T> Default for Pairs<T> {
    fn default() -> Self {
        Pairs { waiting: HashMap::new() }
    }
}

impl<T> Pairs<T> {
    /// Add `stream` of `kind` for request `request_id`, opened at `now`.
    pub fn add(&mut self, request_id: &str, kind: StreamKind, stream: T, now: Instant) -> Added<T> {
        let half = self.waiting.entry(request_id.to_owned()).or_insert(Half { data: None, error: None, since: now });
        let slot = match kind {
            StreamKind::Data => &mut half.data,
            StreamKind::Error => &mut half.error,
        };
        if slot.is_some() {
            return Added::Duplicate(stream);
        }
        *slot = Some(stream);
        if half.data.is_some() && half.error.is_some() {
            let half = self.waiting.remove(request_id).expect("the pair was just filled");
            return Added::Complete(half.data.expect("data"), half.error.expect("error"));
        }
        Added::Waiting
    }

    /// Remove the requests that waited `timeout` or longer at `now`; each
    /// gives its error stream (to say so on) and data stream, whichever came.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<(Option<T>, Option<T>)> {
        let expired: Vec<String> = self
            .waiting
            .iter()
            .filter(|(_, half)| now.duration_since(half.since) >= timeout)
            .map(|(id, _)| id.clone())
            .collect();
        expired.into_iter().filter_map(|id| self.waiting.remove(&id)).map(|half| (half.data, half.error)).collect()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no request waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// Answer a port-forward request: upgrade it to SPDY/3.1, tunnelled SPDY or
/// WebSocket channels (see the module) and forward each connection the
/// client opens through `dial`. `query` is the request's decoded query
/// (ports of the WebSocket channel protocol). Returns the `101 Switching
/// Protocols` response, or 400/403 when the request is no usable upgrade;
/// the session runs on a spawned task.
pub async fn upgrade(req: Request<Body>, query: &[(String, String)], dial: Dial) -> Response<Body> {
    let upgrade = req.headers().get(header::UPGRADE).and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase();
    if upgrade.contains("websocket") {
        let offered: Vec<String> = req
            .headers()
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .collect();
        let tunnel = offered.iter().any(|p| p == TUNNEL_PROTOCOL);
        let channels = offered.is_empty() || offered.iter().any(|p| p == CHANNEL_PROTOCOL);
        if !tunnel && !channels {
            return plain(
                StatusCode::BAD_REQUEST,
                &format!(
                    "unable to upgrade: no supported WebSocket subprotocol in {offered:?}; port forwarding speaks \
                     {TUNNEL_PROTOCOL} and {CHANNEL_PROTOCOL}"
                ),
            );
        }
        let ports = if tunnel {
            Vec::new()
        } else {
            match ports_from_query(query) {
                Ok(ports) => ports,
                Err(message) => return plain(StatusCode::BAD_REQUEST, &message),
            }
        };
        let ws = match WebSocketUpgrade::from_request(req, &()).await {
            Ok(ws) => ws.max_message_size(MAX_MESSAGE_BYTES).max_frame_size(MAX_MESSAGE_BYTES),
            Err(rejection) => return axum::response::IntoResponse::into_response(rejection),
        };
        tracing::info!(stream.transport = if tunnel { "websocket-spdy" } else { "websocket" }, "port-forward session");
        let response = if tunnel {
            ws.protocols([TUNNEL_PROTOCOL]).on_upgrade(move |socket| async move {
                let session = Session::start_with_cap(websocket_bytes(socket), 2 * MAX_CONNECTIONS);
                serve_spdy(session, dial).await;
            })
        } else {
            let ws = if offered.is_empty() { ws } else { ws.protocols([CHANNEL_PROTOCOL]) };
            ws.on_upgrade(move |socket| serve_channels(socket, ports, dial))
        };
        return axum::response::IntoResponse::into_response(response);
    }
    if !upgrade.contains(&UPGRADE.to_ascii_lowercase()) {
        return plain(
            StatusCode::BAD_REQUEST,
            "unable to upgrade: missing upgrade headers in request (want Upgrade: SPDY/3.1 or websocket)",
        );
    }
    let offered: Vec<&str> = req
        .headers()
        .get_all(super::remotecommand::PROTOCOL_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    // A client that names no version (before `portforward.k8s.io` was
    // named) is served, as the kubelet serves it, and told none.
    let legacy = offered.iter().all(|v| v.is_empty());
    if !legacy && !offered.contains(&PROTOCOL) {
        let mut response = plain(
            StatusCode::FORBIDDEN,
            &format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server accepts [{PROTOCOL:?}]"),
        );
        response
            .headers_mut()
            .insert(super::remotecommand::ACCEPTED_HEADER, axum::http::HeaderValue::from_static(PROTOCOL));
        return response;
    }
    tracing::info!(stream.transport = "spdy", "port-forward session");
    let mut req = req;
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                serve_spdy(Session::start_with_cap(TokioIo::new(upgraded), 2 * MAX_CONNECTIONS), dial).await
            }
            Err(e) => tracing::debug!(error = %e, "SPDY upgrade did not complete"),
        }
    });
    let mut response = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, UPGRADE);
    if !legacy {
        response = response.header(super::remotecommand::PROTOCOL_HEADER, PROTOCOL);
    }
    response.body(Body::empty()).expect("a 101 response builds")
}

/// The bytes of a tunnelling WebSocket's binary messages as one byte
/// stream, and what is written to it as binary messages. Buffers at most
/// 64 KiB each way plus one message.
fn websocket_bytes(socket: WebSocket) -> tokio::io::DuplexStream {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (mut from_session, mut to_session) = tokio::io::split(ours);
    let (mut sink, mut source) = socket.split();
    tokio::spawn(async move {
        while let Some(Ok(message)) = source.next().await {
            let bytes = match message {
                Message::Binary(bytes) => bytes,
                Message::Close(_) => break,
                // Pings are answered by the WebSocket layer; text carries no SPDY.
                _ => continue,
            };
            if to_session.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to_session.shutdown().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from_session.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if sink.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = sink.send(Message::Close(Some(CloseFrame { code: 1000, reason: "".into() }))).await;
        let _ = sink.close().await;
    });
    theirs
}

/// Run a port-forward session on an established SPDY session until the
/// client goes away; then every connection still forwarded is dropped.
pub async fn serve_spdy(mut session: Session, dial: Dial) {
    let mut pairs: Pairs<SpdyStream> = Pairs::default();
    let mut running = tokio::task::JoinSet::new();
    let mut check = tokio::time::interval(PAIR_CHECK_INTERVAL);
    loop {
        tokio::select! {
            stream = session.accept() => {
                let Some(stream) = stream else { break };
                let header = match stream_header(stream.id, &stream.headers) {
                    Ok(header) => header,
                    Err(message) => {
                        tracing::debug!(%message, "port-forward stream refused");
                        stream.send.reset().await;
                        stream.send.release();
                        continue;
                    }
                };
                match pairs.add(&header.request_id, header.kind, stream, Instant::now()) {
                    Added::Waiting => {}
                    Added::Duplicate(stream) => {
                        tracing::debug!(request = %header.request_id, "second stream of one kind for a request; resetting it");
                        stream.send.reset().await;
                        stream.send.release();
                    }
                    Added::Complete(data, error) => {
                        running.spawn(forward(data, error, Arc::clone(&dial)));
                    }
                }
            }
            _ = check.tick() => {
                for (data, error) in pairs.expire(Instant::now(), STREAM_CREATION_TIMEOUT) {
                    if let Some(error) = &error {
                        let _ = error.send.write(b"timed out waiting for streams").await;
                        let _ = error.send.finish().await;
                    }
                    for stream in data.iter().chain(error.iter()) {
                        stream.send.reset().await;
                        stream.send.release();
                    }
                }
            }
            Some(_) = running.join_next(), if !running.is_empty() => {}
        }
    }
    running.abort_all();
    session.close().await;
}

/// Forward one connection: the data stream's `port` of the guest.
async fn forward(data: SpdyStream, error: SpdyStream, dial: Dial) {
    let SpdyStream { headers, send, recv, .. } = data;
    let port = frame::header(&headers, "port").ok_or_else(|| "data stream without a port header".to_owned());
    let connected = match port.and_then(parse_port) {
        Ok(port) => dial(port).await,
        Err(message) => Err(message),
    };
    match connected {
        Ok(guest) => copy_both_ways(&send, recv, guest).await,
        Err(message) => {
            let _ = error.send.write(message.as_bytes()).await;
        }
    }
    let _ = send.finish().await;
    let _ = error.send.finish().await;
    send.release();
    error.send.release();
}

/// Copy client → guest and guest → client until the guest closes its side
/// or the client resets the stream (or the session ends). The client's FIN
/// half-closes the guest connection; the guest's close ends the forwarding.
async fn copy_both_ways(send: &SendHalf, mut recv: RecvHalf, guest: Box<dyn GuestConnection>) {
    let (mut from_guest, mut to_guest) = tokio::io::split(guest);
    let up = async {
        while let Some(bytes) = recv.read().await {
            if to_guest.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to_guest.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from_guest.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if send.write(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    tokio::pin!(up, down);
    let mut up_done = false;
    loop {
        tokio::select! {
            _ = &mut up, if !up_done => {
                up_done = true;
                // A FIN leaves the guest's answer to come; a reset (or the
                // session's end) leaves nobody to send it to.
                if send.is_closed() {
                    return;
                }
            }
            _ = &mut down => return,
        }
    }
}

/// A WebSocket channel message: the channel's number, then `data`.
fn channel_message(channel: u8, data: &[u8]) -> Message {
    let mut message = Vec::with_capacity(data.len() + 1);
    message.push(channel);
    message.extend_from_slice(data);
    Message::Binary(message.into())
}

/// Run a WebSocket channel session: one connection per port of `ports`,
/// until the client closes or every connection has ended.
async fn serve_channels(socket: WebSocket, ports: Vec<u16>, dial: Dial) {
    let (mut sink, mut source) = socket.split();
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
    let mut running = tokio::task::JoinSet::new();
    let mut inputs = Vec::with_capacity(ports.len());
    for (i, port) in ports.iter().enumerate() {
        let (data_channel, error_channel) = (2 * i as u8, 2 * i as u8 + 1);
        for channel in [data_channel, error_channel] {
            let _ = out_tx.send(channel_message(channel, &port.to_le_bytes())).await;
        }
        // One message waits at most (bounded by MAX_MESSAGE_BYTES).
        let (tx, rx) = mpsc::channel::<Vec<u8>>(1);
        inputs.push(tx);
        running.spawn(forward_channel(*port, data_channel, rx, out_tx.clone(), Arc::clone(&dial)));
    }
    let read = async {
        while let Some(Ok(message)) = source.next().await {
            let bytes = match message {
                Message::Binary(bytes) => bytes,
                Message::Close(_) => break,
                _ => continue,
            };
            let Some((&channel, data)) = bytes.split_first() else { continue };
            // The client writes on data channels only; error channels are ours.
            let input = (channel % 2 == 0).then(|| inputs.get(usize::from(channel / 2))).flatten();
            if let (Some(input), false) = (input, data.is_empty()) {
                let _ = input.send(data.to_vec()).await;
            }
        }
    };
    let all_done = async { while running.join_next().await.is_some() {} };
    tokio::select! {
        _ = read => {}
        _ = all_done => {}
    }
    running.abort_all();
    let _ = out_tx.send(Message::Close(Some(CloseFrame { code: 1000, reason: "".into() }))).await;
    drop(out_tx);
    let _ = writer.await;
}

/// One port of a WebSocket channel session: client bytes from `input` to
/// the guest, the guest's bytes on `channel`, a connect failure as text on
/// `channel + 1`.
async fn forward_channel(
    port: u16,
    channel: u8,
    mut input: mpsc::Receiver<Vec<u8>>,
    out: mpsc::Sender<Message>,
    dial: Dial,
) {
    let guest = match dial(port).await {
        Ok(guest) => guest,
        Err(message) => {
            let _ = out.send(channel_message(channel + 1, message.as_bytes())).await;
            return;
        }
    };
    let (mut from_guest, mut to_guest) = tokio::io::split(guest);
    let up = async {
        while let Some(bytes) = input.recv().await {
            if to_guest.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to_guest.shutdown().await;
        std::future::pending::<()>().await;
    };
    let down = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from_guest.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if out.send(channel_message(channel, &buf[..n])).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streams::spdy::frame::{Frame, FrameDecoder, FrameEncoder, FLAG_FIN};

    fn headers(pairs: &[(&str, &str)]) -> Headers {
        pairs.iter().map(|(k, v)| (k.to_ascii_lowercase(), (*v).to_owned())).collect()
    }

    #[test]
    fn stream_headers_give_kind_port_and_request_id() {
        let data = headers(&[("streamType", "data"), ("port", "7000"), ("requestID", "4")]);
        assert_eq!(
            stream_header(9, &data),
            Ok(StreamHeader { kind: StreamKind::Data, request_id: "4".into(), port: Some("7000".into()) })
        );
        let error = headers(&[("streamType", "error"), ("port", "7000")]);
        assert_eq!(stream_header(5, &error).unwrap().request_id, "5", "an old client's error stream: its own id");
        let data = headers(&[("streamType", "data"), ("port", "7000")]);
        assert_eq!(stream_header(7, &data).unwrap().request_id, "5", "and its data stream: the id before");
        assert!(stream_header(1, &headers(&[("streamType", "stdin")])).unwrap_err().contains("unknown stream type"));
        assert!(stream_header(1, &headers(&[("port", "80")])).is_err());
    }

    #[test]
    fn ports_are_1_to_65535_and_the_query_may_repeat_or_list_them() {
        assert_eq!(parse_port("7000"), Ok(7000));
        assert!(parse_port("0").is_err());
        assert!(parse_port("65536").is_err());
        assert!(parse_port("-1").is_err());
        assert!(parse_port("80; rm").is_err());
        let query: Vec<(String, String)> = [("port", "80,443"), ("other", "1"), ("port", "7000")]
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        assert_eq!(ports_from_query(&query), Ok(vec![80, 443, 7000]));
        assert!(ports_from_query(&[]).unwrap_err().contains("required"));
        let many = vec![("port".to_owned(), vec!["1"; MAX_CONNECTIONS + 1].join(","))];
        assert!(ports_from_query(&many).is_err());
    }

    #[test]
    fn a_request_pairs_when_both_kinds_arrive_in_either_order_and_duplicates_are_returned() {
        let now = Instant::now();
        let mut pairs = Pairs::default();
        assert_eq!(pairs.add("1", StreamKind::Error, "e1", now), Added::Waiting);
        assert_eq!(pairs.add("2", StreamKind::Data, "d2", now), Added::Waiting);
        assert_eq!(pairs.add("1", StreamKind::Error, "e1bis", now), Added::Duplicate("e1bis"));
        assert_eq!(pairs.add("1", StreamKind::Data, "d1", now), Added::Complete("d1", "e1"));
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs.add("2", StreamKind::Error, "e2", now), Added::Complete("d2", "e2"));
        assert!(pairs.is_empty());
    }

    #[test]
    fn a_request_without_its_second_stream_expires_after_the_timeout() {
        let start = Instant::now();
        let mut pairs = Pairs::default();
        pairs.add("1", StreamKind::Error, "e1", start);
        pairs.add("2", StreamKind::Data, "d2", start + Duration::from_secs(20));
        assert!(pairs.expire(start + Duration::from_secs(29), Duration::from_secs(30)).is_empty());
        assert_eq!(pairs.expire(start + Duration::from_secs(30), Duration::from_secs(30)), vec![(None, Some("e1"))]);
        assert_eq!(pairs.len(), 1);
    }

    /// Frames the server sends, until `done` says one is the last wanted (a
    /// hang guard of 30 s).
    async fn frames_until<R: tokio::io::AsyncRead + Unpin>(
        reader: &mut R,
        decoder: &mut FrameDecoder,
        done: impl Fn(&Frame) -> bool,
    ) -> Vec<Frame> {
        let (mut buf, mut frames, mut chunk) = (Vec::new(), Vec::new(), vec![0u8; 4096]);
        let read = async {
            loop {
                while let Some((frame, used)) = decoder.decode(&buf).expect("the server's frames decode") {
                    buf.drain(..used);
                    let last = done(&frame);
                    frames.push(frame);
                    if last {
                        return;
                    }
                }
                let n = reader.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the session closed early; got {frames:?}");
                buf.extend_from_slice(&chunk[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(30), read).await.expect("the server answered");
        frames
    }

    fn syn(stream_id: u32, kind: &str, port: &str, request: &str) -> Frame {
        let headers = headers(&[("streamType", kind), ("port", port), ("requestID", request)]);
        Frame::SynStream { stream_id, associated_to: 0, priority: 0, flags: 0, headers }
    }

    /// A dial to a TCP echo server on loopback (a stand-in for the guest).
    async fn echo_dial() -> (Dial, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = conn.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let dial: Dial = Arc::new(move |port: u16| {
            Box::pin(async move {
                if port != 7000 {
                    return Err(format!("error forwarding port {port}: connection refused"));
                }
                let conn = tokio::net::TcpStream::connect(("127.0.0.1", echo_port)).await.map_err(|e| e.to_string())?;
                Ok(Box::new(conn) as Box<dyn GuestConnection>)
            })
        });
        (dial, echo_port)
    }

    #[tokio::test]
    async fn paired_streams_carry_bytes_to_the_port_and_back_and_a_refusal_is_text_on_the_error_stream() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (dial, _) = echo_dial().await;
        tokio::spawn(serve_spdy(Session::start_with_cap(server, 2 * MAX_CONNECTIONS), dial));
        let (mut reader, mut writer) = tokio::io::split(client);
        let (mut encoder, mut decoder) = (FrameEncoder::new(), FrameDecoder::new());
        let mut out = Vec::new();
        // Request 0 to the echo port, data stream first; request 1 to a refused port.
        encoder.encode(&syn(1, "data", "7000", "0"), &mut out);
        encoder.encode(&syn(3, "error", "7000", "0"), &mut out);
        encoder.encode(&syn(5, "error", "7001", "1"), &mut out);
        encoder.encode(&syn(7, "data", "7001", "1"), &mut out);
        encoder.encode(&Frame::Data { stream_id: 1, flags: 0, data: b"hello guest".to_vec() }, &mut out);
        writer.write_all(&out).await.unwrap();

        let mut echoed = Vec::new();
        let mut refusal = Vec::new();
        let frames = frames_until(
            &mut reader,
            &mut decoder,
            |f| matches!(f, Frame::Data { stream_id: 1, data, .. } if data == b"hello guest"),
        )
        .await;
        for frame in &frames {
            match frame {
                Frame::Data { stream_id: 1, data, .. } => echoed.extend_from_slice(data),
                Frame::Data { stream_id: 5, data, .. } => refusal.extend_from_slice(data),
                _ => {}
            }
        }
        assert_eq!(echoed, b"hello guest");

        // The client half-closes: the echo server sees the end and closes, so
        // the data stream ends, then the error stream (what kubectl waits for).
        let mut out = Vec::new();
        encoder.encode(&Frame::Data { stream_id: 1, flags: FLAG_FIN, data: Vec::new() }, &mut out);
        writer.write_all(&out).await.unwrap();
        let frames = frames_until(
            &mut reader,
            &mut decoder,
            |f| matches!(f, Frame::Data { stream_id: 3, flags, .. } if flags & FLAG_FIN != 0),
        )
        .await;
        for frame in &frames {
            if let Frame::Data { stream_id: 5, data, .. } = frame {
                refusal.extend_from_slice(data);
            }
        }
        assert!(
            frames.iter().any(|f| matches!(f, Frame::Data { stream_id: 1, flags, .. } if flags & FLAG_FIN != 0)),
            "the data stream ended: {frames:?}"
        );
        if refusal.is_empty() {
            let frames =
                frames_until(&mut reader, &mut decoder, |f| matches!(f, Frame::Data { stream_id: 5, .. })).await;
            for frame in &frames {
                if let Frame::Data { stream_id: 5, data, .. } = frame {
                    refusal.extend_from_slice(data);
                }
            }
        }
        assert_eq!(String::from_utf8_lossy(&refusal), "error forwarding port 7001: connection refused");
    }

    #[tokio::test]
    async fn released_streams_free_the_sessions_cap_for_later_connections() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (dial, _) = echo_dial().await;
        // Room for one connection (two streams) at a time.
        tokio::spawn(serve_spdy(Session::start_with_cap(server, 2), dial));
        let (mut reader, mut writer) = tokio::io::split(client);
        let (mut encoder, mut decoder) = (FrameEncoder::new(), FrameDecoder::new());
        for request in 0..3u32 {
            let (error_id, data_id) = (4 * request + 1, 4 * request + 3);
            let mut out = Vec::new();
            encoder.encode(&syn(error_id, "error", "7001", &request.to_string()), &mut out);
            encoder.encode(&syn(data_id, "data", "7001", &request.to_string()), &mut out);
            writer.write_all(&out).await.unwrap();
            let frames = frames_until(&mut reader, &mut decoder, |f| {
                matches!(f, Frame::Data { stream_id, flags, .. } if *stream_id == error_id && flags & FLAG_FIN != 0)
            })
            .await;
            assert!(
                !frames.iter().any(|f| matches!(f, Frame::RstStream { .. })),
                "request {request} was refused: {frames:?}"
            );
        }
    }
}
