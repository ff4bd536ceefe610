//! Task pods: the pods of backup, restore and snapshot Jobs, which run on
//! this host beside VM pods and do one thing with the host's provider.
//!
//! A pod is a task pod when it carries one of the annotations
//! `vmlet.io/backup`, `vmlet.io/restore`, `vmlet.io/snapshot` naming a
//! VirtualMachineBackup, VirtualMachineRestore or VirtualMachineSnapshot of
//! its namespace. It is acted on only when what a tenant cannot forge
//! agrees ([`verify_job`]): its controlling ownerReference is a batch/v1 Job
//! that exists in the pod's namespace with that UID, and if that Job has a
//! controlling owner of one of those kinds it is the one the annotation
//! names. Everything it reaches is in the pod's own namespace (the
//! backup, its VirtualMachine, the backup file whose name carries both), so a
//! pod can only ever touch VMs of its own namespace, whatever it claims.
//!
//! The work runs in a task of its own (a copy takes minutes); the pod is
//! Running meanwhile and ends Succeeded or Failed with a message, so the Job's
//! status is the operation's. Progress goes to the pod's log
//! (`<stateDir>/tasks/<pod uid>/0.log`, CRI format), which `kubectl logs`
//! reads through the kubelet API.

mod backup;
mod backup_files;
mod in_place;
mod restore;
mod snapshot;

pub(crate) use restore::locate_backup;

use super::pods::{finish_deletion, write_status, Error};
use super::Agent;
use crate::v1alpha1::{BACKUP_ANNOTATION, RESTORE_ANNOTATION, SNAPSHOT_ANNOTATION};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod, PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a task pod does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Copy a VM's disk to a backup file.
    Backup,
    /// Make a new disk from a backup file, or put a stopped VM back from a
    /// backup or a snapshot.
    Restore,
    /// Take a snapshot, or delete it.
    Snapshot,
}

impl TaskKind {
    /// The annotation naming the pod's object.
    pub fn annotation(self) -> &'static str {
        match self {
            TaskKind::Backup => BACKUP_ANNOTATION,
            TaskKind::Restore => RESTORE_ANNOTATION,
            TaskKind::Snapshot => SNAPSHOT_ANNOTATION,
        }
    }

    /// The kind of the object the annotation names.
    pub fn object_kind(self) -> &'static str {
        match self {
            TaskKind::Backup => "VirtualMachineBackup",
            TaskKind::Restore => "VirtualMachineRestore",
            TaskKind::Snapshot => "VirtualMachineSnapshot",
        }
    }
}

/// The task a pod claims to be, from its annotations (not yet verified): the
/// kind and the object's name. A pod claiming more than one is no task pod.
pub fn claimed_task(pod: &Pod) -> Option<(TaskKind, String)> {
    let annotations = pod.metadata.annotations.as_ref()?;
    let mut claims = [TaskKind::Backup, TaskKind::Restore, TaskKind::Snapshot]
        .into_iter()
        .filter_map(|kind| annotations.get(kind.annotation()).map(|name| (kind, name.clone())));
    match (claims.next(), claims.next()) {
        (Some(claim), None) => Some(claim),
        _ => None,
    }
}

/// The directory of a task pod's log (`0.log`, CRI format).
pub fn log_dir(state_dir: &Path, pod_uid: &str) -> PathBuf {
    state_dir.join("tasks").join(pod_uid)
}

/// One pass over a task pod (see the module doc).
pub(super) async fn sync(
    pod: &Pod,
    agent: &std::sync::Arc<Agent>,
    kind: TaskKind,
    name: &str,
) -> Result<Action, Error> {
    if pod.metadata.deletion_timestamp.is_some() {
        if kind == TaskKind::Backup && agent.task_running(&pod.uid().unwrap_or_default()) {
            // Deleting a backup's pod (or its Job) stops the copy; the VM runs on.
            backup::abort(pod, agent, name).await;
        }
        // Other work is short, or only ever run once; the pod goes now.
        return finish_deletion(pod, agent).await;
    }
    if matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
        return Ok(Action::await_change());
    }
    match verify_job(pod, agent, kind, name).await? {
        Ok(job) => match kind {
            TaskKind::Backup => backup::sync(pod, agent, name, &job).await,
            TaskKind::Restore => restore::sync(pod, agent, name, &job).await,
            TaskKind::Snapshot => snapshot::sync(pod, agent, name, &job).await,
        },
        Err(refusal) => {
            end(pod, agent, Outcome::Failed { reason: "NotAVirtualMachineTask", message: &refusal }).await?;
            Ok(Action::await_change())
        }
    }
}

/// Check the pod's ownership ([`crate::node::tasks`]): `Ok(Ok(job))` when it
/// is a Job's pod as the module doc requires, `Ok(Err(why))` when not.
async fn verify_job(pod: &Pod, agent: &Agent, kind: TaskKind, name: &str) -> Result<Result<Job, String>, Error> {
    let namespace = pod.namespace().unwrap_or_default();
    let pod_name = format!("{namespace}/{}", pod.name_any());
    let Some(owner) = pod
        .owner_references()
        .iter()
        .find(|r| r.controller == Some(true) && r.kind == "Job" && r.api_version == "batch/v1")
    else {
        return Ok(Err(format!(
            "pod {pod_name} names {} {name} but is not a Job's pod (no controlling ownerReference of kind Job); \
             backups and restores run only as Jobs",
            kind.object_kind()
        )));
    };
    let jobs: Api<Job> = Api::namespaced(agent.client.clone(), &namespace);
    let job = jobs.get_opt(&owner.name).await.map_err(|source| Error::Kube {
        action: "read the Job of",
        pod: pod.name_any(),
        source,
    })?;
    let Some(job) = job.filter(|j| j.uid().as_deref() == Some(owner.uid.as_str())) else {
        return Ok(Err(format!(
            "pod {pod_name} names Job {} (UID {}) as its owner, and its namespace has no such Job",
            owner.name, owner.uid
        )));
    };
    let job_owner = job.owner_references().iter().find(|r| r.controller == Some(true)).cloned();
    if let Some(job_owner) = job_owner {
        let other_task = matches!(
            job_owner.kind.as_str(),
            "VirtualMachineBackup" | "VirtualMachineRestore" | "VirtualMachineSnapshot"
        ) && job_owner.api_version.starts_with("vmlet.io/");
        if other_task && (job_owner.kind != kind.object_kind() || job_owner.name != name) {
            return Ok(Err(format!(
                "pod {pod_name} names {} {name}, but its Job belongs to {} {}",
                kind.object_kind(),
                job_owner.kind,
                job_owner.name
            )));
        }
    }
    Ok(Ok(job))
}

/// Whether `job` is the own Job of `kind` object `name` (its controlling
/// owner). Only such a Job's pod, or the pod that claimed the object, may
/// write a failure into the object; any other pod naming it (a user's Job)
/// fails on its own, so it cannot end someone else's operation.
pub(super) fn job_is_objects(job: &Job, kind: TaskKind, name: &str) -> bool {
    job.owner_references().iter().any(|r| {
        r.controller == Some(true)
            && r.kind == kind.object_kind()
            && r.name == name
            && r.api_version.starts_with("vmlet.io/")
    })
}

/// How a task pod ends, or that it runs.
pub(super) enum Outcome<'a> {
    /// The work runs.
    Running,
    /// Done.
    Succeeded { message: &'a str },
    /// Failed for good.
    Failed { reason: &'a str, message: &'a str },
}

/// Write the pod's status for `outcome`, as a kubelet shows a container that
/// runs or ended (exit code 0 or 1, with the message).
pub(super) async fn end(pod: &Pod, agent: &Agent, outcome: Outcome<'_>) -> Result<(), Error> {
    let container = pod.spec.as_ref().and_then(|s| s.containers.first()).map(|c| c.name.clone()).unwrap_or_default();
    let image = pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone()).unwrap_or_default();
    write_status(pod, agent, |p| {
        let old = p.status.clone().unwrap_or_default();
        let started = old.start_time.clone().unwrap_or_else(|| Time(Timestamp::now()));
        let now = Time(Timestamp::now());
        let (phase, ready, state, reason, message) = match &outcome {
            Outcome::Running => (
                "Running",
                true,
                ContainerState {
                    running: Some(ContainerStateRunning { started_at: Some(started.clone()) }),
                    ..Default::default()
                },
                None,
                None,
            ),
            Outcome::Succeeded { message } => (
                "Succeeded",
                false,
                terminated(0, "Completed", message, &started, &now),
                None,
                Some((*message).to_owned()),
            ),
            Outcome::Failed { reason, message } => (
                "Failed",
                false,
                terminated(1, reason, message, &started, &now),
                Some((*reason).to_owned()),
                Some((*message).to_owned()),
            ),
        };
        let condition = |type_: &str, status: bool| {
            let status = if status { "True" } else { "False" };
            let unchanged = old
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == type_ && c.status == status)
                .and_then(|c| c.last_transition_time.clone());
            PodCondition {
                type_: type_.to_owned(),
                status: status.to_owned(),
                last_transition_time: Some(unchanged.unwrap_or_else(|| now.clone())),
                ..Default::default()
            }
        };
        PodStatus {
            phase: Some(phase.to_owned()),
            reason,
            message,
            host_ip: Some(agent.host_ip.clone()),
            start_time: Some(started.clone()),
            conditions: Some(vec![
                condition("PodScheduled", true),
                condition("Initialized", true),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ]),
            container_statuses: Some(vec![ContainerStatus {
                name: container.clone(),
                image: image.clone(),
                image_id: String::new(),
                ready,
                started: Some(ready),
                restart_count: 0,
                state: Some(state),
                ..Default::default()
            }]),
            ..old
        }
    })
    .await
}

fn terminated(exit_code: i32, reason: &str, message: &str, started: &Time, now: &Time) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code,
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            started_at: Some(started.clone()),
            finished_at: Some(now.clone()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Append `line` to the pod's log (best effort: a log that cannot be written
/// never fails the work; it is logged).
pub(super) fn log_line(agent: &Agent, pod_uid: &str, line: &str) {
    let dir = log_dir(&agent.state_dir, pod_uid);
    if let Err(e) = super::console::append_lines(&dir, &format!("{line}\n")) {
        tracing::warn!(dir = %dir.display(), error = %e, "could not write a task pod's log");
    }
}

/// `n` bytes as MiB with one decimal.
pub(super) fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1024.0 * 1024.0))
}

/// How often a running task's object status is written at most.
pub(super) const STATUS_EVERY: Duration = Duration::from_secs(5);

/// RFC 3339 now.
pub(super) fn now() -> String {
    Timestamp::now().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn pod_with(annotations: &[(&str, &str)]) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.annotations =
            Some(annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect::<BTreeMap<_, _>>());
        pod
    }

    #[test]
    fn a_pod_is_the_task_its_one_annotation_names() {
        let snapshot = pod_with(&[("vmlet.io/snapshot", "before-upgrade")]);
        assert_eq!(claimed_task(&snapshot), Some((TaskKind::Snapshot, "before-upgrade".to_owned())));
        let restore = pod_with(&[("vmlet.io/restore", "back"), ("unrelated", "x")]);
        assert_eq!(claimed_task(&restore), Some((TaskKind::Restore, "back".to_owned())));
        assert_eq!(claimed_task(&pod_with(&[])), None);
    }

    #[test]
    fn a_pod_claiming_two_tasks_is_none() {
        let both = pod_with(&[("vmlet.io/snapshot", "s"), ("vmlet.io/backup", "b")]);
        assert_eq!(claimed_task(&both), None);
    }
}
