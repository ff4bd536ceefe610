//! The node agent's side of storage roots ([`crate::storage`]): the host's
//! roots, resolved once at start (the pod sync checks a VM against them right
//! before its define), and the report of a refusal on the VM's pod.
//!
//! A refusal defines nothing and stops nothing. The pod's container waits with
//! reason `StorageNotAllowed` and the refusal's message (the VirtualMachine's
//! `Ready` condition carries both); one Warning Event says the same. Whether
//! the refusal was reported already is read from the pod itself, so later
//! passes publish no second Event and write nothing. A refused pod is checked
//! again when it or its VirtualMachine changes, or after [`RECHECK`].

use super::pod_status::{pod_status, Observed};
use super::pods::{write_status, Error};
use super::Agent;
use crate::config::HostConfig;
use crate::events::Reason;
use crate::storage::{StorageRefusal, StorageRoots};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::Action;
use std::time::Duration;
use tracing::{debug, info, warn};
use vmlet_provider::HostInfo;

/// How long a refused pod waits before it is checked again, unless it or its
/// VirtualMachine changes first. Long: only a change of the VM's files (a new
/// pod) or of the host's roots (a vmlet restart) can lift a refusal.
pub(super) const RECHECK: Duration = Duration::from_secs(300);

/// The storage roots of `host` (its config's, else the backend's default in
/// `info`), logged once, with any backend default that was ignored.
pub(super) fn roots_for(host: &HostConfig, info: &HostInfo) -> StorageRoots {
    let roots = StorageRoots::for_host(host, info);
    for (root, why) in roots.ignored() {
        warn!(storage.root = %root, reason = %why, "ignoring a default storage root the backend reports");
    }
    info!(
        storage.roots = %roots,
        storage.origin = roots.origin().as_str(),
        storage.resolves_links = roots.resolves_links(),
        "VM disk images, kernels and initrds are allowed only under these storage roots"
    );
    roots
}

/// Report `refusal` on `pod` (the container waits with reason
/// `StorageNotAllowed`, one Warning Event) unless the pod shows it already;
/// then wait for a change. Errors: the status write failed (the pass retries;
/// no Event was published yet).
pub(super) async fn refuse(pod: &Pod, agent: &Agent, refusal: &StorageRefusal) -> Result<Action, Error> {
    let message = refusal.to_string();
    if shows_refusal(pod, &message) {
        debug!(field = %refusal.field, path = %refusal.path, "storage refusal already reported; waiting for a change");
        return Ok(Action::requeue(RECHECK));
    }
    warn!(
        field = %refusal.field,
        path = %refusal.path,
        storage.roots = ?refusal.roots,
        "the VM names a host file it may not (outside the storage roots, or from an untrusted namespace); not defining it"
    );
    // Status first: once it shows the refusal, no later pass publishes again.
    let reason = Reason::StorageNotAllowed.as_str();
    write_status(pod, agent, |p| {
        pod_status(p, &agent.host_ip, &Observed::Waiting { reason, message: &message }, false)
    })
    .await?;
    agent.events.publish(pod, Reason::StorageNotAllowed, &message);
    Ok(Action::requeue(RECHECK))
}

/// True when `pod`'s container already waits with reason `StorageNotAllowed`
/// and `message`.
fn shows_refusal(pod: &Pod, message: &str) -> bool {
    crate::vmpod::waiting_reason(pod) == Some((Reason::StorageNotAllowed.as_str(), Some(message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{PodBuilder, VmBuilder};

    fn pod_waiting(reason: &str, message: &str) -> Pod {
        let mut pod = PodBuilder::for_vm(&VmBuilder::new("web").build()).on_node("host-a").build();
        pod.status = Some(pod_status(&pod, "127.0.0.1", &Observed::Waiting { reason, message }, false));
        pod
    }

    #[test]
    fn a_pod_that_shows_the_same_refusal_is_not_reported_again() {
        assert!(shows_refusal(
            &pod_waiting("StorageNotAllowed", "spec.image \"/etc/shadow\" …"),
            "spec.image \"/etc/shadow\" …"
        ));
    }

    #[test]
    fn a_new_refusal_or_another_waiting_reason_is_reported() {
        let pod = pod_waiting("StorageNotAllowed", "spec.image \"/etc/shadow\" …");
        assert!(!shows_refusal(&pod, "spec.kernelBoot.kernel \"/boot/vmlinuz\" …"));
        assert!(!shows_refusal(&pod_waiting("ProviderFailed", "boom"), "boom"));
        let fresh = PodBuilder::for_vm(&VmBuilder::new("web").build()).on_node("host-a").build();
        assert!(!shows_refusal(&fresh, "anything"));
    }
}
