//! A hostile client against one vmlet, on real qemu guests: `cargo bench
//! --bench hostile_clients` (through hack/test.sh's environment: the control
//! plane and libvirtd up, VMLET_LIBVIRT_QEMU_URI set).
//!
//! Two guests run on one host (`web`, the target, and `other`). Straight at
//! the host's kubelet API, as the API server's kubelet client, the client
//! then holds at once
//! - `VMLET_BENCH_EXECS` (default 1,000) exec upgrades (SPDY) to `web`,
//! - `VMLET_BENCH_FOLLOWERS` (default 600) `logs -f` followers of `web`,
//! - one SPDY session to `other` that declares a 16 MiB data frame and goes
//!   on writing up to 100 MiB, and
//! - one WebSocket exec to `other` whose resize channel gets `{` and then
//!   spaces, up to 100 MiB,
//!
//! and meanwhile a third VM is created on the host and execs into `other` go
//! through the API server. Printed, each next to its limit measured in the
//! same run: how each attack was answered (statuses, bytes taken before the
//! cut), vmlet's RSS idle and at its peak under attack (target < 2× idle),
//! exec p50/p95 into `other` idle and under attack, and the third VM's
//! create→Running next to the first two's. Figures only; nothing is asserted
//! about speed or memory. Every wait has a deadline.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/exec.rs"]
#[allow(dead_code)] // the per-step timings are exec_roundtrip's
mod exec;
#[path = "support/process.rs"]
#[allow(dead_code)] // its CPU figures are apply_to_running's
mod process;

use common::kubelet::Caller;
use common::{Host, TestEnv};
use exec::{exec_via_api, report};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

type Tls = TlsStream<TcpStream>;

/// Bytes each flood attack writes at most.
const FLOOD_BYTES: usize = 100 << 20;
/// How long one request may take to be answered (or one flood to be cut).
const ANSWER_LIMIT: Duration = Duration::from_secs(30);
/// Requests of one kind in flight at once.
const IN_FLIGHT: usize = 32;
/// Exec round trips measured idle and under attack.
const EXECS_MEASURED: usize = 20;

/// How the kubelet API answered one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Answer {
    /// This HTTP status.
    Status(u16),
    /// The connection closed (or could not be made) before a status.
    Closed,
    /// No status within [`ANSWER_LIMIT`].
    Silent,
}

/// Sends `GET <path>` with `headers` on a new connection as the API server
/// and reads the response head: the answer and, for a 1xx/2xx, the open
/// connection.
async fn request(port: u16, path: &str, headers: &[(&str, &str)]) -> (Answer, Option<Tls>) {
    let attempt = async {
        let Some(mut tls) = common::kubelet::connect(port, Caller::ApiServer).await else {
            return (Answer::Closed, None);
        };
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        if tls.write_all(head.as_bytes()).await.is_err() {
            return (Answer::Closed, None);
        }
        // The response head, byte by byte up to its blank line (16 KiB at most).
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n\r\n") && got.len() < 16 << 10 {
            match tls.read(&mut byte).await {
                Ok(1) => got.push(byte[0]),
                _ => return (Answer::Closed, None),
            }
        }
        let status = String::from_utf8_lossy(&got).split(' ').nth(1).and_then(|s| s.parse().ok());
        match status {
            Some(code) if code < 300 => (Answer::Status(code), Some(tls)),
            Some(code) => (Answer::Status(code), None),
            None => (Answer::Closed, None),
        }
    };
    tokio::time::timeout(ANSWER_LIMIT, attempt).await.unwrap_or((Answer::Silent, None))
}

/// An exec upgrade to SPDY/3.1, as the API server asks for it.
const SPDY_EXEC: &[(&str, &str)] =
    &[("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1"), ("X-Stream-Protocol-Version", "v4.channel.k8s.io")];

/// `count` requests of `path` (`in_flight` at once): the answers counted,
/// and the connections left open (held until dropped; a follower's are
/// read and their bytes dropped).
async fn storm(port: u16, path: &str, headers: &'static [(&'static str, &'static str)], count: usize) -> Storm {
    use futures::StreamExt;
    let answers: Vec<(Answer, Option<Tls>)> = futures::stream::iter(0..count)
        .map(|_| request(port, path, headers))
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let mut counts = std::collections::BTreeMap::new();
    let mut held = Vec::new();
    for (answer, tls) in answers {
        *counts.entry(answer).or_insert(0usize) += 1;
        if let Some(mut tls) = tls {
            held.push(tokio::spawn(async move {
                let mut sink = vec![0u8; 16 << 10];
                while matches!(tls.read(&mut sink).await, Ok(n) if n > 0) {}
            }));
        }
    }
    Storm { counts, held }
}

/// What a storm got back.
struct Storm {
    counts: std::collections::BTreeMap<Answer, usize>,
    /// One task per connection still open, reading it until it closes.
    held: Vec<tokio::task::JoinHandle<()>>,
}

impl Storm {
    fn print(&self, what: &str) {
        let counts: Vec<String> = self.counts.iter().map(|(a, n)| format!("{n} × {a:?}")).collect();
        let open = self.held.iter().filter(|h| !h.is_finished()).count();
        println!("  {what:<34} {} (still open now: {open})", counts.join(", "));
    }
}

impl Drop for Storm {
    fn drop(&mut self) {
        self.held.iter().for_each(|h| h.abort());
    }
}

/// Writes `chunk`s (after `first`) to `stream` until [`FLOOD_BYTES`] are
/// written, a write fails or [`ANSWER_LIMIT`] passes: the bytes written
/// and whether the server then closed the connection (within 10 s).
async fn flood<S: AsyncReadExt + AsyncWriteExt + Unpin>(stream: &mut S, first: &[u8], chunk: &[u8]) -> (usize, bool) {
    let mut written = 0;
    let writing = async {
        if stream.write_all(first).await.is_err() {
            return;
        }
        written += first.len();
        while written < FLOOD_BYTES {
            if stream.write_all(chunk).await.is_err() {
                return;
            }
            written += chunk.len();
        }
        let _ = stream.flush().await;
    };
    let _ = tokio::time::timeout(ANSWER_LIMIT, writing).await;
    let mut rest = vec![0u8; 64 << 10];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.read(&mut rest).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    })
    .await
    .unwrap_or(false);
    (written, closed)
}

/// A SPDY session to `pod` that declares a data frame of 16 MiB - 1 (the
/// largest SPDY/3.1's 24-bit length allows) on stream 1 and streams zeros.
async fn spdy_big_frame(port: u16, path: &str) -> String {
    let (answer, tls) = request(port, path, SPDY_EXEC).await;
    let Some(mut tls) = tls else { return format!("no session: {answer:?}") };
    // Data frame: control bit 0 + stream id 1, flags 0, length 0xFFFFFF.
    let header = [0, 0, 0, 1, 0, 0xFF, 0xFF, 0xFF];
    let (written, closed) = flood(&mut tls, &header, &[0u8; 64 << 10]).await;
    format!("{answer:?}, then {} KiB taken, {}", written >> 10, if closed { "then cut off" } else { "NOT cut off" })
}

/// A WebSocket exec with a TTY to `path`'s pod whose resize channel (4) gets
/// `{` and then spaces.
async fn endless_resize(port: u16, path: &str) -> String {
    use futures::SinkExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let Some(tls) = common::kubelet::connect(port, Caller::ApiServer).await else { return "no connection".into() };
    let mut request = format!("wss://127.0.0.1{path}").into_client_request().unwrap();
    request.headers_mut().insert("Sec-WebSocket-Protocol", "v5.channel.k8s.io".parse().unwrap());
    let upgrade = tokio::time::timeout(ANSWER_LIMIT, tokio_tungstenite::client_async(request, tls)).await;
    let Ok(Ok((mut ws, _))) = upgrade else { return format!("no WebSocket session: {upgrade:?}") };
    let mut spaces = vec![b' '; 64 << 10];
    spaces[0] = 4;
    let mut written = 0usize;
    let sending = async {
        if ws.send(Message::binary(vec![4u8, b'{'])).await.is_err() {
            return;
        }
        while written < FLOOD_BYTES {
            if ws.send(Message::binary(spaces.clone())).await.is_err() {
                return;
            }
            written += spaces.len();
        }
    };
    let _ = tokio::time::timeout(ANSWER_LIMIT, sending).await;
    let mut said = String::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        use futures::StreamExt;
        while let Some(message) = ws.next().await {
            match message {
                Ok(Message::Binary(data)) if data.first() == Some(&3) => {
                    said = String::from_utf8_lossy(&data[1..]).chars().take(160).collect();
                }
                Ok(Message::Close(_)) | Err(_) => return true,
                Ok(_) => {}
            }
        }
        true
    })
    .await
    .unwrap_or(false);
    // The kubelet keeps such a stream and stops reading resizes; vmlet keeps
    // at most 4 KiB of the unfinished object (MAX_PENDING_RESIZE_BYTES).
    let outcome = if closed { "then cut off" } else { "stream kept, resizes ignored past 4 KiB" };
    format!("{} KiB of resize taken, {outcome}; error channel: {said:?}", written >> 10)
}

/// vmlet's largest VmRSS (MiB) seen every 100 ms until `stop` is set.
async fn peak_rss(pid: u32, stop: Arc<AtomicBool>) -> f64 {
    let mut peak: f64 = 0.0;
    while !stop.load(Ordering::Relaxed) {
        peak = peak.max(process::status_mib(pid, "VmRSS").unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    peak
}

/// [`EXECS_MEASURED`] `true`s in `pod` through the API server.
async fn exec_round_trips(pods: &Api<Pod>, pod: &str) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(EXECS_MEASURED);
    for _ in 0..EXECS_MEASURED {
        let start = Instant::now();
        exec_via_api(pods, pod, &["true"]).await;
        samples.push(start.elapsed());
    }
    samples
}

/// Applies VM `name` and waits for it to be Running: the time it took.
async fn create_to_running(env: &TestEnv, name: &str, spec: serde_json::Value) -> Duration {
    let start = Instant::now();
    env.apply_vm(name, spec);
    env.wait_vm_phase(name, "Running").await;
    start.elapsed()
}

#[tokio::main]
async fn main() {
    let execs: usize = common::env_or("VMLET_BENCH_EXECS", 1000);
    let followers: usize = common::env_or("VMLET_BENCH_FOLLOWERS", 600);

    let mut env = TestEnv::new("bench-hostile").await;
    let guest = common::guest_for(&env);
    env.start_vmlet(&[Host {
        uri: common::qemu_uri(),
        accelerator: Some(common::guest_accelerator(&guest)),
        ..Host::qemu("q")
    }]);
    let mut spec = common::guest_vm_spec(&guest);
    // The guest runs from its initramfs; its VMs cannot share one disk.
    spec.as_object_mut().unwrap().remove("image");
    let first = create_to_running(&env, "web", spec.clone()).await;
    let second = create_to_running(&env, "other", spec.clone()).await;
    let (web, other) = (env.pod_of("web").await, env.pod_of("other").await);
    let pods: Api<Pod> = env.pods();
    for pod in [&web, &other] {
        env.wait_for(&format!("the guest agent of {pod}"), || {
            let pods = pods.clone();
            async move {
                let mut process = pods.exec(pod, ["true"], &Default::default()).await.ok()?;
                let status = process.take_status()?.await?;
                (status.status.as_deref() == Some("Success")).then_some(())
            }
        })
        .await;
    }
    let (pid, port, ns) = (env.vmlet_pid(), env.kubelet_port, env.ns.clone());
    let idle_rss = process::status_mib(pid, "VmRSS").expect("vmlet's VmRSS");
    let idle_execs = exec_round_trips(&pods, &other).await;

    println!("hostile clients against one vmlet (kubelet API port {port}), two guests Running:");
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(peak_rss(pid, stop.clone()));
    let attack_started = Instant::now();
    let exec_path = format!("/exec/{ns}/{web}/vm?command=sleep&command=600&stdout=1");
    let logs_path = format!("/containerLogs/{ns}/{web}/vm?follow=true");
    let (exec_storm, follow_storm) =
        tokio::join!(storm(port, &exec_path, SPDY_EXEC, execs), storm(port, &logs_path, &[], followers));
    println!("  held at once after {:.1} s:", attack_started.elapsed().as_secs_f64());
    exec_storm.print(&format!("{execs} exec upgrades (SPDY):"));
    follow_storm.print(&format!("{followers} logs -f followers:"));

    // With those held: the floods, execs into the other VM, a new VM.
    let big_frame_path = format!("/exec/{ns}/{other}/vm?command=sleep&command=600&stdout=1");
    let resize_path = format!("/exec/{ns}/{other}/vm?command=sleep&command=600&stdin=1&stdout=1&tty=1");
    let (big_frame, resize, busy_execs, third) = tokio::join!(
        spdy_big_frame(port, &big_frame_path),
        endless_resize(port, &resize_path),
        exec_round_trips(&pods, &other),
        create_to_running(&env, "late", spec.clone()),
    );
    println!("  a 16 MiB SPDY data frame, 100 MiB: {big_frame}");
    println!("  an endless resize message:         {resize}");
    stop.store(true, Ordering::Relaxed);
    let peak = sampler.await.unwrap();
    drop((exec_storm, follow_storm));

    println!("vmlet memory (VmRSS, /proc/<pid>/status):");
    println!("  idle, two VMs Running:   {idle_rss:.1} MiB");
    println!("  peak under attack:       {peak:.1} MiB ({:.2}× idle; target < 2×)", peak / idle_rss);
    println!("exec `true` into the other VM through the API server:");
    report("  idle", idle_execs);
    report("  under attack", busy_execs);
    println!("create → Running on the same host:");
    println!("  first VM, idle:          {:.1} s", first.as_secs_f64());
    println!("  second VM, idle:         {:.1} s", second.as_secs_f64());
    println!("  third VM, under attack:  {:.1} s", third.as_secs_f64());
}
