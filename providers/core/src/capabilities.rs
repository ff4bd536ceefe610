//! Optional provider capabilities: console output, the live console,
//! commands in the guest, and connections to the guest's ports. A provider
//! declares each one it has through [`crate::Provider::console`],
//! [`crate::Provider::guest_exec`] and [`crate::Provider::port_forward`]; the core
//! answers "not supported" (HTTP 501, with a message naming the backend) for the
//! rest, never a hang.
//!
//! Streams are transport-neutral ([`StreamIo`]): the kubelet API turns SPDY/3.1 or
//! WebSocket channels into these, so providers never see a protocol.

use crate::{Result, VmId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

/// Terminal size in character cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermSize {
    /// Columns.
    pub width: u16,
    /// Rows.
    pub height: u16,
}

/// The client side of an attach or exec session, as channels. A `None` stream was
/// not requested by the client. The provider reads `stdin` until it closes (the
/// client detached or sent EOF), writes output to `stdout`/`stderr`, and must
/// stop writing once a receiver is gone. With `tty`, stderr is merged into
/// stdout (as for containers) and `resize` carries terminal size changes.
#[derive(Debug)]
pub struct StreamIo {
    /// Bytes the client types or pipes in.
    pub stdin: Option<mpsc::Receiver<Vec<u8>>>,
    /// Output for the client's stdout.
    pub stdout: Option<mpsc::Sender<Vec<u8>>>,
    /// Output for the client's stderr (absent with a tty).
    pub stderr: Option<mpsc::Sender<Vec<u8>>>,
    /// Whether the client asked for a terminal.
    pub tty: bool,
    /// Terminal size changes (only with a tty).
    pub resize: Option<mpsc::Receiver<TermSize>>,
}

/// A piece of a VM's serial console output, as recorded by the hypervisor from
/// the start of the current boot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsoleChunk {
    /// Identifies the boot this output belongs to; it changes when the VM is
    /// started again, and then offsets start over at 0.
    pub boot: String,
    /// Bytes from the requested offset (may be empty: nothing new yet).
    pub data: Vec<u8>,
    /// Offset to ask for next.
    pub next_offset: u64,
}

/// Serial console access.
#[async_trait::async_trait]
pub trait Console: Send + Sync {
    /// Console output of the current (or last) boot from byte `offset`, at most
    /// `max_bytes`. An offset past the end returns no data. Errors: `NotFound`
    /// when the VM does not exist; `Unsupported` when this VM has no recorded
    /// console.
    async fn console_output(&self, id: &VmId, offset: u64, max_bytes: usize) -> Result<ConsoleChunk>;

    /// Connect `io` to the live serial console until stdin closes or the console
    /// ends. Only one session holds a console at a time; a second gets an error
    /// of kind `Transient` ("console busy"), never a hang. Errors: `NotFound`,
    /// `Transient` when the VM is not running.
    async fn attach(&self, id: &VmId, io: StreamIo) -> Result<()>;
}

/// Commands run in the guest (through a guest agent).
#[async_trait::async_trait]
pub trait GuestExec: Send + Sync {
    /// Run `command` (argv, no shell) in the guest, streaming its output into
    /// `io` and feeding it `io.stdin` when the agent allows; returns the exit code.
    /// Errors: `Unsupported` when the guest has no agent (the message says what is
    /// missing), `Transient` when the agent does not answer.
    async fn exec(&self, id: &VmId, command: &[String], io: StreamIo) -> Result<i32>;
}

/// Resource usage of one VM, for `/stats/summary` and `/metrics/resource`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmStats {
    /// Cumulative CPU time in nanoseconds since the VM started.
    pub cpu_usage_ns: u64,
    /// Guest memory in use (working set), in bytes.
    pub memory_working_set_bytes: u64,
}

/// Per-VM resource usage.
#[async_trait::async_trait]
pub trait Stats: Send + Sync {
    /// Usage of a running VM. Errors: `NotFound`; `Transient` when not running.
    async fn stats(&self, id: &VmId) -> Result<VmStats>;
}

/// A byte stream to one TCP port of a guest: what `kubectl port-forward`
/// carries. Reading returns what the guest sends (0 bytes once it closed
/// its side); writing sends to the guest; `shutdown` closes our sending
/// side only (the guest sees end of input), as a TCP half-close.
pub trait GuestConnection: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> GuestConnection for T {}

/// Connections to TCP ports of a running guest (port forwarding).
///
/// Where the connection goes is the provider's to decide from what the back
/// end says about the VM (e.g. the address its host's network leased to
/// it), never from the caller: a caller names only the VM and the port, so
/// that forwarding cannot reach the host itself or any other machine.
#[async_trait::async_trait]
pub trait PortForward: Send + Sync {
    /// Open a TCP connection to `port` of VM `id`'s guest, within a deadline
    /// of the provider's (seconds, not minutes). Errors: `NotFound` when the
    /// VM does not exist; `Transient` when it is not running, has no known
    /// address yet, or the guest refused or did not answer (the message says
    /// which, for the user); `Unsupported` when the VM has no interface the
    /// host can reach (the message says why).
    async fn connect(&self, id: &VmId, port: u16) -> Result<Box<dyn GuestConnection>>;
}
