//! Create→Running timing, the same for vmlet's VirtualMachines and the
//! baseline's pods: create N objects with a fixed number of create calls in
//! flight, note when a watch first sees each one Running, and turn that into
//! figures (p50/p95/max latency, throughput).

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a watch may take to list what exists before the first create.
pub const WATCH_SYNC_LIMIT: Duration = Duration::from_secs(60);

/// When each object's create call started and when a watch first saw it
/// Running.
pub struct Timeline {
    /// How many objects were to be created.
    pub wanted: usize,
    /// Start of each object's create call, by name.
    created_at: HashMap<String, Instant>,
    /// When the watch first saw each object Running, by name.
    running_at: HashMap<String, Instant>,
    /// Start of the first create call: the clock of the throughput.
    first_create: Instant,
    /// How long the create calls took, all of them; `None` when they had not
    /// all returned within the time limit.
    creates_took: Option<Duration>,
    /// The time limit both waits had.
    limit: Duration,
}

/// The two figures vmlet is compared on with the baseline.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    /// Median create→Running latency.
    pub p50: Duration,
    /// Objects Running per second, from the first create call to the last
    /// object seen Running.
    pub per_second: f64,
}

/// Create `objects` through `api` with `concurrency` create calls in flight
/// and wait until a watch on `api` has seen each of them `is_running`, within
/// `limit` from the first create call (create calls included).
///
/// Panics when a create call fails (the objects are the bench's own, so a
/// refusal is a bug worth stopping for) or the watch cannot start.
pub async fn create_until_running<K>(
    api: &Api<K>,
    objects: Vec<K>,
    concurrency: usize,
    limit: Duration,
    is_running: fn(&K) -> bool,
) -> Timeline
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug + Send + Sync + 'static,
{
    let wanted = objects.len();
    let running_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    // Watch before the first create so that no transition is missed.
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let (count_tx, mut count_rx) = tokio::sync::watch::channel(0usize);
    let watch = tokio::spawn(record_first_running(api.clone(), is_running, running_at.clone(), synced_tx, count_tx));
    match tokio::time::timeout(WATCH_SYNC_LIMIT, synced_rx).await {
        Ok(Ok(())) => {}
        _ => panic!("the watch of the objects to create had no first list within {WATCH_SYNC_LIMIT:?}"),
    }

    let created_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let first_create = Instant::now();
    let deadline = tokio::time::Instant::now() + limit;
    let creates = futures::stream::iter(objects)
        .map(|object| {
            let api = api.clone();
            let created_at = created_at.clone();
            async move {
                created_at.lock().unwrap().insert(object.name_any(), Instant::now());
                api.create(&PostParams::default(), &object).await.map(|_| ())
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>();
    let creates_took = match tokio::time::timeout_at(deadline, creates).await {
        Ok(Ok(_)) => Some(first_create.elapsed()),
        Ok(Err(e)) => panic!("a create call failed: {e}"),
        Err(_) => None,
    };
    if creates_took.is_some() {
        // Err (timed out) leaves fewer than `wanted` in `running_at`: reported as such.
        let _ = tokio::time::timeout_at(deadline, count_rx.wait_for(|count| *count >= wanted)).await;
    }
    watch.abort();
    let created_at = created_at.lock().unwrap().clone();
    let running_at = running_at.lock().unwrap().clone();
    Timeline { wanted, created_at, running_at, first_create, creates_took, limit }
}

/// Watch `api` and note in `running_at` when each object is first seen
/// `is_running`; signal `synced` after the first list and publish the count of
/// Running objects on `count`. Runs until aborted.
async fn record_first_running<K>(
    api: Api<K>,
    is_running: fn(&K) -> bool,
    running_at: Arc<Mutex<HashMap<String, Instant>>>,
    synced: tokio::sync::oneshot::Sender<()>,
    count: tokio::sync::watch::Sender<usize>,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut synced = Some(synced);
    let mut events = watcher(api, watcher::Config::default()).boxed();
    while let Some(event) = events.next().await {
        let object = match event {
            Ok(watcher::Event::InitDone) => {
                if let Some(synced) = synced.take() {
                    let _ = synced.send(());
                }
                continue;
            }
            Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => object,
            Ok(_) => continue,
            Err(e) => {
                eprintln!("  watch error (retrying): {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if is_running(&object) {
            let now = Instant::now();
            let mut running_at = running_at.lock().unwrap();
            running_at.entry(object.name_any()).or_insert(now);
            let _ = count.send(running_at.len());
        }
    }
}

impl Timeline {
    /// How many objects were seen Running.
    pub fn reached(&self) -> usize {
        self.running_at.len()
    }

    /// Whether every create call returned and every object was seen Running
    /// within the limit.
    pub fn all_running(&self) -> bool {
        self.creates_took.is_some() && self.reached() >= self.wanted
    }

    /// From the first create call to the last object seen Running.
    pub fn span(&self) -> Option<Duration> {
        self.running_at.values().max().map(|last| last.saturating_duration_since(self.first_create))
    }

    /// Create→Running latency of each object seen Running, shortest first.
    fn latencies(&self) -> Vec<Duration> {
        let mut latencies: Vec<Duration> = self
            .running_at
            .iter()
            .filter_map(|(name, running)| Some(running.saturating_duration_since(*self.created_at.get(name)?)))
            .collect();
        latencies.sort();
        latencies
    }

    /// The figures vmlet is compared on, if any object reached Running.
    pub fn figures(&self) -> Option<Figures> {
        let span = self.span()?;
        Some(Figures {
            p50: percentile(&self.latencies(), 50.0),
            per_second: self.reached() as f64 / span.as_secs_f64().max(1e-3),
        })
    }

    /// Print the create call time, a line naming how many reached Running when
    /// not all did, create→Running p50/p95/max and the throughput; `noun` is
    /// what was created (`VMs`, `pods`).
    pub fn print(&self, noun: &str, concurrency: usize) {
        let wanted = self.wanted;
        match self.creates_took {
            Some(took) => {
                println!("  create calls:          {} for {wanted} {noun} ({concurrency} in flight)", ms(took))
            }
            None => println!(
                "  create calls:          NOT DONE: only {} of {wanted} {noun} created within {:?}",
                self.created_at.len(),
                self.limit
            ),
        }
        if !self.all_running() {
            println!(
                "  NOT ALL RUNNING: {} of {wanted} {noun} reached Running within {:?}; the figures below cover those",
                self.reached(),
                self.limit
            );
        }
        let latencies = self.latencies();
        println!("  create→Running p50:    {}", ms(percentile(&latencies, 50.0)));
        println!("  create→Running p95:    {}", ms(percentile(&latencies, 95.0)));
        println!("  create→Running max:    {}", ms(latencies.last().copied().unwrap_or_default()));
        if let (Some(span), Some(figures)) = (self.span(), self.figures()) {
            println!(
                "  throughput:            {:.1} {noun}/s ({} {noun} from first create to last Running in {})",
                figures.per_second,
                self.reached(),
                ms(span)
            );
        }
    }
}

/// The `p`th percentile (nearest rank) of `sorted`; zero when it is empty.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `d` in whole milliseconds, e.g. `1234 ms`.
pub fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}
