//! The libvirt provider's console, exec and stats capabilities against a real
//! guest on a real libvirtd with QEMU (`qemu:///system`, software emulation).
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it) and root. The guest is
//! `test-vms/guest/build.sh`'s (cached; `VMLET_GUEST_DIR` names a built one
//! instead). Its files are copied into a per-run directory under
//! `/var/lib/vmlet/test-guests/`, which QEMU (running as `libvirt-qemu`) can
//! read and whose disk no other run shares. One test boots one guest and checks
//! everything in order, since the boot is the expensive part.

mod common;
use common::guest::{exec, guest_accelerator, guest_dir, remove_leftovers, RunDir, BOOT_DEADLINE};
use common::qemu_uri;

use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{ErrorKind, Provider, StreamIo, VmId};

const NAMESPACE: &str = "vmlet-guest-it";
const BOOTED: &str = "vmlet-guest: booted";
/// Bound on what should happen at once (a session ending, fds and threads
/// going back after the cycles): generous, so that only a hang or a leak
/// reaches it on a loaded CI host, never slowness.
const PROMPT_DEADLINE: Duration = Duration::from_secs(60);

/// Poll the console history from offset 0 until it contains `needle`; returns
/// the boot and the text so far.
async fn wait_for_console(provider: &LibvirtProvider, id: &VmId, needle: &str, deadline: Duration) -> (String, String) {
    let console = provider.console().expect("QEMU has a console");
    let start = Instant::now();
    let (mut boot, mut text, mut offset) = (String::new(), Vec::new(), 0);
    loop {
        let chunk = console.console_output(id, offset, 1 << 20).await.expect("console output");
        if chunk.boot != boot {
            (boot, text, offset) = (chunk.boot.clone(), Vec::new(), 0);
            continue;
        }
        text.extend_from_slice(&chunk.data);
        offset = chunk.next_offset;
        let so_far = String::from_utf8_lossy(&text).into_owned();
        if so_far.contains(needle) {
            return (boot, so_far);
        }
        if start.elapsed() >= deadline {
            panic!("no {needle:?} on the console after {deadline:?}:\n{so_far}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A live attach session driven by the test.
struct Session {
    stdin: mpsc::Sender<Vec<u8>>,
    stdout: mpsc::Receiver<Vec<u8>>,
    task: tokio::task::JoinHandle<vmlet_provider::Result<()>>,
}

impl Session {
    fn open(provider: &LibvirtProvider, id: &VmId) -> Session {
        let (stdin, stdin_rx) = mpsc::channel(16);
        let (stdout_tx, stdout) = mpsc::channel(64);
        let (_resize_tx, resize_rx) = mpsc::channel(1);
        let io = StreamIo {
            stdin: Some(stdin_rx),
            stdout: Some(stdout_tx),
            stderr: None,
            tty: true,
            resize: Some(resize_rx),
        };
        let (provider, id) = (provider.clone(), id.clone());
        let task = tokio::spawn(async move { provider.console().expect("console").attach(&id, io).await });
        Session { stdin, stdout, task }
    }

    /// Type `line` and wait until the console shows `expect`.
    async fn type_and_expect(&mut self, line: &str, expect: &str) {
        self.stdin.send(line.as_bytes().to_vec()).await.expect("attach takes stdin");
        let mut seen = Vec::new();
        let deadline = Instant::now() + PROMPT_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.stdout.recv()).await {
                Ok(Some(data)) => seen.extend(data),
                Ok(None) => panic!("console closed before {expect:?}: {}", String::from_utf8_lossy(&seen)),
                Err(_) => panic!("no {expect:?} on the console: {}", String::from_utf8_lossy(&seen)),
            }
            if String::from_utf8_lossy(&seen).contains(expect) {
                return;
            }
        }
    }

    /// Close stdin and wait for the session to end.
    async fn close(self) {
        let Session { stdin, stdout, task } = self;
        drop(stdin);
        let result = tokio::time::timeout(PROMPT_DEADLINE, task).await.expect("attach ends when stdin closes");
        result.expect("attach task").expect("attach");
        drop(stdout);
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: in /proc/self/status")
}

/// Wait until fds and threads are back within `slack` of `before`, for up to
/// [`PROMPT_DEADLINE`]; returns the last counts (the caller asserts on them).
async fn settle(before: (usize, usize), fd_slack: usize, thread_slack: usize) -> (usize, usize) {
    let deadline = Instant::now() + PROMPT_DEADLINE;
    loop {
        let now = (open_fds(), threads());
        if (now.0 <= before.0 + fd_slack && now.1 <= before.1 + thread_slack) || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_guest_serves_logs_exec_attach_and_stats() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let release = std::fs::read_to_string(guest.join("kernel-release")).expect("kernel-release").trim().to_owned();

    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    remove_leftovers(&provider, NAMESPACE).await;
    let mut spec = common::unique_spec(NAMESPACE, "guest");
    let run = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    spec.image = Some(run.path("disk.qcow2"));
    spec.kernel_boot = Some(run.kernel_boot(&guest));
    let id = spec.id.clone();
    provider.ensure_defined(&spec).await.expect("define");

    // Before the first start there is no output yet, and no boot.
    let before = provider.console().expect("console").console_output(&id, 0, 4096).await.expect("console output");
    assert_eq!((before.boot.as_str(), before.data.len(), before.next_offset), ("off", 0, 0));

    let started = Instant::now();
    provider.start(&id).await.expect("start");

    // Logs: the console history from boot, including the kernel's first lines.
    let (boot, text) = wait_for_console(&provider, &id, BOOTED, BOOT_DEADLINE).await;
    let booted_after = started.elapsed();
    assert!(text.contains("Linux version"), "kernel messages from boot are in the history:\n{text}");
    assert!(text.contains("vmlet-guest: no cloud-init seed"), "a VM without cloud-init data has no seed:\n{text}");
    assert!(boot.parse::<u32>().is_ok(), "boot is the domain id: {boot}");

    // Exec: wait for the agent (it answers a few seconds after boot).
    let agent_deadline = Instant::now() + BOOT_DEADLINE;
    let uname = loop {
        match exec(&provider, &id, &["uname", "-r"], None).await {
            Ok(output) => break output,
            Err(err) if err.kind == ErrorKind::Unsupported && Instant::now() < agent_deadline => {
                assert!(err.message.contains("qemu-guest-agent"), "{err}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(err) => panic!("uname -r: {err}"),
        }
    };
    println!("guest booted after {booted_after:?}, agent answered after {:?}", started.elapsed());
    assert_eq!((uname.code, uname.stdout.trim()), (0, release.as_str()), "{uname:?}");

    let exit3 = exec(&provider, &id, &["sh", "-c", "exit 3"], None).await.expect("exit 3");
    assert_eq!(exit3.code, 3, "{exit3:?}");
    let both = exec(&provider, &id, &["sh", "-c", "echo out; echo err >&2"], None).await.expect("stderr");
    assert_eq!((both.code, both.stdout.as_str(), both.stderr.as_str()), (0, "out\n", "err\n"));
    let cat = exec(&provider, &id, &["cat"], Some(b"line one\nline two\n")).await.expect("cat");
    assert_eq!((cat.code, cat.stdout.as_str()), (0, "line one\nline two\n"), "{cat:?}");
    let missing = exec(&provider, &id, &["/no/such/command"], None).await.expect_err("missing command");
    assert_eq!(missing.kind, ErrorKind::InvalidInput, "{missing}");

    // Stats.
    let stats = provider.stats().expect("stats").stats(&id).await.expect("stats");
    assert!(stats.cpu_usage_ns > 0, "{stats:?}");
    assert!(stats.memory_working_set_bytes > 0 && stats.memory_working_set_bytes <= spec.memory_bytes, "{stats:?}");

    // Attach: type into the shell and read its answer; a second session is refused.
    let marker = format!("{}", std::process::id());
    let mut session = Session::open(&provider, &id);
    session
        .type_and_expect(&format!("\necho vmlet-attach-$((40+2))-{marker}\n"), &format!("vmlet-attach-42-{marker}"))
        .await;
    let (_stdin, stdin_rx) = mpsc::channel(1);
    let (stdout_tx, _stdout) = mpsc::channel(1);
    let second = StreamIo { stdin: Some(stdin_rx), stdout: Some(stdout_tx), stderr: None, tty: true, resize: None };
    // Refused rather than left waiting for the console: a generous bound that
    // only a hang would exceed (no speed goal here).
    let busy = tokio::time::timeout(PROMPT_DEADLINE, provider.console().unwrap().attach(&id, second))
        .await
        .expect("a second attach is answered, not left hanging")
        .expect_err("a second attach is refused");
    assert_eq!(busy.kind, ErrorKind::Transient, "{busy}");
    assert!(busy.message.contains("console busy"), "{busy}");
    session.close().await;

    // 100 exec + attach cycles leave no fd, thread or console lock behind.
    let cycle = |n: usize| {
        let (provider, id) = (provider.clone(), id.clone());
        async move {
            let out = exec(&provider, &id, &["echo", &format!("cycle-{n}")], None).await.expect("exec in cycle");
            assert_eq!(out.stdout, format!("cycle-{n}\n"));
            let session = Session::open(&provider, &id);
            session.stdin.send(b"\n".to_vec()).await.expect("stdin");
            session.close().await;
        }
    };
    cycle(0).await;
    let baseline = settle((open_fds(), threads()), 0, 0).await;
    let cycles_started = Instant::now();
    for n in 1..=100 {
        cycle(n).await;
    }
    let after = settle(baseline, 0, 4).await;
    println!("100 cycles in {:?}; fds/threads before {baseline:?}, after {after:?}", cycles_started.elapsed());
    // At most as many as before: an fd of the warm-up cycle that was still
    // closing when the baseline was read may be gone by now.
    assert!(after.0 <= baseline.0, "file descriptors leaked: before {baseline:?}, after {after:?}");
    assert!(after.1 <= baseline.1 + 4, "threads leaked: before {baseline:?}, after {after:?}");
    let mut session = Session::open(&provider, &id);
    session.type_and_expect("echo still-$((6*7))\n", "still-42").await;

    // Stopping the VM ends the session it had open (stdin still open).
    provider.destroy(&id).await.expect("destroy");
    let ended = tokio::time::timeout(PROMPT_DEADLINE, session.task).await.expect("attach ends with the VM");
    ended.expect("attach task").expect("attach ends without error when the console ends");
    drop(session.stdin);

    // A stopped VM keeps its last boot's history under the same boot.
    let (after_stop, text_after_stop) = wait_for_console(&provider, &id, BOOTED, PROMPT_DEADLINE).await;
    assert_eq!(after_stop, boot);
    assert!(text_after_stop.contains("vmlet-attach-42"), "{text_after_stop}");
    let err = exec(&provider, &id, &["true"], None).await.expect_err("exec in a stopped VM");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");

    provider.undefine(&id).await.expect("undefine");
    drop(run);
}
