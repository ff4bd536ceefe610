//! Fuzz the SPDY/3.1 frame and header-block decoder: any bytes must decode to
//! frames or an error, never a panic, a hang or an unbounded allocation.
//!
//!     cargo +nightly fuzz run spdy_frames fuzz/corpus/spdy_frames
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmlet::streams::spdy::frame::decode_all;

fuzz_target!(|data: &[u8]| {
    let _ = decode_all(data);
});
