//! A libvirt connection that reopens itself after the daemon went away.

use std::sync::{Arc, Mutex, PoisonError};

use virt::connect::Connect;
use vmlet_provider::Result;

use crate::error::from_libvirt;
use crate::events::DomainEvents;

/// One libvirt URI and the connection currently open to it.
///
/// libvirt connections are thread-safe (the `virt` crate marks `Connect` `Send`
/// and `Sync`, and cloning one only takes another reference), so callers share
/// one connection; the mutex only guards swapping it for a new one.
///
/// Every method blocks: call them from `spawn_blocking`.
pub(crate) struct Connection {
    uri: String,
    state: Mutex<State>,
    /// Where each connection opened sends its domains' lifecycle events;
    /// `None` when the driver has none (then the core polls).
    events: Option<Arc<DomainEvents>>,
}

/// The open connection, if any, and a counter that tells reopened ones apart.
struct State {
    generation: u64,
    conn: Option<Connect>,
}

impl Connection {
    /// Open `uri` now (see [`open_watched`]). Errors: the mapped libvirt error
    /// (`Transient` when the daemon does not answer), `Permanent` when libvirt's
    /// event loop cannot be started.
    pub(crate) fn open(uri: &str) -> Result<Connection> {
        let conn = open_watched(uri).map_err(|e| from_libvirt("connect to libvirt", e))?;
        Ok(Connection {
            uri: uri.to_owned(),
            state: Mutex::new(State { generation: 0, conn: Some(conn) }),
            events: None,
        })
    }

    /// [`Connection::open`], and send the lifecycle events of this and every
    /// reopened connection to `events` ([`DomainEvents::listen`]). A driver
    /// that has no events is logged and left without (see
    /// [`Connection::events`]). Errors: those of `open`.
    pub(crate) fn open_with_events(uri: &str, events: Arc<DomainEvents>) -> Result<Connection> {
        let mut connection = Connection::open(uri)?;
        let conn = connection.live()?.1;
        match events.listen(&conn) {
            Ok(()) => connection.events = Some(events),
            Err(e) => tracing::info!(libvirt.uri = %uri, error = %e, "no domain events from this driver; polling"),
        }
        Ok(connection)
    }

    /// Where this connection's domain lifecycle events go, if it has them.
    pub(crate) fn events(&self) -> Option<&Arc<DomainEvents>> {
        self.events.as_ref()
    }

    /// The URI this connection opens.
    pub(crate) fn uri(&self) -> &str {
        &self.uri
    }

    /// Run `f` on a live connection. When `f` fails with a transient error and
    /// the connection turns out to be dead (libvirtd restarted), reopen it and
    /// run `f` once more; `f` must therefore be idempotent, as every provider
    /// operation is.
    ///
    /// Caveat: for `test:///` URIs a reopened connection starts again from the
    /// inventory file, so everything defined on the old one is gone. The test
    /// driver's connections never die on their own, so this only matters if
    /// libvirt itself reports one dead.
    pub(crate) fn with<T>(&self, f: impl Fn(&Connect) -> Result<T>) -> Result<T> {
        let (generation, conn) = self.live()?;
        match f(&conn) {
            Err(err) if err.is_transient() && !conn.is_alive().unwrap_or(false) => {
                tracing::warn!(
                    libvirt.uri = %self.uri,
                    error = %err,
                    "libvirt connection lost; reconnecting"
                );
                drop(conn);
                self.forget(generation);
                let (_, conn) = self.live()?;
                f(&conn)
            }
            result => result,
        }
    }

    /// The current connection if it is alive, else a newly opened one.
    fn live(&self) -> Result<(u64, Connect)> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(conn) = &state.conn {
            if conn.is_alive().unwrap_or(false) {
                return Ok((state.generation, conn.clone()));
            }
        }
        // Close the dead connection before opening its replacement.
        state.conn = None;
        let conn = open_watched(&self.uri).map_err(|e| from_libvirt("reconnect to libvirt", e))?;
        tracing::info!(libvirt.uri = %self.uri, "libvirt connection reopened");
        if let Some(events) = &self.events {
            if let Err(e) = events.listen(&conn) {
                tracing::warn!(libvirt.uri = %self.uri, error = %e, "domain events lost on the reopened connection");
            }
            // Whatever changed while the old one was down was not pushed.
            events.missed();
        }
        state.generation += 1;
        state.conn = Some(conn.clone());
        Ok((state.generation, conn))
    }

    /// Close connection `generation` so that the next call reopens; a newer one,
    /// opened meanwhile by another thread, is kept.
    fn forget(&self, generation: u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.generation == generation {
            state.conn = None;
        }
    }
}

/// Seconds between keepalive probes on a connection to libvirtd.
const KEEPALIVE_INTERVAL_SECONDS: i32 = 5;
/// Unanswered keepalive probes after which a connection counts as dead.
const KEEPALIVE_COUNT: u32 = 6;

/// Open `uri` with libvirt's event loop running (so the socket is watched, see
/// [`crate::event_loop`]) and, where the driver supports it, keepalive: a
/// daemon that stops answering for about 30 s closes the connection instead of
/// leaving calls waiting. Blocking.
pub(crate) fn open_watched(uri: &str) -> Result<Connect, virt::error::Error> {
    if let Err(err) = crate::event_loop::ensure_running() {
        // Connections still work without it; consoles report the failure.
        tracing::warn!(error = %err, "libvirt event loop not running");
    }
    let conn = Connect::open(Some(uri))?;
    // In-process drivers (test:///) have no keepalive; nothing to do there.
    let _ = conn.set_keep_alive(KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_COUNT);
    Ok(conn)
}
