//! Domain lifecycle events, pushed by libvirt, as [`Change`]s.
//!
//! libvirt tells each connection's listeners when a domain is defined,
//! undefined, started, stopped, paused, resumed or crashed
//! (`virConnectDomainEventRegisterAny` with `VIR_DOMAIN_EVENT_ID_LIFECYCLE`,
//! <https://libvirt.org/html/libvirt-libvirt-domain.html#virConnectDomainEventRegisterAny>),
//! on the thread that runs libvirt's event loop ([`crate::event_loop`]). The
//! listener here reads only the domain's UUID (no call to the daemon), maps
//! it to the vmlet identity the [`UuidCache`] knows, and sends that identity on
//! a broadcast channel: the core then reads the VM instead of polling it.
//! Domains the cache does not know (not vmlet's, or defined by someone else
//! since the last scan) are not sent: the core reads those when it needs them.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use tokio::sync::broadcast;
use virt::connect::Connect;
use virt::sys;
use vmlet_provider::Change;

use crate::domains::UuidCache;

/// Changes a subscriber may fall behind by before it is told it lagged (and
/// then reads every VM of the host again). The channel's slots are allocated
/// up front, per host: 1,024 held 24 KiB per host (12 MiB on 500 hosts),
/// where the agent drains them as they come, in batches.
const BACKLOG: usize = 128;

/// The sending side of one host's [`Change`]s.
pub(crate) struct DomainEvents {
    tx: broadcast::Sender<Change>,
    uuids: Arc<UuidCache>,
}

impl DomainEvents {
    /// Changes of the domains `uuids` knows.
    pub(crate) fn new(uuids: Arc<UuidCache>) -> Arc<DomainEvents> {
        Arc::new(DomainEvents { tx: broadcast::channel(BACKLOG).0, uuids })
    }

    /// A new receiver of every change from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.tx.subscribe()
    }

    /// Tell subscribers that changes may have been missed (a connection was
    /// opened again: events of the old one are lost).
    pub(crate) fn missed(&self) {
        // No subscriber yet is no error: it reads every VM when it starts.
        let _ = self.tx.send(Change::All);
    }

    /// Listen to `conn`'s domain lifecycle events until it is closed.
    /// Blocking (one call to libvirt). Errors: libvirt's, e.g. a driver
    /// without events; the caller then polls.
    pub(crate) fn listen(self: &Arc<Self>, conn: &Connect) -> Result<(), virt::error::Error> {
        // The callback's context: one reference, released by libvirt through
        // `release` when the callback is deregistered or the connection
        // closes.
        let opaque = Arc::into_raw(self.clone()) as *mut c_void;
        // SAFETY: libvirt calls a lifecycle listener with the lifecycle
        // signature (virConnectDomainEventCallback) through the generic
        // pointer type the registration takes, as its documentation says;
        // `opaque` stays valid until libvirt calls `release`.
        let registered = unsafe {
            let callback = std::mem::transmute::<
                unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, c_int, c_int, *mut c_void) -> c_int,
                unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, *mut c_void),
            >(on_lifecycle);
            sys::virConnectDomainEventRegisterAny(
                conn.as_ptr(),
                std::ptr::null_mut(),
                sys::VIR_DOMAIN_EVENT_ID_LIFECYCLE as c_int,
                Some(callback),
                opaque,
                Some(release),
            )
        };
        if registered < 0 {
            // SAFETY: libvirt did not take the reference.
            drop(unsafe { Arc::from_raw(opaque as *const DomainEvents) });
            return Err(virt::error::Error::last_error());
        }
        Ok(())
    }

    /// The domain with `uuid` changed: tell subscribers which VM, if it is
    /// one of vmlet's.
    fn changed(&self, uuid: &str) {
        if let Some(id) = self.uuids.id_of(uuid) {
            let _ = self.tx.send(Change::Vm(id));
        }
    }
}

/// libvirt's lifecycle listener: see [`DomainEvents::listen`].
unsafe extern "C" fn on_lifecycle(
    _conn: sys::virConnectPtr,
    domain: sys::virDomainPtr,
    _event: c_int,
    _detail: c_int,
    opaque: *mut c_void,
) -> c_int {
    let mut uuid = [0 as c_char; sys::VIR_UUID_STRING_BUFLEN as usize];
    // SAFETY: `opaque` is the reference `listen` gave libvirt, alive until
    // `release`; `domain` is valid for the call; the buffer has the length
    // libvirt writes (VIR_UUID_STRING_BUFLEN, NUL included).
    unsafe {
        let events = &*(opaque as *const DomainEvents);
        if sys::virDomainGetUUIDString(domain, uuid.as_mut_ptr()) == 0 {
            events.changed(&CStr::from_ptr(uuid.as_ptr()).to_string_lossy());
        }
    }
    0
}

/// libvirt is done with a listener's context.
unsafe extern "C" fn release(opaque: *mut c_void) {
    // SAFETY: the reference `listen` gave libvirt, released once.
    drop(unsafe { Arc::from_raw(opaque as *const DomainEvents) });
}
