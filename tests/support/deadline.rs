//! Every external command a test runs has a deadline.
//!
//! A hung kubectl, virsh, tmux or build script must fail its test, naming the
//! command line, the time it ran and the output it had printed, instead of
//! hanging CI. [`run`] pipes the child's stdout and stderr, reads them on threads
//! (so a full pipe never blocks the child), polls the child with `try_wait`, and
//! kills and reaps it when the deadline passes.
//!
//! Shared by both test trees: `tests/common/mod.rs` and
//! `providers/libvirt/tests/common/mod.rs` include this file with `#[path]`, so
//! it may use the standard library only.
#![allow(dead_code)] // each test binary uses a different part

use std::ffi::OsStr;
use std::fmt;
use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// Deadline of one kubectl call that does not wait by itself (get, patch,
/// apply, exec, logs, attach -i, scale…); a `--timeout` it waits for is added
/// on top by the callers.
pub const KUBECTL: Duration = Duration::from_secs(60);
/// Deadline of one virsh call.
pub const VIRSH: Duration = Duration::from_secs(60);
/// Deadline of one tmux call (they only talk to the tmux server).
pub const TMUX: Duration = Duration::from_secs(30);
/// Deadline of `test-vms/guest/build.sh`: a cold build downloads and packs a
/// kernel and a root file system; a cached one answers at once.
pub const GUEST_BUILD: Duration = Duration::from_secs(20 * 60);

/// How often a running child is polled.
const POLL: Duration = Duration::from_millis(10);
/// How long a killed child may take to be reaped, and its pipes to drain.
pub const KILL_WAIT: Duration = Duration::from_secs(10);
/// How much of each stream a [`TimedOut`] message shows (its end).
pub const SHOWN: usize = 16 * 1024;

/// A command that did not finish within its deadline.
#[derive(Debug)]
pub struct TimedOut {
    /// The command line: environment set on the command, program and
    /// arguments, quoted for a POSIX shell.
    pub command: String,
    /// The deadline it was given.
    pub deadline: Duration,
    /// Time from its start until it was given up on (killed, or found still
    /// holding its output open).
    pub elapsed: Duration,
    /// `Some` when the process itself exited in time but its stdout or stderr
    /// stayed open past the deadline (held by a process it left running in the
    /// background); `None` when it was still running and was killed.
    pub exited: Option<ExitStatus>,
    /// What it wrote to stdout until then.
    pub stdout: Vec<u8>,
    /// What it wrote to stderr until then.
    pub stderr: Vec<u8>,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (command, deadline, elapsed) = (&self.command, self.deadline, self.elapsed);
        match self.exited {
            None => {
                write!(f, "`{command}` did not finish within its {deadline:?} deadline: killed after {elapsed:.1?}")?
            }
            Some(status) => write!(
                f,
                "`{command}` exited ({status}) but its stdout/stderr were still open at its {deadline:?} deadline \
                 ({elapsed:.1?}; a process it left in the background holds them)"
            )?,
        }
        for (name, bytes) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            let shown = &bytes[bytes.len().saturating_sub(SHOWN)..];
            let what = if shown.len() < bytes.len() {
                format!("last {} of {} bytes", shown.len(), bytes.len())
            } else {
                format!("{} bytes", bytes.len())
            };
            write!(f, "\n--- {name} so far ({what}):\n{}", String::from_utf8_lossy(shown))?;
        }
        Ok(())
    }
}

impl std::error::Error for TimedOut {}

/// Run `cmd` to completion within `deadline` (from its start), with stdin from
/// /dev/null and stdout and stderr captured, like [`Command::output`].
///
/// Returns its [`Output`] whatever its exit status. Errors: [`TimedOut`] when it
/// is still running at the deadline (it is then killed with SIGKILL and reaped)
/// or its output pipes are still open then.
///
/// # Panics
/// When the program cannot be started (e.g. not installed), naming it.
pub fn run(cmd: &mut Command, deadline: Duration) -> Result<Output, TimedOut> {
    run_inner(cmd, None, false, deadline)
}

/// [`run`], writing `input` to the child's stdin and then closing it (for
/// `kubectl apply -f -`, `kubectl attach -i`). The write happens on a thread,
/// so a child that never reads its stdin still meets its deadline.
pub fn run_with_stdin(cmd: &mut Command, input: &[u8], deadline: Duration) -> Result<Output, TimedOut> {
    run_inner(cmd, Some(input), false, deadline)
}

/// [`run`], also copying the child's stdout and stderr to the test process's
/// stderr as they arrive (uncaptured, live), for long builds whose progress
/// should show in CI logs.
pub fn run_echoing(cmd: &mut Command, deadline: Duration) -> Result<Output, TimedOut> {
    run_inner(cmd, None, true, deadline)
}

/// [`run`], panicking with the [`TimedOut`] text (command line, elapsed time,
/// output so far) when the deadline passes.
pub fn output_within(cmd: &mut Command, deadline: Duration) -> Output {
    run(cmd, deadline).unwrap_or_else(|timed_out| panic!("{timed_out}"))
}

/// Kill `child` (SIGKILL) and reap it, polling for up to `within`. Returns its
/// exit status, or `None` if it was not reaped in time (a process stuck in the
/// kernel); a child that had already exited is just reaped.
pub fn kill_and_reap(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let _ = child.kill(); // an error means it was already reaped
    wait_within(child, within)
}

/// Wait up to `within` for `child` to exit, polling; `None` if it still runs.
pub fn wait_within(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        let elapsed = start.elapsed();
        if elapsed >= within {
            return None;
        }
        thread::sleep(POLL.min(within - elapsed));
    }
}

/// `cmd` as a POSIX shell line: the environment set on it, program, arguments.
pub fn command_line(cmd: &Command) -> String {
    let envs = cmd
        .get_envs()
        .filter_map(|(key, value)| value.map(|value| format!("{}={}", key.to_string_lossy(), shell_word(value))));
    let words = std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(shell_word);
    envs.chain(words).collect::<Vec<_>>().join(" ")
}

fn shell_word(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn run_inner(cmd: &mut Command, input: Option<&[u8]>, echo: bool, deadline: Duration) -> Result<Output, TimedOut> {
    let command = command_line(cmd);
    cmd.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let input = input.to_vec();
        // An error means the child closed its stdin: its exit tells the rest.
        thread::spawn(move || drop(stdin.write_all(&input)));
    }
    let (stdout, stderr) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (closed_tx, closed) = mpsc::channel();
    read_into(child.stdout.take().expect("stdout is piped"), stdout.clone(), echo, closed_tx.clone());
    read_into(child.stderr.take().expect("stderr is piped"), stderr.clone(), echo, closed_tx);
    let exited = wait_within(&mut child, deadline);
    // Its output is complete once both pipes are closed: at once after its exit,
    // unless a process it started in the background holds them.
    let drain = match exited {
        Some(_) => deadline.saturating_sub(start.elapsed()),
        None => {
            kill_and_reap(&mut child, KILL_WAIT);
            KILL_WAIT
        }
    };
    let drained_by = Instant::now() + drain;
    let all_closed = (0..2).all(|_| closed.recv_timeout(drained_by.saturating_duration_since(Instant::now())).is_ok());
    let take = |buf: &Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *buf.lock().unwrap_or_else(PoisonError::into_inner));
    match exited {
        Some(status) if all_closed => Ok(Output { status, stdout: take(&stdout), stderr: take(&stderr) }),
        _ => Err(TimedOut {
            command,
            deadline,
            elapsed: start.elapsed(),
            exited,
            stdout: take(&stdout),
            stderr: take(&stderr),
        }),
    }
}

/// Read `source` to its end into `sink` on a thread (echoing to stderr if
/// `echo`), then signal `closed`.
fn read_into(mut source: impl Read + Send + 'static, sink: Arc<Mutex<Vec<u8>>>, echo: bool, closed: mpsc::Sender<()>) {
    thread::spawn(move || {
        let mut buf = [0u8; 64 * 1024];
        loop {
            match source.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if echo {
                        let _ = std::io::stderr().write_all(&buf[..n]);
                    }
                    sink.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(&buf[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = closed.send(());
    });
}
