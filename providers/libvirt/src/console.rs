//! [`Console`] for QEMU domains: the history of the serial console from the log
//! virtlogd writes, and live sessions through `virDomainOpenConsole`.
//!
//! History. Every QEMU domain vmlet defines records its serial port in
//! [`console_log_path`] (`/var/log/vmlet/console/<domain uuid>.log`,
//! `append='off'`): virtlogd truncates the file when the domain starts and
//! appends everything the guest writes from the first kernel line on. vmlet reads
//! the file directly, so history needs vmlet to run on the libvirt host (a remote
//! URI answers `Unsupported`).
//!
//! Boots. [`ConsoleChunk::boot`] is the domain's runtime id (`virDomainGetID`),
//! which libvirt assigns anew at every start. While the domain is off, the log
//! still holds the last boot's output; it is served under the boot this provider
//! last saw running (so a follower reading boot `7` sees no change when the VM
//! stops), or under `off` when it saw none (the provider restarted meanwhile, or
//! the domain never ran): a follower then sees one boot change and rereads from 0.
//!
//! Sessions. [`Console::attach`] opens the console, on a libvirt connection of
//! the session's own, without `FORCE`, so a second session gets `Transient`
//! "console busy" at once instead of taking the console away. The stream is
//! non-blocking: libvirt's event loop ([`crate::event_loop`]) queues what the
//! guest prints, and one blocking thread (the pump) takes it off the queue with
//! `virStreamRecv`, which then never waits, and hands it to stdout; when the
//! queue is empty the pump sleeps 2–40 ms (less right after a keystroke).
//! Keystrokes go stdin → console through short blocking calls. The session ends
//! when stdin closes, the stdout receiver is dropped, or the console ends
//! (domain stopped); then the pump is told to stop, which it does within one
//! sleep, the stream is aborted (or finished after EOF) and the connection
//! closed, which releases libvirt's console lock.
//!
//! Why not a blocking `virStreamRecv`: libvirt's remote driver holds the
//! connection's lock for the whole call, so an abort from another thread waits
//! until the guest prints something. On a quiet console that was forever: a
//! client whose stdin closed stayed attached, and so did the console lock.
//!
//! A serial console has no window size: resize messages are accepted and
//! ignored (a shell on it believes 80x24 unless told with `stty rows R cols C`).

use std::fs::File;
use std::io::{ErrorKind as IoErrorKind, Read, Seek, SeekFrom};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::instrument;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::stream::Stream;
use vmlet_provider::{Console, ConsoleChunk, Error, ErrorKind, Result, StreamIo, VmId};

use crate::error::{from_libvirt, is_no_domain};
use crate::provider::{is_active, is_local_uri, not_completed, Host, LibvirtProvider};
use crate::xml::console_log_path;

/// Bytes read from the console per `virStreamRecv`.
const RECV_BUFFER: usize = 16 * 1024;

/// How long teardown waits for the pump thread to stop, and then for the
/// stream to close; the pump checks its stop flag at least every
/// [`IDLE_POLL_MAX`], so this is a bound for a wedged libvirt, not a wait.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// The pump's first sleep when the console has nothing queued; it doubles up
/// to [`IDLE_POLL_MAX`] while the console stays quiet.
const IDLE_POLL_MIN: Duration = Duration::from_millis(2);

/// The pump's longest sleep between reads of a quiet console.
const IDLE_POLL_MAX: Duration = Duration::from_millis(40);

/// Boot name for output of a domain that is off and whose last boot is unknown.
const BOOT_OFF: &str = "off";

impl Host {
    /// Up to `max_bytes` of the console log from `offset`, with the boot it
    /// belongs to. The boot is read before and after the file; when a start
    /// happened in between (the file was truncated), the read is repeated.
    fn console_output(&self, conn: &Connect, id: &VmId, offset: u64, max_bytes: usize) -> Result<ConsoleChunk> {
        const OP: &str = "read console output";
        let domain = self.require(conn, OP, id)?;
        let uuid = domain.uuid_string().map_err(|e| from_libvirt(OP, e))?;
        let path = console_log_path(&uuid);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let before = current_boot(conn, &uuid)?;
            let data = read_log(&path, offset, max_bytes)?;
            let after = current_boot(conn, &uuid)?;
            if before != after && attempts < 3 {
                continue;
            }
            let data = match data {
                Some(data) => data,
                None => {
                    // No file: either the domain never started since it was
                    // defined, or it records no console log at all.
                    if !records_console_log(&domain, &path)? {
                        return Err(Error::new(
                            OP,
                            ErrorKind::Unsupported,
                            format!(
                                "domain {uuid} records no console log (it has no <log file='{path}'/> on its \
                                 serial port; vmlet defines domains with one)"
                            ),
                        ));
                    }
                    if !is_local_uri(self.connection.uri()) {
                        return Err(Error::new(
                            OP,
                            ErrorKind::Unsupported,
                            format!(
                                "console history is read from {path} on the libvirt host, and {} is remote; \
                                 run vmlet on the hypervisor host",
                                self.connection.uri()
                            ),
                        ));
                    }
                    Vec::new()
                }
            };
            let boot = self.boot_name(id, after);
            let next_offset = offset + data.len() as u64;
            return Ok(ConsoleChunk { boot, data, next_offset });
        }
    }

    /// The boot name for `running` (the domain id while active), remembering it
    /// so that the stopped domain's log keeps it.
    fn boot_name(&self, id: &VmId, running: Option<u32>) -> String {
        let mut boots = self.boots.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match running {
            Some(domain_id) => {
                let boot = domain_id.to_string();
                boots.insert(id.clone(), boot.clone());
                boot
            }
            None => boots.get(id).cloned().unwrap_or_else(|| BOOT_OFF.to_owned()),
        }
    }

    /// Open the console of the running domain `id` on a new stream over a new
    /// connection of its own (see [`ConsoleSession`]).
    fn open_console(&self, conn: &Connect, id: &VmId) -> Result<ConsoleSession> {
        const OP: &str = "attach to console";
        let uuid = self.require(conn, OP, id)?.uuid_string().map_err(|e| from_libvirt(OP, e))?;
        crate::event_loop::ensure_running()?;
        let session_conn = crate::connection::open_watched(self.connection.uri()).map_err(|e| from_libvirt(OP, e))?;
        let domain = match session_conn.lookup_domain_by_uuid_string(&uuid) {
            Ok(domain) => domain,
            Err(err) if is_no_domain(&err) => {
                return Err(Error::new(OP, ErrorKind::NotFound, format!("no domain carries vmlet uid {id}")))
            }
            Err(err) => return Err(from_libvirt(OP, err)),
        };
        if !is_active(&domain, OP)? {
            return Err(Error::new(OP, ErrorKind::Transient, format!("VM {id} is not running; start it to attach")));
        }
        let stream = Stream::new(&session_conn, virt::sys::VIR_STREAM_NONBLOCK).map_err(|e| from_libvirt(OP, e))?;
        domain.open_console(None, &stream, virt::sys::VIR_DOMAIN_CONSOLE_SAFE).map_err(|err| {
            if is_console_busy(&err) {
                Error::new(
                    OP,
                    ErrorKind::Transient,
                    format!("console busy: another session is attached to the serial console of VM {id}"),
                )
                .with_source(err)
            } else {
                from_libvirt(OP, err)
            }
        })?;
        Ok(ConsoleSession { conn: session_conn, stream })
    }
}

/// An open console: the non-blocking stream and the connection it runs on.
///
/// Each session has a libvirt connection of its own, so that nothing a console
/// does (a send waiting on a full socket, a slow abort) can delay lifecycle
/// calls on the host's shared connection (libvirt 9.0, with a blocking stream:
/// a `virDomainIsActive` was seen to wait forever while a console was open).
struct ConsoleSession {
    conn: Connect,
    stream: Stream,
}

impl ConsoleSession {
    /// Finish (after EOF) or abort the stream; the caller closes the
    /// connection afterwards. Blocking; call once the pump has stopped.
    fn close_stream(stream: Stream, console_ended: bool) {
        let result = if console_ended { stream.finish() } else { stream.abort() };
        if let Err(err) = result {
            tracing::debug!(error = %err, "closing the console stream failed");
        }
    }
}

/// The runtime id of the domain with `uuid` now (`None` while it is off). A
/// fresh lookup: a `Domain` handle keeps the id it was looked up with.
fn current_boot(conn: &Connect, uuid: &str) -> Result<Option<u32>> {
    match conn.lookup_domain_by_uuid_string(uuid) {
        Ok(domain) => Ok(domain.id()),
        Err(err) if is_no_domain(&err) => {
            Err(Error::new("read console output", ErrorKind::NotFound, format!("domain {uuid} is gone")))
        }
        Err(err) => Err(from_libvirt("read console output", err)),
    }
}

/// Whether `domain`'s definition names `path` as a console log.
fn records_console_log(domain: &Domain, path: &str) -> Result<bool> {
    let xml = domain.xml_desc(0).map_err(|e| from_libvirt("read console output", e))?;
    Ok(xml.contains(&format!("file='{path}'")) || xml.contains(&format!("file=\"{path}\"")))
}

/// Up to `max_bytes` of the file at `path` from `offset`; `None` when there is
/// no such file.
fn read_log(path: &str, offset: u64, max_bytes: usize) -> Result<Option<Vec<u8>>> {
    let failed = |err: std::io::Error| {
        Error::new("read console output", ErrorKind::Permanent, format!("cannot read console log {path}: {err}"))
    };
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == IoErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(failed(err)),
    };
    let len = file.metadata().map_err(failed)?.len();
    if offset >= len {
        return Ok(Some(Vec::new()));
    }
    file.seek(SeekFrom::Start(offset)).map_err(failed)?;
    let want = (len - offset).min(max_bytes as u64);
    let mut data = Vec::with_capacity(usize::try_from(want).unwrap_or(max_bytes));
    file.take(want).read_to_end(&mut data).map_err(failed)?;
    Ok(Some(data))
}

/// True when `err` says another session holds the console (libvirt reports
/// `VIR_ERR_OPERATION_FAILED`, "Active console session exists for this domain").
fn is_console_busy(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::OperationFailed) && err.message().contains("console session")
}

/// Why the console → stdout pump stopped.
#[derive(Debug)]
enum PumpEnd {
    /// The console ended (the domain stopped or libvirt closed the stream).
    Eof,
    /// The stdout receiver is gone.
    ClientGone,
    /// `virStreamRecv` failed.
    Failed,
    /// The session told it to stop.
    Stopped,
}

/// What one non-blocking `virStreamRecv` found.
enum Received {
    /// This many bytes, at the start of the buffer.
    Data(usize),
    /// Nothing queued yet.
    Nothing,
    /// The console ended.
    Eof,
}

/// One non-blocking `virStreamRecv` into `buf`. The `virt` crate maps its
/// "would block" answer (-2) to an error, so this calls libvirt directly.
fn recv_nonblocking(stream: &Stream, buf: &mut [u8]) -> Result<Received, VirtError> {
    // SAFETY: `stream` holds a reference to a valid virStreamPtr for the whole
    // call, and `buf` is valid for writes of `buf.len()` bytes.
    let n = unsafe { virt::sys::virStreamRecv(stream.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    match n {
        -2 => Ok(Received::Nothing),
        0 => Ok(Received::Eof),
        n if n > 0 => Ok(Received::Data(usize::try_from(n).unwrap_or(0).min(buf.len()))),
        _ => Err(VirtError::last_error()),
    }
}

/// Flags shared by a session and its pump.
#[derive(Default)]
struct PumpControl {
    /// Set by the session when it ends; the pump returns within one sleep.
    stop: AtomicBool,
    /// Set when a keystroke was sent: the echo is due, so poll quickly again.
    poke: AtomicBool,
}

/// Copy the console to `stdout` (or discard it) until EOF, an error, the
/// receiver is gone, or `control.stop`. Runs on a blocking thread; never blocks
/// for longer than [`IDLE_POLL_MAX`] without checking `control.stop`.
fn pump_console_to_stdout(stream: Stream, stdout: Option<mpsc::Sender<Vec<u8>>>, control: Arc<PumpControl>) -> PumpEnd {
    let mut buf = vec![0u8; RECV_BUFFER];
    let mut idle = IDLE_POLL_MIN;
    loop {
        if control.stop.load(Ordering::Acquire) {
            return PumpEnd::Stopped;
        }
        match recv_nonblocking(&stream, &mut buf) {
            Ok(Received::Data(n)) => {
                idle = IDLE_POLL_MIN;
                if let Some(stdout) = &stdout {
                    if let Some(end) = deliver(stdout, buf[..n].to_vec(), &control) {
                        return end;
                    }
                }
            }
            Ok(Received::Nothing) => {
                if control.poke.swap(false, Ordering::AcqRel) {
                    idle = IDLE_POLL_MIN;
                }
                std::thread::sleep(idle);
                idle = (idle * 2).min(IDLE_POLL_MAX);
            }
            Ok(Received::Eof) => return PumpEnd::Eof,
            Err(err) => {
                tracing::debug!(error = %err, "console stream ended");
                return PumpEnd::Failed;
            }
        }
    }
}

/// Hand `data` to `stdout`, waiting while its buffer is full but checking
/// `control.stop` between tries; `Some` when the pump must end instead.
fn deliver(stdout: &mpsc::Sender<Vec<u8>>, mut data: Vec<u8>, control: &PumpControl) -> Option<PumpEnd> {
    loop {
        match stdout.try_send(data) {
            Ok(()) => return None,
            Err(mpsc::error::TrySendError::Closed(_)) => return Some(PumpEnd::ClientGone),
            Err(mpsc::error::TrySendError::Full(back)) => {
                if control.stop.load(Ordering::Acquire) {
                    return Some(PumpEnd::Stopped);
                }
                data = back;
                std::thread::sleep(IDLE_POLL_MIN);
            }
        }
    }
}

/// Write all of `data` to the console. Blocking.
fn send_all(stream: &Stream, mut data: &[u8]) -> Result<(), VirtError> {
    while !data.is_empty() {
        let sent = stream.send(data)?;
        let sent = usize::try_from(sent).unwrap_or(0).min(data.len());
        if sent == 0 {
            break;
        }
        data = &data[sent..];
    }
    Ok(())
}

/// The next message of an optional channel; pending forever without one.
async fn next<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Resolves when `tx`'s receiver is gone; pending forever without a sender.
async fn receiver_gone<T>(tx: &Option<mpsc::Sender<T>>) {
    match tx {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

/// Why an attach session ended, for the log.
#[derive(Debug)]
enum SessionEnd {
    StdinClosed,
    ClientGone,
    ConsoleEnded,
    SendFailed,
}

impl LibvirtProvider {
    async fn attach_session(&self, id: &VmId, io: StreamIo) -> Result<()> {
        const OP: &str = "attach to console";
        let StreamIo { mut stdin, stdout, stderr: _, tty: _, mut resize } = io;
        if stdin.is_none() && stdout.is_none() {
            return Ok(());
        }
        let target = id.clone();
        let ConsoleSession { conn, stream } =
            self.blocking(OP, move |host, conn| host.open_console(conn, &target)).await?;
        tracing::debug!(vm.uid = %id, "console attached");

        let control = Arc::new(PumpControl::default());
        let mut pump = tokio::task::spawn_blocking({
            let (stream, stdout, control) = (stream.clone(), stdout.clone(), Arc::clone(&control));
            move || pump_console_to_stdout(stream, stdout, control)
        });
        let mut pump_result = None;
        let end = loop {
            tokio::select! {
                result = &mut pump => {
                    pump_result = Some(result);
                    break SessionEnd::ConsoleEnded;
                }
                input = next(&mut stdin) => match input {
                    Some(data) => {
                        let writer = stream.clone();
                        let sent = tokio::task::spawn_blocking(move || send_all(&writer, &data)).await;
                        if !matches!(sent, Ok(Ok(()))) {
                            tracing::debug!(vm.uid = %id, result = ?sent, "console write failed");
                            break SessionEnd::SendFailed;
                        }
                        control.poke.store(true, Ordering::Release);
                    }
                    None => break SessionEnd::StdinClosed,
                },
                () = receiver_gone(&stdout) => break SessionEnd::ClientGone,
                size = next(&mut resize) => {
                    // A serial line has no window size; see the module docs.
                    if size.is_none() {
                        resize = None;
                    }
                }
            }
        };
        drop(stdout);

        // Tear down: stop the pump, then finish or abort the stream and close
        // the session's connection, which releases the console.
        control.stop.store(true, Ordering::Release);
        let pump_end = match pump_result {
            Some(result) => result,
            None => match tokio::time::timeout(TEARDOWN_TIMEOUT, &mut pump).await {
                Ok(result) => result,
                Err(_) => {
                    tracing::warn!(vm.uid = %id, "console pump did not stop; leaving the session to it");
                    tokio::spawn(async move {
                        let _ = pump.await;
                        let _ = tokio::task::spawn_blocking(move || {
                            ConsoleSession::close_stream(stream, false);
                            drop(conn);
                        })
                        .await;
                    });
                    return Ok(());
                }
            },
        };
        let console_ended = matches!(pump_end, Ok(PumpEnd::Eof));
        let closed = tokio::task::spawn_blocking(move || {
            ConsoleSession::close_stream(stream, console_ended);
            drop(conn);
        });
        match tokio::time::timeout(TEARDOWN_TIMEOUT, closed).await {
            Ok(joined) => joined.map_err(|e| not_completed(OP, e))?,
            Err(_) => tracing::warn!(vm.uid = %id, "closing the console stream did not finish; left in the background"),
        }
        tracing::debug!(vm.uid = %id, session.end = ?end, pump.end = ?pump_end, "console detached");
        Ok(())
    }
}

#[async_trait::async_trait]
impl Console for LibvirtProvider {
    /// Reads `/var/log/vmlet/console/<domain uuid>.log` (see the module docs for
    /// boots). Errors: `NotFound`; `Unsupported` for a domain without a console
    /// log or a remote libvirt host.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn console_output(&self, id: &VmId, offset: u64, max_bytes: usize) -> Result<ConsoleChunk> {
        let id = id.clone();
        self.blocking("read console output", move |host, conn| host.console_output(conn, &id, offset, max_bytes)).await
    }

    /// A live session on the serial console (see the module docs). Errors:
    /// `NotFound`; `Transient` when the VM is not running or another session
    /// holds the console ("console busy").
    #[instrument(skip(self, io), fields(provider = "libvirt", vm.uid = %id))]
    async fn attach(&self, id: &VmId, io: StreamIo) -> Result<()> {
        self.attach_session(id, io).await
    }
}
