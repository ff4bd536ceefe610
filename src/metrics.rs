//! vmlet's own Prometheus metrics, served as `GET /metrics` on the kubelet
//! API (text exposition format 0.0.4, through the `prometheus-client`
//! crate), as a kubelet serves its own there:
//!
//! - `vmlet_kubelet_api_requests_total{route, code}`: requests by matched
//!   route template (e.g. `/exec/{namespace}/{pod}/{container}`; `other`
//!   for paths no route matches) and HTTP status code;
//! - `vmlet_kubelet_api_streams_open`: exec and attach streams running now;
//! - `vmlet_reconciles_total{controller, result}` and
//!   `vmlet_reconcile_duration_seconds{controller}`: passes of vmlet's
//!   controllers (`virtualmachine`, `pod`, `claim`), `ok` or `error`, and
//!   how long each took (seconds);
//! - `vmlet_pods{node, phase}`: the pods on this process's nodes by phase,
//!   as of the scrape;
//! - `vmlet_controller_leader`: 1 while this process holds the controllers'
//!   election Lease and runs the controllers, else 0 ([`crate::election`]).
//!
//! The registry is process-wide ([`global`]): every part of vmlet counts
//! into the same families.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Labels of `vmlet_kubelet_api_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The matched route template, or `other`.
    pub route: String,
    /// The HTTP status code.
    pub code: u16,
}

/// Labels of `vmlet_reconciles_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    /// The controller: `virtualmachine`, `pod`, `claim`.
    pub controller: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Labels of `vmlet_reconcile_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// The controller.
    pub controller: &'static str,
}

/// Labels of `vmlet_pods`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// The node (hypervisor host).
    pub node: String,
    /// The pod's phase (`Pending`, `Running`, …; `Unknown` when it has none).
    pub phase: String,
}

/// The metric families ([`global`]).
pub struct Metrics {
    registry: Registry,
    /// `vmlet_kubelet_api_requests_total`.
    pub api_requests: Family<RequestLabels, Counter>,
    /// `vmlet_kubelet_api_streams_open`.
    pub streams_open: Gauge,
    /// `vmlet_reconciles_total`.
    pub reconciles: Family<ReconcileLabels, Counter>,
    /// `vmlet_reconcile_duration_seconds`.
    pub reconcile_seconds: Family<ControllerLabels, Histogram>,
    /// `vmlet_pods`.
    pub pods: Family<PodLabels, Gauge>,
    /// `vmlet_controller_leader`: 1 while this process leads, else 0.
    pub controller_leader: Gauge,
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("vmlet");
        let api_requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "kubelet_api_requests",
            "Kubelet API requests by matched route and HTTP status code",
            api_requests.clone(),
        );
        let streams_open = Gauge::default();
        registry.register("kubelet_api_streams_open", "Exec and attach streams running now", streams_open.clone());
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        registry.register("reconciles", "Controller passes by controller and result", reconciles.clone());
        // 1 ms to about 33 s.
        let reconcile_seconds = Family::<ControllerLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.001, 2.0, 16))) as fn() -> Histogram,
        );
        registry.register("reconcile_duration_seconds", "How long controller passes take", reconcile_seconds.clone());
        let pods = Family::<PodLabels, Gauge>::default();
        registry.register("pods", "Pods on this process's nodes by node and phase, as of the scrape", pods.clone());
        let controller_leader = Gauge::default();
        registry.register(
            "controller_leader",
            "1 while this process holds the controllers' election Lease and runs the controllers, else 0",
            controller_leader.clone(),
        );
        Metrics { registry, api_requests, streams_open, reconciles, reconcile_seconds, pods, controller_leader }
    }

    /// The registry in the text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String never fails");
        out
    }

    /// Count one pass of `controller` that ended `ok` (or not) after `seconds`.
    pub fn observe_reconcile(&self, controller: &'static str, ok: bool, seconds: f64) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles.get_or_create(&ReconcileLabels { controller, result }).inc();
        self.reconcile_seconds.get_or_create(&ControllerLabels { controller }).observe(seconds);
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// A boxed reconcile future, as [`counted`] returns it.
pub type Reconciling<E> = Pin<Box<dyn Future<Output = Result<kube::runtime::controller::Action, E>> + Send>>;

/// `reconcile`, counted and timed as passes of `controller`
/// ([`Metrics::observe_reconcile`]); for `kube::runtime::Controller::run`.
pub fn counted<K, C, E, Fut>(
    controller: &'static str,
    reconcile: impl Fn(Arc<K>, Arc<C>) -> Fut,
) -> impl Fn(Arc<K>, Arc<C>) -> Reconciling<E>
where
    Fut: Future<Output = Result<kube::runtime::controller::Action, E>> + Send + 'static,
{
    move |object, ctx| {
        let pass = reconcile(object, ctx);
        Box::pin(async move {
            let started = Instant::now();
            let result = pass.await;
            global().observe_reconcile(controller, result.is_ok(), started.elapsed().as_secs_f64());
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::controller::Action;

    #[tokio::test]
    async fn counted_passes_show_in_the_exposition_by_controller_and_result() {
        let pass = counted("test-controller", |n: Arc<u32>, _: Arc<()>| async move {
            if *n == 0 {
                Err("failed")
            } else {
                Ok(Action::await_change())
            }
        });
        pass(Arc::new(1), Arc::new(())).await.unwrap();
        pass(Arc::new(1), Arc::new(())).await.unwrap();
        pass(Arc::new(0), Arc::new(())).await.unwrap_err();
        let text = global().encode();
        assert!(text.contains("vmlet_reconciles_total{controller=\"test-controller\",result=\"ok\"} 2"), "{text}");
        assert!(text.contains("vmlet_reconciles_total{controller=\"test-controller\",result=\"error\"} 1"), "{text}");
        assert!(text.contains("vmlet_reconcile_duration_seconds_count{controller=\"test-controller\"} 3"), "{text}");
        assert!(text.contains("# TYPE vmlet_kubelet_api_streams_open gauge"), "{text}");
        assert!(text.contains("# TYPE vmlet_controller_leader gauge"), "{text}");
    }
}
