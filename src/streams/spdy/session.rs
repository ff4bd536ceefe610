//! The server side of a SPDY/3.1 session over an upgraded connection.
//!
//! One task reads frames and dispatches them: it accepts SYN_STREAM with an
//! empty SYN_REPLY (as the Kubernetes `httpstream/spdy` server does), routes
//! DATA to the stream's reader, echoes PING, honours RST_STREAM, GOAWAY,
//! SETTINGS and WINDOW_UPDATE. One task writes: every frame goes through its
//! queue, so the header compression state and frame order stay consistent.
//!
//! Flow control (SPDY/3.1): data we receive is credited back with WINDOW_UPDATE
//! (stream and session) as the reader consumes it. As the Kubernetes peer
//! does not honour windows, memory is bounded instead: a frame of at most
//! 1 MiB ([`frame::MAX_RECEIVED_PAYLOAD`]), at most [`STREAM_BUFFER_BYTES`]
//! waiting per stream before the session stops reading, at most
//! [`MAX_STREAMS`] streams: about 9 MiB per session at worst. Data we send is held to the
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
/// Bytes of DATA buffered per stream before the session stops reading the
/// connection (backpressure): a peer that ignores flow control (as
/// moby/spdystream does) and a guest that does not read hold at most this
/// much per stream. At least [`frame::MAX_RECEIVED_PAYLOAD`].
pub const STREAM_BUFFER_BYTES: usize = 1 << 20;
/// Streams a peer may have open at once in a remote-command session
/// ([`Session::start`]); more are refused with RST_STREAM REFUSED_STREAM.
/// The remote-command protocol opens at most 5 (error, stdin, stdout,
/// stderr, resize). A port-forward session sets its own cap
/// ([`Session::start_with_cap`]) and releases each stream when done with it.
pub const MAX_STREAMS: usize = 8;

const _: () = assert!(frame::MAX_RECEIVED_PAYLOAD <= STREAM_BUFFER_BYTES, "a frame must fit a stream's budget");

/// A session-level failure.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The connection is gone or the stream was reset.
    #[error("SPDY stream {0} is closed")]
    Closed(u32),
}

/// Data received on a stream, with the share of the stream's byte budget it
/// holds until its reader took it.
type Received = (Vec<u8>, tokio::sync::OwnedSemaphorePermit);

struct StreamState {
    data: Option<mpsc::Sender<Received>>,
    /// The stream's byte budget ([`STREAM_BUFFER_BYTES`]).
    budget: Arc<tokio::sync::Semaphore>,
    send_window: i64,
    reset: bool,
}

struct State {
    streams: HashMap<u32, StreamState>,
    /// At most this many entries in `streams` ([`MAX_STREAMS`] unless set).
    max_streams: usize,
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
    rx: mpsc::Receiver<Received>,
    shared: Arc<Shared>,
}

/// A session: accept the streams the client opens, then close.
pub struct Session {
    incoming: mpsc::Receiver<SpdyStream>,
    shared: Arc<Shared>,
}

impl Session {
    /// Start serving SPDY on `io` (the connection after `101 Switching Protocols`),
    /// with at most [`MAX_STREAMS`] streams.
    pub fn start<IO>(io: IO) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        Session::start_with_cap(io, MAX_STREAMS)
    }

    /// [`Session::start`] with at most `max_streams` streams open at once
    /// (each may buffer [`STREAM_BUFFER_BYTES`]); a stream counts until it
    /// is released ([`SendHalf::release`]) or the session ends.
    pub fn start_with_cap<IO>(io: IO, max_streams: usize) -> Session
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer) = tokio::io::split(io);
        let (out_tx, out_rx) = mpsc::channel(64);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                streams: HashMap::new(),
                max_streams,
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

    /// Whether the stream can no longer carry data to the client: it was
    /// reset (by either side), released, or the session ended.
    pub fn is_closed(&self) -> bool {
        self.check().is_err()
    }

    /// Forget the stream: it no longer counts against the session's cap,
    /// data the client still sends on it is answered with RST_STREAM
    /// INVALID_STREAM, and data not read yet is dropped. For sessions that
    /// open streams as they go (port forwarding), once both directions of
    /// the stream are done or it was reset.
    pub fn release(&self) {
        self.shared.state.lock().expect("spdy state").streams.remove(&self.id);
        self.shared.window.notify_waiters();
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
        let (data, _budget) = self.rx.recv().await?;
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
                } else if state.streams.len() >= state.max_streams {
                    state.last_stream = stream_id;
                    Some(rst::REFUSED_STREAM)
                } else {
                    state.last_stream = stream_id;
                    let window = state.initial_send_window;
                    let data = (flags & FLAG_FIN == 0).then_some(tx);
                    let budget = Arc::new(tokio::sync::Semaphore::new(STREAM_BUFFER_BYTES));
                    state.streams.insert(stream_id, StreamState { data, budget, send_window: window, reset: false });
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
                        let tx = s.data.clone().map(|tx| (tx, Arc::clone(&s.budget)));
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
                Some(Some((tx, budget))) => {
                    if !data.is_empty() {
                        // Waits while the stream's reader is behind
                        // (backpressure): the connection is not read meanwhile.
                        // A frame is at most MAX_RECEIVED_PAYLOAD, which fits the budget.
                        let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                        let Ok(permit) = budget.acquire_many_owned(bytes).await else { return true };
                        let _ = tx.send((data, permit)).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Frames the server sends on `reader`, until `want` says one is the
    /// last to wait for (a hang guard of 30 s, not a measurement).
    async fn frames_until<R: AsyncRead + Unpin>(reader: &mut R, want: impl Fn(&Frame) -> bool) -> Vec<Frame> {
        let mut decoder = FrameDecoder::new();
        let (mut buf, mut frames, mut chunk) = (Vec::new(), Vec::new(), vec![0u8; 4096]);
        let read = async {
            loop {
                while let Some((frame, used)) = decoder.decode(&buf).expect("the server's frames decode") {
                    buf.drain(..used);
                    let done = want(&frame);
                    frames.push(frame);
                    if done {
                        return;
                    }
                }
                let n = reader.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the session closed before the frame waited for; got {frames:?}");
                buf.extend_from_slice(&chunk[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(30), read).await.expect("the server answered");
        frames
    }

    fn syn(stream_id: u32) -> Frame {
        let headers = vec![("streamtype".to_owned(), "stdin".to_owned())];
        Frame::SynStream { stream_id, associated_to: 0, priority: 0, flags: 0, headers }
    }

    #[tokio::test]
    async fn streams_past_the_cap_are_refused_and_an_oversized_frame_ends_the_session() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let mut session = Session::start(server);
        let (mut reader, mut writer) = tokio::io::split(client);
        let mut encoder = FrameEncoder::new();
        let mut out = Vec::new();
        for n in 0..=MAX_STREAMS as u32 {
            encoder.encode(&syn(2 * n + 1), &mut out);
        }
        writer.write_all(&out).await.unwrap();
        for _ in 0..MAX_STREAMS {
            session.accept().await.expect("a stream within the cap");
        }
        let refused_id = 2 * MAX_STREAMS as u32 + 1;
        let frames = frames_until(&mut reader, |f| matches!(f, Frame::RstStream { .. })).await;
        assert_eq!(frames.last(), Some(&Frame::RstStream { stream_id: refused_id, status: rst::REFUSED_STREAM }));

        // A DATA frame announcing 16 MiB: GOAWAY (protocol error) as soon as
        // its 8-byte header arrives; its payload is never waited for.
        let mut header = 1u32.to_be_bytes().to_vec();
        header.extend_from_slice(&[0, 0xff, 0xff, 0xff]);
        writer.write_all(&header).await.unwrap();
        let frames = frames_until(&mut reader, |f| matches!(f, Frame::GoAway { .. })).await;
        assert_eq!(frames.last(), Some(&Frame::GoAway { last_good_stream_id: refused_id, status: 1 }));
    }

    #[tokio::test]
    async fn a_stream_whose_reader_is_behind_stops_the_session_reading_at_its_byte_budget() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let mut session = Session::start(server);
        let (mut reader, mut writer) = tokio::io::split(client);
        let mut encoder = FrameEncoder::new();
        let mut out = Vec::new();
        encoder.encode(&syn(1), &mut out);
        writer.write_all(&out).await.unwrap();
        let mut stream = session.accept().await.unwrap();
        // Two frames of 1 MiB (the budget) that nobody reads, then a PING:
        // the second frame waits for budget, so the PING is not read (nor
        // echoed) until the stream's reader takes the first frame.
        let mut out = Vec::new();
        for _ in 0..2 {
            let data = vec![7u8; frame::MAX_RECEIVED_PAYLOAD];
            encoder.encode(&Frame::Data { stream_id: 1, flags: 0, data }, &mut out);
        }
        encoder.encode(&Frame::Ping { id: 1 }, &mut out);
        let write = tokio::spawn(async move {
            writer.write_all(&out).await.unwrap();
            writer
        });
        let first = stream.recv.read().await.expect("the first frame");
        assert_eq!(first.len(), frame::MAX_RECEIVED_PAYLOAD);
        let frames = frames_until(&mut reader, |f| matches!(f, Frame::Ping { .. })).await;
        assert!(frames.contains(&Frame::Ping { id: 1 }));
        let budget = {
            let state = stream.recv.shared.state.lock().unwrap();
            state.streams.get(&1).unwrap().budget.available_permits()
        };
        assert_eq!(budget, 0, "the second frame holds the whole budget while unread");
        assert_eq!(stream.recv.read().await.expect("the second frame").len(), frame::MAX_RECEIVED_PAYLOAD);
        drop(write.await.unwrap());
    }
}
