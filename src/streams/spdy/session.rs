//! The server side of a SPDY/3.1 session over an upgraded connection.
//!
//! One task reads frames and dispatches them: it accepts SYN_STREAM with an
//! empty SYN_REPLY (as the Kubernetes `httpstream/spdy` server does), routes
//! DATA to the stream's reader, echoes PING, honours RST_STREAM, GOAWAY,
//! SETTINGS and WINDOW_UPDATE. One task writes: every frame goes through its
//! queue, so the header compression state and frame order stay consistent.
//!
//! Flow control (SPDY/3.1): data we receive is credited back with WINDOW_UPDATE
//! (stream and session) as the reader consumes it. Data we send is held to the
//! peer's windows once the peer shows it takes part in flow control (it sent
//! SETTINGS_INITIAL_WINDOW_SIZE or a WINDOW_UPDATE). The Kubernetes peer
//! (moby/spdystream) implements none: it never sends WINDOW_UPDATE, so holding
//! it to the 64 KiB default window would stall every exec after 64 KiB.

use super::frame::{self, rst, Frame, FrameDecoder, FrameEncoder, Headers, FLAG_FIN};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify};

/// The initial flow-control window of SPDY/3.1 streams and sessions.
pub const DEFAULT_WINDOW: i64 = 64 * 1024;
/// Largest DATA frame we send.
const MAX_CHUNK: usize = 32 * 1024;
/// DATA frames buffered per stream before the reader waits (backpressure).
const STREAM_BUFFER: usize = 32;

/// A session-level failure.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The connection is gone or the stream was reset.
    #[error("SPDY stream {0} is closed")]
    Closed(u32),
}

struct StreamState {
    data: Option<mpsc::Sender<Vec<u8>>>,
    send_window: i64,
    reset: bool,
}

struct State {
    streams: HashMap<u32, StreamState>,
    session_send_window: i64,
    initial_send_window: i64,
    enforce: bool,
    closed: bool,
    go_away: bool,
    last_stream: u32,
}

struct Shared {
    state: Mutex<State>,
    window: Notify,
    out: mpsc::Sender<Out>,
}

enum Out {
    Frame(Frame),
    Close,
}

/// A stream the client opened.
pub struct SpdyStream {
    /// Stream id.
    pub id: u32,
    /// Headers of its SYN_STREAM.
    pub headers: Headers,
    /// Our half: data to the client.
    pub send: SendHalf,
    /// The client's half: data from the client.
    pub recv: RecvHalf,
}

/// Writes data to the client on one stream.
#[derive(Clone)]
pub struct SendHalf {
    id: u32,
    shared: Arc<Shared>,
}

/// Reads data the client sent on one stream.
pub struct RecvHalf {
    id: u32,
    rx: mpsc::Receiver<Vec<u8>>,
    shared: Arc<Shared>,
}

/// A session: accept the streams the client opens, then close.
pub struct Session {
    incoming: mpsc::Receiver<SpdyStream>,
    shared: Arc<Shared>,
}

impl Session {
    /// Start serving SPDY on `io` (the connection after `101 Switching Protocols`).
    pub fn start<IO>(io: IO) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer) = tokio::io::split(io);
        let (out_tx, out_rx) = mpsc::channel(64);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                streams: HashMap::new(),
                session_send_window: DEFAULT_WINDOW,
                initial_send_window: DEFAULT_WINDOW,
                enforce: false,
                closed: false,
                go_away: false,
                last_stream: 0,
            }),
            window: Notify::new(),
            out: out_tx,
        });
        let (in_tx, in_rx) = mpsc::channel(16);
        tokio::spawn(write_loop(writer, out_rx, shared.clone()));
        tokio::spawn(read_loop(reader, shared.clone(), in_tx));
        Session { incoming: in_rx, shared }
    }

    /// The next stream the client opens; `None` once the connection is gone.
    pub async fn accept(&mut self) -> Option<SpdyStream> {
        self.incoming.recv().await
    }

    /// Flush what was queued, send GOAWAY and close the connection.
    pub async fn close(self) {
        let last = self.shared.state.lock().expect("spdy state").last_stream;
        let _ = self.shared.out.send(Out::Frame(Frame::GoAway { last_good_stream_id: last, status: 0 })).await;
        let _ = self.shared.out.send(Out::Close).await;
    }
}

impl SendHalf {
    /// Stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Send `data`, in frames no larger than the peer's windows allow.
    pub async fn write(&self, mut data: &[u8]) -> Result<(), SessionError> {
        while !data.is_empty() {
            let n = self.reserve(data.len().min(MAX_CHUNK)).await?;
            let frame = Frame::Data { stream_id: self.id, flags: 0, data: data[..n].to_vec() };
            self.shared.out.send(Out::Frame(frame)).await.map_err(|_| SessionError::Closed(self.id))?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Half-close: an empty DATA frame with FLAG_FIN.
    pub async fn finish(&self) -> Result<(), SessionError> {
        self.check()?;
        let frame = Frame::Data { stream_id: self.id, flags: FLAG_FIN, data: Vec::new() };
        self.shared.out.send(Out::Frame(frame)).await.map_err(|_| SessionError::Closed(self.id))
    }

    /// Abort the stream with RST_STREAM CANCEL.
    pub async fn reset(&self) {
        if let Some(s) = self.shared.state.lock().expect("spdy state").streams.get_mut(&self.id) {
            s.reset = true;
            s.data = None;
        }
        let _ = self.shared.out.send(Out::Frame(Frame::RstStream { stream_id: self.id, status: rst::CANCEL })).await;
    }

    fn check(&self) -> Result<(), SessionError> {
        let state = self.shared.state.lock().expect("spdy state");
        match state.streams.get(&self.id) {
            Some(s) if !s.reset && !state.closed => Ok(()),
            _ => Err(SessionError::Closed(self.id)),
        }
    }

    /// Wait until at least one byte may be sent; take up to `want` bytes of credit.
    async fn reserve(&self, want: usize) -> Result<usize, SessionError> {
        loop {
            let notified = self.shared.window.notified();
            {
                let mut state = self.shared.state.lock().expect("spdy state");
                let enforce = state.enforce;
                let closed = state.closed;
                let session = state.session_send_window;
                let stream = state.streams.get_mut(&self.id).filter(|s| !s.reset && !closed);
                let Some(stream) = stream else { return Err(SessionError::Closed(self.id)) };
                if !enforce {
                    return Ok(want);
                }
                let credit = stream.send_window.min(session);
                if credit > 0 {
                    let n = want.min(credit as usize);
                    stream.send_window -= n as i64;
                    state.session_send_window -= n as i64;
                    return Ok(n);
                }
            }
            notified.await;
        }
    }
}

impl RecvHalf {
    /// Stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The next data the client sent; `None` after its FIN, a reset or the end
    /// of the connection. Credits the bytes back to the client's windows.
    pub async fn read(&mut self) -> Option<Vec<u8>> {
        let data = self.rx.recv().await?;
        if !data.is_empty() {
            let delta = data.len() as u32;
            for stream_id in [self.id, 0] {
                let _ = self.shared.out.send(Out::Frame(Frame::WindowUpdate { stream_id, delta })).await;
            }
        }
        Some(data)
    }
}

async fn write_loop<W: AsyncWrite>(writer: W, mut out: mpsc::Receiver<Out>, shared: Arc<Shared>) {
    let mut writer = std::pin::pin!(writer);
    let mut encoder = FrameEncoder::new();
    let mut buf = Vec::with_capacity(MAX_CHUNK + 64);
    while let Some(item) = out.recv().await {
        let Out::Frame(frame) = item else { break };
        buf.clear();
        encoder.encode(&frame, &mut buf);
        // Coalesce whatever else is queued into one write.
        let mut close = false;
        while buf.len() < 256 * 1024 {
            match out.try_recv() {
                Ok(Out::Frame(f)) => encoder.encode(&f, &mut buf),
                Ok(Out::Close) => {
                    close = true;
                    break;
                }
                Err(_) => break,
            }
        }
        if writer.write_all(&buf).await.is_err() || writer.flush().await.is_err() {
            break;
        }
        if close {
            break;
        }
    }
    let _ = writer.shutdown().await;
    mark_closed(&shared);
}

fn mark_closed(shared: &Shared) {
    let mut state = shared.state.lock().expect("spdy state");
    state.closed = true;
    for s in state.streams.values_mut() {
        s.data = None;
    }
    drop(state);
    shared.window.notify_waiters();
}

async fn read_loop<R: AsyncRead>(reader: R, shared: Arc<Shared>, incoming: mpsc::Sender<SpdyStream>) {
    let mut reader = std::pin::pin!(reader);
    let mut decoder = FrameDecoder::new();
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    'read: loop {
        loop {
            let (frame, used) = match decoder.decode(&buf) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "SPDY protocol error; sending GOAWAY");
                    let last = shared.state.lock().expect("spdy state").last_stream;
                    let _ = shared.out.send(Out::Frame(Frame::GoAway { last_good_stream_id: last, status: 1 })).await;
                    let _ = shared.out.send(Out::Close).await;
                    break 'read;
                }
            };
            buf.drain(..used);
            if !dispatch(frame, &shared, &incoming).await {
                break 'read;
            }
        }
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    mark_closed(&shared);
}

/// Handle one frame; false ends the session.
async fn dispatch(frame: Frame, shared: &Arc<Shared>, incoming: &mpsc::Sender<SpdyStream>) -> bool {
    let send = |f: Frame| async { shared.out.send(Out::Frame(f)).await.is_ok() };
    match frame {
        Frame::SynStream { stream_id, flags, headers, .. } => {
            let (tx, rx) = mpsc::channel(STREAM_BUFFER);
            let refuse = {
                let mut state = shared.state.lock().expect("spdy state");
                if state.go_away || stream_id % 2 == 0 || stream_id <= state.last_stream {
                    Some(if stream_id <= state.last_stream { rst::PROTOCOL_ERROR } else { rst::REFUSED_STREAM })
                } else {
                    state.last_stream = stream_id;
                    let window = state.initial_send_window;
                    let data = (flags & FLAG_FIN == 0).then_some(tx);
                    state.streams.insert(stream_id, StreamState { data, send_window: window, reset: false });
                    None
                }
            };
            if let Some(status) = refuse {
                return send(Frame::RstStream { stream_id, status }).await;
            }
            if !send(Frame::SynReply { stream_id, flags: 0, headers: Vec::new() }).await {
                return false;
            }
            let stream = SpdyStream {
                id: stream_id,
                headers,
                send: SendHalf { id: stream_id, shared: shared.clone() },
                recv: RecvHalf { id: stream_id, rx, shared: shared.clone() },
            };
            if incoming.send(stream).await.is_err() {
                // Nobody accepts streams any more: refuse it.
                return send(Frame::RstStream { stream_id, status: rst::REFUSED_STREAM }).await;
            }
            true
        }
        Frame::Data { stream_id, flags, data } => {
            let target = {
                let mut state = shared.state.lock().expect("spdy state");
                match state.streams.get_mut(&stream_id) {
                    None => None,
                    Some(s) => {
                        let tx = s.data.clone();
                        if flags & FLAG_FIN != 0 {
                            s.data = None;
                        }
                        Some(tx)
                    }
                }
            };
            match target {
                None => send(Frame::RstStream { stream_id, status: rst::INVALID_STREAM }).await,
                Some(None) => true, // data after FIN or reset: dropped
                Some(Some(tx)) => {
                    if !data.is_empty() {
                        // Waits while the stream's reader is behind (backpressure).
                        let _ = tx.send(data).await;
                    }
                    true
                }
            }
        }
        Frame::RstStream { stream_id, .. } => {
            if let Some(s) = shared.state.lock().expect("spdy state").streams.get_mut(&stream_id) {
                s.reset = true;
                s.data = None;
            }
            shared.window.notify_waiters();
            true
        }
        Frame::Ping { id } => {
            // We never ping, so every PING is the client's: echo it.
            send(Frame::Ping { id }).await
        }
        Frame::GoAway { .. } => {
            shared.state.lock().expect("spdy state").go_away = true;
            true
        }
        Frame::Settings { entries, .. } => {
            let mut state = shared.state.lock().expect("spdy state");
            for e in entries.iter().filter(|e| e.id == frame::SETTINGS_INITIAL_WINDOW_SIZE) {
                let delta = i64::from(e.value) - state.initial_send_window;
                state.initial_send_window = i64::from(e.value);
                for s in state.streams.values_mut() {
                    s.send_window += delta;
                }
                state.enforce = true;
            }
            drop(state);
            shared.window.notify_waiters();
            true
        }
        Frame::WindowUpdate { stream_id, delta } => {
            let mut state = shared.state.lock().expect("spdy state");
            state.enforce = true;
            if stream_id == 0 {
                state.session_send_window += i64::from(delta);
            } else if let Some(s) = state.streams.get_mut(&stream_id) {
                s.send_window += i64::from(delta);
            }
            drop(state);
            shared.window.notify_waiters();
            true
        }
        // A server never receives SYN_REPLY (it opens no streams); HEADERS carry
        // nothing the remote-command protocol uses. Their header blocks were
        // still inflated, keeping the zlib state in step.
        Frame::SynReply { .. } | Frame::Headers { .. } | Frame::Unknown { .. } => true,
    }
}
