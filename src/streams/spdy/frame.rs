//! SPDY/3.1 frames: encoding and incremental decoding, pure and synchronous.
//!
//! Layout (SPDY protocol draft 3.1, section 2.2): a control frame starts with
//! the bit 1, a 15-bit version (3) and a 16-bit type; a data frame starts with
//! the bit 0 and a 31-bit stream id. Both continue with 8 bits of flags and a
//! 24-bit payload length. Header blocks (SYN_STREAM, SYN_REPLY, HEADERS) are
//! compressed with one zlib stream per direction, primed with
//! [`super::dictionary::DICTIONARY`], flushed with `Z_SYNC_FLUSH` after each block.

use super::dictionary::DICTIONARY;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The only SPDY version spoken.
pub const VERSION: u16 = 3;
/// Largest payload a frame can carry (24-bit length).
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Largest frame payload accepted from a peer (1 MiB): a frame header that
/// announces more is a protocol error at once, before its payload is
/// buffered. kubectl and the API server send DATA of at most 32 KiB.
pub const MAX_RECEIVED_PAYLOAD: usize = 1 << 20;
/// Largest decompressed header block accepted (as spdystream: 1 MiB per field).
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// Most header pairs accepted in one block.
pub const MAX_HEADER_COUNT: u32 = 1000;

/// Control frame types.
mod kind {
    pub const SYN_STREAM: u16 = 1;
    pub const SYN_REPLY: u16 = 2;
    pub const RST_STREAM: u16 = 3;
    pub const SETTINGS: u16 = 4;
    pub const PING: u16 = 6;
    pub const GOAWAY: u16 = 7;
    pub const HEADERS: u16 = 8;
    pub const WINDOW_UPDATE: u16 = 9;
}

/// FLAG_FIN on SYN_STREAM, SYN_REPLY, HEADERS and DATA.
pub const FLAG_FIN: u8 = 0x01;
/// FLAG_UNIDIRECTIONAL on SYN_STREAM.
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;

/// RST_STREAM status codes used here.
pub mod rst {
    /// PROTOCOL_ERROR.
    pub const PROTOCOL_ERROR: u32 = 1;
    /// INVALID_STREAM.
    pub const INVALID_STREAM: u32 = 2;
    /// REFUSED_STREAM.
    pub const REFUSED_STREAM: u32 = 3;
    /// CANCEL.
    pub const CANCEL: u32 = 5;
    /// FLOW_CONTROL_ERROR.
    pub const FLOW_CONTROL_ERROR: u32 = 7;
    /// STREAM_IN_USE.
    pub const STREAM_IN_USE: u32 = 8;
}

/// SETTINGS id of SETTINGS_INITIAL_WINDOW_SIZE.
pub const SETTINGS_INITIAL_WINDOW_SIZE: u32 = 7;

/// Header name/value pairs; names lowercase, several values of one name joined
/// by NUL as on the wire.
pub type Headers = Vec<(String, String)>;

/// The value of header `name` (case-insensitive), if present.
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// One SETTINGS entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// FLAG_SETTINGS_PERSIST_VALUE / PERSISTED.
    pub flags: u8,
    /// 24-bit id.
    pub id: u32,
    /// Value.
    pub value: u32,
}

/// A decoded SPDY frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Opens a stream.
    SynStream {
        /// Stream id (odd from the client).
        stream_id: u32,
        /// Associated stream (server push), 0 if none.
        associated_to: u32,
        /// 3-bit priority.
        priority: u8,
        /// FLAG_FIN and FLAG_UNIDIRECTIONAL.
        flags: u8,
        /// Headers.
        headers: Headers,
    },
    /// Accepts a stream.
    SynReply {
        /// Stream id.
        stream_id: u32,
        /// FLAG_FIN.
        flags: u8,
        /// Headers.
        headers: Headers,
    },
    /// Aborts a stream.
    RstStream {
        /// Stream id.
        stream_id: u32,
        /// Status code, see [`rst`].
        status: u32,
    },
    /// Session settings.
    Settings {
        /// FLAG_SETTINGS_CLEAR_SETTINGS.
        flags: u8,
        /// Entries.
        entries: Vec<Setting>,
    },
    /// Liveness probe; the receiver echoes pings it did not send.
    Ping {
        /// Id (odd from the client, even from the server).
        id: u32,
    },
    /// The sender will accept no new streams.
    GoAway {
        /// Last stream the sender accepted.
        last_good_stream_id: u32,
        /// 0 OK, 1 PROTOCOL_ERROR, 2 INTERNAL_ERROR.
        status: u32,
    },
    /// More headers on a stream.
    Headers {
        /// Stream id.
        stream_id: u32,
        /// FLAG_FIN.
        flags: u8,
        /// Headers.
        headers: Headers,
    },
    /// Flow-control credit; stream 0 is the session (SPDY/3.1).
    WindowUpdate {
        /// Stream id, 0 for the whole session.
        stream_id: u32,
        /// Bytes the receiver may send in addition.
        delta: u32,
    },
    /// Stream payload.
    Data {
        /// Stream id.
        stream_id: u32,
        /// FLAG_FIN.
        flags: u8,
        /// Payload.
        data: Vec<u8>,
    },
    /// A control frame of a type this version does not know; ignored as the
    /// specification requires.
    Unknown {
        /// The frame type.
        frame_type: u16,
    },
}

/// A byte sequence that is not valid SPDY/3.1. After one, the session is lost
/// (the header compression state can no longer be trusted): send GOAWAY.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// A control frame of another version.
    #[error("unsupported SPDY version {0}")]
    UnsupportedVersion(u16),
    /// A frame whose payload does not fit its type.
    #[error("invalid {frame} frame: {why}")]
    Invalid {
        /// Frame type.
        frame: &'static str,
        /// What is wrong.
        why: &'static str,
    },
    /// The zlib header stream is corrupt or too large.
    #[error("header block: {0}")]
    HeaderBlock(String),
    /// A frame announces a payload larger than [`MAX_RECEIVED_PAYLOAD`].
    #[error("a frame of {0} bytes; at most {MAX_RECEIVED_PAYLOAD} are accepted")]
    TooLarge(usize),
}

fn invalid(frame: &'static str, why: &'static str) -> FrameError {
    FrameError::Invalid { frame, why }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Decodes frames from one direction of a session. Holds that direction's
/// header decompression state, so every byte must go through one decoder.
pub struct FrameDecoder {
    inflate: Decompress,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder::new()
    }
}

impl FrameDecoder {
    /// A decoder for a new session.
    pub fn new() -> FrameDecoder {
        FrameDecoder { inflate: Decompress::new(true) }
    }

    /// Decode one frame from the front of `buf`: `Ok(None)` when `buf` does not
    /// yet hold a whole frame, else the frame and how many bytes it took.
    pub fn decode(&mut self, buf: &[u8]) -> Result<Option<(Frame, usize)>, FrameError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let first = be32(&buf[0..4]);
        let flags = buf[4];
        let length = (be32(&buf[4..8]) & 0x00ff_ffff) as usize;
        if length > MAX_RECEIVED_PAYLOAD {
            return Err(FrameError::TooLarge(length));
        }
        let total = 8 + length;
        if buf.len() < total {
            return Ok(None);
        }
        let payload = &buf[8..total];
        let frame = if first & 0x8000_0000 == 0 {
            let stream_id = first & 0x7fff_ffff;
            if stream_id == 0 {
                return Err(invalid("DATA", "stream id 0"));
            }
            Frame::Data { stream_id, flags, data: payload.to_vec() }
        } else {
            let version = ((first >> 16) & 0x7fff) as u16;
            if version != VERSION {
                return Err(FrameError::UnsupportedVersion(version));
            }
            self.control((first & 0xffff) as u16, flags, payload)?
        };
        Ok(Some((frame, total)))
    }

    fn control(&mut self, frame_type: u16, flags: u8, p: &[u8]) -> Result<Frame, FrameError> {
        let stream_id = |name: &'static str, min: usize| -> Result<u32, FrameError> {
            if p.len() < min {
                return Err(invalid(name, "payload too short"));
            }
            let id = be32(p) & 0x7fff_ffff;
            if id == 0 {
                return Err(invalid(name, "stream id 0"));
            }
            Ok(id)
        };
        Ok(match frame_type {
            kind::SYN_STREAM => {
                let id = stream_id("SYN_STREAM", 10)?;
                let headers = self.headers(&p[10..])?;
                Frame::SynStream {
                    stream_id: id,
                    associated_to: be32(&p[4..8]) & 0x7fff_ffff,
                    priority: p[8] >> 5,
                    flags,
                    headers,
                }
            }
            kind::SYN_REPLY => {
                let id = stream_id("SYN_REPLY", 4)?;
                Frame::SynReply { stream_id: id, flags, headers: self.headers(&p[4..])? }
            }
            kind::HEADERS => {
                let id = stream_id("HEADERS", 4)?;
                Frame::Headers { stream_id: id, flags, headers: self.headers(&p[4..])? }
            }
            kind::RST_STREAM => {
                if p.len() != 8 {
                    return Err(invalid("RST_STREAM", "length is not 8"));
                }
                let id = stream_id("RST_STREAM", 8)?;
                Frame::RstStream { stream_id: id, status: be32(&p[4..8]) }
            }
            kind::SETTINGS => {
                if p.len() < 4 {
                    return Err(invalid("SETTINGS", "payload too short"));
                }
                let count = be32(p) as usize;
                if count > (p.len() - 4) / 8 {
                    return Err(invalid("SETTINGS", "more entries than the payload holds"));
                }
                let entries = (0..count)
                    .map(|i| {
                        let e = &p[4 + i * 8..12 + i * 8];
                        Setting { flags: e[0], id: be32(e) & 0x00ff_ffff, value: be32(&e[4..8]) }
                    })
                    .collect();
                Frame::Settings { flags, entries }
            }
            kind::PING => {
                if p.len() != 4 {
                    return Err(invalid("PING", "length is not 4"));
                }
                Frame::Ping { id: be32(p) }
            }
            kind::GOAWAY => {
                // SPDY/3 GOAWAY carries a status; tolerate the 4-byte SPDY/2 form.
                if p.len() != 8 && p.len() != 4 {
                    return Err(invalid("GOAWAY", "length is not 8"));
                }
                let status = if p.len() == 8 { be32(&p[4..8]) } else { 0 };
                Frame::GoAway { last_good_stream_id: be32(p) & 0x7fff_ffff, status }
            }
            kind::WINDOW_UPDATE => {
                if p.len() != 8 {
                    return Err(invalid("WINDOW_UPDATE", "length is not 8"));
                }
                let delta = be32(&p[4..8]) & 0x7fff_ffff;
                if delta == 0 {
                    return Err(invalid("WINDOW_UPDATE", "delta 0"));
                }
                Frame::WindowUpdate { stream_id: be32(p) & 0x7fff_ffff, delta }
            }
            other => Frame::Unknown { frame_type: other },
        })
    }

    /// Inflate one header block (continuing the session's zlib stream) and
    /// parse it.
    fn headers(&mut self, block: &[u8]) -> Result<Headers, FrameError> {
        let raw = inflate(&mut self.inflate, block)?;
        parse_header_block(&raw)
    }
}

fn inflate(z: &mut Decompress, mut input: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::with_capacity(256);
    loop {
        if out.len() == out.capacity() {
            out.reserve(out.capacity().max(256));
        }
        let (in_before, out_before) = (z.total_in(), out.len());
        let result = z.decompress_vec(input, &mut out, FlushDecompress::Sync);
        let consumed = (z.total_in() - in_before) as usize;
        input = &input[consumed..];
        let produced = out.len() - out_before;
        if out.len() > MAX_HEADER_BLOCK {
            return Err(FrameError::HeaderBlock(format!("inflates to more than {MAX_HEADER_BLOCK} bytes")));
        }
        match result {
            Ok(Status::StreamEnd) => return Ok(out),
            Ok(_) => {
                if input.is_empty() && out.len() < out.capacity() {
                    return Ok(out);
                }
                if consumed == 0 && produced == 0 && out.len() < out.capacity() {
                    return Err(FrameError::HeaderBlock("zlib made no progress".into()));
                }
            }
            Err(e) if e.needs_dictionary().is_some() => {
                z.set_dictionary(&DICTIONARY).map_err(|e| FrameError::HeaderBlock(e.to_string()))?;
            }
            Err(e) => return Err(FrameError::HeaderBlock(e.to_string())),
        }
    }
}

/// Parse an uncompressed header block: a 32-bit count, then for each pair a
/// 32-bit length and the name, a 32-bit length and the value.
pub fn parse_header_block(raw: &[u8]) -> Result<Headers, FrameError> {
    let bad = |why: &'static str| FrameError::HeaderBlock(why.into());
    let mut at = 0usize;
    let mut next = |len: usize| -> Result<&[u8], FrameError> {
        let end = at.checked_add(len).filter(|&e| e <= raw.len()).ok_or_else(|| bad("truncated header block"))?;
        let slice = &raw[at..end];
        at = end;
        Ok(slice)
    };
    let count = be32(next(4)?);
    if count > MAX_HEADER_COUNT {
        return Err(bad("too many headers"));
    }
    let mut headers = Headers::with_capacity(count as usize);
    for _ in 0..count {
        let len = be32(next(4)?) as usize;
        let name = String::from_utf8_lossy(next(len)?).to_ascii_lowercase();
        let len = be32(next(4)?) as usize;
        let value = String::from_utf8_lossy(next(len)?).into_owned();
        if name.is_empty() {
            return Err(bad("empty header name"));
        }
        headers.push((name, value));
    }
    Ok(headers)
}

/// Serialize headers into an uncompressed header block.
pub fn header_block(headers: &Headers) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    for (name, value) in headers {
        let name = name.to_ascii_lowercase();
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// Encodes frames for one direction of a session, holding that direction's
/// header compression state.
pub struct FrameEncoder {
    deflate: Compress,
}

impl Default for FrameEncoder {
    fn default() -> Self {
        FrameEncoder::new()
    }
}

impl FrameEncoder {
    /// An encoder for a new session.
    pub fn new() -> FrameEncoder {
        let mut deflate = Compress::new(Compression::best(), true);
        deflate.set_dictionary(&DICTIONARY).expect("a new zlib stream takes a dictionary");
        FrameEncoder { deflate }
    }

    /// Append `frame` to `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut Vec<u8>) {
        match frame {
            Frame::Data { stream_id, flags, data } => {
                debug_assert!(data.len() <= MAX_PAYLOAD);
                out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
                out.extend_from_slice(&length_word(*flags, data.len()));
                out.extend_from_slice(data);
            }
            Frame::SynStream { stream_id, associated_to, priority, flags, headers } => {
                let mut p = Vec::new();
                p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
                p.extend_from_slice(&(associated_to & 0x7fff_ffff).to_be_bytes());
                p.push((priority & 0x07) << 5);
                p.push(0);
                self.compress_into(headers, &mut p);
                control(out, kind::SYN_STREAM, *flags, &p);
            }
            Frame::SynReply { stream_id, flags, headers } => {
                let mut p = (stream_id & 0x7fff_ffff).to_be_bytes().to_vec();
                self.compress_into(headers, &mut p);
                control(out, kind::SYN_REPLY, *flags, &p);
            }
            Frame::Headers { stream_id, flags, headers } => {
                let mut p = (stream_id & 0x7fff_ffff).to_be_bytes().to_vec();
                self.compress_into(headers, &mut p);
                control(out, kind::HEADERS, *flags, &p);
            }
            Frame::RstStream { stream_id, status } => {
                control(out, kind::RST_STREAM, 0, &[stream_id.to_be_bytes(), status.to_be_bytes()].concat());
            }
            Frame::Settings { flags, entries } => {
                let mut p = (entries.len() as u32).to_be_bytes().to_vec();
                for e in entries {
                    p.extend_from_slice(&((u32::from(e.flags) << 24) | (e.id & 0x00ff_ffff)).to_be_bytes());
                    p.extend_from_slice(&e.value.to_be_bytes());
                }
                control(out, kind::SETTINGS, *flags, &p);
            }
            Frame::Ping { id } => control(out, kind::PING, 0, &id.to_be_bytes()),
            Frame::GoAway { last_good_stream_id, status } => {
                control(out, kind::GOAWAY, 0, &[last_good_stream_id.to_be_bytes(), status.to_be_bytes()].concat());
            }
            Frame::WindowUpdate { stream_id, delta } => {
                control(out, kind::WINDOW_UPDATE, 0, &[stream_id.to_be_bytes(), delta.to_be_bytes()].concat());
            }
            Frame::Unknown { frame_type } => control(out, *frame_type, 0, &[]),
        }
    }

    fn compress_into(&mut self, headers: &Headers, out: &mut Vec<u8>) {
        let raw = header_block(headers);
        let mut input = &raw[..];
        loop {
            out.reserve(raw.len() + 64);
            let before = self.deflate.total_in();
            self.deflate.compress_vec(input, out, FlushCompress::Sync).expect("zlib deflate of a header block");
            input = &input[(self.deflate.total_in() - before) as usize..];
            if input.is_empty() && out.len() < out.capacity() {
                return;
            }
        }
    }
}

fn length_word(flags: u8, len: usize) -> [u8; 4] {
    ((u32::from(flags) << 24) | (len as u32 & 0x00ff_ffff)).to_be_bytes()
}

fn control(out: &mut Vec<u8>, frame_type: u16, flags: u8, payload: &[u8]) {
    out.extend_from_slice(&(0x8000 | VERSION).to_be_bytes());
    out.extend_from_slice(&frame_type.to_be_bytes());
    out.extend_from_slice(&length_word(flags, payload.len()));
    out.extend_from_slice(payload);
}

/// Decode every frame in `input` with a fresh decoder, stopping at the first
/// error or incomplete frame. The fuzz target's entry point: it must never
/// panic, whatever the bytes.
pub fn decode_all(input: &[u8]) -> Result<Vec<Frame>, FrameError> {
    let mut decoder = FrameDecoder::new();
    let mut frames = Vec::new();
    let mut at = 0;
    while let Some((frame, used)) = decoder.decode(&input[at..])? {
        frames.push(frame);
        at += used;
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn hdrs(pairs: &[(&str, &str)]) -> Headers {
        pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    fn round_trip(frames: &[Frame]) -> Vec<Frame> {
        let mut enc = FrameEncoder::new();
        let mut wire = Vec::new();
        for f in frames {
            enc.encode(f, &mut wire);
        }
        decode_all(&wire).unwrap()
    }

    #[test]
    fn every_frame_type_survives_encode_and_decode() {
        let frames = vec![
            Frame::SynStream {
                stream_id: 1,
                associated_to: 0,
                priority: 3,
                flags: 0,
                headers: hdrs(&[("streamtype", "error")]),
            },
            Frame::SynReply { stream_id: 1, flags: 0, headers: vec![] },
            Frame::Headers { stream_id: 1, flags: FLAG_FIN, headers: hdrs(&[("a", "b\0c")]) },
            Frame::RstStream { stream_id: 3, status: rst::CANCEL },
            Frame::Settings {
                flags: 0,
                entries: vec![Setting { flags: 1, id: SETTINGS_INITIAL_WINDOW_SIZE, value: 1 << 20 }],
            },
            Frame::Ping { id: 7 },
            Frame::GoAway { last_good_stream_id: 5, status: 0 },
            Frame::WindowUpdate { stream_id: 0, delta: 65536 },
            Frame::Data { stream_id: 1, flags: FLAG_FIN, data: b"hello".to_vec() },
            Frame::Data { stream_id: 3, flags: 0, data: vec![] },
        ];
        assert_eq!(round_trip(&frames), frames);
    }

    #[test]
    fn later_header_blocks_reuse_the_compression_context() {
        let frames: Vec<Frame> = (0..5)
            .map(|i| Frame::SynStream {
                stream_id: 2 * i + 1,
                associated_to: 0,
                priority: 0,
                flags: 0,
                headers: hdrs(&[("streamtype", "stdout"), ("requestid", "0")]),
            })
            .collect();
        let mut enc = FrameEncoder::new();
        let (mut first, mut last) = (Vec::new(), Vec::new());
        enc.encode(&frames[0], &mut first);
        for f in &frames[1..] {
            last.clear();
            enc.encode(f, &mut last);
        }
        assert!(last.len() < first.len(), "the shared zlib window shrinks repeated headers");
        assert_eq!(round_trip(&frames), frames);
    }

    #[test]
    fn a_header_block_compressed_by_plain_zlib_with_the_dictionary_decodes() {
        // What Go's compress/zlib NewWriterLevelDict(..., headerDictionary) emits:
        // a zlib stream with FDICT set, flushed with Z_SYNC_FLUSH.
        let raw = header_block(&hdrs(&[("streamtype", "stdin"), ("x-custom", "v")]));
        let mut z = flate2::write::ZlibEncoder::new_with_compress(Vec::new(), {
            let mut c = Compress::new(Compression::default(), true);
            c.set_dictionary(&DICTIONARY).unwrap();
            c
        });
        z.write_all(&raw).unwrap();
        z.flush().unwrap();
        let block = z.get_ref().clone();
        assert_eq!(block[0] & 0x0f, 8, "deflate");
        assert_ne!(block[1] & 0x20, 0, "FDICT is set");
        let dict_id = u32::from_be_bytes([block[2], block[3], block[4], block[5]]);
        assert_eq!(dict_id, adler32(&DICTIONARY), "the dictionary id names our dictionary");

        let mut wire = vec![0x80, 0x03, 0x00, 0x01];
        let payload_len = 10 + block.len();
        wire.extend_from_slice(&(payload_len as u32).to_be_bytes());
        wire.extend_from_slice(&1u32.to_be_bytes());
        wire.extend_from_slice(&0u32.to_be_bytes());
        wire.extend_from_slice(&[0, 0]);
        wire.extend_from_slice(&block);
        let frames = decode_all(&wire).unwrap();
        assert_eq!(
            frames,
            vec![Frame::SynStream {
                stream_id: 1,
                associated_to: 0,
                priority: 0,
                flags: 0,
                headers: hdrs(&[("streamtype", "stdin"), ("x-custom", "v")]),
            }]
        );
    }

    fn adler32(data: &[u8]) -> u32 {
        let (mut a, mut b) = (1u32, 0u32);
        for &x in data {
            a = (a + u32::from(x)) % 65521;
            b = (b + a) % 65521;
        }
        (b << 16) | a
    }

    #[test]
    fn the_dictionary_is_the_one_of_the_specification() {
        assert_eq!(DICTIONARY.len(), 1423);
        assert!(DICTIONARY.starts_with(b"\0\0\0\x07options\0\0\0\x04head"));
        assert!(DICTIONARY.ends_with(b"charset=utf-8charset=iso-8859-1,utf-,*,enq=0."));
    }

    #[test]
    fn a_wire_capture_of_a_control_frame_decodes() {
        // PING id 1 and WINDOW_UPDATE stream 1 +4096, byte for byte.
        let wire = [
            0x80, 0x03, 0x00, 0x06, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x01, //
            0x80, 0x03, 0x00, 0x09, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x10, 0x00,
        ];
        assert_eq!(
            decode_all(&wire).unwrap(),
            vec![Frame::Ping { id: 1 }, Frame::WindowUpdate { stream_id: 1, delta: 4096 }]
        );
    }

    #[test]
    fn incomplete_input_waits_for_more() {
        let mut enc = FrameEncoder::new();
        let mut wire = Vec::new();
        enc.encode(&Frame::Data { stream_id: 1, flags: 0, data: vec![1; 100] }, &mut wire);
        let mut dec = FrameDecoder::new();
        for cut in [0, 4, 8, 50, wire.len() - 1] {
            assert_eq!(dec.decode(&wire[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(dec.decode(&wire).unwrap().unwrap().1, wire.len());
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        let cases: &[&[u8]] = &[
            &[0x80, 0x02, 0x00, 0x01, 0, 0, 0, 0],       // SPDY/2
            &[0x80, 0x03, 0x00, 0x06, 0, 0, 0, 2, 0, 0], // short PING
            &[0x80, 0x03, 0x00, 0x01, 0, 0, 0, 12, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xff, 0xff], // bad zlib
            &[0x00, 0x00, 0x00, 0x00, 0, 0, 0, 0],       // data on stream 0
            &[0x80, 0x03, 0x00, 0x04, 0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff], // SETTINGS count overflow
        ];
        for case in cases {
            assert!(decode_all(case).is_err(), "{case:?}");
        }
    }

    /// The fuzz target's corpus, run as a plain test: each seed decodes (it was
    /// made by Python's zlib with the dictionary, an independent encoder), and
    /// every truncation and single-byte mutation of it decodes or errs without
    /// panicking.
    #[test]
    fn the_fuzz_corpus_and_its_mutations_never_panic() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/spdy_frames");
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let seed = std::fs::read(entry.unwrap().path()).unwrap();
            let frames = decode_all(&seed).unwrap();
            assert!(!frames.is_empty());
            seeds += 1;
            for cut in 0..seed.len() {
                let _ = decode_all(&seed[..cut]);
            }
            for at in 0..seed.len() {
                for flip in [0x01, 0x80, 0xff] {
                    let mut mutated = seed.clone();
                    mutated[at] ^= flip;
                    let _ = decode_all(&mutated);
                }
            }
        }
        assert!(seeds >= 3, "corpus in {}", dir.display());
    }

    #[test]
    fn the_python_made_exec_session_decodes_to_the_expected_frames() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/spdy_frames");
        let frames = decode_all(&std::fs::read(dir.join("exec-session")).unwrap()).unwrap();
        let types: Vec<&str> = frames
            .iter()
            .map(|f| match f {
                Frame::SynStream { headers, .. } => header(headers, "streamtype").unwrap(),
                Frame::Data { .. } => "data",
                Frame::Ping { .. } => "ping",
                Frame::WindowUpdate { .. } => "window",
                Frame::Settings { .. } => "settings",
                Frame::RstStream { .. } => "rst",
                Frame::GoAway { .. } => "goaway",
                _ => "other",
            })
            .collect();
        assert_eq!(types, ["error", "stdin", "stdout", "data", "data", "ping", "window", "settings", "rst", "goaway"]);
    }

    #[test]
    fn unknown_control_frames_are_skipped() {
        let wire = [0x80, 0x03, 0x00, 0x0a, 0, 0, 0, 2, 9, 9, 0x80, 0x03, 0x00, 0x06, 0, 0, 0, 4, 0, 0, 0, 3];
        assert_eq!(decode_all(&wire).unwrap(), vec![Frame::Unknown { frame_type: 10 }, Frame::Ping { id: 3 }]);
    }

    #[test]
    fn a_frame_announcing_more_than_a_mebibyte_is_refused_from_its_header_alone() {
        let mut header = 1u32.to_be_bytes().to_vec();
        header.extend_from_slice(&[0, 0xff, 0xff, 0xff]);
        let err = FrameDecoder::new().decode(&header).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge(0x00ff_ffff)), "{err}");
        let mut at_limit = 1u32.to_be_bytes().to_vec();
        at_limit.extend_from_slice(&length_word(0, MAX_RECEIVED_PAYLOAD));
        assert_eq!(FrameDecoder::new().decode(&at_limit).unwrap(), None, "waits for the payload");
    }
}
