//! What the exec benchmarks share: an exec through the API server as
//! `kubectl exec` makes it, and percentiles of the round trips.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams};
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// The `p` quantile (0.0..=1.0) of `sorted` (nearest rank).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One line: `what`, the count, p50, p95 and max of `samples` in ms.
pub fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{what:<40} n={:<4} p50={:>8.1} ms  p95={:>8.1} ms  max={:>8.1} ms",
        samples.len(),
        percentile(&samples, 0.5).as_secs_f64() * 1e3,
        percentile(&samples, 0.95).as_secs_f64() * 1e3,
        samples.last().unwrap().as_secs_f64() * 1e3
    );
}

/// When each step of one exec through the API server ended, counted from
/// the call: the upgrade answered (`pods.exec` returned), stdout closed,
/// the status read from the error stream, the connection closed.
#[derive(Clone, Copy, Debug)]
pub struct Phases {
    pub upgraded: Duration,
    pub output: Duration,
    pub status: Duration,
    pub closed: Duration,
}

/// The stdout of `command` run in pod `pod` through the API server (kube-rs'
/// exec: SPDY or WebSocket as the server offers). Panics when the exec
/// cannot be made or the command fails.
pub async fn exec_via_api(pods: &Api<Pod>, pod: &str, command: &[&str]) -> Vec<u8> {
    exec_via_api_timed(pods, pod, command).await.0
}

/// [`exec_via_api`], with when each of its steps ended.
pub async fn exec_via_api_timed(pods: &Api<Pod>, pod: &str, command: &[&str]) -> (Vec<u8>, Phases) {
    let start = std::time::Instant::now();
    let params = AttachParams::default().stdin(false).stdout(true).stderr(false);
    let mut process = pods.exec(pod, command.to_vec(), &params).await.expect("exec through the API server");
    let upgraded = start.elapsed();
    let mut stdout = process.stdout().expect("stdout");
    let status = process.take_status().expect("status");
    let mut out = Vec::new();
    stdout.read_to_end(&mut out).await.unwrap();
    let output = start.elapsed();
    if let Some(status) = status.await {
        if status.status.as_deref() != Some("Success") {
            panic!("exec {command:?} failed: {:?}", status.message);
        }
    }
    let status = start.elapsed();
    process.join().await.unwrap();
    (out, Phases { upgraded, output, status, closed: start.elapsed() })
}
