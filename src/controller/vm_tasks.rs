//! The part backups and snapshots share: one Job per object, placed where
//! its VM is ([`vm_task_placement`]), run by that host's agent, which writes
//! the object's status ([`crate::node::tasks`]). This module writes status
//! only for what happens around the agent: the Job it made, a VM that does
//! not exist or never ran, a Job that failed before its pod reached an
//! agent, and an outcome the agent could not write (taken from the ended
//! Job).

use super::task_jobs::{job_failure, job_outcome, task_job, vm_task_placement, TaskJob, TaskPlacement, VmTask};
use crate::conditions::new_condition;
use crate::v1alpha1::{OperationPhase, VirtualMachine};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::NamespaceResourceScope;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use std::time::Duration;
use tracing::{info, warn};

/// Seconds a task's Job gets beyond the task's own deadline, so that the
/// agent's message (the task timed out) arrives before the Job's.
const JOB_SLACK_SECONDS: i64 = 120;

/// An object whose work is a Job next to its VM (a backup, a snapshot).
pub trait VmTaskObject:
    Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + std::fmt::Debug
{
    /// What the Job is for, as a word of its name (`<name>-<word>`) and its
    /// container's name: `backup`, `snapshot`.
    const WORD: &'static str;
    /// The pod annotation naming the object.
    const ANNOTATION: &'static str;
    /// The reason of the `Complete` condition when the controller ends it
    /// from its Job.
    const COMPLETE_REASON: &'static str;
    /// The reason of the `Failed` condition.
    const FAILED_REASON: &'static str;

    /// The VM's name, in the object's namespace.
    fn vm_name(&self) -> &str;
    /// Its phase, if any.
    fn phase(&self) -> Option<OperationPhase>;
    /// The pod that claimed it, if one did.
    fn pod_uid(&self) -> Option<&str>;
    /// The Job the controller made for it (`status.jobName`), once made.
    fn job_name(&self) -> Option<&str>;
    /// Seconds the task may take (the Job gets [`JOB_SLACK_SECONDS`] more).
    fn deadline_seconds(&self) -> i64;
    /// A claim the Job's pod uses, if any.
    fn claim(&self) -> Option<String> {
        None
    }
    /// What never having had a host means for it (`there is nothing to …`).
    fn nothing_yet(&self) -> &'static str;
    /// Status fields it gets besides phase, message and conditions when it
    /// ends (e.g. `completionTime`, `readyToUse`), as JSON.
    fn ended_fields(&self, succeeded: bool) -> serde_json::Value;
}

/// Run or follow `object`'s Job until the agent ends it (see the module
/// doc); the object has neither succeeded nor failed yet.
pub async fn run_task<K: VmTaskObject>(object: &K, client: &Client, scope: &str) -> Result<Action, kube::Error> {
    let namespace = object.namespace().unwrap_or_default();
    let name = object.name_any();
    let objects: Api<K> = Api::namespaced(client.clone(), &namespace);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &namespace);
    let job_name = format!("{name}-{}", K::WORD);
    if let Some(job) = jobs.get_opt(&job_name).await? {
        let ours = job.owner_references().iter().any(|r| Some(&r.uid) == object.meta().uid.as_ref());
        if !ours {
            let message =
                format!("Job {job_name} exists and is not this {}'s; delete it or rename the {}", K::WORD, K::WORD);
            return end(&objects, object, false, &message).await;
        }
        if let (Some(message), None) = (job_failure(&job), object.pod_uid()) {
            // The pod never reached an agent (the agent reports its own
            // failures): unless the object says otherwise now. The cached
            // copy may predate the agent's final write, whose message (e.g.
            // why it refused) must not be replaced by the Job's.
            let fresh = objects.get_status(&name).await?;
            let ended = matches!(fresh.phase(), Some(OperationPhase::Succeeded | OperationPhase::Failed));
            if ended {
                return Ok(Action::await_change());
            }
            if fresh.pod_uid().is_none() {
                return end(&objects, &fresh, false, &message).await;
            }
        }
        if let Some((succeeded, message)) = job_outcome(client, &job).await? {
            // The agent ends the pod after it wrote the outcome; an object
            // still Running now lost that write (read again: not the cache).
            let fresh = objects.get_status(&name).await?;
            if fresh.phase() == Some(OperationPhase::Running) {
                warn!(object = %name, succeeded, "the agent's final status was lost; taking the Job's outcome");
                let message = format!("{message} (from Job {job_name}: the agent's final status was not written)");
                return end(&objects, object, succeeded, &message).await;
            }
        }
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    if object.job_name().is_some() {
        // Its Job was made and is gone: someone deleted it, which cancels
        // the work. A new Job would only be refused by the agent (the object
        // is written once, by one pod) and would race the cancellation.
        return job_deleted(object, &objects, client, &job_name).await;
    }

    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), &namespace);
    let vm_name = object.vm_name();
    let Some(vm) = vms.get_opt(vm_name).await? else {
        let message = format!("spec.virtualMachine: namespace {namespace} has no VirtualMachine {vm_name}");
        return end(&objects, object, false, &message).await;
    };
    let placement = match vm_task_placement(&vm) {
        VmTask::Run(placement) => placement,
        VmTask::Migrating => {
            // It waits: the pod would land on the host the VM leaves.
            let message = format!("waiting for VirtualMachine {vm_name}'s migration to end");
            let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "message": message}});
            objects.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        VmTask::NeverDefined => {
            let message =
                format!("VirtualMachine {vm_name} has never been defined on a host: {}", object.nothing_yet());
            return end(&objects, object, false, &message).await;
        }
    };
    if let Some(claim) = object.claim() {
        // The pod would wait for it until the Job's deadline, saying so only in an Event.
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
        if claims.get_opt(&claim).await?.is_none() {
            let message = format!(
                "spec.target.persistentVolumeClaim.claimName: namespace {namespace} has no PersistentVolumeClaim \
                 {claim}; create it (or name another), then a new {}",
                K::WORD
            );
            return end(&objects, object, false, &message).await;
        }
    }
    let job = vm_task_job(object, &vm, job_name.clone(), placement, scope);
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => info!(job = %job_name, "{} Job created", K::WORD),
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e),
    }
    let patch = serde_json::json!({"status": {"phase": OperationPhase::Pending, "jobName": job_name}});
    objects.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// `object`'s Job `job_name` was deleted. A claimed object is ended by the
/// agent that stops the work when the Job's pod goes; this ends it only once
/// that pod is gone too (the agent may be down), or at once when no pod ever
/// claimed it. Requeues while the claiming pod is still there.
async fn job_deleted<K: VmTaskObject>(
    object: &K,
    objects: &Api<K>,
    client: &Client,
    job_name: &str,
) -> Result<Action, kube::Error> {
    let word = K::WORD;
    let Some(pod_uid) = object.pod_uid() else {
        let message = format!(
            "Job {job_name} was deleted before a host ran the {word}: cancelled; create a new {} to try again",
            K::kind(&())
        );
        return end(objects, object, false, &message).await;
    };
    let namespace = object.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let selector = ListParams::default().labels(&format!("job-name={job_name}"));
    if pods.list(&selector).await?.items.iter().any(|p| p.uid().as_deref() == Some(pod_uid)) {
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    let fresh = objects.get_status(&object.name_any()).await?;
    if matches!(fresh.phase(), Some(OperationPhase::Succeeded | OperationPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let message = format!("Job {job_name} was deleted, and its pod {pod_uid} with it: the {word} was cancelled");
    end(objects, &fresh, false, &message).await
}

/// The Job `job_name` that does `object`'s work for `vm` at `placement`
/// (its pod carries the VM's tolerations and the object's claim).
pub fn vm_task_job<K: VmTaskObject>(
    object: &K,
    vm: &VirtualMachine,
    job_name: String,
    placement: TaskPlacement,
    scope: &str,
) -> Job {
    let name = object.name_any();
    task_job(&TaskJob {
        name: job_name,
        namespace: &object.namespace().unwrap_or_default(),
        owner: object.controller_owner_ref(&()).expect("a stored object has a name and UID"),
        annotation: (K::ANNOTATION, &name),
        container: K::WORD,
        placement,
        deadline_seconds: object.deadline_seconds() + JOB_SLACK_SECONDS,
        scope,
        tolerations: vm.spec.tolerations.clone().unwrap_or_default(),
        claim: object.claim(),
    })
}

/// End `object` Succeeded or Failed with `message` (condition `Complete` or
/// `Failed`, as a Job's, and its [`VmTaskObject::ended_fields`]).
pub async fn end<K: VmTaskObject>(
    objects: &Api<K>,
    object: &K,
    succeeded: bool,
    message: &str,
) -> Result<Action, kube::Error> {
    let (phase, type_, reason) = if succeeded {
        (OperationPhase::Succeeded, "Complete", K::COMPLETE_REASON)
    } else {
        warn!(object = %object.name_any(), message, "{} failed", K::WORD);
        (OperationPhase::Failed, "Failed", K::FAILED_REASON)
    };
    let mut status = object.ended_fields(succeeded);
    status["phase"] = serde_json::to_value(phase).expect("a phase serialises");
    status["message"] = message.into();
    status["conditions"] = serde_json::json!([new_condition(type_, true, reason, message, None)]);
    let patch = serde_json::json!({ "status": status });
    objects.patch_status(&object.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::await_change())
}
