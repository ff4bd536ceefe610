//! The node's heartbeat: its Lease in `kube-node-lease`, renewed like the
//! kubelet's, held as this process's identity ([`crate::config::Config::identity`]).
//!
//! The host sets of two vmlet processes never overlap: a process refuses to
//! start while another live one holds the Lease of a node of its config
//! ([`check_free`]), and never renews over such a hold ([`renew`]). A hold is
//! live until its `renewTime + leaseDurationSeconds`; an expired one may be
//! taken over.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use std::time::{Duration, SystemTime};

/// Namespace of node Leases.
pub const NAMESPACE: &str = "kube-node-lease";

/// What [`renew`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewal {
    /// The Lease existed and was renewed.
    Renewed,
    /// There was no Lease (first heartbeat, or the garbage collector removed
    /// it with its deleted Node): one was created.
    Created,
    /// Another live process holds the Lease: it was left as it is.
    HeldElsewhere(Holder),
}

/// Another process's live hold of a node Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its `holderIdentity`.
    pub identity: String,
    /// Until when the hold is live (`renewTime + leaseDurationSeconds`).
    pub until: SystemTime,
}

/// Why this process may not serve its nodes.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Another live vmlet serves the node.
    #[error(
        "node {node} is served by another live vmlet process, {holder:?} (its Lease {NAMESPACE}/{node} holds          for {left_s} s more); stop that process or remove the node from this config; a restarted process          that keeps its `identity` takes its own nodes back"
    )]
    HeldElsewhere {
        /// The node.
        node: String,
        /// The other process's identity.
        holder: String,
        /// Seconds until its hold expires, rounded up.
        left_s: u64,
    },
    /// The Lease could not be read.
    #[error("reading the Lease {NAMESPACE}/{node}: {source}")]
    Read {
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// Who other than `identity` holds `lease` live at `now`, if anyone: a hold
/// without renewTime or duration, or past `renewTime + duration`, is not live.
pub fn held_elsewhere(lease: &Lease, identity: &str, now: SystemTime) -> Option<Holder> {
    let spec = lease.spec.as_ref()?;
    let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty() && *h != identity)?;
    let renewed = SystemTime::from(spec.renew_time.as_ref()?.0);
    let until = renewed + Duration::from_secs(spec.lease_duration_seconds?.max(0) as u64);
    (until > now).then(|| Holder { identity: holder.to_owned(), until })
}

/// Check that no other live process holds the Lease of any of `nodes`
/// (read only: writes nothing). Errors: the first node held elsewhere, or a
/// Lease that could not be read.
pub async fn check_free(leases: &Api<Lease>, nodes: &[String], identity: &str) -> Result<(), CheckError> {
    for node in nodes {
        let lease = leases.get_opt(node).await.map_err(|source| CheckError::Read { node: node.clone(), source })?;
        let now = SystemTime::now();
        if let Some(holder) = lease.as_ref().and_then(|l| held_elsewhere(l, identity, now)) {
            let left = holder.until.duration_since(now).unwrap_or_default();
            return Err(CheckError::HeldElsewhere {
                node: node.clone(),
                holder: holder.identity,
                left_s: left.as_secs() + u64::from(left.subsec_nanos() > 0),
            });
        }
    }
    Ok(())
}

/// Create or renew the Lease of node `name` (owned by the Node with `node_uid`),
/// holder `identity`, duration `duration_seconds`, renewTime now; a Lease
/// another live process holds is left alone ([`Renewal::HeldElsewhere`]).
///
/// `last` is the Lease as this process last wrote it: like the kubelet's
/// heartbeat, a renewal writes over it without reading first (one request,
/// not two), guarded by its resourceVersion. When someone else wrote the
/// Lease meanwhile that write is refused (409) and the Lease is read fresh, so
/// another holder is still seen; when it is gone (404) it is created again
/// ([`Renewal::Created`]). `last` is left holding what was written, or `None`
/// after an error. Errors: a read, create or write the API server refused; the
/// next tick retries with a fresh read.
pub async fn renew(
    leases: &Api<Lease>,
    last: &mut Option<Lease>,
    name: &str,
    identity: &str,
    node_uid: &str,
    duration_seconds: i32,
) -> Result<Renewal, kube::Error> {
    let (renewal, written) = renew_from(leases, last.take(), name, identity, node_uid, duration_seconds).await?;
    *last = written;
    Ok(renewal)
}

async fn renew_from(
    leases: &Api<Lease>,
    last: Option<Lease>,
    name: &str,
    identity: &str,
    node_uid: &str,
    duration_seconds: i32,
) -> Result<(Renewal, Option<Lease>), kube::Error> {
    if let Some(last) = last {
        match leases
            .replace(name, &PostParams::default(), &renewed(last, name, identity, node_uid, duration_seconds))
            .await
        {
            Ok(written) => return Ok((Renewal::Renewed, Some(written))),
            // Written by someone else, or deleted: decide from a fresh read.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    match leases.get_opt(name).await? {
        Some(lease) => {
            if let Some(holder) = held_elsewhere(&lease, identity, SystemTime::now()) {
                return Ok((Renewal::HeldElsewhere(holder), None));
            }
            let lease = renewed(lease, name, identity, node_uid, duration_seconds);
            let written = leases.replace(name, &PostParams::default(), &lease).await?;
            Ok((Renewal::Renewed, Some(written)))
        }
        None => {
            let now = MicroTime(Timestamp::now());
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    namespace: Some(NAMESPACE.to_owned()),
                    owner_references: Some(vec![owner(name, node_uid)]),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(identity.to_owned()),
                    lease_duration_seconds: Some(duration_seconds),
                    renew_time: Some(now.clone()),
                    acquire_time: Some(now),
                    ..LeaseSpec::default()
                }),
            };
            let written = leases.create(&PostParams::default(), &lease).await?;
            Ok((Renewal::Created, Some(written)))
        }
    }
}

/// `lease` held by `identity` from now for `duration_seconds`, owned by the
/// Node as it is now (a re-registered Node has a new UID); a change of holder
/// counts a transition and sets `acquireTime`.
fn renewed(mut lease: Lease, name: &str, identity: &str, node_uid: &str, duration_seconds: i32) -> Lease {
    let now = MicroTime(Timestamp::now());
    lease.metadata.owner_references = Some(vec![owner(name, node_uid)]);
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(identity) {
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.holder_identity = Some(identity.to_owned());
    spec.lease_duration_seconds = Some(duration_seconds);
    spec.renew_time = Some(now);
    lease
}

fn owner(name: &str, node_uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: name.to_owned(),
        uid: node_uid.to_owned(),
        ..OwnerReference::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed: SystemTime, seconds: i32) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                renew_time: Some(MicroTime(renewed.try_into().unwrap())),
                lease_duration_seconds: Some(seconds),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn a_live_lease_of_another_process_is_held_elsewhere_until_it_expires() {
        let now = SystemTime::now();
        let renewed = now - Duration::from_secs(10);
        let held = held_elsewhere(&lease("kvm-1_0a1b2c3d", renewed, 40), "kvm-2_00000000", now).unwrap();
        assert_eq!(held, Holder { identity: "kvm-1_0a1b2c3d".into(), until: renewed + Duration::from_secs(40) });
        let expired = lease("kvm-1_0a1b2c3d", now - Duration::from_secs(41), 40);
        assert_eq!(held_elsewhere(&expired, "kvm-2_00000000", now), None, "an expired hold may be taken over");
    }

    #[test]
    fn a_lease_of_this_process_or_of_nobody_is_free() {
        let now = SystemTime::now();
        assert_eq!(held_elsewhere(&lease("me", now, 40), "me", now), None, "a restart takes its own back");
        assert_eq!(held_elsewhere(&lease("", now, 40), "me", now), None);
        assert_eq!(held_elsewhere(&Lease::default(), "me", now), None);
        let unrenewed = Lease {
            spec: Some(LeaseSpec { holder_identity: Some("other".into()), ..LeaseSpec::default() }),
            ..Lease::default()
        };
        assert_eq!(held_elsewhere(&unrenewed, "me", now), None, "no renewTime: not live");
    }
}
