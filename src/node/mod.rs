//! The node agent of one hypervisor host: its Node, its Lease, and the sync of
//! the pods bound to it.
//!
//! Order, as the kubelet's: probe the host, start the pod and cleanup loops, then
//! register the Node as Ready; renew the Lease every `leaseDuration / 4`; while
//! the provider fails its ping, report the Node NotReady with the failure's kind
//! and message (as a kubelet whose runtime fails), Ready once it answers; on
//! shutdown, report NotReady (the VMs keep running) and stop.

pub mod admission;
pub mod cloud_init;
pub mod console;
pub mod decide;
pub mod directory;
pub mod disks;
pub mod host_images;
pub mod images;
pub mod lease;
pub mod measured;
mod migration;
pub mod placement;
pub mod pod_status;
mod pods;
pub mod provisioner;
pub use pods::PLACED_ELSEWHERE;
pub mod registration;
pub mod release;
pub mod resize;
pub mod restart;
#[cfg(test)]
mod scenarios;
mod storage;
pub mod tasks;
pub mod volumes;

use crate::cache::{compact_ref, decoded, decoded_policy};
use crate::config::{Config, HostConfig};
use crate::events::EventSink;
use crate::watches::Watches;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use registration::Readiness;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, instrument, warn};
use vmlet_provider::{Change, HostInfo, Provider, VmId};

/// Shared state of one host's agent.
pub struct Agent {
    host: HostConfig,
    host_ip: String,
    client: Client,
    provider: Arc<dyn Provider>,
    events: EventSink,
    /// The process's watch caches (see [`crate::watches`]).
    watches: Watches,
    /// The hosts of this process, asked where a VM is ([`placement`]).
    hosts: Hosts,
    /// Where VMs' files may come from on this host (see [`crate::storage`]).
    storage: crate::storage::StorageRoots,
    /// Pods (by UID) whose guest was asked to shut down, and when.
    shutdown_sent: Mutex<HashMap<String, Instant>>,
    /// Evicted pods (by UID) whose VM is held running; the Event was sent.
    held: Mutex<HashSet<String>>,
    /// Deleted pods (by UID) whose VM this agent destroyed lately: their
    /// `Destroyed` Event already said the VM is off, so no `Stopped` follows.
    destroyed: crate::written::Recent,
    /// Pods (by UID) whose deletion this agent completed lately (grace
    /// period 0): a pass over the deleted pod the watch still shows does
    /// nothing (no second delete, no second Event).
    finished: crate::written::Recent,
    /// Per-pod backoff of failed passes.
    backoff: crate::failure::Backoff,
    /// This agent's last write per pod and per VirtualMachine
    /// ([`crate::written`]): a pass over a pod the watch shows older than
    /// that waits for it, and the placement record is not written again.
    written: crate::written::Written,
    /// vmlet's state directory (console histories, task pods' logs).
    state_dir: PathBuf,
    /// The only namespace whose pods this agent acts on, when vmlet's
    /// config names one.
    namespace: Option<String>,
    /// Task pods (by UID) whose work runs now ([`tasks`]).
    tasks: Mutex<HashSet<String>>,
    /// VMs (by UID) a restore in place writes under now, and the restore's
    /// name: this agent does not start them meanwhile.
    restoring: Arc<Mutex<HashMap<String, String>>>,
    /// Whether the back end pushes its VMs' changes
    /// ([`Provider::changes`]): then a running VM is read again only at
    /// [`POD_RESYNC_PUSHED`], not polled.
    pushed: bool,
}

/// A VM held stopped while a restore in place writes under it
/// ([`Agent::lock_for_restore`]); released when dropped.
pub struct RestoreLock {
    restoring: Arc<Mutex<HashMap<String, String>>>,
    vm_uid: String,
}

impl Drop for RestoreLock {
    fn drop(&mut self) {
        self.restoring.lock().expect("agent map poisoned").remove(&self.vm_uid);
    }
}

impl Agent {
    /// Record `uid` in `set`; true when it was new.
    fn remember(&self, set: &Mutex<HashSet<String>>, uid: &str) -> bool {
        set.lock().expect("agent set poisoned").insert(uid.to_owned())
    }

    /// Whether the work of task pod `uid` runs now.
    fn task_running(&self, uid: &str) -> bool {
        self.tasks.lock().expect("agent set poisoned").contains(uid)
    }

    fn task_started(&self, uid: &str) {
        self.remember(&self.tasks, uid);
    }

    fn task_ended(&self, uid: &str) {
        self.tasks.lock().expect("agent set poisoned").remove(uid);
    }

    /// Hold VM `id` stopped for restore `restore`: `None` when another
    /// restore holds it.
    fn lock_for_restore(&self, id: &VmId, restore: &str) -> Option<RestoreLock> {
        let mut restoring = self.restoring.lock().expect("agent map poisoned");
        if restoring.contains_key(&id.0) {
            return None;
        }
        restoring.insert(id.0.clone(), restore.to_owned());
        Some(RestoreLock { restoring: Arc::clone(&self.restoring), vm_uid: id.0.clone() })
    }

    /// The restore that holds VM `id` stopped, if one does.
    fn restoring(&self, id: &VmId) -> Option<String> {
        self.restoring.lock().expect("agent map poisoned").get(&id.0).cloned()
    }

    fn forget(&self, uid: &str) {
        self.shutdown_sent.lock().expect("agent set poisoned").remove(uid);
        self.held.lock().expect("agent set poisoned").remove(uid);
        self.backoff.succeeded(uid);
    }
}

/// One host served by this process: what the kubelet API and the release loop
/// need to reach a pod's VM.
#[derive(Clone)]
pub struct HostHandle {
    /// Node name.
    pub name: String,
    /// The host's provider.
    pub provider: Arc<dyn Provider>,
    /// Where VMs' files may come from on the host ([`crate::storage`]).
    pub storage: crate::storage::StorageRoots,
    /// The host's backup roots ([`HostConfig::effective_backup_roots`]):
    /// where the backup files a claim may be filled from lie.
    pub backup_roots: Vec<String>,
}

/// The hosts this process serves, filled in as their agents start.
#[derive(Clone, Default)]
pub struct Hosts(Arc<Mutex<Vec<HostHandle>>>);

impl Hosts {
    fn add(&self, host: HostHandle) {
        self.0.lock().expect("hosts poisoned").push(host);
    }

    /// A snapshot of the hosts served so far.
    pub fn list(&self) -> Vec<HostHandle> {
        self.0.lock().expect("hosts poisoned").clone()
    }

    /// The host whose node is `name`, once its agent runs.
    pub fn get(&self, name: &str) -> Option<HostHandle> {
        self.0.lock().expect("hosts poisoned").iter().find(|h| h.name == name).cloned()
    }
}

/// Run the agent of `host` until `shutdown` is cancelled; registers the host in
/// `hosts` once it answers. `watches` are the process's shared watch caches:
/// the agent's queue is fed from them ([`Watches::node_triggers`]).
#[instrument(skip_all, fields(node.name = %host.name, provider = provider.kind()))]
pub async fn run(
    client: Client,
    config: Arc<Config>,
    host: HostConfig,
    provider: Arc<dyn Provider>,
    hosts: Hosts,
    watches: Watches,
    shutdown: CancellationToken,
) {
    // From here on every call of the host's provider is timed
    // (`vmlet_provider_call_duration_seconds`), whoever makes it.
    let provider = measured::Measured::wrap(provider, &host.name);
    // Subscribed before anything is read: no change falls between.
    let changes = provider.changes();
    let Some(info) = probe(&*provider, &Api::all(client.clone()), &host.name, &shutdown).await else { return };
    match provider.list().await {
        Ok(vms) => info!(count = vms.len(), "found vmlet VMs on the host; they are adopted, not changed"),
        Err(e) => warn!(error = %e, "could not list the host's VMs"),
    }
    let agent = Arc::new(Agent {
        host_ip: config.node_ip.to_string(),
        events: EventSink::new(client.clone(), &format!("vmlet/{}", host.name)),
        client: client.clone(),
        provider: provider.clone(),
        host: host.clone(),
        watches: watches.clone(),
        hosts: hosts.clone(),
        storage: storage::roots_for(&host, &info)
            .with_image_reference(provider.image_reference())
            .with_trusted_namespaces(&config.trusted_namespaces),
        shutdown_sent: Mutex::default(),
        held: Mutex::default(),
        destroyed: crate::written::Recent::new(DESTROYED_WITHIN),
        finished: crate::written::Recent::new(Duration::from_secs(10)),
        backoff: Default::default(),
        written: Default::default(),
        state_dir: config.state_dir.clone(),
        namespace: config.namespace.clone(),
        tasks: Mutex::default(),
        restoring: Arc::default(),
        pushed: changes.is_some(),
    });

    hosts.add(HostHandle {
        name: host.name.clone(),
        provider: provider.clone(),
        storage: agent.storage.clone(),
        backup_roots: host.effective_backup_roots(),
    });
    let recorder = record_consoles(
        provider.clone(),
        host.name.clone(),
        watches.clone(),
        config.state_dir.clone(),
        config.console_history.into(),
        shutdown.clone(),
    );
    let pods = {
        let (watches, agent, shutdown) = (watches.clone(), agent.clone(), shutdown.clone());
        let triggers = watches.node_triggers(&host.name);
        async move {
            let Some(controller) = watches.pod_controller(&shutdown).await else { return };
            let queue = crate::metrics::QueueDepth::new(
                crate::metrics::QueueLabels { controller: "pod", node: Some(agent.host.name.clone()) },
                watches.pods.store(),
            );
            controller
                .reconcile_on(queue.track(triggers.map(compact_ref)))
                .graceful_shutdown_on(cancelled(shutdown.clone()))
                .run(queue.counted(decoded(pods::reconcile)), decoded_policy(pods::error_policy), agent)
                .for_each(|_| async {})
                .await
        }
    };
    // Every pod of the node is looked at again every POD_RESYNC, whatever
    // its last pass asked for, as the kubelet's sync loop does
    // (`--sync-frequency`): a change whose trigger never reached the queue
    // is acted on within that period rather than never. A back end that
    // pushes its changes is swept less often: its pushes are the triggers.
    let sweep_every = if agent.pushed { POD_RESYNC_PUSHED } else { POD_RESYNC };
    let followed = follow_changes(changes, watches.clone(), host.name.clone(), shutdown.clone());
    let resync = {
        let (watches, name, shutdown) = (watches.clone(), host.name.clone(), shutdown.clone());
        async move {
            let mut every = tokio::time::interval(sweep_every);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = every.tick() => watches.requeue_node(&name),
                }
            }
        }
    };
    let loops = tokio::spawn(async move { tokio::join!(pods, recorder, resync, followed) });

    // When the host stops answering, and when it answers again after an
    // outage, its pods are synced at once (their conditions say so, then
    // clear) instead of at each one's next sync or backoff.
    let answering = |answers: bool| {
        if answers {
            agent.backoff.reset();
        }
        watches.requeue_node(&host.name);
    };
    heartbeat(&client, &config, &host, &*provider, info, &shutdown, answering).await;
    let _ = loops.await;
    info!("node agent stopped");
}

/// Every second, copy new console output of this host's VM pods into their
/// history files (see [`console`]). Only pods that are their VirtualMachine's
/// own ([`crate::identity`]) are recorded. Does nothing on a backend without a
/// console.
async fn record_consoles(
    provider: Arc<dyn Provider>,
    node: String,
    watches: Watches,
    state_dir: PathBuf,
    limits: console::Limits,
    shutdown: CancellationToken,
) {
    if provider.console().is_none() {
        return;
    }
    let mut failing = HashSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let Some(console) = provider.console() else { return };
        for pod in watches.pods_on(&node) {
            let Ok(vm) = crate::identity::resolve_cached(&pod, &watches.vms) else { continue };
            let dir = console::vm_log_dir(&state_dir, &vm.spec.namespace, &vm.spec.name, &vm.spec.id.0);
            match console::record(console, &vm.spec.id, &dir, limits).await {
                Ok(_) => {
                    failing.remove(&vm.spec.id.0);
                }
                Err(e) => {
                    if failing.insert(vm.spec.id.0.clone()) {
                        debug!(vm.uid = %vm.spec.id, error = %e, "console not recorded");
                    }
                }
            }
        }
    }
}

/// Queue the pods of node `node` whose VMs the back end says changed
/// ([`Provider::changes`]), until `shutdown` or until the back end stops
/// sending; nothing when it pushes nothing. Changes that came together are
/// routed together (one look over the node's pods per batch). A missed change
/// ([`Change::All`], or a receiver that lagged) queues every pod of the node.
async fn follow_changes(
    changes: Option<broadcast::Receiver<Change>>,
    watches: Watches,
    node: String,
    shutdown: CancellationToken,
) {
    let Some(mut changes) = changes else { return };
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            change = changes.recv() => change,
        };
        let (mut vms, mut all) = (HashSet::new(), false);
        let mut next = Some(first);
        while let Some(received) = next {
            match received {
                Ok(Change::Vm(id)) => {
                    vms.insert(id.0);
                }
                Ok(Change::All) | Err(RecvError::Lagged(_)) => all = true,
                Err(RecvError::Closed) => return,
            }
            next = match changes.try_recv() {
                Ok(change) => Some(Ok(change)),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Lagged(missed)) => Some(Err(RecvError::Lagged(missed))),
                Err(TryRecvError::Closed) => Some(Err(RecvError::Closed)),
            };
        }
        if all {
            watches.requeue_node(&node);
        } else {
            watches.requeue_vms_on(&node, &vms);
        }
    }
}

async fn cancelled(token: CancellationToken) {
    token.cancelled().await
}

/// Probe the host until it answers (or shutdown). Logs each failure, and
/// while it fails reports the host's Node, if one exists from an earlier run,
/// NotReady saying why ([`registration::report_failing`]).
async fn probe(
    provider: &dyn Provider,
    nodes: &Api<Node>,
    name: &str,
    shutdown: &CancellationToken,
) -> Option<HostInfo> {
    loop {
        match provider.host_info().await {
            Ok(info) => return Some(info),
            Err(e) => {
                warn!(error = %e, "host does not answer; retrying in 5 s");
                let reason = crate::failure::handling(e.kind).reason.as_str();
                match registration::report_failing(nodes, name, reason, &e.to_string()).await {
                    Err(kube::Error::Api(s)) if s.code == 404 => {} // no Node yet
                    Err(report) => debug!(error = %report, "could not report the node NotReady"),
                    Ok(()) => {}
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

/// How long a destroy of a deleted pod's VM is remembered: the pass that
/// sees the VM off (at once for libvirt; a back end whose power-off is a
/// task may take minutes) then says nothing more than the `Destroyed` Event.
const DESTROYED_WITHIN: Duration = Duration::from_secs(600);

/// How often every pod of a node is synced again, whatever its last pass
/// asked for (the kubelet's `--sync-frequency` default).
const POD_RESYNC: Duration = Duration::from_secs(60);

/// [`POD_RESYNC`] for a back end that pushes its VMs' changes
/// ([`Provider::changes`]); also how often such a running VM is read again.
/// A safety net for a change the back end did not tell, as Nova's periodic
/// power-state sync is (every 10 min by default).
pub(crate) const POD_RESYNC_PUSHED: Duration = Duration::from_secs(300);

/// `call`, a call of the heartbeat to the `kind` back end, given at most
/// `deadline`; past it the call is dropped and answers `Transient` (the
/// node's reason `HostNotResponding`). A back end that hangs rather than
/// fails (a vCenter that stopped answering, a wedged daemon) would otherwise
/// hold the heartbeat for its own request timeout, and with it the renewal
/// of the node's Lease: the node lifecycle controller would mark the node
/// Unknown and taint it, where the kubelet's way is to keep the Lease and
/// say NotReady, and why.
async fn within<T>(
    deadline: Duration,
    operation: &'static str,
    kind: &str,
    call: impl std::future::Future<Output = vmlet_provider::Result<T>>,
) -> vmlet_provider::Result<T> {
    tokio::time::timeout(deadline, call).await.unwrap_or_else(|_| {
        Err(vmlet_provider::Error::new(
            operation,
            vmlet_provider::ErrorKind::Transient,
            format!("the {kind} back end did not answer within {} s", deadline.as_secs_f32()),
        ))
    })
}

/// Whether Node `name` still exists with `uid` (true when it cannot be read:
/// only a sure "gone" re-registers).
async fn node_exists(nodes: &Api<Node>, name: &str, uid: &str) -> bool {
    match nodes.get_metadata_opt(name).await {
        Ok(Some(node)) => node.metadata.uid.as_deref() == Some(uid),
        Ok(None) => false,
        Err(_) => true,
    }
}

/// Register the Node, then renew its Lease and refresh its status until
/// shutdown; finally report NotReady. `answering(false)` runs when the host
/// stops answering, `answering(true)` when it answers again after it did not.
async fn heartbeat(
    client: &Client,
    config: &Config,
    host: &HostConfig,
    provider: &dyn Provider,
    mut info: HostInfo,
    shutdown: &CancellationToken,
    answering: impl Fn(bool),
) {
    // The calls below run boxed: this future lives as long as the host is
    // served (500 of them in one process), and inline it would be as large as
    // the largest call's state (registration: 7.9 KiB) all the time. Boxed,
    // a host's agent future (`run`) took 5.6 KiB against 12.6 (dev build,
    // `size_of_val`).
    let nodes: Api<Node> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), lease::NAMESPACE);
    let desired = registration::node_for_host(host, provider.kind(), &info, config.scope());
    let lease_seconds = config.lease_duration_seconds as i32;
    let tick = config.lease_duration() / 4;
    let status_every = Duration::from_secs(60);

    let mut node_uid = None;
    let mut last_status: Option<Instant> = None;
    let mut last_lease = None;
    // The back end's last failure, while it fails: (reason, message).
    let mut failing: Option<(&'static str, String)> = None;
    let mut first_beat = true;
    loop {
        if node_uid.is_none() {
            match Box::pin(registration::register(&nodes, &desired)).await {
                Ok(uid) => {
                    info!("node registered");
                    node_uid = Some(uid);
                }
                Err(e) => warn!(error = %e, "node registration failed; retrying"),
            }
        }
        if let Some(uid) = &node_uid {
            match Box::pin(within(tick, "ping", provider.kind(), provider.ping())).await {
                Ok(()) => {
                    if failing.take().is_some() {
                        info!("host answers again");
                        last_status = None;
                        answering(true);
                    }
                    if let Ok(fresh) = Box::pin(within(tick, "probe host", provider.kind(), provider.host_info())).await
                    {
                        if fresh != info {
                            info = fresh;
                            last_status = None;
                        }
                    }
                }
                Err(e) => {
                    let now = (crate::failure::handling(e.kind).reason.as_str(), e.to_string());
                    if failing.as_ref() != Some(&now) {
                        warn!(error = %e, "the host's back end fails; reporting the node NotReady until it answers");
                        if failing.is_none() {
                            // A back end that pushes its changes pushes no
                            // outage: its pods learn of it now, not at their
                            // next sync minutes away.
                            answering(false);
                        }
                        failing = Some(now);
                        last_status = None;
                    }
                }
            }
            // The kubelet's way: while its runtime fails, it keeps its Lease
            // and says NotReady itself, with why (the node lifecycle
            // controller would only say that status stopped coming).
            let readiness = match &failing {
                None => Readiness::Ready,
                Some((reason, message)) => Readiness::BackendFailing { reason, message },
            };
            if last_status.is_none_or(|t| t.elapsed() >= status_every) {
                let status = registration::node_status(config, host, &info, readiness);
                match Box::pin(registration::write_status(&nodes, &host.name, &status)).await {
                    Ok(()) => last_status = Some(Instant::now()),
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        warn!("the Node was deleted; registering it again");
                        node_uid = None;
                        last_status = None;
                        continue;
                    }
                    Err(e) => warn!(error = %e, "node status write failed"),
                }
            }
            let renewal = lease::renew(&leases, &mut last_lease, &host.name, &config.identity, uid, lease_seconds);
            match Box::pin(renewal).await {
                // The garbage collector removes the Lease of a deleted
                // Node: a Lease that had to be created again is the
                // first sign. Then register at once, within one lease
                // period of the deletion; the VMs' pods come back to
                // the node through their placement records.
                Ok(lease::Renewal::Created) if !Box::pin(node_exists(&nodes, &host.name, uid)).await => {
                    warn!("the Node was deleted; registering it again");
                    node_uid = None;
                    last_status = None;
                    continue;
                }
                Ok(lease::Renewal::HeldElsewhere(holder)) => error!(
                    holder = %holder.identity,
                    "another live vmlet process holds this node's Lease; not renewing it (two processes serve the node: \
                     remove it from one of their configs)"
                ),
                Ok(_) => {}
                Err(e) => warn!(error = %e, "lease renewal failed"),
            }
        }
        let pause = next_beat(tick, &mut first_beat);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
    if node_uid.is_some() {
        let status = registration::node_status(config, host, &info, Readiness::Stopping);
        if let Err(e) = Box::pin(registration::write_status(&nodes, &host.name, &status)).await {
            warn!(error = %e, "could not report NotReady on shutdown");
        }
    }
}

/// The pause after a heartbeat of period `tick`: a uniformly random part of
/// it after the first beat, so that the heartbeats of hosts that started
/// together (every host of a process) spread over the period instead of
/// all writing their Leases in the same instant; after that `tick` less up to
/// 10%, as the kubelet jitters its Lease renewal (`wait.JitterUntil`), but
/// never later than `tick`, so a hold is renewed at least as often as
/// configured. Clears `first`.
fn next_beat(tick: Duration, first: &mut bool) -> Duration {
    let part: f64 = if std::mem::take(first) { rand::random() } else { 1.0 - 0.1 * rand::random::<f64>() };
    tick.mul_f64(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_spread_over_the_period_and_never_come_later_than_it() {
        let tick = Duration::from_secs(10);
        let mut first = true;
        let firsts: Vec<Duration> = (0..200).map(|_| next_beat(tick, &mut true)).collect();
        assert!(firsts.iter().all(|d| *d <= tick));
        // Spread: both halves of the period are used.
        assert!(firsts.iter().any(|d| *d < tick / 2) && firsts.iter().any(|d| *d > tick / 2));
        next_beat(tick, &mut first);
        assert!(!first);
        for _ in 0..200 {
            let d = next_beat(tick, &mut first);
            assert!(d <= tick && d >= tick.mul_f64(0.9), "{d:?}");
        }
    }

    #[tokio::test]
    async fn a_pushed_change_queues_the_pods_of_that_vm_on_this_node_and_a_missed_one_queues_all() {
        use futures::StreamExt;
        use kube::runtime::{reflector::ObjectRef, watcher};
        let config = Config::from_yaml(
            "hosts: [{name: host-a, provider: libvirt, uri: 'test:///default'}, \
             {name: host-b, provider: libvirt, uri: 'test:///default'}]",
            &["libvirt"],
        )
        .unwrap();
        let (watches, mut writers) = Watches::new(&config);
        let mut queue_a = watches.node_triggers("host-a");
        let bound = |name: &str, node: &str| {
            let (vm, mut pod) = crate::testing::vm_and_pod("ns", name);
            pod.spec.as_mut().unwrap().node_name = Some(node.into());
            (VmId(vm.metadata.uid.unwrap()), pod)
        };
        let (web, web_pod) = bound("web", "host-a");
        let (_, db_pod) = bound("db", "host-a");
        let (mail, mail_pod) = bound("mail", "host-b");
        watches.feed_pod(&mut writers, watcher::Event::Init);
        for pod in [&web_pod, &db_pod, &mail_pod] {
            watches.feed_pod(&mut writers, watcher::Event::InitApply(pod.clone()));
        }
        watches.feed_pod(&mut writers, watcher::Event::InitDone);
        // The list's own routing: both of host-a's pods, once each.
        let listed: HashSet<String> =
            [queue_a.next().await.unwrap(), queue_a.next().await.unwrap()].into_iter().map(|r| r.name).collect();
        assert_eq!(listed, HashSet::from(["web-x7k2p".to_owned(), "db-x7k2p".to_owned()]));

        let (tx, rx) = broadcast::channel(16);
        let shutdown = CancellationToken::new();
        let follow = tokio::spawn(follow_changes(Some(rx), watches.clone(), "host-a".into(), shutdown.clone()));
        async fn next(
            queue: &mut crate::watches::Triggers<k8s_openapi::api::core::v1::Pod>,
        ) -> ObjectRef<k8s_openapi::api::core::v1::Pod> {
            let next = tokio::time::timeout(Duration::from_secs(10), queue.next()).await;
            next.expect("queued within 10 s").expect("queue open")
        }

        // web's VM changed: web's pod is queued, and nothing else (host-b's
        // mail is another agent's, even when its change comes here).
        tx.send(Change::Vm(mail)).unwrap();
        tx.send(Change::Vm(web)).unwrap();
        assert_eq!(next(&mut queue_a).await, ObjectRef::from_obj(&web_pod));
        assert!(queue_a.try_recv().is_err(), "only web's pod was queued");

        // Changes were missed: every pod of the node.
        tx.send(Change::All).unwrap();
        let all: HashSet<String> =
            [next(&mut queue_a).await, next(&mut queue_a).await].into_iter().map(|r| r.name).collect();
        assert_eq!(all, listed);

        // The back end stops sending: the follower ends.
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), follow).await.expect("ended").unwrap();
    }

    #[tokio::test]
    async fn a_back_end_that_hangs_answers_transient_at_the_deadline_and_one_that_answers_passes_through() {
        // A call that never answers: only the deadline ends it.
        let hung =
            within(Duration::from_millis(50), "ping", "vsphere", std::future::pending::<vmlet_provider::Result<()>>());
        let e = hung.await.unwrap_err();
        assert_eq!(e.kind, vmlet_provider::ErrorKind::Transient);
        assert_eq!(crate::failure::handling(e.kind).reason.as_str(), "HostNotResponding");
        assert!(e.to_string().contains("the vsphere back end did not answer within 0.05 s"), "{e}");

        let answered = within(Duration::from_secs(5), "ping", "vsphere", async { Ok(7) }).await;
        assert_eq!(answered.unwrap(), 7);
        let failed = within(Duration::from_secs(5), "ping", "vsphere", async {
            Err::<(), _>(vmlet_provider::Error::new("ping", vmlet_provider::ErrorKind::PermissionDenied, "no"))
        });
        assert_eq!(failed.await.unwrap_err().kind, vmlet_provider::ErrorKind::PermissionDenied, "its own error kept");
    }
}
