//! Admission of a VM pod by the node it is bound to, as the kubelet admits
//! pods (its predicate admit handler: node selector, required node affinity
//! and taints): whoever bound the pod, a VM is defined on a host only when
//! that host's Node satisfies the VirtualMachine's own placement fields.
//!
//! A pod may reach a node without the scheduler: anyone who may create pods
//! may set `spec.nodeName`, and a pod of the VM's name, owned by it, could
//! be made before the controller's (a tenant watching `status.podName`).
//! So the agent decides from the VirtualMachine (`spec.nodeSelector`,
//! `spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`,
//! `spec.tolerations` plus the tolerations vmlet gives every VM pod) and
//! the Node object the scheduler reads, never from the pod's copy of them.
//! Taints that Kubernetes manages for node conditions
//! (`node.kubernetes.io/*`, e.g. `unschedulable`) are the scheduler's
//! business and not checked here. A rejected pod is marked Failed (the
//! controller then makes a new one, which the scheduler places); a rejected
//! migration target fails the migration, and the VM stays where it is.
//! Capacity is not checked (the scheduler's accounting of the node).

use crate::v1alpha1::VirtualMachineSpec;
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration};
use kube::ResourceExt;

/// Why a node does not admit a VM: the pod's `status.reason` (the kubelet's
/// predicate names) and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Rejection {
    /// `NodeAffinity` (selector or required affinity) or `TaintToleration`.
    pub reason: &'static str,
    /// What does not match, naming the field.
    pub message: String,
}

/// Whether `node` admits a VM of spec `vm` (its own placement fields, and
/// `extra` tolerations that vmlet adds to every VM pod).
/// Errors: the first [`Rejection`]: an unmatched `spec.nodeSelector` entry,
/// no matching required node-affinity term, or an untolerated taint.
pub fn admit(vm: &VirtualMachineSpec, extra: &[Toleration], node: &Node) -> Result<(), Rejection> {
    let labels = node.labels();
    let node_name = node.name_any();
    for (key, value) in vm.node_selector.iter().flatten() {
        if labels.get(key) != Some(value) {
            return Err(Rejection {
                reason: "NodeAffinity",
                message: format!(
                    "node {node_name} does not match spec.nodeSelector {key}={value} of the VirtualMachine; its pod \
                     was bound there without the scheduler"
                ),
            });
        }
    }
    let required = vm
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref());
    if let Some(required) = required {
        if !required.node_selector_terms.iter().any(|term| term_matches(term, labels, &node_name)) {
            return Err(Rejection {
                reason: "NodeAffinity",
                message: format!(
                    "node {node_name} matches no term of spec.affinity.nodeAffinity.\
                     requiredDuringSchedulingIgnoredDuringExecution of the VirtualMachine; its pod was bound there \
                     without the scheduler"
                ),
            });
        }
    }
    let tolerations: Vec<&Toleration> = vm.tolerations.iter().flatten().chain(extra).collect();
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_deref()).unwrap_or_default();
    for taint in taints {
        let enforced = matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute");
        if enforced && !taint.key.starts_with("node.kubernetes.io/") && !tolerations.iter().any(|t| tolerates(t, taint))
        {
            return Err(Rejection {
                reason: "TaintToleration",
                message: format!(
                    "node {node_name} has taint {}={}:{}, which spec.tolerations of the VirtualMachine do not \
                     tolerate; its pod was bound there without the scheduler",
                    taint.key,
                    taint.value.as_deref().unwrap_or_default(),
                    taint.effect
                ),
            });
        }
    }
    Ok(())
}

/// [`admit`] by the Node of `agent`'s host (its labels and taints as the
/// scheduler reads them), for a VM of spec `vm` with the tolerations every
/// VM pod gets. The Node comes from the process's Node watch cache, as a
/// kubelet's admission reads its informer's; only when the cache has none
/// (before its first list) is it read from the API server.
/// Errors: reading the Node failed (the pass retries). A Node that is gone
/// admits nothing.
pub(super) async fn admit_here(
    agent: &super::Agent,
    vm: &VirtualMachineSpec,
) -> Result<Result<(), Rejection>, super::pods::Error> {
    let name = agent.host.name.as_str();
    let node = match agent.watches.nodes.get(&kube::runtime::reflector::ObjectRef::new(name)) {
        Some(cached) => Some(cached),
        None => {
            let nodes: kube::Api<Node> = kube::Api::all(agent.client.clone());
            let read = nodes.get_opt(name).await.map_err(|source| super::pods::Error::Kube {
                action: "read the Node of",
                pod: name.to_owned(),
                source,
            })?;
            read.map(std::sync::Arc::new)
        }
    };
    let Some(node) = node else {
        return Ok(Err(Rejection { reason: "NodeAffinity", message: format!("node {name} is gone") }));
    };
    Ok(admit(vm, &crate::vmpod::vm_pod_tolerations(), &node))
}

/// A node selector term: all its expressions and fields hold; an empty term
/// matches nothing (as in Kubernetes).
fn term_matches(term: &NodeSelectorTerm, labels: &std::collections::BTreeMap<String, String>, name: &str) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions.iter().all(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| r.key == "metadata.name" && requirement_holds(r, Some(name)))
}

/// A requirement (`In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`) on
/// `value`, the label's value (`None`: no such label).
fn requirement_holds(requirement: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = requirement.values.as_deref().unwrap_or_default();
    let number = |text: &str| text.parse::<i64>().ok();
    let compare = |ordering| match (value.and_then(number), values.first().and_then(|v| number(v))) {
        (Some(label), Some(bound)) => label.cmp(&bound) == ordering,
        _ => false,
    };
    match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => compare(std::cmp::Ordering::Greater),
        "Lt" => compare(std::cmp::Ordering::Less),
        _ => false,
    }
}

/// Whether `toleration` tolerates `taint` (Kubernetes' rule: an empty
/// effect matches every effect; `Exists` with an empty key matches every
/// taint; `Equal`, the default, needs the same key and value).
fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        _ => {
            key == taint.key
                && toleration.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(json: serde_json::Value) -> Node {
        let mut base = serde_json::json!({"metadata": {"name": "host-b",
            "labels": {"kubernetes.io/hostname": "host-b", "tenant": "b", "rack": "7"}},
            "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "value": "vmlet", "effect": "NoSchedule"}]}});
        if let (Some(base), Some(extra)) = (base.as_object_mut(), json.as_object()) {
            for (k, v) in extra {
                base.insert(k.clone(), v.clone());
            }
        }
        serde_json::from_value(base).unwrap()
    }

    fn vm(json: serde_json::Value) -> VirtualMachineSpec {
        serde_json::from_value(json).unwrap()
    }

    fn extra() -> Vec<Toleration> {
        vec![crate::vmpod::virtual_node_toleration()]
    }

    #[test]
    fn a_node_outside_the_vms_selector_rejects_it_naming_the_entry() {
        let rejected = admit(
            &vm(serde_json::json!({"nodeSelector": {"kubernetes.io/hostname": "host-a"}})),
            &extra(),
            &node(serde_json::json!({})),
        );
        let rejected = rejected.unwrap_err();
        assert_eq!(rejected.reason, "NodeAffinity");
        assert!(
            rejected.message.starts_with("node host-b does not match spec.nodeSelector kubernetes.io/hostname=host-a"),
            "{rejected}"
        );
        assert_eq!(
            admit(&vm(serde_json::json!({"nodeSelector": {"tenant": "b"}})), &extra(), &node(serde_json::json!({}))),
            Ok(())
        );
    }

    #[test]
    fn required_node_affinity_is_ored_over_terms_and_anded_within() {
        let affinity = |terms: serde_json::Value| {
            vm(
                serde_json::json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}),
            )
        };
        let n = node(serde_json::json!({}));
        let ok = affinity(serde_json::json!([
            {"matchExpressions": [{"key": "tenant", "operator": "In", "values": ["a"]}]},
            {"matchExpressions": [{"key": "tenant", "operator": "In", "values": ["b"]}, {"key": "rack", "operator": "Gt", "values": ["5"]}]}]));
        assert_eq!(admit(&ok, &extra(), &n), Ok(()));
        let no = affinity(serde_json::json!([
            {"matchExpressions": [{"key": "tenant", "operator": "NotIn", "values": ["b"]}]},
            {"matchExpressions": [{"key": "rack", "operator": "Lt", "values": ["5"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["host-a"]}]},
            {}]));
        assert_eq!(admit(&no, &extra(), &n).unwrap_err().reason, "NodeAffinity");
        let by_name = affinity(
            serde_json::json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["host-b"]}]}]),
        );
        assert_eq!(admit(&by_name, &extra(), &n), Ok(()));
        let absent = affinity(serde_json::json!([{"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}]));
        assert_eq!(admit(&absent, &extra(), &n), Ok(()));
    }

    #[test]
    fn an_untolerated_taint_rejects_and_vmlets_own_toleration_counts() {
        let tainted = node(serde_json::json!({"spec": {"taints": [
            {"key": "virtual-kubelet.io/provider", "value": "vmlet", "effect": "NoSchedule"},
            {"key": "tenant", "value": "b", "effect": "NoSchedule"},
            {"key": "soft", "effect": "PreferNoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}));
        let rejected = admit(&vm(serde_json::json!({})), &extra(), &tainted).unwrap_err();
        assert_eq!(rejected.reason, "TaintToleration");
        assert!(rejected.message.contains("taint tenant=b:NoSchedule"), "{rejected}");
        let tolerant = vm(serde_json::json!({"tolerations": [{"key": "tenant", "operator": "Equal", "value": "b"}]}));
        assert_eq!(admit(&tolerant, &extra(), &tainted), Ok(()));
        let wrong_value =
            vm(serde_json::json!({"tolerations": [{"key": "tenant", "value": "a", "effect": "NoSchedule"}]}));
        assert_eq!(admit(&wrong_value, &extra(), &tainted).unwrap_err().reason, "TaintToleration");
        let everything = vm(serde_json::json!({"tolerations": [{"operator": "Exists"}]}));
        assert_eq!(admit(&everything, &[], &tainted), Ok(()));
        assert_eq!(
            admit(&vm(serde_json::json!({})), &[], &node(serde_json::json!({}))).unwrap_err().reason,
            "TaintToleration"
        );
    }
}
