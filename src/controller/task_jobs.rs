//! The Jobs that run backups and restores ([`crate::node::tasks`]): one pod,
//! never retried (a failed copy is reported, not repeated behind the user's
//! back), placed next to the VM or on the backup's host.

use crate::v1alpha1::{MigrationPhase, VirtualMachine, VmPhase, VM_LABEL};
use crate::vmpod::{virtual_node_toleration, CONTAINER_IMAGE, VIRTUAL_NODE_LABEL};
use futures::StreamExt;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Container, PersistentVolumeClaimVolumeSource, Pod, PodAffinity, PodAffinityTerm, PodSpec,
    PodTemplateSpec, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::NamespaceResourceScope;
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Where a task Job's pod must run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskPlacement {
    /// Beside the running VM's pod: required pod affinity to
    /// `vmlet.io/vm=<name>` over `kubernetes.io/hostname`, so the scheduler
    /// follows the VM wherever it runs.
    NextToVm(String),
    /// On this node (a stopped VM's recorded host, a backup's host).
    OnNode(String),
}

/// Where a task about a VM (its backup, its snapshot) may run now
/// ([`vm_task_placement`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmTask {
    /// Here.
    Run(TaskPlacement),
    /// Not while the VM moves to another host (its migration's phase is
    /// Running): the pod would land on the host it leaves. Wait.
    Migrating,
    /// The VM was never defined on a host: there is no disk yet.
    NeverDefined,
}

/// Where a task about `vm` runs: next to its pod while it runs, else on its
/// recorded host; never while the move of a migration runs (a migration that
/// waits for a target host leaves the VM where it is: the task runs there).
pub fn vm_task_placement(vm: &VirtualMachine) -> VmTask {
    let status = vm.status.clone().unwrap_or_default();
    if status.migration.as_ref().is_some_and(|m| m.phase == MigrationPhase::Running) {
        return VmTask::Migrating;
    }
    let running = matches!(status.phase, Some(VmPhase::Running | VmPhase::Migrating)) && status.pod_name.is_some();
    match crate::node::placement::recorded_node(vm) {
        _ if running => VmTask::Run(TaskPlacement::NextToVm(vm.metadata.name.clone().unwrap_or_default())),
        Some(node) => VmTask::Run(TaskPlacement::OnNode(node.to_owned())),
        None => VmTask::NeverDefined,
    }
}

/// What a task Job is for.
pub struct TaskJob<'a> {
    /// The Job's name (`<object>-backup`, `<object>-restore`).
    pub name: String,
    /// The namespace of the object and its VM.
    pub namespace: &'a str,
    /// The controlling owner: the VirtualMachineBackup or Restore.
    pub owner: OwnerReference,
    /// `vmlet.io/backup` or `vmlet.io/restore`, and the object's name: the
    /// pod's annotation and label.
    pub annotation: (&'static str, &'a str),
    /// The container's name (`backup`, `restore`), as `kubectl logs` shows it.
    pub container: &'static str,
    /// Where the pod runs.
    pub placement: TaskPlacement,
    /// The Job's `activeDeadlineSeconds`.
    pub deadline_seconds: i64,
    /// The scope label value of this vmlet's nodes.
    pub scope: &'a str,
    /// Tolerations besides the virtual-node taint's (a backup's: its VM's, so
    /// that the pod can go where the VM is).
    pub tolerations: Vec<Toleration>,
    /// A PersistentVolumeClaim the pod uses (volume `target`): the scheduler
    /// binds it next to the pod, and it cannot be deleted while the pod runs.
    pub claim: Option<String>,
}

/// The Job for `task`: `backoffLimit: 0`, `restartPolicy: Never`, the pod
/// selecting vmlet's virtual nodes of this scope and tolerating their taint.
pub fn task_job(task: &TaskJob<'_>) -> Job {
    let (annotation, object) = task.annotation;
    let mut node_selector = BTreeMap::from([
        (VIRTUAL_NODE_LABEL.0.to_owned(), VIRTUAL_NODE_LABEL.1.to_owned()),
        (crate::config::SCOPE_LABEL.to_owned(), task.scope.to_owned()),
    ]);
    let affinity = match &task.placement {
        TaskPlacement::NextToVm(vm) => Some(Affinity {
            pod_affinity: Some(PodAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                    label_selector: Some(LabelSelector {
                        match_labels: Some(BTreeMap::from([(VM_LABEL.to_owned(), vm.clone())])),
                        ..LabelSelector::default()
                    }),
                    topology_key: "kubernetes.io/hostname".to_owned(),
                    ..PodAffinityTerm::default()
                }]),
                ..PodAffinity::default()
            }),
            ..Affinity::default()
        }),
        TaskPlacement::OnNode(node) => {
            node_selector.insert("kubernetes.io/hostname".to_owned(), node.clone());
            None
        }
    };
    let mut tolerations = task.tolerations.clone();
    tolerations.push(virtual_node_toleration());
    let marks = BTreeMap::from([(annotation.to_owned(), object.to_owned())]);
    Job {
        metadata: ObjectMeta {
            name: Some(task.name.clone()),
            namespace: Some(task.namespace.to_owned()),
            labels: Some(marks.clone()),
            owner_references: Some(vec![task.owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(task.deadline_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(marks.clone()),
                    annotations: Some(marks),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: task.container.to_owned(),
                        image: Some(CONTAINER_IMAGE.to_owned()),
                        ..Container::default()
                    }],
                    restart_policy: Some("Never".to_owned()),
                    node_selector: Some(node_selector),
                    affinity,
                    tolerations: Some(tolerations),
                    volumes: task.claim.as_ref().map(|claim| {
                        vec![Volume {
                            name: "target".to_owned(),
                            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                                claim_name: claim.clone(),
                                read_only: None,
                            }),
                            ..Volume::default()
                        }]
                    }),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// Run `reconcile` over the objects of kind `K` (all namespaces, or
/// `namespace`) and the Jobs labelled `job_label` they own, until
/// `shutdown`; a failed pass is retried after 5 s. The loop of the backup and
/// restore controllers.
pub async fn run_job_owner<K, Ctx, E, Fut>(
    client: Client,
    namespace: Option<&str>,
    job_label: &str,
    reconcile: impl FnMut(Arc<K>, Arc<Ctx>) -> Fut,
    ctx: Arc<Ctx>,
    shutdown: CancellationToken,
) where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    Ctx: Send + Sync + 'static,
    E: std::error::Error + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
{
    let (objects, jobs): (Api<K>, Api<Job>) = match namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client, ns)),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    Controller::new(objects, watcher::Config::default())
        .owns(jobs, watcher::Config::default().labels(job_label))
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(
            reconcile,
            |_, error: &E, _| {
                tracing::warn!(%error, "requeue");
                Action::requeue(Duration::from_secs(5))
            },
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

/// How a task Job ended, once it did: `Some((true, message))` when it
/// completed, `Some((false, message))` when it failed; the message is its
/// pod's (what the agent wrote when it ended the pod), else the Job's.
/// `None` while it runs. Errors: reading the Job's pods failed.
pub async fn job_outcome(client: &Client, job: &Job) -> Result<Option<(bool, String)>, kube::Error> {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
    let ended = |type_: &str| conditions.iter().find(|c| c.type_ == type_ && c.status == "True");
    let (succeeded, condition) = match (ended("Complete"), ended("Failed")) {
        (Some(c), _) => (true, c),
        (None, Some(c)) => (false, c),
        (None, None) => return Ok(None),
    };
    let namespace = job.metadata.namespace.as_deref().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = format!("job-name={}", job.metadata.name.as_deref().unwrap_or_default());
    let listed = pods.list(&ListParams::default().labels(&selector)).await?;
    let pod_message = listed.items.iter().find_map(|p| p.status.as_ref()?.message.clone());
    let message = pod_message.or_else(|| condition.message.clone()).unwrap_or_default();
    Ok(Some((succeeded, message)))
}

/// The message of a Job's `Failed` condition, when it failed (a deadline
/// passed, its pod could not run).
pub fn job_failure(job: &Job) -> Option<String> {
    let conditions = job.status.as_ref()?.conditions.as_ref()?;
    let failed = conditions.iter().find(|c| c.type_ == "Failed" && c.status == "True")?;
    Some(format!(
        "Job {} failed ({}): {}",
        job.metadata.name.as_deref().unwrap_or("?"),
        failed.reason.as_deref().unwrap_or("?"),
        failed.message.as_deref().unwrap_or("")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1alpha1::{Migration, Placement, VirtualMachineStatus};

    fn task(placement: TaskPlacement) -> Job {
        task_job(&TaskJob {
            name: "nightly-backup".into(),
            namespace: "team-a",
            owner: OwnerReference {
                api_version: "vmlet.io/v1alpha1".into(),
                kind: "VirtualMachineBackup".into(),
                name: "nightly".into(),
                uid: "u-1".into(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            },
            annotation: (crate::v1alpha1::BACKUP_ANNOTATION, "nightly"),
            container: "backup",
            placement,
            deadline_seconds: 600,
            scope: "all",
            tolerations: vec![Toleration {
                key: Some("dedicated".into()),
                operator: Some("Equal".into()),
                value: Some("team-a".into()),
                effect: Some("NoSchedule".into()),
                ..Toleration::default()
            }],
            claim: Some("backups".into()),
        })
    }

    #[test]
    fn a_backup_of_a_running_vm_is_pinned_to_its_pod_by_required_pod_affinity_with_its_tolerations() {
        let job = task(TaskPlacement::NextToVm("web".into()));
        let spec = job.spec.unwrap();
        assert_eq!((spec.backoff_limit, spec.active_deadline_seconds), (Some(0), Some(600)));
        let pod = spec.template.spec.unwrap();
        let term =
            &pod.affinity.unwrap().pod_affinity.unwrap().required_during_scheduling_ignored_during_execution.unwrap()
                [0];
        assert_eq!(term.topology_key, "kubernetes.io/hostname");
        assert_eq!(term.label_selector.as_ref().unwrap().match_labels.as_ref().unwrap()["vmlet.io/vm"], "web");
        assert!(!pod.node_selector.as_ref().unwrap().contains_key("kubernetes.io/hostname"));
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let keys: Vec<_> = pod.tolerations.unwrap().into_iter().map(|t| t.key.unwrap_or_default()).collect();
        assert_eq!(keys, ["dedicated", "virtual-kubelet.io/provider"], "the VM's tolerations, then the node's taint");
        let annotations = spec.template.metadata.unwrap().annotations.unwrap();
        assert_eq!(annotations["vmlet.io/backup"], "nightly");
        assert_eq!(job.metadata.owner_references.unwrap()[0].kind, "VirtualMachineBackup");
        let volume = &pod.volumes.unwrap()[0];
        assert_eq!(volume.persistent_volume_claim.as_ref().unwrap().claim_name, "backups", "the target claim");
    }

    fn vm(phase: VmPhase, pod: Option<&str>, node: Option<&str>, migration: Option<MigrationPhase>) -> VirtualMachine {
        let mut vm: VirtualMachine = serde_json::from_value(serde_json::json!({
            "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
            "metadata": {"name": "web", "namespace": "team-a", "uid": "u-1"},
            "spec": {"image": "/var/lib/vmlet/images/web.qcow2", "resources": {"cpu": 1, "memory": "1Gi"}},
        }))
        .unwrap();
        vm.status = Some(VirtualMachineStatus {
            phase: Some(phase),
            pod_name: pod.map(str::to_owned),
            placement: node.map(|n| Placement { node_name: n.to_owned(), backend_id: None }),
            migration: migration.map(|phase| Migration { phase, ..Migration::default() }),
            ..VirtualMachineStatus::default()
        });
        vm
    }

    #[test]
    fn a_task_follows_a_running_vms_pod_goes_to_a_stopped_ones_host_and_waits_out_a_move() {
        let running = vm(VmPhase::Running, Some("web-x"), Some("host-a"), None);
        assert_eq!(vm_task_placement(&running), VmTask::Run(TaskPlacement::NextToVm("web".into())));
        let stopped = vm(VmPhase::Stopped, None, Some("host-b"), None);
        assert_eq!(vm_task_placement(&stopped), VmTask::Run(TaskPlacement::OnNode("host-b".into())));
        assert_eq!(vm_task_placement(&vm(VmPhase::Stopped, None, None, None)), VmTask::NeverDefined);
        let moving = vm(VmPhase::Migrating, Some("web-x"), Some("host-a"), Some(MigrationPhase::Running));
        assert_eq!(vm_task_placement(&moving), VmTask::Migrating);
        let waiting = vm(VmPhase::Migrating, Some("web-x"), Some("host-a"), Some(MigrationPhase::Pending));
        assert_eq!(
            vm_task_placement(&waiting),
            VmTask::Run(TaskPlacement::NextToVm("web".into())),
            "a migration waiting for a host leaves the VM where it is"
        );
    }

    #[test]
    fn a_backup_of_a_stopped_vm_goes_to_its_recorded_host_by_node_selector() {
        let pod = task(TaskPlacement::OnNode("host-b".into())).spec.unwrap().template.spec.unwrap();
        assert!(pod.affinity.is_none());
        let selector = pod.node_selector.unwrap();
        assert_eq!(selector["kubernetes.io/hostname"], "host-b");
        assert_eq!(selector["type"], "virtual-kubelet");
        assert_eq!(selector["vmlet.io/scope"], "all");
    }
}
