//! vmlet's own Prometheus metrics, served as `GET /metrics` on the kubelet
//! API (text exposition format 0.0.4, through the `prometheus-client`
//! crate), as a kubelet serves its own there:
//!
//! - `vmlet_kubelet_api_requests_total{route, code}`: requests by matched
//!   route template (e.g. `/exec/{namespace}/{pod}/{container}`; `other`
//!   for paths no route matches) and HTTP status code;
//! - `vmlet_kubelet_api_streams_open`: exec, attach and port-forward streams running now;
//! - `vmlet_reconciles_total{controller, result}` and
//!   `vmlet_reconcile_duration_seconds{controller}`: passes of vmlet's
//!   controllers (`virtualmachine`, `pod`, `claim`), `ok` or `error`, and
//!   how long each took (seconds);
//! - `vmlet_pods{node, phase}`: the pods on this process's nodes by phase,
//!   as of the scrape;
//! - `vmlet_controller_leader`: 1 while this process holds the controllers'
//!   election Lease and runs the controllers, else 0 ([`crate::election`]);
//! - `vmlet_provider_call_duration_seconds{node, backend, operation, result}`:
//!   how long each call of a host's provider took (seconds), by the host's
//!   node, the back end ([`vmlet_provider::Provider::kind`]), the operation
//!   (the trait method, e.g. `ensure_defined`, `stats`, `migrate`) and its
//!   result, `ok` or the error's [`vmlet_provider::ErrorKind`] (`Transient`,
//!   `NotFound`, …); measured in one place, [`crate::node::measured`];
//! - `vmlet_workqueue_depth{controller, node}`: objects a work queue fed from
//!   the shared watches ([`crate::watches`]) was told about and whose pass has
//!   not started yet ([`QueueDepth`]): the `pod` queue of each node's agent
//!   and the `virtualmachine` controller's queue (no `node` label).
//!
//! The registry is process-wide ([`global`]): every part of vmlet counts
//! into the same families.

use futures::{Stream, StreamExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::Resource;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::HashSet;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use vmlet_provider::ErrorKind;

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

/// Labels of `vmlet_provider_call_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderCallLabels {
    /// The node (hypervisor host) whose provider was called.
    pub node: String,
    /// The back end ([`vmlet_provider::Provider::kind`]): `libvirt`, `openstack`, …
    pub backend: &'static str,
    /// The provider operation: the trait method's name, e.g. `ensure_defined`.
    pub operation: &'static str,
    /// `ok`, or the error's kind ([`error_kind_label`]).
    pub result: &'static str,
}

/// Labels of `vmlet_workqueue_depth`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// The controller that drains the queue: `pod` (a node agent's), `virtualmachine`.
    pub controller: &'static str,
    /// The node whose agent owns the queue; `None` (encoded `node=""`, which
    /// Prometheus reads as no label) for a process-wide controller.
    pub node: Option<String>,
}

/// The `result` label of a provider call that failed with `kind`: the kind's
/// name as [`ErrorKind`] spells it (`Transient`, `NotFound`, …).
pub fn error_kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotFound => "NotFound",
        ErrorKind::InvalidInput => "InvalidInput",
        ErrorKind::Unsupported => "Unsupported",
        ErrorKind::Transient => "Transient",
        ErrorKind::Conflict => "Conflict",
        ErrorKind::PermissionDenied => "PermissionDenied",
        ErrorKind::QuotaExceeded => "QuotaExceeded",
        ErrorKind::Permanent => "Permanent",
    }
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
    /// `vmlet_provider_call_duration_seconds`.
    pub provider_calls: Family<ProviderCallLabels, Histogram>,
    /// `vmlet_workqueue_depth`.
    pub queue_depth: Family<QueueLabels, Gauge>,
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
        registry.register(
            "kubelet_api_streams_open",
            "Exec, attach and port-forward streams running now",
            streams_open.clone(),
        );
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
        // 1 ms to about 149 s, each bucket 2.5 times the one before: a
        // domain lookup takes milliseconds, a live migration minutes.
        let provider_calls = Family::<ProviderCallLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.001, 2.5, 14))) as fn() -> Histogram,
        );
        registry.register(
            "provider_call_duration_seconds",
            "How long calls of a host's provider take, by node, back end, operation and result (ok or the error kind)",
            provider_calls.clone(),
        );
        let queue_depth = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "workqueue_depth",
            "Objects a work queue was told about whose pass has not started yet, by controller and node",
            queue_depth.clone(),
        );
        Metrics {
            registry,
            api_requests,
            streams_open,
            reconciles,
            reconcile_seconds,
            pods,
            controller_leader,
            provider_calls,
            queue_depth,
        }
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

impl Metrics {
    /// Count one provider call of `node`'s `backend` that took `elapsed` and
    /// ended with `error` (`None`: it succeeded).
    pub fn observe_provider_call(
        &self,
        node: &str,
        backend: &'static str,
        operation: &'static str,
        error: Option<ErrorKind>,
        elapsed: Duration,
    ) {
        let result = error.map_or("ok", error_kind_label);
        let labels = ProviderCallLabels { node: node.to_owned(), backend, operation, result };
        self.provider_calls.get_or_create(&labels).observe(elapsed.as_secs_f64());
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

/// The pending objects of one work queue, published as
/// `vmlet_workqueue_depth{controller, node}`.
///
/// kube-runtime's `Controller` keeps its queue to itself, so the depth is
/// measured around it, for the controllers fed from the shared watches
/// ([`crate::watches::Triggers`]):
/// - an object counts from when a trigger for it reaches the controller
///   ([`QueueDepth::track`]) until a pass over it starts
///   ([`QueueDepth::counted`]), as client-go's `workqueue_depth` counts keys
///   added and not yet taken by a worker;
/// - several triggers of one object before its pass count once (the queue
///   merges them too); a trigger while the object's pass runs counts until
///   the next pass starts;
/// - an object that left the watch cache before its pass is not counted
///   (the controller skips it), checked at every change of the count;
/// - requeues the controller schedules itself (`Action::requeue`, the
///   backoff after an error) are not counted while they wait for their time,
///   as client-go's delaying queue does not count them before they are due.
///
/// Dropping it (the controller stopped, e.g. the process stepped down as
/// leader) sets its gauge to 0.
pub struct QueueDepth<K: Resource<DynamicType = ()> + Clone + 'static> {
    gauge: Gauge,
    controller: &'static str,
    store: Store<K>,
    pending: Mutex<HashSet<ObjectRef<K>>>,
}

impl<K> QueueDepth<K>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    /// The depth of the queue `labels` names, over the controller's watch
    /// cache `store` (where it looks objects up).
    pub fn new(labels: QueueLabels, store: Store<K>) -> Arc<Self> {
        let gauge = global().queue_depth.get_or_create(&labels).clone();
        gauge.set(0);
        Arc::new(QueueDepth { gauge, controller: labels.controller, store, pending: Mutex::default() })
    }

    /// `triggers`, each counted as pending as it passes to the controller.
    pub fn track(self: &Arc<Self>, triggers: impl Stream<Item = ObjectRef<K>>) -> impl Stream<Item = ObjectRef<K>> {
        let depth = Arc::clone(self);
        triggers.map(move |object| {
            depth.pending.lock().expect("queue depth poisoned").insert(object.clone());
            depth.publish();
            object
        })
    }

    /// `reconcile`, counted and timed as passes of this queue's controller
    /// ([`counted`]), and each object no longer pending once its pass starts.
    pub fn counted<C, E, Fut>(
        self: Arc<Self>,
        reconcile: impl Fn(Arc<K>, Arc<C>) -> Fut,
    ) -> impl Fn(Arc<K>, Arc<C>) -> Reconciling<E>
    where
        Fut: Future<Output = Result<kube::runtime::controller::Action, E>> + Send + 'static,
    {
        let passes = counted(self.controller, reconcile);
        move |object, ctx| {
            self.pending.lock().expect("queue depth poisoned").remove(&ObjectRef::from_obj(&*object));
            self.publish();
            passes(object, ctx)
        }
    }

    /// The objects pending now (those still in the cache).
    pub fn depth(&self) -> usize {
        self.publish()
    }

    /// Forget objects that left the cache, set the gauge; the count.
    fn publish(&self) -> usize {
        let mut pending = self.pending.lock().expect("queue depth poisoned");
        pending.retain(|object| self.store.get(object).is_some());
        self.gauge.set(pending.len() as i64);
        pending.len()
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Drop for QueueDepth<K> {
    fn drop(&mut self) {
        self.gauge.set(0);
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

    fn pod(name: &str) -> k8s_openapi::api::core::v1::Pod {
        let mut pod = k8s_openapi::api::core::v1::Pod::default();
        pod.metadata.name = Some(name.to_owned());
        pod.metadata.namespace = Some("ns".to_owned());
        pod
    }

    fn depth_line(text: &str) -> Option<&str> {
        text.lines().find(|l| l.starts_with("vmlet_workqueue_depth{controller=\"test-queue\",node=\"host-q\"}"))
    }

    #[tokio::test]
    async fn queue_depth_counts_each_triggered_object_once_until_its_pass_starts() {
        use futures::StreamExt;
        use kube::runtime::watcher::Event;
        let (store, mut writer) = kube::runtime::reflector::store();
        for name in ["a", "b"] {
            writer.apply_watcher_event(&Event::Apply(pod(name)));
        }
        let labels = QueueLabels { controller: "test-queue", node: Some("host-q".to_owned()) };
        let queue = QueueDepth::new(labels, store);
        // `a` twice (merged), `b`, and `gone`, which is in no cache: the
        // controller would skip it.
        let triggers = ["a", "a", "b", "gone"].map(|n| ObjectRef::from_obj(&pod(n)));
        let passed: Vec<_> = queue.track(futures::stream::iter(triggers)).collect().await;
        assert_eq!(passed.len(), 4, "every trigger still reaches the controller");
        assert_eq!(queue.depth(), 2);
        assert_eq!(
            depth_line(&global().encode()),
            Some("vmlet_workqueue_depth{controller=\"test-queue\",node=\"host-q\"} 2")
        );

        let pass = Arc::clone(&queue).counted(|_: Arc<k8s_openapi::api::core::v1::Pod>, _: Arc<()>| async {
            Ok::<_, &str>(Action::await_change())
        });
        pass(Arc::new(pod("a")), Arc::new(())).await.unwrap();
        assert_eq!(queue.depth(), 1, "a's pass started");
        assert!(global().encode().contains("vmlet_reconciles_total{controller=\"test-queue\",result=\"ok\"} 1"));

        writer.apply_watcher_event(&Event::Delete(pod("b")));
        assert_eq!(queue.depth(), 0, "b left the cache before its pass");
        assert_eq!(
            depth_line(&global().encode()),
            Some("vmlet_workqueue_depth{controller=\"test-queue\",node=\"host-q\"} 0")
        );

        let _ = queue.track(futures::stream::iter([ObjectRef::from_obj(&pod("a"))])).collect::<Vec<_>>().await;
        assert_eq!(queue.depth(), 1);
        drop(pass);
        drop(queue);
        assert_eq!(
            depth_line(&global().encode()),
            Some("vmlet_workqueue_depth{controller=\"test-queue\",node=\"host-q\"} 0"),
            "a stopped controller's queue reads 0"
        );
    }

    #[test]
    fn provider_calls_are_labelled_ok_or_by_error_kind() {
        let metrics = global();
        metrics.observe_provider_call("kind-host", "test", "get", None, Duration::from_millis(3));
        metrics.observe_provider_call("kind-host", "test", "get", Some(ErrorKind::Conflict), Duration::from_secs(2));
        let text = metrics.encode();
        let series = |result: &str, suffix: &str| {
            format!(
                "vmlet_provider_call_duration_seconds_{suffix}{{node=\"kind-host\",backend=\"test\",operation=\"get\",result=\"{result}\"}}"
            )
        };
        assert!(text.contains(&format!("{} 1\n", series("ok", "count"))), "{text}");
        assert!(text.contains(&format!("{} 0.003\n", series("ok", "sum"))), "{text}");
        assert!(text.contains(&format!("{} 2.0\n", series("Conflict", "sum"))), "{text}");
        // 3 ms is above the 1 ms and 2.5 ms bounds and within 6.25 ms.
        let bucket = |le: &str| {
            format!(
                "vmlet_provider_call_duration_seconds_bucket{{le=\"{le}\",node=\"kind-host\",backend=\"test\",operation=\"get\",result=\"ok\"}}"
            )
        };
        assert!(text.contains(&format!("{} 0\n", bucket("0.0025"))), "{text}");
        assert!(text.contains(&format!("{} 1\n", bucket("0.00625"))), "{text}");
    }
}
