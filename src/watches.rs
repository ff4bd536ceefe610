//! The process's watches: ONE pod watch, ONE VirtualMachine watch and ONE
//! Node watch, whatever the number of hosts, shared by the controller and
//! every host agent.
//!
//! Each watch feeds a reflector store (the watch cache) and then a dispatcher
//! that turns every change into work-queue entries for whoever acts on it:
//! - a pod change → the queue of the agent of the pod's node, and the queue of
//!   the VirtualMachine that controls the pod (controller, release loop);
//! - a VirtualMachine change → its own queue entry, and the queues of the
//!   agents whose nodes hold its pods.
//!
//! Memory grows with pods + VMs, never with hosts × VMs: before this, every
//! host agent kept its own VirtualMachine watch (twice), and 100 hosts with
//! 2,000 VMs held 2.26 GB.
//!
//! The pod and VirtualMachine stores hold each object as its JSON
//! ([`crate::cache`]): typed, they were most of vmlet's memory at 10,000 VMs.
//!
//! The pod store keeps only the pods vmlet may act on: those bound to one of
//! this process's nodes (any namespace: a pod that is not a VM's must still be
//! refused) and VM pods (label [`VM_LABEL`]) of the namespaces it serves.
//! The Node store keeps this process's own nodes only, without their status
//! (what an agent's admission reads: labels and taints, as a kubelet reads
//! its Node from its informer rather than per pod). No store keeps managed
//! fields, which nothing in vmlet reads, nor the VMs' annotations (see
//! [`strip_unread_vm_fields`]).

use crate::cache::{self, compact_event, Cache, Compact};
use crate::config::Config;
use crate::pod_index::PodIndex;
use crate::v1alpha1::{VirtualMachine, VM_LABEL};
use futures::channel::mpsc;
use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::Controller;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The write sides of the [`Watches`] stores, consumed by [`Watches::start`].
pub struct Writers {
    vms: reflector::store::Writer<Compact<VirtualMachine>>,
    pods: reflector::store::Writer<Compact<Pod>>,
    nodes: reflector::store::Writer<Node>,
}

/// A work queue's input: object references, merged by the queue.
pub type Triggers<K> = mpsc::UnboundedReceiver<ObjectRef<K>>;

/// The shared watch caches and the subscriptions that route changes to queues.
#[derive(Clone)]
pub struct Watches {
    /// Every VirtualMachine of the namespaces served.
    pub vms: Cache<VirtualMachine>,
    /// Pods bound to this process's nodes, and VM pods of the namespaces served.
    pub pods: Cache<Pod>,
    /// This process's own Nodes, without status and managed fields.
    pub nodes: Store<Node>,
    /// Set once the VirtualMachine watch has completed its first list.
    vms_listed: Listed,
    /// Set once the pod watch has completed its first list.
    pods_listed: Listed,
    /// Bumped after each VirtualMachine watch event reached `vms`.
    vm_changes: Arc<watch::Sender<u64>>,
    routes: Arc<Routes>,
    /// The pods of `pods` by node and by VirtualMachine, updated after the
    /// store at each pod event.
    index: Arc<Mutex<PodIndex>>,
}

/// Passes of one VirtualMachine controller that run at once (see
/// [`Watches::vm_controller`]). A pass is a few API requests (and, in the
/// release loop, a few provider calls). 16 were too few: at 2,000 VMs
/// created at once the controller fell behind the creates, and since the
/// queue is not first-in first-out, some VMs waited 30 s (p95 31 s against
/// 7.7 s unbounded). With 64, 10,000 VMs ran within 6.7 s of their create
/// (p95) and were all deleted with no Lease renewal missed.
pub const VM_PASSES_IN_FLIGHT: u16 = 64;

/// How long a controller waits for a watch's first list before it says so
/// (and again at each such interval).
const NOT_LISTED_WARNING: Duration = Duration::from_secs(30);

/// Whether a watch has completed its first list, awaited by any number of
/// controllers.
///
/// Not `Store::wait_until_ready`: kube-runtime 5.0 keeps a single waker for
/// all of a store's waiters (`utils/delayed_init.rs`: every waiter polls the
/// same `futures::channel::oneshot::Receiver`, which remembers only the last
/// waker), so when the list completes only the controller that looked last
/// wakes; the others, whose `Controller` waits for the store before running
/// anything, wait for some later event of theirs — forever if none comes.
#[derive(Clone)]
struct Listed {
    watch: &'static str,
    tx: Arc<watch::Sender<bool>>,
}

impl Listed {
    fn new(watch: &'static str) -> Self {
        Listed { watch, tx: Arc::new(watch::Sender::new(false)) }
    }

    fn set(&self) {
        self.tx.send_if_modified(|listed| !std::mem::replace(listed, true));
    }

    /// Wait for the first list; `false` if `shutdown` came first. Warns every
    /// [`NOT_LISTED_WARNING`] while it waits.
    async fn wait(&self, shutdown: &CancellationToken) -> bool {
        let mut rx = self.tx.subscribe();
        let started = tokio::time::Instant::now();
        loop {
            tokio::select! {
                listed = rx.wait_for(|listed| *listed) => return listed.is_ok(),
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(NOT_LISTED_WARNING) => warn!(
                    watch = self.watch,
                    waited_s = started.elapsed().as_secs(),
                    "watch has not completed its first list; the controllers over its cache wait for it"
                ),
            }
        }
    }
}

#[derive(Default)]
struct Routes {
    /// Node name → the queue of its agent.
    nodes: Mutex<HashMap<String, mpsc::UnboundedSender<ObjectRef<Pod>>>>,
    /// Queues keyed by VirtualMachine (controller, release loop).
    vms: Mutex<Vec<mpsc::UnboundedSender<ObjectRef<VirtualMachine>>>>,
    /// Queue outputs of the configured nodes, made before the first event,
    /// until each agent takes its own.
    pending: Mutex<HashMap<String, Triggers<Pod>>>,
}

impl Watches {
    /// The stores and routes for the nodes of `config.hosts`, before any watch
    /// runs. Subscribe ([`Watches::vm_triggers`]) before [`Watches::start`]: a
    /// change is routed only to the queues that exist when it arrives. The
    /// nodes' queues exist from here on, so the initial list reaches every
    /// agent, however late it starts.
    pub fn new(config: &Config) -> (Self, Writers) {
        let (vms, vm_writer) = cache::cache();
        let (pods, pod_writer) = cache::cache();
        let (nodes, node_writer) = reflector::store();
        let watches = Watches {
            vms,
            pods,
            nodes,
            vms_listed: Listed::new("VirtualMachine"),
            pods_listed: Listed::new("Pod"),
            vm_changes: Arc::new(watch::Sender::new(0)),
            routes: Arc::new(Routes::default()),
            index: Arc::default(),
        };
        for host in &config.hosts {
            let rx = watches.subscribe_node(&host.name);
            watches.routes.pending.lock().expect("routes poisoned").insert(host.name.clone(), rx);
        }
        (watches, Writers { vms: vm_writer, pods: pod_writer, nodes: node_writer })
    }

    /// Open the three watches (VMs of all namespaces or `config.namespace`,
    /// pods and Nodes); the stores fill and the routes run in the background
    /// until `shutdown`.
    pub fn start(&self, writers: Writers, client: &Client, config: &Config, shutdown: CancellationToken) {
        let Writers { vms: mut vm_writer, pods: mut pod_writer, nodes: node_writer } = writers;
        let watches = self;

        let served_namespace = config.namespace.clone();
        let nodes: HashSet<String> = config.hosts.iter().map(|h| h.name.clone()).collect();
        let vm_api: Api<VirtualMachine> = match &config.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let vm_events = watcher(vm_api, watcher::Config::default())
            .default_backoff()
            .modify(strip_unread_vm_fields)
            .inspect_ok(move |event| vm_writer.apply_watcher_event(&compact_event(event)));
        let router = watches.clone();
        let vm_loop = vm_events.for_each(move |event| {
            match event {
                Ok(event) => router.on_vm_event(&event),
                // Retried with kube's DefaultBackoff (0.8 s doubling to
                // 30 s); until its first list completes, the controllers over
                // the store wait (see `Listed`, which warns if that is long).
                Err(error) => warn!(%error, "VirtualMachine watch failed; retrying"),
            }
            std::future::ready(())
        });

        // Pods: all namespaces, because a pod of any namespace may be bound to
        // our nodes; filtered before it reaches the store.
        let pod_api: Api<Pod> = Api::all(client.clone());
        let keep = Arc::new(move |pod: &Pod| {
            let on_our_node = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some_and(|n| nodes.contains(n));
            let vm_pod = pod.labels().contains_key(VM_LABEL)
                && served_namespace.as_deref().is_none_or(|ns| pod.namespace().as_deref() == Some(ns));
            on_our_node || vm_pod
        });
        let filter = keep.clone();
        let pod_events = watcher(pod_api, watcher::Config::default())
            .default_backoff()
            .filter_map(move |event| std::future::ready(event.map(|e| only_kept(e, &*filter)).transpose()))
            .modify(|pod| pod.managed_fields_mut().clear())
            .inspect_ok(move |event| pod_writer.apply_watcher_event(&compact_event(event)));
        let router = watches.clone();
        let pod_loop = pod_events.for_each(move |event| {
            match event {
                Ok(event) => router.on_pod_event(&event, &*keep),
                Err(error) => warn!(%error, "pod watch failed; retrying"),
            }
            std::future::ready(())
        });
        // Nodes: ours only, their labels and taints (no status, which
        // changes at every heartbeat).
        let ours: HashSet<String> = config.hosts.iter().map(|h| h.name.clone()).collect();
        let node_api: Api<Node> = Api::all(client.clone());
        let node_loop = watcher(node_api, watcher::Config::default())
            .default_backoff()
            .filter_map(move |event| {
                std::future::ready(event.map(|e| only_kept(e, &|n: &Node| ours.contains(&n.name_any()))).transpose())
            })
            .modify(|node| {
                node.status = None;
                node.managed_fields_mut().clear();
            })
            .reflect(node_writer)
            .for_each(|event| {
                if let Err(error) = event {
                    warn!(%error, "Node watch failed; retrying");
                }
                std::future::ready(())
            });
        tokio::spawn(async move {
            tokio::select! {
                _ = vm_loop => {}
                _ = pod_loop => {}
                _ = node_loop => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }

    /// The cached VirtualMachine `key` once `wanted` holds of it, waiting
    /// for later watch events at most `patience`; `None` when it does not
    /// get there in time (or is not cached). Lets a caller that must not act
    /// on a cache that only lags (e.g. a pod seen before its VM's claim of
    /// it) wait for the watch instead of reading the API server.
    pub async fn vm_when(
        &self,
        key: &ObjectRef<VirtualMachine>,
        patience: Duration,
        wanted: impl Fn(&VirtualMachine) -> bool,
    ) -> Option<Arc<VirtualMachine>> {
        let mut changes = self.vm_changes.subscribe();
        let until = tokio::time::Instant::now() + patience;
        loop {
            changes.borrow_and_update();
            if let Some(vm) = self.vms.get(key).filter(|vm| wanted(vm)) {
                return Some(vm);
            }
            if tokio::time::timeout_at(until, changes.changed()).await.is_err() {
                return None;
            }
        }
    }

    /// A controller over the VirtualMachine cache, once the watch has listed
    /// every VM (`None` if `shutdown` comes first). Every controller over the
    /// shared caches starts here, never from `Controller::for_stream` on the
    /// store directly (see [`Listed`]).
    ///
    /// At most [`VM_PASSES_IN_FLIGHT`] passes of one such controller run at
    /// once, as kube-controller-manager bounds each controller's workers
    /// (`--concurrent-*-syncs`): deleting 10,000 VMs at once otherwise ran
    /// 10,000 passes together, whose requests starved the leader's Lease
    /// renewals (it stepped down three times) and held 1.5 GB.
    ///
    /// The controller runs on the compact objects of the cache: feed it
    /// [`cache::compact_ref`]s and run [`cache::decoded`] reconcilers.
    pub async fn vm_controller(&self, shutdown: &CancellationToken) -> Option<Controller<Compact<VirtualMachine>>> {
        let config = kube::runtime::controller::Config::default().concurrency(VM_PASSES_IN_FLIGHT);
        self.vms_listed
            .wait(shutdown)
            .await
            .then(|| Controller::for_stream(no_objects(), self.vms.store()).with_config(config))
    }

    /// A controller over the pod cache, once the watch has listed every pod
    /// kept (`None` if `shutdown` comes first); see [`Watches::vm_controller`].
    pub async fn pod_controller(&self, shutdown: &CancellationToken) -> Option<Controller<Compact<Pod>>> {
        self.pods_listed.wait(shutdown).await.then(|| Controller::for_stream(no_objects(), self.pods.store()))
    }

    /// Wait until both watches have listed (`false` if `shutdown` comes
    /// first): for a controller that reads both caches but watches neither.
    pub async fn wait_listed(&self, shutdown: &CancellationToken) -> bool {
        self.vms_listed.wait(shutdown).await && self.pods_listed.wait(shutdown).await
    }

    /// A VirtualMachine watch event, after the store has applied it: route it,
    /// and at the end of a list release the controllers waiting for it.
    fn on_vm_event(&self, event: &watcher::Event<VirtualMachine>) {
        self.vm_changes.send_modify(|n| *n = n.wrapping_add(1));
        for vm in touched(event) {
            self.route_vm(vm);
        }
        if matches!(event, watcher::Event::InitDone) {
            self.vms_listed.set();
        }
    }

    /// A pod watch event, after the store has applied it (see
    /// [`Watches::on_vm_event`]). A change that removed a pod from the store
    /// (see `only_kept`) concerns nobody here.
    fn on_pod_event(&self, event: &watcher::Event<Pod>, keep: &dyn Fn(&Pod) -> bool) {
        {
            let mut index = self.index.lock().expect("pod index poisoned");
            match event {
                watcher::Event::Apply(pod) => index.apply(pod),
                watcher::Event::Delete(pod) => index.remove(&ObjectRef::from_obj(pod)),
                // The store takes a list whole at its end: so does the index.
                watcher::Event::InitDone => index.rebuild(self.pods.state()),
                watcher::Event::Init | watcher::Event::InitApply(_) => {}
            }
        }
        for pod in touched(event).into_iter().filter(|p| keep(p)) {
            self.route_pod(pod);
        }
        if matches!(event, watcher::Event::InitDone) {
            self.pods_listed.set();
        }
    }

    /// The queue input of node `name`'s agent: the pods bound to it, and the
    /// pods of VMs that changed. Taken once per node (see [`Watches::start`]).
    pub fn node_triggers(&self, name: &str) -> Triggers<Pod> {
        let taken = self.routes.pending.lock().expect("routes poisoned").remove(name);
        taken.unwrap_or_else(|| self.subscribe_node(name))
    }

    fn subscribe_node(&self, name: &str) -> Triggers<Pod> {
        let (tx, rx) = mpsc::unbounded();
        self.routes.nodes.lock().expect("routes poisoned").insert(name.to_owned(), tx);
        rx
    }

    /// A queue input keyed by VirtualMachine: every VM change and every change
    /// of a pod a VM controls. Subscribe before [`Watches::start`].
    pub fn vm_triggers(&self) -> Triggers<VirtualMachine> {
        let (tx, rx) = mpsc::unbounded();
        self.routes.vms.lock().expect("routes poisoned").push(tx);
        rx
    }

    /// A queue input keyed by VirtualMachine, as [`Watches::vm_triggers`],
    /// that starts with every VirtualMachine in the cache: for a controller
    /// that starts after the watch (the elected leader's), which would
    /// otherwise see only later changes. Subscribed before the cache is read,
    /// so no change falls between the two (some VMs come twice; the queue
    /// merges them).
    pub fn vm_triggers_from_now(&self) -> Triggers<VirtualMachine> {
        let (tx, rx) = mpsc::unbounded();
        self.routes.vms.lock().expect("routes poisoned").push(tx.clone());
        for vm in self.vms.keys() {
            let _ = tx.unbounded_send(vm);
        }
        rx
    }

    /// Queue every pod bound to `node` for its agent now (e.g. when its host
    /// answers again after an outage, rather than at each pod's backoff).
    pub fn requeue_node(&self, node: &str) {
        if let Some(tx) = self.routes.nodes.lock().expect("routes poisoned").get(node) {
            for pod in self.pods_on(node) {
                let _ = tx.unbounded_send(ObjectRef::from_obj(&*pod));
            }
        }
    }

    /// Queue the pods bound to `node` whose VirtualMachine (controlling owner)
    /// has one of the UIDs `vms`, for its agent now.
    pub fn requeue_vms_on(&self, node: &str, vms: &HashSet<String>) {
        if let Some(tx) = self.routes.nodes.lock().expect("routes poisoned").get(node) {
            for pod in self.pods_on(node) {
                if crate::identity::vm_owner(&pod).is_some_and(|owner| vms.contains(&owner.uid)) {
                    let _ = tx.unbounded_send(ObjectRef::from_obj(&*pod));
                }
            }
        }
    }

    /// The pods in the store bound to node `node`.
    pub fn pods_on(&self, node: &str) -> Vec<Arc<Pod>> {
        let refs = self.index.lock().expect("pod index poisoned").on_node(node);
        refs.iter().filter_map(|r| self.pods.get(r)).filter(|p| node_of(p) == Some(node)).collect()
    }

    /// The pods in the store labelled as VirtualMachine `name`'s in
    /// `namespace` (label `vmlet.io/vm`, whoever controls them).
    fn pods_labelled(&self, namespace: &str, name: &str) -> Vec<Arc<Pod>> {
        let refs = self.index.lock().expect("pod index poisoned").of_vm(namespace, name);
        refs.iter()
            .filter_map(|r| self.pods.get(r))
            .filter(|p| p.labels().get(VM_LABEL).map(String::as_str) == Some(name))
            .collect()
    }

    /// The pods of the VirtualMachine `name` in `namespace` (label
    /// `vmlet.io/vm=<name>`, controlled by a VirtualMachine with `uid`), in the
    /// store: the live one and any still terminating.
    pub fn pods_of_vm(&self, namespace: &str, name: &str, uid: &str) -> Vec<Arc<Pod>> {
        let mut pods = self.pods_labelled(namespace, name);
        pods.retain(|p| crate::identity::vm_owner(p).is_some_and(|o| o.uid == uid));
        pods
    }

    fn route_pod(&self, pod: &Pod) {
        let pod_ref = ObjectRef::from_obj(pod);
        if let Some(node) = node_of(pod) {
            if let Some(tx) = self.routes.nodes.lock().expect("routes poisoned").get(node) {
                let _ = tx.unbounded_send(pod_ref);
            }
        }
        if let Some(owner) = crate::identity::vm_owner(pod) {
            let vm_ref = ObjectRef::new(&owner.name).within(&pod.namespace().unwrap_or_default());
            self.send_vm(vm_ref);
        }
    }

    fn route_vm(&self, vm: &VirtualMachine) {
        self.send_vm(ObjectRef::from_obj(vm));
        let pods = self.pods_labelled(&vm.namespace().unwrap_or_default(), &vm.name_any());
        let nodes = self.routes.nodes.lock().expect("routes poisoned");
        for pod in pods {
            if let Some(tx) = node_of(&pod).and_then(|n| nodes.get(n)) {
                let _ = tx.unbounded_send(ObjectRef::from_obj(&*pod));
            }
        }
    }

    fn send_vm(&self, vm_ref: ObjectRef<VirtualMachine>) {
        let mut queues = self.routes.vms.lock().expect("routes poisoned");
        queues.retain(|tx| tx.unbounded_send(vm_ref.clone()).is_ok());
    }
}

#[cfg(test)]
impl Watches {
    /// Feed a pod watch event as the pod watch does: the store, then the
    /// routes (every pod kept).
    pub(crate) fn feed_pod(&self, writers: &mut Writers, event: watcher::Event<Pod>) {
        writers.pods.apply_watcher_event(&compact_event(&event));
        self.on_pod_event(&event, &|_| true);
    }
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// The objects a watch event is about (none for the list markers).
fn touched<K>(event: &watcher::Event<K>) -> Vec<&K> {
    match event {
        watcher::Event::Apply(o) | watcher::Event::Delete(o) | watcher::Event::InitApply(o) => vec![o],
        watcher::Event::Init | watcher::Event::InitDone => vec![],
    }
}

/// The event as the store should see it: objects vmlet does not keep are left
/// out of a list, and a change that makes a stored object one it does not keep
/// (a label removed) removes it.
fn only_kept<K>(event: watcher::Event<K>, keep: &impl Fn(&K) -> bool) -> Option<watcher::Event<K>> {
    match event {
        watcher::Event::Apply(o) if !keep(&o) => Some(watcher::Event::Delete(o)),
        watcher::Event::InitApply(o) | watcher::Event::Delete(o) if !keep(&o) => None,
        other => Some(other),
    }
}

/// What the VirtualMachine store leaves out of each VM: its managed fields and
/// annotations, which nothing reads from the cache (the VMs' own writes are
/// to `/status`, where the API server keeps everything but the status as
/// stored, and a restore reads its target VM from the API server). A VM
/// applied with kubectl carries its whole manifest again in the
/// `kubectl.kubernetes.io/last-applied-configuration` annotation: about a
/// kilobyte per VM that the cache need not hold. Labels stay (the VM's pods
/// carry them), as do the finalizers (released by a JSON patch that tests
/// them) and the owner references.
fn strip_unread_vm_fields(vm: &mut VirtualMachine) {
    vm.managed_fields_mut().clear();
    vm.metadata.annotations = None;
}

/// A stream that never yields: the object-trigger input of a queue that is
/// fed only through [`Triggers`].
pub fn no_objects<K: Send + 'static>() -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    futures::stream::pending()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{vm_and_pod, PodBuilder, VmBuilder};
    use std::collections::BTreeMap;

    fn on_node(pod: &Pod, node: &str) -> bool {
        node_of(pod) == Some(node)
    }

    #[test]
    fn a_change_that_makes_a_stored_pod_one_not_kept_removes_it() {
        let pod = PodBuilder::for_vm(&VmBuilder::new("web").build()).on_node("elsewhere").build();
        let keep = |p: &Pod| on_node(p, "host-a");
        assert!(matches!(only_kept(watcher::Event::Apply(pod.clone()), &keep), Some(watcher::Event::Delete(_))));
        assert!(only_kept(watcher::Event::InitApply(pod.clone()), &keep).is_none(), "left out of a list");
        assert!(only_kept(watcher::Event::Delete(pod), &keep).is_none());
    }

    #[test]
    fn pods_vmlet_keeps_pass_unchanged_and_list_markers_always() {
        let pod = PodBuilder::for_vm(&VmBuilder::new("web").build()).on_node("host-a").build();
        let keep = |p: &Pod| on_node(p, "host-a");
        assert!(matches!(only_kept(watcher::Event::Apply(pod.clone()), &keep), Some(watcher::Event::Apply(_))));
        assert!(matches!(only_kept(watcher::Event::InitApply(pod), &keep), Some(watcher::Event::InitApply(_))));
        assert!(matches!(only_kept(watcher::Event::<Pod>::Init, &keep), Some(watcher::Event::Init)));
        assert!(matches!(only_kept(watcher::Event::<Pod>::InitDone, &keep), Some(watcher::Event::InitDone)));
    }

    #[test]
    fn the_vm_store_drops_annotations_and_managed_fields_and_keeps_what_is_read() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
        let mut vm = VmBuilder::new("web").build();
        vm.metadata.labels = Some(BTreeMap::from([("tier".to_owned(), "front".to_owned())]));
        vm.metadata.finalizers = Some(vec!["vmlet.io/undefine".to_owned()]);
        vm.metadata.annotations = Some(BTreeMap::from([(
            "kubectl.kubernetes.io/last-applied-configuration".to_owned(),
            r#"{"apiVersion":"vmlet.io/v1alpha1","kind":"VirtualMachine"}"#.to_owned(),
        )]));
        vm.metadata.managed_fields =
            Some(vec![ManagedFieldsEntry { manager: Some("kubectl".into()), ..Default::default() }]);
        let (spec, status) = (serde_json::to_value(&vm.spec).unwrap(), serde_json::to_value(&vm.status).unwrap());
        let uid = vm.metadata.uid.clone();
        assert!(uid.is_some(), "the builder gives VMs a UID");

        strip_unread_vm_fields(&mut vm);

        assert_eq!(vm.metadata.annotations, None);
        assert_eq!(vm.metadata.managed_fields, Some(vec![]));
        assert_eq!(vm.labels().get("tier").map(String::as_str), Some("front"));
        assert_eq!(vm.finalizers(), ["vmlet.io/undefine"]);
        assert_eq!(vm.metadata.uid, uid);
        assert_eq!(serde_json::to_value(&vm.spec).unwrap(), spec);
        assert_eq!(serde_json::to_value(&vm.status).unwrap(), status);
    }

    #[test]
    fn list_markers_touch_no_object_and_changes_touch_theirs() {
        let (_, pod) = vm_and_pod("team-a", "web");
        assert_eq!(touched(&watcher::Event::Apply(pod.clone())).len(), 1);
        assert_eq!(touched(&watcher::Event::Delete(pod)).len(), 1);
        assert!(touched(&watcher::Event::<Pod>::InitDone).is_empty());
    }
}

#[cfg(test)]
mod readiness {
    use super::*;
    use crate::testing::VmBuilder;
    use kube::runtime::controller::Action;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Three controllers over the shared VirtualMachine store, as the
    /// VirtualMachine controller, the release loop and (once) the
    /// EndpointSlice controller are: every one must run once the watch has
    /// listed, whichever of them looked at the store last before the list
    /// completed.
    #[tokio::test]
    async fn every_controller_over_the_shared_store_runs_once_the_watch_has_listed() {
        let config =
            Config::from_yaml("hosts: [{name: host-a, provider: libvirt, uri: 'test:///default'}]", &["libvirt"])
                .unwrap();
        let (watches, mut writers) = Watches::new(&config);
        let shutdown = CancellationToken::new();
        let passes: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
        for count in &passes {
            let triggers = watches.vm_triggers();
            let (watches, shutdown, count) = (watches.clone(), shutdown.clone(), count.clone());
            tokio::spawn(async move {
                let Some(controller) = watches.vm_controller(&shutdown).await else { return };
                controller
                    .reconcile_on(triggers.map(cache::compact_ref))
                    .run(
                        |_vm, count: Arc<AtomicUsize>| async move {
                            count.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(Action::await_change())
                        },
                        |_, _, _| Action::await_change(),
                        count,
                    )
                    .for_each(|_| async {})
                    .await
            });
        }
        let settle = || async {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
        };
        settle().await;
        // The watch's first list, as the reflector applies it and the
        // dispatcher routes it; the controllers, woken by the VM's entry,
        // look at the store again before the list completes.
        let vm = VmBuilder::new("web").build();
        for event in [watcher::Event::Init, watcher::Event::InitApply(vm)] {
            writers.vms.apply_watcher_event(&compact_event(&event));
            watches.on_vm_event(&event);
        }
        // ...after the controllers' queues have taken that entry in.
        tokio::time::sleep(Duration::from_millis(50)).await;
        writers.vms.apply_watcher_event(&watcher::Event::InitDone);
        watches.on_vm_event(&watcher::Event::InitDone);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while passes.iter().any(|c| c.load(Ordering::SeqCst) == 0) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let passes: Vec<usize> = passes.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        shutdown.cancel();
        assert!(passes.iter().all(|&n| n == 1), "passes per controller: {passes:?}");
    }

    /// The pod watch releases its controllers at the end of its list; until
    /// then they wait, and shutdown ends the wait.
    #[tokio::test]
    async fn pod_controllers_wait_for_the_pod_list_or_for_shutdown() {
        let config =
            Config::from_yaml("hosts: [{name: host-a, provider: libvirt, uri: 'test:///default'}]", &["libvirt"])
                .unwrap();
        let (watches, _writers) = Watches::new(&config);
        let waiter = |shutdown: CancellationToken| {
            let watches = watches.clone();
            tokio::spawn(async move { watches.pod_controller(&shutdown).await.is_some() })
        };
        let (stopped, listed) = (CancellationToken::new(), CancellationToken::new());
        let (stopping, listing) = (waiter(stopped.clone()), waiter(listed.clone()));
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!stopping.is_finished() && !listing.is_finished(), "no controller before the list");
        stopped.cancel();
        assert!(!stopping.await.unwrap(), "shutdown ends the wait without a controller");
        watches.on_pod_event(&watcher::Event::Init, &|_| true);
        watches.on_pod_event(&watcher::Event::InitDone, &|_| true);
        assert!(listing.await.unwrap(), "the end of the list starts the controller");
    }

    /// A pod's agent that saw its VM in the cache without the claim of the
    /// pod waits for the watch event that brings it, not for the API
    /// server; a claim that never comes ends the wait after its patience.
    #[tokio::test]
    async fn a_wait_for_the_vm_cache_ends_at_the_event_that_satisfies_it_or_at_its_patience() {
        let config =
            Config::from_yaml("hosts: [{name: host-a, provider: libvirt, uri: 'test:///default'}]", &["libvirt"])
                .unwrap();
        let (watches, mut writers) = Watches::new(&config);
        let unclaimed = VmBuilder::new("web").build();
        let claimed = VmBuilder::new("web").pod_name("web-1").build();
        let apply = |writers: &mut Writers, vm: &VirtualMachine| {
            let event = watcher::Event::Apply(vm.clone());
            writers.vms.apply_watcher_event(&compact_event(&event));
            watches.on_vm_event(&event);
        };
        apply(&mut writers, &unclaimed);
        let key = ObjectRef::from_obj(&unclaimed);
        let claims_web_1 =
            |vm: &VirtualMachine| vm.status.as_ref().and_then(|s| s.pod_name.as_deref()) == Some("web-1");

        let waiting = {
            let (watches, key) = (watches.clone(), key.clone());
            tokio::spawn(async move { watches.vm_when(&key, Duration::from_secs(60), claims_web_1).await })
        };
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "the cache does not claim the pod yet");
        apply(&mut writers, &claimed);
        // Within the patience only the event can end it with the VM.
        let seen = waiting.await.unwrap().expect("the claim arrived by the watch");
        assert_eq!(seen.status.as_ref().unwrap().pod_name.as_deref(), Some("web-1"));

        let never = watches.vm_when(&key, Duration::from_millis(300), |vm| vm.spec.replicas == 0).await;
        assert!(never.is_none(), "a condition the cache never meets ends at the patience");
    }
}
