//! `GET /stats/summary` (the kubelet's Summary API, `stats/v1alpha1`) and
//! `GET /metrics/resource` (the Prometheus text metrics-server scrapes), from
//! the providers' per-VM [`vmlet_provider::Stats`].
//!
//! Each node has its own listener ([`super::ForNode`], the request's
//! [`super::routes::Scope`]), so the figures are that node's: its VMs, and the node section adds up theirs (a hypervisor
//! host's own usage outside its VMs is not known to vmlet). A listener that
//! spans all nodes (a process without nodes, tests) adds up all it sees.

use super::routes::ApiState;
use super::PodEntry;
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

/// Previous CPU counters, for rates: by node and VM, as one cache serves
/// every node's listener and two hosts may use the same VM id.
#[derive(Default)]
pub struct RateCache {
    last: Mutex<HashMap<(String, VmId), (Instant, u64)>>,
}

impl RateCache {
    fn rate(&self, node: &str, id: &VmId, cpu_ns: u64) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock().expect("rate cache");
        let previous = last.insert((node.to_owned(), id.clone()), (now, cpu_ns));
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
            let usage_nano_cores = state.rates.rate(&entry.node, &vm, stats.cpu_usage_ns);
            Sample { entry, stats, usage_nano_cores }
        })
        .collect()
}

fn start_time(entry: &PodEntry) -> Option<String> {
    entry.pod.status.as_ref()?.start_time.as_ref().map(|t| t.0.to_string())
}

/// The Summary API document of node `node` (`None`: named after the first
/// sample's node, for a listener that spans all nodes) from its VMs'
/// `samples`.
pub fn summary(node: Option<&str>, samples: &[Sample], now: Timestamp) -> serde_json::Value {
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
            "nodeName": node.map(str::to_owned).or_else(|| samples.first().map(|s| s.entry.node.clone())).unwrap_or_default(),
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
pub async fn get_summary(state: ApiState) -> Response {
    let samples = collect(&state).await;
    axum::Json(summary(state.directory.node(), &samples, Timestamp::now())).into_response()
}

/// `GET /metrics/resource`.
pub async fn get_resource_metrics(state: ApiState) -> Response {
    let samples = collect(&state).await;
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        resource_metrics(&samples, Timestamp::now()),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::routes::{RouterState, Scope};
    use crate::api::{AuthorizationMode, ForNode, PodDirectory};
    use crate::testing::StatsHost;
    use axum::body::Body;
    use axum::http::Request;
    use std::sync::Arc;
    use tower::ServiceExt;

    /// VM pods `(name, node)` of namespace `ns`, VM id `uid-<name>`, each
    /// node's provider running its own VMs.
    struct TwoHosts(Vec<PodEntry>);

    impl TwoHosts {
        fn new(pods: &[(&str, &str, u64)]) -> Self {
            let providers: HashMap<&str, Arc<StatsHost>> = ["host-a", "host-b"]
                .into_iter()
                .map(|node| {
                    let vms: Vec<(String, u64)> = pods
                        .iter()
                        .filter(|(_, n, _)| *n == node)
                        .map(|(name, _, cpu)| (format!("uid-{name}"), *cpu))
                        .collect();
                    let vms: Vec<(&str, u64)> = vms.iter().map(|(id, cpu)| (id.as_str(), *cpu)).collect();
                    (node, Arc::new(StatsHost::new(&vms)))
                })
                .collect();
            TwoHosts(
                pods.iter()
                    .map(|(name, node, _)| {
                        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
                            "metadata": {"name": name, "namespace": "ns", "uid": format!("pod-{name}")},
                            "spec": {"nodeName": node, "containers": [{"name": "vm", "image": "vm"}]},
                        }))
                        .unwrap();
                        PodEntry {
                            pod: Arc::new(pod),
                            node: (*node).to_owned(),
                            provider: providers[node].clone(),
                            vm: Some(VmId(format!("uid-{name}"))),
                            task: false,
                            log_dir: "/nonexistent".into(),
                        }
                    })
                    .collect(),
            )
        }
    }

    impl PodDirectory for TwoHosts {
        fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry> {
            self.0
                .iter()
                .find(|e| {
                    e.pod.metadata.namespace.as_deref() == Some(namespace)
                        && e.pod.metadata.name.as_deref() == Some(name)
                })
                .cloned()
        }
        fn pods(&self) -> Vec<PodEntry> {
            self.0.clone()
        }
    }

    /// `GET path` on the listener of `node` over `directory`, anonymous and
    /// always allowed (no API server in unit tests): status and body.
    async fn get(directory: Arc<dyn PodDirectory>, node: &str, path: &str) -> (u16, String) {
        let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
        let auth = crate::api::auth::Auth::new(client, true, AuthorizationMode::AlwaysAllow);
        let slots = crate::api::slots::StreamSlots::new(1, 1);
        let scoped = Arc::new(ForNode::new(directory, node));
        let router = crate::api::routes::router(RouterState::new(Arc::new(auth), Arc::new(slots)));
        let request = Request::get(path).extension(Scope(scoped)).body(Body::empty()).unwrap();
        let response = router.oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn each_nodes_listener_sums_only_its_own_vms() {
        let directory: Arc<dyn PodDirectory> = Arc::new(TwoHosts::new(&[
            ("a1", "host-a", 1_000_000_000),
            ("a2", "host-a", 500_000_000),
            ("b1", "host-b", 4_000_000_000),
        ]));
        let (status, body) = get(directory.clone(), "host-a", "/stats/summary").await;
        assert_eq!(status, 200, "{body}");
        let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(summary["node"]["nodeName"], "host-a");
        assert_eq!(summary["node"]["cpu"]["usageCoreNanoSeconds"], 1_500_000_000u64);
        assert_eq!(summary["node"]["memory"]["workingSetBytes"], 2u64 << 20);
        let mut pods: Vec<&str> =
            summary["pods"].as_array().unwrap().iter().map(|p| p["podRef"]["name"].as_str().unwrap()).collect();
        pods.sort();
        assert_eq!(pods, ["a1", "a2"]);

        let (_, body) = get(directory.clone(), "host-b", "/stats/summary").await;
        let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(summary["node"]["nodeName"], "host-b");
        assert_eq!(summary["node"]["cpu"]["usageCoreNanoSeconds"], 4_000_000_000u64);
        assert_eq!(summary["pods"].as_array().unwrap().len(), 1);
        assert_eq!(summary["pods"][0]["podRef"]["name"], "b1");

        let (status, text) = get(directory.clone(), "host-b", "/metrics/resource").await;
        assert_eq!(status, 200);
        assert!(text.contains("\nnode_cpu_usage_seconds_total 4 "), "{text}");
        assert!(text.contains("pod_cpu_usage_seconds_total{namespace=\"ns\",pod=\"b1\"} 4 "), "{text}");
        assert!(!text.contains("pod=\"a1\""), "{text}");
    }

    #[tokio::test]
    async fn a_request_without_its_listeners_scope_is_refused_and_reveals_nothing() {
        let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
        let auth = crate::api::auth::Auth::new(client, true, AuthorizationMode::AlwaysAllow);
        let router = crate::api::routes::router(RouterState::new(
            Arc::new(auth),
            Arc::new(crate::api::slots::StreamSlots::new(1, 1)),
        ));
        for path in ["/pods", "/stats/summary", "/containerLogs/ns/a1/vm", "/exec/ns/a1/vm?command=id&stdout=1"] {
            let response = router.clone().oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
            assert_eq!(response.status().as_u16(), 500, "{path}");
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            assert_eq!(&body[..], b"this request has no node scope; refused\n", "{path}");
        }
    }

    #[test]
    fn rates_of_two_nodes_vms_with_one_id_are_kept_apart() {
        let rates = RateCache::default();
        let id = VmId("same".into());
        assert_eq!(rates.rate("host-a", &id, 1_000), None, "a first sample has no rate");
        assert_eq!(rates.rate("host-b", &id, 9_000_000_000), None, "nor has host-b's first, whatever host-a's was");
        // Keyed by VM id alone, host-a's counter would be compared with
        // host-b's (lower than it: no rate).
        assert_eq!(rates.rate("host-a", &id, 1_000), Some(0), "host-a's VM used nothing since its own last sample");
    }

    #[tokio::test]
    async fn a_node_without_vms_names_itself_with_zero_usage() {
        let directory: Arc<dyn PodDirectory> = Arc::new(TwoHosts::new(&[("a1", "host-a", 1)]));
        let (_, body) = get(directory, "host-b", "/stats/summary").await;
        let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(summary["node"]["nodeName"], "host-b", "metrics-server files it under the node it asked");
        assert_eq!(summary["node"]["cpu"]["usageCoreNanoSeconds"], 0);
        assert_eq!(summary["pods"], json!([]));
    }

    #[tokio::test]
    async fn a_pod_of_another_node_is_not_found_on_this_nodes_listener() {
        let directory: Arc<dyn PodDirectory> = Arc::new(TwoHosts::new(&[("a1", "host-a", 1), ("b1", "host-b", 1)]));
        let (status, body) = get(directory.clone(), "host-b", "/containerLogs/ns/a1/vm").await;
        assert_eq!(status, 404, "{body}");
        let (status, body) = get(directory.clone(), "host-b", "/pods").await;
        assert_eq!(status, 200);
        let list: serde_json::Value = serde_json::from_str(&body).unwrap();
        let names: Vec<&str> =
            list["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["b1"]);
        let (status, _) = get(directory, "host-b", "/healthz").await;
        assert_eq!(status, 200);
    }
}
