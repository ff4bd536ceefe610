//! A snapshot Job's pod: take the VirtualMachineSnapshot it names through the
//! provider's [`vmlet_provider::Snapshots`], or, when that object is being
//! deleted, delete the back end's snapshot and release the object's
//! finalizer.
//!
//! Only the pod that claimed the snapshot (`status.podUid`, written with the
//! object's resourceVersion as precondition) takes it. The back end's name is
//! vmlet's (namespace, name, UID), so no tenant can name another's snapshot;
//! the VM is the one of the pod's own namespace, and a snapshot is deleted
//! only from the VM whose UID the snapshot recorded.

use super::{end, log_line, now, Outcome};
use crate::conditions::new_condition;
use crate::node::pods::Error;
use crate::node::Agent;
use crate::v1alpha1::{
    snapshot_backend_name, OperationPhase, VirtualMachine, VirtualMachineSnapshot, VirtualMachineSnapshotStatus,
    SNAPSHOT_FINALIZER,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};
use vmlet_provider::{ErrorKind, SnapshotInfo, SnapshotRequest, VmId};

pub(super) async fn sync(pod: &Pod, agent: &Arc<Agent>, name: &str, job: &Job) -> Result<Action, Error> {
    let pod_uid = pod.uid().unwrap_or_default();
    if agent.task_running(&pod_uid) {
        return Ok(Action::requeue(Duration::from_secs(10)));
    }
    let namespace = pod.namespace().unwrap_or_default();
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(agent.client.clone(), &namespace);
    let kube = |action| move |source| Error::Kube { action, pod: pod.name_any(), source };
    let Some(snapshot) = snapshots.get_opt(name).await.map_err(kube("read the VirtualMachineSnapshot of"))? else {
        let message =
            format!("namespace {namespace} has no VirtualMachineSnapshot {name} (annotation vmlet.io/snapshot)");
        return fail(pod, agent, None, "SnapshotNotFound", &message).await;
    };
    if snapshot.metadata.deletion_timestamp.is_some() {
        return delete(pod, agent, &snapshots, &snapshot).await;
    }
    let status = snapshot.status.clone().unwrap_or_default();
    match (status.phase, status.pod_uid.as_deref()) {
        (Some(OperationPhase::Succeeded | OperationPhase::Failed), Some(uid)) if uid == pod_uid => {
            // Ended while this vmlet was down, before the pod was told.
            let message = status.message.unwrap_or_default();
            let outcome = if status.phase == Some(OperationPhase::Succeeded) {
                Outcome::Succeeded { message: &message }
            } else {
                Outcome::Failed { reason: "SnapshotFailed", message: &message }
            };
            end(pod, agent, outcome).await?;
            return Ok(Action::await_change());
        }
        (_, Some(uid)) if uid != pod_uid => {
            let message = format!(
                "VirtualMachineSnapshot {name} is taken by pod UID {uid}; a snapshot is taken once: create a new \
                 VirtualMachineSnapshot"
            );
            return fail(pod, agent, None, "SnapshotTakenByAnotherPod", &message).await;
        }
        (Some(OperationPhase::Succeeded | OperationPhase::Failed), None) => {
            let message = format!("VirtualMachineSnapshot {name} has ended already; create a new one");
            return fail(pod, agent, None, "SnapshotEnded", &message).await;
        }
        _ => {}
    }

    // Only the snapshot's own Job (or the pod that claimed it) ends it.
    let mine = super::job_is_objects(job, super::TaskKind::Snapshot, name) || status.pod_uid == Some(pod_uid.clone());
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let vm_name = &snapshot.spec.virtual_machine;
    let Some(vm) = vms.get_opt(vm_name).await.map_err(kube("read the VirtualMachine of"))? else {
        let message = format!("spec.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}");
        return fail(pod, agent, mine.then_some((&snapshots, name)), "VirtualMachineNotFound", &message).await;
    };
    let id = VmId(vm.uid().unwrap_or_default());
    if agent.provider.snapshots().is_none() {
        let message = format!(
            "host {} ({}) has no snapshot capability",
            agent.host.name,
            agent.host.describe(agent.provider.kind())
        );
        return fail(pod, agent, mine.then_some((&snapshots, name)), "SnapshotNotSupported", &message).await;
    }
    if agent.provider.get(&id).await?.is_none() {
        let recorded = crate::node::placement::recorded_node(&vm).unwrap_or("no host");
        let message = format!(
            "VirtualMachine {vm_name} is not on host {} (its placement record names {recorded}); the snapshot's pod \
             must run on the VM's node",
            agent.host.name
        );
        return fail(pod, agent, mine.then_some((&snapshots, name)), "VirtualMachineNotOnThisHost", &message).await;
    }
    let backend_name = snapshot_backend_name(&namespace, name, &snapshot.uid().unwrap_or_default());
    if status.pod_uid.is_none() {
        let claim = serde_json::json!({
            "metadata": {"resourceVersion": snapshot.resource_version()},
            "status": VirtualMachineSnapshotStatus {
                phase: Some(OperationPhase::Running),
                job_name: Some(job.name_any()),
                pod_uid: Some(pod_uid.clone()),
                node_name: Some(agent.host.name.clone()),
                virtual_machine_uid: Some(id.0.clone()),
                snapshot_name: Some(backend_name.clone()),
                virtual_machine_spec: Some(vm.spec.clone()),
                message: Some(format!("taking snapshot {backend_name} of VirtualMachine {vm_name}")),
                ..status.clone()
            },
        });
        match snapshots.patch_status(name, &PatchParams::default(), &Patch::Merge(&claim)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Action::requeue(Duration::from_secs(1))),
            Err(e) => return Err(kube("claim the VirtualMachineSnapshot of")(e)),
        }
    }
    let request = SnapshotRequest {
        name: backend_name.clone(),
        memory: snapshot.spec.memory,
        quiesce: true,
        timeout: Duration::from_secs(snapshot.spec.active_deadline_seconds.max(10) as u64),
    };
    end(pod, agent, Outcome::Running).await?;
    agent.task_started(&pod_uid);
    log_line(agent, &pod_uid, &format!("taking snapshot {backend_name} of VirtualMachine {vm_name} ({id})"));
    let (agent, pod, name) = (Arc::clone(agent), pod.clone(), name.to_owned());
    tokio::spawn(async move {
        let capability = agent.provider.snapshots().expect("checked before the task started");
        // The VM busy with another job (a backup, another snapshot) is
        // waited out, up to the snapshot's deadline: the object cannot be
        // retried once it failed.
        let deadline = std::time::Instant::now() + request.timeout;
        let result = loop {
            match capability.create_snapshot(&id, &request).await {
                Err(e) if e.kind == ErrorKind::Conflict && std::time::Instant::now() < deadline => {
                    log_line(&agent, &pod.uid().unwrap_or_default(), &format!("{e}; waiting"));
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                result => break result,
            }
        };
        let (patch, message, failed) = match result {
            Ok(info) => {
                info!(snapshot = %name, backend.name = %info.name, memory = info.memory, "snapshot taken");
                let message = taken_message(&info);
                (taken(&info, &message), message, false)
            }
            Err(e) => {
                warn!(snapshot = %name, error = %e, "snapshot failed");
                let message = format!("snapshot failed; the VM was left as it was: {e}");
                (terminal(OperationPhase::Failed, "SnapshotFailed", &message), message, true)
            }
        };
        log_line(&agent, &pod.uid().unwrap_or_default(), &message);
        write_outcome(&snapshots, &name, &serde_json::json!({ "status": patch })).await;
        let outcome = if failed {
            Outcome::Failed { reason: "SnapshotFailed", message: &message }
        } else {
            Outcome::Succeeded { message: &message }
        };
        if let Err(e) = end(&pod, &agent, outcome).await {
            warn!(snapshot = %name, error = %e, "could not end the snapshot's pod; its next pass will");
        }
        agent.task_ended(&pod.uid().unwrap_or_default());
    });
    Ok(Action::requeue(Duration::from_secs(10)))
}

/// The deletion pass: drop the back end's snapshot (from the VM whose UID the
/// snapshot recorded; a VM of that name made since is another VM), then the
/// finalizer.
async fn delete(
    pod: &Pod,
    agent: &Agent,
    snapshots: &Api<VirtualMachineSnapshot>,
    snapshot: &VirtualMachineSnapshot,
) -> Result<Action, Error> {
    let name = snapshot.name_any();
    let status = snapshot.status.clone().unwrap_or_default();
    let pod_uid = pod.uid().unwrap_or_default();
    let namespace = snapshot.namespace().unwrap_or_default();
    let vms: Api<VirtualMachine> = Api::namespaced(agent.client.clone(), &namespace);
    let vm_name = &snapshot.spec.virtual_machine;
    let vm = vms.get_opt(vm_name).await.map_err(|source| Error::Kube {
        action: "read the VirtualMachine of",
        pod: pod.name_any(),
        source,
    })?;
    // The VM the snapshot was taken of, if it still exists: its domain (and
    // the snapshot with it) went when the VM was deleted.
    let vm = vm.filter(|vm| vm.uid().is_some() && vm.uid() == status.virtual_machine_uid);
    let message = match (vm, &status.snapshot_name, agent.provider.snapshots()) {
        (None, _, _) => format!("VirtualMachine {vm_name} the snapshot was taken of is gone, and the snapshot with it"),
        (Some(_), None, _) => format!("VirtualMachineSnapshot {name} was never taken: nothing to delete"),
        (Some(_), Some(backend_name), None) => {
            let message = format!(
                "host {}'s back end ({}) has no snapshots; cannot delete {backend_name}",
                agent.host.name,
                agent.provider.kind()
            );
            return fail(pod, agent, None, "SnapshotNotSupported", &message).await;
        }
        (Some(vm), Some(backend_name), Some(capability)) => {
            let id = VmId(vm.uid().unwrap_or_default());
            if agent.provider.get(&id).await?.is_none() {
                let recorded = crate::node::placement::recorded_node(&vm).unwrap_or("no host");
                let message = format!(
                    "VirtualMachine {vm_name} is not on host {} (its placement record names {recorded}): its \
                     snapshot {backend_name} is deleted where the VM is",
                    agent.host.name
                );
                return fail(pod, agent, None, "VirtualMachineNotOnThisHost", &message).await;
            }
            log_line(agent, &pod_uid, &format!("deleting snapshot {backend_name} of VM {id}"));
            match capability.delete_snapshot(&id, backend_name).await {
                Ok(()) => format!("snapshot {backend_name} deleted from host {}", agent.host.name),
                Err(e) if e.kind == ErrorKind::Conflict || e.kind == ErrorKind::Transient => {
                    log_line(agent, &pod_uid, &format!("{e}; retrying"));
                    return Err(Error::Provider(e));
                }
                Err(e) => {
                    let message = format!("deleting snapshot {backend_name} failed: {e}");
                    log_line(agent, &pod_uid, &message);
                    return fail(pod, agent, None, "SnapshotDeleteFailed", &message).await;
                }
            }
        }
    };
    log_line(agent, &pod_uid, &message);
    let finalizers: Vec<&String> = snapshot.finalizers().iter().filter(|f| *f != SNAPSHOT_FINALIZER).collect();
    let patch =
        serde_json::json!({"metadata": {"resourceVersion": snapshot.resource_version(), "finalizers": finalizers}});
    match snapshots.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Action::requeue(Duration::from_secs(1))),
        Err(source) => {
            return Err(Error::Kube { action: "release the VirtualMachineSnapshot of", pod: pod.name_any(), source })
        }
    }
    info!(snapshot = %name, "snapshot deleted");
    end(pod, agent, Outcome::Succeeded { message: &message }).await?;
    Ok(Action::await_change())
}

/// The message of a snapshot taken.
fn taken_message(info: &SnapshotInfo) -> String {
    let what = match (info.memory, info.vm_was_running) {
        (true, _) => "with the VM's memory",
        (false, true) => "disk only, of the running VM",
        (false, false) => "disk only (the VM was stopped)",
    };
    format!("snapshot {} taken, {what}", info.name)
}

/// The status patch of a snapshot taken.
fn taken(info: &SnapshotInfo, message: &str) -> serde_json::Value {
    let mut status = terminal(OperationPhase::Succeeded, "SnapshotTaken", message);
    status["readyToUse"] = true.into();
    status["memory"] = info.memory.into();
    status["virtualMachineWasRunning"] = info.vm_was_running.into();
    let created = Timestamp::from_second(info.created_unix_seconds).map(|t| t.to_string()).unwrap_or_else(|_| now());
    status["creationTime"] = created.into();
    status
}

/// The status patch of an ended snapshot: phase, message and condition
/// (`Complete` or `Failed`, as a Job's).
fn terminal(phase: OperationPhase, reason: &str, message: &str) -> serde_json::Value {
    let type_ = if phase == OperationPhase::Succeeded { "Complete" } else { "Failed" };
    let condition = new_condition(type_, true, reason, message, None);
    serde_json::json!({"phase": phase, "message": message, "conditions": [condition]})
}

/// Write a finished task's outcome, retrying for about 10 s.
async fn write_outcome(snapshots: &Api<VirtualMachineSnapshot>, name: &str, patch: &serde_json::Value) {
    for attempt in 0..5 {
        match snapshots.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => return,
            Err(e) => {
                warn!(snapshot = %name, attempt, error = %e, "could not write the snapshot's outcome; retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
}

/// Fail the pod (and the snapshot, when given) with `reason` and `message`;
/// nothing was done on the host.
async fn fail(
    pod: &Pod,
    agent: &Agent,
    snapshot: Option<(&Api<VirtualMachineSnapshot>, &str)>,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    agent.events.publish(pod, crate::events::Reason::ProviderFailed, message);
    if let Some((snapshots, name)) = snapshot {
        let patch = serde_json::json!({"status": terminal(OperationPhase::Failed, reason, message)});
        snapshots.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(|source| {
            Error::Kube { action: "write the VirtualMachineSnapshot status of", pod: pod.name_any(), source }
        })?;
    }
    end(pod, agent, Outcome::Failed { reason, message }).await?;
    Ok(Action::await_change())
}
