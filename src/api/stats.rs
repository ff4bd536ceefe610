//! `GET /stats/summary` (the kubelet's Summary API, `stats/v1alpha1`) and
//! `GET /metrics/resource` (the Prometheus text metrics-server scrapes), from
//! the providers' per-VM [`vmlet_provider::Stats`].
//!
//! One listener serves every node of this process, so the node section of the
//! summary adds up the VMs of all of them (named after the first pod's node).

use super::routes::ApiState;
use super::PodEntry;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use vmlet_provider::{VmId, VmStats};

/// One VM's sample.
#[derive(Clone)]
pub struct Sample {
    /// The pod.
    pub entry: PodEntry,
    /// Usage.
    pub stats: VmStats,
    /// CPU rate since the previous sample of this VM, in nanocores.
    pub usage_nano_cores: Option<u64>,
}

/// Previous CPU counters, for rates.
#[derive(Default)]
pub struct RateCache {
    last: Mutex<HashMap<VmId, (Instant, u64)>>,
}

impl RateCache {
    fn rate(&self, id: &VmId, cpu_ns: u64) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock().expect("rate cache");
        let previous = last.insert(id.clone(), (now, cpu_ns));
        let (then, before) = previous?;
        let elapsed = now.duration_since(then).as_nanos() as u64;
        (elapsed > 0 && cpu_ns >= before).then(|| ((cpu_ns - before) as u128 * 1_000_000_000 / elapsed as u128) as u64)
    }
}

/// Stats of every running VM pod whose provider has the capability; VMs that
/// fail (stopped, gone) are left out, as the kubelet leaves out dead containers.
pub async fn collect(state: &ApiState) -> Vec<Sample> {
    let pods = state.directory.pods();
    let futures = pods.into_iter().filter_map(|entry| {
        let vm = entry.vm.clone()?;
        entry.provider.stats()?;
        Some(async move {
            let stats = entry.provider.stats()?.stats(&vm).await.ok()?;
            Some((entry, vm, stats))
        })
    });
    futures::future::join_all(futures)
        .await
        .into_iter()
        .flatten()
        .map(|(entry, vm, stats)| {
            let usage_nano_cores = state.rates.rate(&vm, stats.cpu_usage_ns);
            Sample { entry, stats, usage_nano_cores }
        })
        .collect()
}

fn start_time(entry: &PodEntry) -> Option<String> {
    entry.pod.status.as_ref()?.start_time.as_ref().map(|t| t.0.to_string())
}

/// The Summary API document.
pub fn summary(samples: &[Sample], now: Timestamp) -> serde_json::Value {
    let time = now.to_string();
    let usage = |s: &Sample| {
        let mut cpu = json!({"time": time, "usageCoreNanoSeconds": s.stats.cpu_usage_ns});
        if let Some(rate) = s.usage_nano_cores {
            cpu["usageNanoCores"] = json!(rate);
        }
        let memory = json!({"time": time, "workingSetBytes": s.stats.memory_working_set_bytes});
        (cpu, memory)
    };
    let pods: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| {
            let (cpu, memory) = usage(s);
            let meta = &s.entry.pod.metadata;
            json!({
                "podRef": {
                    "name": meta.name.clone().unwrap_or_default(),
                    "namespace": meta.namespace.clone().unwrap_or_default(),
                    "uid": meta.uid.clone().unwrap_or_default(),
                },
                "startTime": start_time(&s.entry),
                "containers": [{
                    "name": crate::vmpod::CONTAINER_NAME,
                    "startTime": start_time(&s.entry),
                    "cpu": cpu,
                    "memory": memory,
                }],
                "cpu": cpu,
                "memory": memory,
            })
        })
        .collect();
    let cpu_total: u64 = samples.iter().map(|s| s.stats.cpu_usage_ns).sum();
    let rate_total: Option<u64> = samples.iter().map(|s| s.usage_nano_cores).sum();
    let memory_total: u64 = samples.iter().map(|s| s.stats.memory_working_set_bytes).sum();
    let mut node_cpu = json!({"time": time, "usageCoreNanoSeconds": cpu_total});
    if let Some(rate) = rate_total {
        node_cpu["usageNanoCores"] = json!(rate);
    }
    json!({
        "node": {
            "nodeName": samples.first().map(|s| s.entry.node.clone()).unwrap_or_default(),
            "cpu": node_cpu,
            "memory": {"time": time, "workingSetBytes": memory_total},
        },
        "pods": pods,
    })
}

fn escape(label: &str) -> String {
    label.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The `/metrics/resource` text (Prometheus exposition format 0.0.4).
pub fn resource_metrics(samples: &[Sample], now: Timestamp) -> String {
    let ms = now.as_millisecond();
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(&Sample) -> String, pod_level: bool| {
        out.push_str(&format!("# HELP {name} [STABLE] {help}\n# TYPE {name} {kind}\n"));
        for s in samples {
            let meta = &s.entry.pod.metadata;
            let (ns, pod) =
                (escape(meta.namespace.as_deref().unwrap_or("")), escape(meta.name.as_deref().unwrap_or("")));
            let labels = if pod_level {
                format!("namespace=\"{ns}\",pod=\"{pod}\"")
            } else {
                format!("container=\"{}\",namespace=\"{ns}\",pod=\"{pod}\"", crate::vmpod::CONTAINER_NAME)
            };
            out.push_str(&format!("{name}{{{labels}}} {} {ms}\n", value(s)));
        }
    };
    let cpu = |s: &Sample| format!("{}", s.stats.cpu_usage_ns as f64 / 1e9);
    let memory = |s: &Sample| s.stats.memory_working_set_bytes.to_string();
    family(
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
        &cpu,
        false,
    );
    family(
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
        &memory,
        false,
    );
    family(
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
        &cpu,
        true,
    );
    family("pod_memory_working_set_bytes", "gauge", "Current working set of the pod in bytes", &memory, true);
    let cpu_total: u64 = samples.iter().map(|s| s.stats.cpu_usage_ns).sum();
    let memory_total: u64 = samples.iter().map(|s| s.stats.memory_working_set_bytes).sum();
    out.push_str(&format!(
        "# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the node in core-seconds\n\
         # TYPE node_cpu_usage_seconds_total counter\nnode_cpu_usage_seconds_total {} {ms}\n\
         # HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes\n\
         # TYPE node_memory_working_set_bytes gauge\nnode_memory_working_set_bytes {memory_total} {ms}\n\
         # HELP scrape_error [ALPHA] 1 if there was an error while getting container metrics, 0 otherwise\n\
         # TYPE scrape_error gauge\nscrape_error 0\n",
        cpu_total as f64 / 1e9
    ));
    out
}

/// `GET /stats/summary`.
pub async fn get_summary(State(state): State<ApiState>) -> Response {
    let samples = collect(&state).await;
    axum::Json(summary(&samples, Timestamp::now())).into_response()
}

/// `GET /metrics/resource`.
pub async fn get_resource_metrics(State(state): State<ApiState>) -> Response {
    let samples = collect(&state).await;
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        resource_metrics(&samples, Timestamp::now()),
    )
        .into_response()
}
