//! SPDY/3.1, as far as the Kubernetes remote-command protocol uses it: the
//! frame codec with zlib header blocks ([`frame`]) and the server session
//! ([`session`]).

pub mod dictionary;
pub mod frame;
pub mod session;

/// Value of the `Upgrade` header for SPDY.
pub const UPGRADE: &str = "SPDY/3.1";
