//! libvirt's default event loop, run on one thread for the whole process.
//!
//! A libvirt client watches its connections' sockets only when an event loop
//! is registered before they are opened (`virEventRegisterDefaultImpl`, then
//! `virEventRunDefaultImpl` in a loop). With it, data that libvirtd pushes
//! (console streams, keepalive pings, closed sockets) is read as it arrives, so
//! a non-blocking `virStreamRecv` finds it queued and a dead daemon is noticed
//! at once. Without it, a stream can only be read by a blocking `virStreamRecv`,
//! which holds the connection's lock until data comes: an abort from another
//! thread then waits for the guest to print something (the attach hang of a
//! quiet console). See <https://libvirt.org/html/libvirt-libvirt-event.html>.

use std::sync::OnceLock;
use std::time::Duration;

use vmlet_provider::{Error, ErrorKind, Result};

/// Register libvirt's default event implementation and start the thread that
/// runs it, once per process. Call before opening any connection; later calls
/// return the first call's outcome.
///
/// Errors: `Permanent` when libvirt refuses the registration or the thread
/// cannot be started.
pub(crate) fn ensure_running() -> Result<()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            virt::event::event_register_default_impl()
                .map_err(|e| format!("virEventRegisterDefaultImpl failed: {e}"))?;
            std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(run)
                .map(drop)
                .map_err(|e| format!("cannot start the libvirt event thread: {e}"))
        })
        .clone()
        .map_err(|message| Error::new("start libvirt's event loop", ErrorKind::Permanent, message))
}

/// Dispatch libvirt events forever. An iteration fails only on a broken poll;
/// it is logged and retried after a pause rather than spinning.
fn run() {
    loop {
        if let Err(err) = virt::event::event_run_default_impl() {
            tracing::warn!(error = %err, "libvirt event loop iteration failed");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
