//! The node's heartbeat: its Lease in `kube-node-lease`, renewed like the kubelet's.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;

/// Namespace of node Leases.
pub const NAMESPACE: &str = "kube-node-lease";

/// What [`renew`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The Lease existed and was renewed.
    Renewed,
    /// There was no Lease (first heartbeat, or the garbage collector removed
    /// it with its deleted Node): one was created.
    Created,
}

/// Create or renew the Lease of node `name` (owned by the Node with `node_uid`),
/// holder `name`, duration `duration_seconds`, renewTime now. A conflict (someone
/// else wrote it meanwhile) is returned; the next tick retries with a fresh read.
pub async fn renew(
    leases: &Api<Lease>,
    name: &str,
    node_uid: &str,
    duration_seconds: i32,
) -> Result<Renewal, kube::Error> {
    let now = MicroTime(Timestamp::now());
    match leases.get_opt(name).await? {
        Some(mut lease) => {
            // Owned by the Node as it is now (a re-registered Node has a new UID).
            lease.metadata.owner_references = Some(vec![owner(name, node_uid)]);
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            spec.holder_identity = Some(name.to_owned());
            spec.lease_duration_seconds = Some(duration_seconds);
            spec.renew_time = Some(now);
            leases.replace(name, &PostParams::default(), &lease).await?;
            Ok(Renewal::Renewed)
        }
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    namespace: Some(NAMESPACE.to_owned()),
                    owner_references: Some(vec![owner(name, node_uid)]),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(name.to_owned()),
                    lease_duration_seconds: Some(duration_seconds),
                    renew_time: Some(now.clone()),
                    acquire_time: Some(now),
                    ..LeaseSpec::default()
                }),
            };
            leases.create(&PostParams::default(), &lease).await?;
            Ok(Renewal::Created)
        }
    }
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
