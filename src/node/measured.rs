//! Every call of a host's provider, timed in one place: [`Measured`] wraps
//! the host's [`Provider`] when its agent starts ([`super::run`]), so the
//! agent, its flows, the kubelet API and the release loop all call through
//! it, and no call site carries timing code.
//!
//! Each call is observed as `vmlet_provider_call_duration_seconds{node,
//! backend, operation, result}` ([`crate::metrics`]): `backend` is the
//! provider's own [`Provider::kind`] (the core names none), `operation` the
//! trait method's name, `result` `ok` or the error's kind.
//!
//! Measured: the core trait's calls, and the capabilities' request/answer
//! calls: `stats`, `resize`, `migrate`, `migration_progress`,
//! `console_output`. Passed through unmeasured, because their duration is
//! a session's or a copy's length and no latency: console `attach`, guest
//! `exec`, and the backup, snapshot, host-image and volume capabilities
//! (their tasks report their own progress and outcome).
//!
//! Keep it whole: a method added to [`Provider`] with a default body must be
//! forwarded here too, or the wrapped provider's answer is hidden behind the
//! default (the compiler does not ask for it). Every method is forwarded
//! today.

use async_trait::async_trait;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmlet_provider::{
    Backup, Console, ConsoleChunk, GuestExec, HostImages, HostInfo, ImageReference, Location, Migration, MigrationMode,
    MigrationProgress, MigrationTarget, PortForward, Provider, Resize, ResizeScope, Resources, Result, Snapshots,
    Stats, StreamIo, VmId, VmSpec, VmStats, VmStatus, Volumes,
};

/// Where each measured call is counted.
struct Timer {
    node: String,
    backend: &'static str,
}

impl Timer {
    async fn time<T>(&self, operation: &'static str, call: impl Future<Output = Result<T>>) -> Result<T> {
        let started = Instant::now();
        let result = call.await;
        self.observe(operation, result.as_ref().err().map(|e| e.kind), started.elapsed());
        result
    }

    fn observe(&self, operation: &'static str, error: Option<vmlet_provider::ErrorKind>, elapsed: Duration) {
        crate::metrics::global().observe_provider_call(&self.node, self.backend, operation, error, elapsed);
    }
}

/// A host's provider whose calls are timed ([`crate::metrics`]); otherwise
/// it answers exactly as the provider it wraps, capabilities included.
pub struct Measured {
    inner: Arc<dyn Provider>,
    timer: Arc<Timer>,
    stats: MeasuredStats,
    resize: MeasuredResize,
    migration: MeasuredMigration,
    console: MeasuredConsole,
}

impl Measured {
    /// `inner`, the provider of node `node`, with its calls timed.
    pub fn new(inner: Arc<dyn Provider>, node: &str) -> Measured {
        let timer = Arc::new(Timer { node: node.to_owned(), backend: inner.kind() });
        let part = || Part { inner: Arc::clone(&inner), timer: Arc::clone(&timer) };
        Measured {
            stats: MeasuredStats(part()),
            resize: MeasuredResize(part()),
            migration: MeasuredMigration(part()),
            console: MeasuredConsole(part()),
            inner,
            timer,
        }
    }

    /// `provider` wrapped for node `node`, as an `Arc<dyn Provider>`.
    pub fn wrap(provider: Arc<dyn Provider>, node: &str) -> Arc<dyn Provider> {
        Arc::new(Measured::new(provider, node))
    }
}

/// What a capability wrapper holds: the provider (whose capability it calls)
/// and the timer.
struct Part {
    inner: Arc<dyn Provider>,
    timer: Arc<Timer>,
}

/// An error for a capability the wrapped provider stopped offering between
/// the caller's `Provider::stats()` (etc.) and its call.
fn gone(operation: &'static str) -> vmlet_provider::Error {
    vmlet_provider::Error::new(
        operation,
        vmlet_provider::ErrorKind::Unsupported,
        "the provider no longer offers this capability",
    )
}

#[async_trait]
impl Provider for Measured {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn ping(&self) -> Result<()> {
        self.timer.time("ping", self.inner.ping()).await
    }

    async fn host_info(&self) -> Result<HostInfo> {
        self.timer.time("host_info", self.inner.host_info()).await
    }

    async fn list(&self) -> Result<Vec<VmStatus>> {
        self.timer.time("list", self.inner.list()).await
    }

    async fn get(&self, id: &VmId) -> Result<Option<VmStatus>> {
        self.timer.time("get", self.inner.get(id)).await
    }

    async fn locate(&self, id: &VmId, backend_name: &str) -> Result<Location> {
        self.timer.time("locate", self.inner.locate(id, backend_name)).await
    }

    async fn ensure_defined(&self, spec: &VmSpec) -> Result<VmStatus> {
        self.timer.time("ensure_defined", self.inner.ensure_defined(spec)).await
    }

    async fn start(&self, id: &VmId) -> Result<()> {
        self.timer.time("start", self.inner.start(id)).await
    }

    async fn shutdown(&self, id: &VmId) -> Result<()> {
        self.timer.time("shutdown", self.inner.shutdown(id)).await
    }

    async fn destroy(&self, id: &VmId) -> Result<()> {
        self.timer.time("destroy", self.inner.destroy(id)).await
    }

    fn backend_host(&self) -> Option<String> {
        self.inner.backend_host()
    }

    fn image_reference(&self) -> ImageReference {
        self.inner.image_reference()
    }

    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<vmlet_provider::Change>> {
        self.inner.changes()
    }

    fn console(&self) -> Option<&dyn Console> {
        self.inner.console().map(|_| &self.console as &dyn Console)
    }

    fn guest_exec(&self) -> Option<&dyn GuestExec> {
        self.inner.guest_exec()
    }

    fn port_forward(&self) -> Option<&dyn PortForward> {
        self.inner.port_forward()
    }

    fn stats(&self) -> Option<&dyn Stats> {
        self.inner.stats().map(|_| &self.stats as &dyn Stats)
    }

    fn resize(&self) -> Option<&dyn Resize> {
        self.inner.resize().map(|_| &self.resize as &dyn Resize)
    }

    fn migration(&self) -> Option<&dyn Migration> {
        self.inner.migration().map(|_| &self.migration as &dyn Migration)
    }

    fn backup(&self) -> Option<&dyn Backup> {
        self.inner.backup()
    }

    fn snapshots(&self) -> Option<&dyn Snapshots> {
        self.inner.snapshots()
    }

    fn host_images(&self) -> Option<&dyn HostImages> {
        self.inner.host_images()
    }

    fn volumes(&self) -> Option<&dyn Volumes> {
        self.inner.volumes()
    }

    async fn undefine(&self, id: &VmId) -> Result<()> {
        self.timer.time("undefine", self.inner.undefine(id)).await
    }
}

struct MeasuredStats(Part);

#[async_trait]
impl Stats for MeasuredStats {
    async fn stats(&self, id: &VmId) -> Result<VmStats> {
        let Some(stats) = self.0.inner.stats() else { return Err(gone("stats")) };
        self.0.timer.time("stats", stats.stats(id)).await
    }
}

struct MeasuredResize(Part);

#[async_trait]
impl Resize for MeasuredResize {
    async fn resize(&self, id: &VmId, to: Resources, ceilings: Resources, scope: ResizeScope) -> Result<()> {
        let Some(resize) = self.0.inner.resize() else { return Err(gone("resize")) };
        self.0.timer.time("resize", resize.resize(id, to, ceilings, scope)).await
    }
}

struct MeasuredMigration(Part);

#[async_trait]
impl Migration for MeasuredMigration {
    fn target(&self) -> MigrationTarget {
        // Only called after `migration()` answered Some; an empty address
        // makes a migration to this host fail with InvalidInput.
        self.0
            .inner
            .migration()
            .map(|m| m.target())
            .unwrap_or_else(|| MigrationTarget { host: self.0.timer.node.clone(), address: String::new() })
    }

    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()> {
        let Some(migration) = self.0.inner.migration() else { return Err(gone("migrate")) };
        self.0.timer.time("migrate", migration.migrate(id, to, mode, timeout)).await
    }

    async fn progress(&self, id: &VmId) -> Result<Option<MigrationProgress>> {
        let Some(migration) = self.0.inner.migration() else { return Err(gone("migration_progress")) };
        self.0.timer.time("migration_progress", migration.progress(id)).await
    }
}

struct MeasuredConsole(Part);

#[async_trait]
impl Console for MeasuredConsole {
    async fn console_output(&self, id: &VmId, offset: u64, max_bytes: usize) -> Result<ConsoleChunk> {
        let Some(console) = self.0.inner.console() else { return Err(gone("console_output")) };
        self.0.timer.time("console_output", console.console_output(id, offset, max_bytes)).await
    }

    async fn attach(&self, id: &VmId, io: StreamIo) -> Result<()> {
        let Some(console) = self.0.inner.console() else { return Err(gone("attach")) };
        console.attach(id, io).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::StatsHost;
    use vmlet_provider::ErrorKind;

    #[tokio::test]
    async fn calls_are_counted_by_node_backend_operation_and_result_and_answer_unchanged() {
        let provider = Measured::wrap(Arc::new(StatsHost::new(&[("up", 7)])), "measured-host");
        assert_eq!(provider.kind(), "statshost");
        provider.ping().await.unwrap();
        provider.ping().await.unwrap();
        assert_eq!(provider.start(&VmId("x".into())).await.unwrap_err().kind, ErrorKind::NotFound);
        let stats = provider.stats().expect("the wrapped provider has stats");
        assert_eq!(stats.stats(&VmId("up".into())).await.unwrap().cpu_usage_ns, 7);
        assert_eq!(stats.stats(&VmId("down".into())).await.unwrap_err().kind, ErrorKind::Transient);
        assert!(provider.console().is_none(), "no capability appears that the provider lacks");
        assert!(provider.resize().is_none());
        assert!(provider.migration().is_none());

        let text = crate::metrics::global().encode();
        let count = |operation: &str, result: &str| {
            format!(
                "vmlet_provider_call_duration_seconds_count{{node=\"measured-host\",backend=\"statshost\",\
                 operation=\"{operation}\",result=\"{result}\"}} "
            )
        };
        assert!(text.contains(&format!("{}2\n", count("ping", "ok"))), "{text}");
        assert!(text.contains(&format!("{}1\n", count("start", "NotFound"))), "{text}");
        assert!(text.contains(&format!("{}1\n", count("stats", "ok"))), "{text}");
        assert!(text.contains(&format!("{}1\n", count("stats", "Transient"))), "{text}");
        // Bucket bounds are cumulative: a ping of this in-memory host takes
        // well under the top bound, so both pings are in the +Inf bucket
        // and in the 149 s one.
        assert!(
            text.contains(
                "vmlet_provider_call_duration_seconds_bucket{le=\"+Inf\",node=\"measured-host\",backend=\"statshost\",\
                 operation=\"ping\",result=\"ok\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("# TYPE vmlet_provider_call_duration_seconds histogram"), "{text}");
    }
}
