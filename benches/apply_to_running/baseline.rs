//! The baseline: what the control plane alone costs for the same N pods.
//!
//! N plain pods with the VM pods' requests (1 cpu, the VM memory), created with
//! the same number of calls in flight, are placed by the same kube-scheduler on
//! one Node that no agent serves. The bench creates that Node itself (Ready,
//! room for every pod, a taint only these pods tolerate) and renews its Lease:
//! without a Lease, kube-controller-manager's node lifecycle controller counts
//! only the Ready condition's heartbeat, sets Ready to Unknown once
//! `--node-monitor-grace-period` (20 s in hack/cluster.sh) has passed and taints
//! the node unreachable. A stand-in kubelet in this process writes each pod's
//! status Running and Ready (one status patch) as soon as it sees the pod bound.
//! create→Running then measures create, schedule, bind and one status write,
//! with no VM behind the pod: the floor vmlet's figures are read against.

use crate::common::ClusterEnv;
use crate::measure::{self, Timeline, WATCH_SYNC_LIMIT};
use crate::requests::Requests;
use crate::{
    cleanup_kubectl, wait_default_service_account, wait_nodes_schedulable, Settings, VM_MEMORY, VM_MEMORY_MIB,
};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Label (on the Node and in the pods' node selector) and taint key (tolerated
/// by the pods) that tie the baseline's pods to the baseline's Node.
const BASELINE_LABEL: &str = "vmlet.io/bench-baseline";
/// Field manager of the bench's server-side applies (the Node's Lease).
const FIELD_MANAGER: &str = "vmlet-bench";
/// Namespace of node Leases.
const LEASE_NAMESPACE: &str = "kube-node-lease";
/// The Lease's `leaseDurationSeconds`, as the kubelet's.
const LEASE_SECONDS: i32 = 40;
/// How often the Lease is renewed: well inside the controller manager's
/// 20 s grace period.
const LEASE_RENEW_EVERY: Duration = Duration::from_secs(5);
/// Image name of the pods' one container; nothing pulls it.
const IMAGE: &str = "vmlet.io/bench-baseline";
/// The address the Node reports and its pods' `hostIP`.
const NODE_IP: &str = "127.0.0.1";

/// Everything the baseline created; dropping it removes the namespace (its pods
/// go at once: their grace period is 0), the Node and its Lease.
struct BaselineCluster {
    cluster: &'static ClusterEnv,
    /// Namespace of the pods; also the Node's (and its Lease's) name.
    name: String,
    /// The task that renews the Lease, stopped before the Node is deleted.
    lease_renewal: Option<JoinHandle<()>>,
    /// The stand-in kubelet's task.
    status_writer: Option<JoinHandle<()>>,
}

impl Drop for BaselineCluster {
    fn drop(&mut self) {
        for task in [self.status_writer.take(), self.lease_renewal.take()].into_iter().flatten() {
            task.abort();
        }
        let name = self.name.as_str();
        cleanup_kubectl(
            self.cluster,
            &["delete", "namespace", name, "--ignore-not-found", "--wait=true", "--timeout=120s"],
        );
        cleanup_kubectl(self.cluster, &["delete", "node", name, "--ignore-not-found", "--wait=false"]);
        cleanup_kubectl(self.cluster, &["-n", LEASE_NAMESPACE, "delete", "lease", name, "--ignore-not-found"]);
    }
}

/// Run the baseline in namespace `name` (the Node gets the same name) and
/// return its timeline and the API requests served from the first create to
/// the last Running; everything it created is removed before it returns.
pub async fn run(
    cluster: &'static ClusterEnv,
    client: &Client,
    name: &str,
    settings: &Settings,
) -> (Timeline, Requests) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap())
        .await
        .expect("create the baseline namespace");
    let mut baseline = BaselineCluster { cluster, name: name.to_owned(), lease_renewal: None, status_writer: None };

    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .create(&PostParams::default(), &baseline_node(name, settings.vms))
        .await
        .expect("create the baseline Node");
    let node_uid = node.uid().expect("a created Node has a UID");
    baseline.lease_renewal = Some(tokio::spawn(keep_lease_fresh(client.clone(), name.to_owned(), node_uid)));
    let selector = format!("{BASELINE_LABEL}={name}");
    wait_nodes_schedulable(client, &selector, 1, Duration::from_secs(60), "the baseline Node").await;
    wait_default_service_account(client, name, Duration::from_secs(60)).await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), name);
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    baseline.status_writer = Some(tokio::spawn(report_bound_pods_running(pods.clone(), name.to_owned(), synced_tx)));
    match tokio::time::timeout(WATCH_SYNC_LIMIT, synced_rx).await {
        Ok(Ok(())) => {}
        _ => panic!("the stand-in kubelet's pod watch had no first list within {WATCH_SYNC_LIMIT:?}"),
    }

    let objects = (0..settings.vms).map(|i| baseline_pod(&format!("pod-{i:04}"), name)).collect();
    let before = Requests::read(client).await;
    let timeline =
        measure::create_until_running(&pods, objects, settings.concurrency, settings.timeout, pod_is_running).await;
    let requests = Requests::read(client).await.since(&before);
    drop(baseline);
    (timeline, requests)
}

/// Whether the pod's phase is Running.
fn pod_is_running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// The baseline's Node `name`: Ready, room for `pods` pods of one cpu and the
/// VM memory each, labelled and tainted with [`BASELINE_LABEL`]. Status is
/// part of the create (the API server takes a Node's status on create).
fn baseline_node(name: &str, pods: usize) -> Node {
    let now = Time(Timestamp::now());
    let capacity = json!({
        "cpu": pods.to_string(),
        "memory": format!("{}Mi", pods as u64 * VM_MEMORY_MIB + 1024),
        "pods": pods.max(110).to_string(),
    });
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {BASELINE_LABEL: name, "kubernetes.io/hostname": name}},
        "spec": {"taints": [{"key": BASELINE_LABEL, "value": name, "effect": "NoSchedule"}]},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": NODE_IP}, {"type": "Hostname", "address": name}],
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "BenchBaseline",
                "message": "created by benches/apply_to_running.rs; no agent serves it",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
        },
    }))
    .expect("baseline Node")
}

/// Renew Node `node`'s Lease (owned by the Node, so it goes with it) every
/// [`LEASE_RENEW_EVERY`] until aborted; a failed renewal is reported and
/// retried at the next tick.
async fn keep_lease_fresh(client: Client, node: String, node_uid: String) {
    let leases: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    loop {
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {
                "name": node, "namespace": LEASE_NAMESPACE,
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
            },
            "spec": {"holderIdentity": node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": MicroTime(Timestamp::now())},
        });
        if let Err(e) = leases.patch(&node, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&lease)).await {
            eprintln!("  baseline: renewing Lease {node}: {e} (retrying)");
        }
        tokio::time::sleep(LEASE_RENEW_EVERY).await;
    }
}

/// Pod `name` of the baseline: one container with the VM pods' requests and
/// limits, selecting and tolerating the baseline Node only; grace period 0,
/// as the bench's VMs (`shutdownTimeoutSeconds: 0`).
fn baseline_pod(name: &str, baseline: &str) -> Pod {
    let amounts = json!({"cpu": "1", "memory": VM_MEMORY});
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "vm", "image": IMAGE, "resources": {"requests": amounts, "limits": amounts}}],
            "nodeSelector": {BASELINE_LABEL: baseline},
            "tolerations": [{"key": BASELINE_LABEL, "operator": "Equal", "value": baseline, "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
        },
    }))
    .expect("baseline Pod")
}

/// The stand-in kubelet of Node `node`: watch the pods bound to it (as a
/// kubelet does, by `spec.nodeName`) and write each one's status Running and
/// Ready as soon as it appears; signal `synced` after the first list. Runs
/// until aborted.
async fn report_bound_pods_running(pods: Api<Pod>, node: String, synced: tokio::sync::oneshot::Sender<()>) {
    let mut synced = Some(synced);
    let mut reported: HashSet<String> = HashSet::new();
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(pods.clone(), config).boxed();
    while let Some(event) = events.next().await {
        let pod = match event {
            Ok(watcher::Event::InitDone) => {
                if let Some(synced) = synced.take() {
                    let _ = synced.send(());
                }
                continue;
            }
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => pod,
            Ok(_) => continue,
            Err(e) => {
                eprintln!("  baseline: pod watch error (retrying): {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if pod_is_running(&pod) || !reported.insert(pod.name_any()) {
            continue;
        }
        tokio::spawn(write_running_status(pods.clone(), pod.name_any()));
    }
}

/// Patch pod `name`'s status to Running and Ready (strategic merge, so the
/// scheduler's PodScheduled condition stays), trying three times.
async fn write_running_status(pods: Api<Pod>, name: String) {
    let now = Time(Timestamp::now());
    let condition = |type_: &str| json!({"type": type_, "status": "True", "lastTransitionTime": now});
    let status = json!({"status": {
        "phase": "Running",
        "hostIP": NODE_IP,
        "hostIPs": [{"ip": NODE_IP}],
        "startTime": now,
        "conditions": [condition("Initialized"), condition("ContainersReady"), condition("Ready")],
        "containerStatuses": [{
            "name": "vm", "image": IMAGE, "imageID": "", "ready": true, "started": true, "restartCount": 0,
            "state": {"running": {"startedAt": now}},
        }],
    }});
    for attempt in 1..=3 {
        match pods.patch_status(&name, &PatchParams::default(), &Patch::Strategic(&status)).await {
            Ok(_) => return,
            Err(e) => {
                eprintln!("  baseline: status of pod {name}, attempt {attempt}: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}
