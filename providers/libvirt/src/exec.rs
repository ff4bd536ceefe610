//! [`GuestExec`] through qemu-guest-agent (`virDomainQemuAgentCommand`).
//!
//! A command runs as `guest-exec` with `capture-output`; vmlet then polls
//! `guest-exec-status` at once, then after [`POLL_FIRST`], doubling the pause
//! up to [`POLL_INTERVAL`], until the process exited, for at most
//! [`EXEC_TIMEOUT`]. A short command is seen exited within a few ms of its
//! end; a long one costs an agent call per [`POLL_INTERVAL`]. The agent hands out the captured output only when the
//! process has exited, so stdout and stderr arrive at the end, each in one piece
//! (the agent keeps at most 16 MiB of each and flags the rest as truncated).
//!
//! Stdin: the agent takes input only up front (`input-data`), so vmlet reads the
//! client's stdin until it closes, at most [`STDIN_LIMIT`] bytes, before the
//! command starts. An interactive `kubectl exec -i` therefore sees no output
//! until stdin ends (Ctrl-D); use `kubectl attach` for a live shell.
//!
//! Exit code: the process's; killed by signal N, `128 + N` as shells report it.

use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tracing::instrument;
use virt::connect::Connect;
use virt::error::{Error as VirtError, ErrorNumber};
use vmlet_provider::{Error, ErrorKind, GuestExec, Result, StreamIo, VmId};

use crate::error::{from_libvirt, is_operation_invalid};
use crate::provider::{Host, LibvirtProvider};
use crate::xml::AGENT_CHANNEL;

/// The first pause between two `guest-exec-status` calls; each next pause
/// doubles, up to [`POLL_INTERVAL`].
pub(crate) const POLL_FIRST: Duration = Duration::from_millis(1);

/// The longest pause between two `guest-exec-status` calls.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How long a command may run before vmlet stops waiting (the process keeps
/// running in the guest: the agent cannot kill it).
pub(crate) const EXEC_TIMEOUT: Duration = Duration::from_secs(600);

/// Most stdin bytes passed to a command (sent base64-encoded in one agent
/// message).
pub(crate) const STDIN_LIMIT: usize = 8 * 1024 * 1024;

/// Seconds libvirt waits for the agent's answer to one command.
const AGENT_TIMEOUT_SECONDS: i32 = 30;

const OP_EXEC: &str = "exec in guest";

impl Host {
    /// Send one agent command to the running domain `id` and parse the reply's
    /// `return` value.
    fn agent_command(&self, conn: &Connect, id: &VmId, command: &Value) -> Result<Value> {
        let domain = self.require(conn, OP_EXEC, id)?;
        let reply = domain
            .qemu_agent_command(&command.to_string(), AGENT_TIMEOUT_SECONDS, 0)
            .map_err(|err| agent_error(id, command, err))?;
        let mut reply: Value = serde_json::from_str(&reply).map_err(|err| {
            Error::new(OP_EXEC, ErrorKind::Permanent, format!("qemu-guest-agent sent unparsable JSON: {err}"))
        })?;
        Ok(reply.get_mut("return").map(Value::take).unwrap_or(Value::Null))
    }
}

/// The provider error for a failed agent command, saying what to do.
fn agent_error(id: &VmId, command: &Value, err: VirtError) -> Error {
    let code = err.code();
    let (kind, message) = if code.is(ErrorNumber::AgentUnresponsive) {
        (
            ErrorKind::Unsupported,
            format!(
                "the guest of VM {id} has no running qemu-guest-agent ({}): install qemu-guest-agent in the \
                 guest and run it on the virtio-serial port {AGENT_CHANNEL} (`qemu-ga --method=virtio-serial \
                 --path=/dev/virtio-ports/{AGENT_CHANNEL}`); a guest that is still booting answers once its \
                 agent has started",
                err.message()
            ),
        )
    } else if code.is_any(vec![ErrorNumber::ArgumentUnsupported, ErrorNumber::OperationUnsupported]) {
        (
            ErrorKind::Unsupported,
            format!(
                "VM {id} has no guest-agent channel ({}); its domain needs <channel type='unix'><target \
                 type='virtio' name='{AGENT_CHANNEL}'/></channel>, which vmlet adds to the domains it defines",
                err.message()
            ),
        )
    } else if code.is_any(vec![ErrorNumber::AgentCommandTimeout, ErrorNumber::AgentUnsynced]) {
        (ErrorKind::Transient, format!("qemu-guest-agent in VM {id} did not answer: {}", err.message()))
    } else if is_operation_invalid(&err) {
        (ErrorKind::Transient, format!("VM {id} is not running: {}", err.message()))
    } else if command["execute"] == "guest-exec"
        && code.is_any(vec![ErrorNumber::AgentCommandFailed, ErrorNumber::InternalError])
    {
        // The agent ran but could not start the process (no such file, ...).
        (ErrorKind::InvalidInput, format!("the guest could not run the command: {}", err.message()))
    } else {
        return from_libvirt(OP_EXEC, err);
    };
    Error::new(OP_EXEC, kind, message).with_source(err)
}

/// The `guest-exec` request for `command` with optional stdin.
fn exec_request(command: &[String], input: Option<&[u8]>) -> Value {
    let mut arguments = json!({
        "path": command[0],
        "arg": &command[1..],
        "capture-output": true,
    });
    if let Some(input) = input {
        arguments["input-data"] = Value::String(BASE64.encode(input));
    }
    json!({ "execute": "guest-exec", "arguments": arguments })
}

/// What `guest-exec-status` reported about an exited process.
#[derive(Debug, PartialEq, Eq)]
struct Exited {
    code: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
}

/// Parse a `guest-exec-status` return value; `None` while still running.
fn exited_from_status(status: &Value) -> Result<Option<Exited>> {
    if !status["exited"].as_bool().unwrap_or(false) {
        return Ok(None);
    }
    let decode = |field: &str| -> Result<Vec<u8>> {
        match status[field].as_str() {
            Some(data) => BASE64.decode(data).map_err(|err| {
                Error::new(OP_EXEC, ErrorKind::Permanent, format!("qemu-guest-agent sent bad base64 in {field}: {err}"))
            }),
            None => Ok(Vec::new()),
        }
    };
    let code = match (status["exitcode"].as_i64(), status["signal"].as_i64()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => -1,
    };
    Ok(Some(Exited {
        code: i32::try_from(code).unwrap_or(-1),
        stdout: decode("out-data")?,
        stderr: decode("err-data")?,
        truncated: status["out-truncated"].as_bool().unwrap_or(false)
            || status["err-truncated"].as_bool().unwrap_or(false),
    }))
}

/// All of `stdin` until it closes, refusing more than [`STDIN_LIMIT`] bytes.
async fn read_stdin(stdin: &mut mpsc::Receiver<Vec<u8>>) -> Result<Vec<u8>> {
    let mut input = Vec::new();
    while let Some(chunk) = stdin.recv().await {
        if input.len() + chunk.len() > STDIN_LIMIT {
            return Err(Error::new(
                OP_EXEC,
                ErrorKind::InvalidInput,
                format!("stdin for a guest command is limited to {STDIN_LIMIT} bytes (qemu-guest-agent takes it in one message)"),
            ));
        }
        input.extend_from_slice(&chunk);
    }
    Ok(input)
}

/// True when every output channel the client asked for is gone (and it asked
/// for at least one).
fn client_gone(stdout: &Option<mpsc::Sender<Vec<u8>>>, stderr: &Option<mpsc::Sender<Vec<u8>>>) -> bool {
    let senders: Vec<_> = stdout.iter().chain(stderr.iter()).collect();
    !senders.is_empty() && senders.iter().all(|tx| tx.is_closed())
}

impl LibvirtProvider {
    /// One agent command, in VM `id`'s turn (its own queue, then one of the
    /// host's `MAX_AGENT_CALLS_IN_FLIGHT` permits); libvirt gives up on the
    /// agent after [`AGENT_TIMEOUT_SECONDS`].
    async fn agent(&self, id: &VmId, command: Value) -> Result<Value> {
        let _turn = self.agent_turn(OP_EXEC, id).await?;
        let id = id.clone();
        self.blocking(OP_EXEC, move |host, conn| host.agent_command(conn, &id, &command)).await
    }

    async fn exec_command(&self, id: &VmId, command: &[String], io: StreamIo) -> Result<i32> {
        if command.is_empty() || command[0].is_empty() {
            return Err(Error::new(OP_EXEC, ErrorKind::InvalidInput, "no command given"));
        }
        let StreamIo { stdin, stdout, stderr, tty, .. } = io;
        let input = match stdin {
            Some(mut stdin) => Some(read_stdin(&mut stdin).await?),
            None => None,
        };
        let started = self.agent(id, exec_request(command, input.as_deref())).await?;
        let pid = started["pid"].as_i64().ok_or_else(|| {
            Error::new(
                OP_EXEC,
                ErrorKind::Permanent,
                format!("qemu-guest-agent answered guest-exec without a pid: {started}"),
            )
        })?;
        tracing::debug!(vm.uid = %id, guest.pid = pid, "guest command started");

        let deadline = Instant::now() + EXEC_TIMEOUT;
        let mut pause = POLL_FIRST;
        let exited = loop {
            let status = self.agent(id, json!({ "execute": "guest-exec-status", "arguments": { "pid": pid } })).await?;
            if let Some(exited) = exited_from_status(&status)? {
                break exited;
            }
            if client_gone(&stdout, &stderr) {
                return Err(Error::new(
                    OP_EXEC,
                    ErrorKind::Transient,
                    format!("the client went away; the command keeps running in the guest as pid {pid}"),
                ));
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    OP_EXEC,
                    ErrorKind::Transient,
                    format!(
                        "the command still runs in the guest (pid {pid}) after {} s; vmlet stopped waiting",
                        EXEC_TIMEOUT.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(POLL_INTERVAL);
        };

        // With a tty, stderr goes to stdout, as for containers.
        let err_channel = if tty { &stdout } else { &stderr };
        if let (Some(tx), false) = (&stdout, exited.stdout.is_empty()) {
            let _ = tx.send(exited.stdout).await;
        }
        if let (Some(tx), false) = (err_channel, exited.stderr.is_empty()) {
            let _ = tx.send(exited.stderr).await;
        }
        if exited.truncated {
            if let Some(tx) = err_channel {
                let _ = tx.send(b"vmlet: qemu-guest-agent truncated the command's output\n".to_vec()).await;
            }
        }
        Ok(exited.code)
    }
}

#[async_trait::async_trait]
impl GuestExec for LibvirtProvider {
    /// `guest-exec` + `guest-exec-status` (see the module docs for stdin,
    /// output and limits). Errors: `NotFound`; `Unsupported` when the guest has
    /// no running qemu-guest-agent or the domain no agent channel (the message
    /// says how to fix it); `Transient` when the VM is not running or the agent
    /// does not answer; `InvalidInput` when the guest cannot start the command.
    #[instrument(skip(self, io), fields(provider = "libvirt", vm.uid = %id))]
    async fn exec(&self, id: &VmId, command: &[String], io: StreamIo) -> Result<i32> {
        self.exec_command(id, command, io).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_passes_argv_and_stdin_as_base64() {
        let argv = ["sh".to_owned(), "-c".to_owned(), "cat".to_owned()];
        let request = exec_request(&argv, Some(b"hi\n"));
        assert_eq!(
            request,
            json!({"execute": "guest-exec", "arguments": {
                "path": "sh", "arg": ["-c", "cat"], "capture-output": true, "input-data": "aGkK"}})
        );
        let request = exec_request(&argv[..1], None);
        assert_eq!(request["arguments"]["arg"], json!([]));
        assert!(request["arguments"].get("input-data").is_none());
    }

    #[test]
    fn status_is_none_while_running_and_decodes_output_when_exited() {
        assert_eq!(exited_from_status(&json!({"exited": false})).unwrap(), None);
        let exited = exited_from_status(&json!({
            "exited": true, "exitcode": 3, "out-data": "b3V0", "err-data": "ZXJy", "out-truncated": false
        }))
        .unwrap()
        .unwrap();
        assert_eq!(exited, Exited { code: 3, stdout: b"out".to_vec(), stderr: b"err".to_vec(), truncated: false });
    }

    #[test]
    fn a_signal_becomes_128_plus_its_number() {
        let exited = exited_from_status(&json!({"exited": true, "signal": 9})).unwrap().unwrap();
        assert_eq!(exited.code, 137);
    }
}
