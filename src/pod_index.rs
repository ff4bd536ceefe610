//! The pods of the shared pod store ([`crate::watches`]) filed by node and by
//! VirtualMachine, so that finding a node's or a VM's pods, and routing a
//! VirtualMachine change to its pods' agents, costs the pods concerned rather
//! than a scan of every pod in the store. At 10,000 VMs such scans, one per
//! VM event and per controller pass, were most of vmlet's CPU.
//!
//! The index names pods; the store holds them. A reader takes the names from
//! here and the objects from the store, and checks each object again (the two
//! are updated one after the other, never under one lock).

use crate::v1alpha1::VM_LABEL;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A VirtualMachine's key in the index: (namespace, name), as a pod's
/// `vmlet.io/vm` label names it.
pub type VmKey = (String, String);

/// Where one pod is filed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Filed {
    node: Option<String>,
    vm: Option<VmKey>,
}

impl Filed {
    fn of(pod: &Pod) -> Filed {
        Filed {
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            vm: pod.labels().get(VM_LABEL).map(|vm| (pod.namespace().unwrap_or_default(), vm.clone())),
        }
    }
}

/// Pods by node (`spec.nodeName`) and by VirtualMachine (the `vmlet.io/vm`
/// label within the pod's namespace). Memory: one entry per pod and key.
#[derive(Debug, Default)]
pub struct PodIndex {
    filed: HashMap<ObjectRef<Pod>, Filed>,
    by_node: HashMap<String, HashSet<ObjectRef<Pod>>>,
    by_vm: HashMap<VmKey, HashSet<ObjectRef<Pod>>>,
}

impl PodIndex {
    /// File `pod` as it is now (a pod bound since, or relabelled, moves).
    pub fn apply(&mut self, pod: &Pod) {
        let key = ObjectRef::from_obj(pod);
        let now = Filed::of(pod);
        if self.filed.get(&key) == Some(&now) {
            return;
        }
        self.remove(&key);
        if let Some(node) = &now.node {
            self.by_node.entry(node.clone()).or_default().insert(key.clone());
        }
        if let Some(vm) = &now.vm {
            self.by_vm.entry(vm.clone()).or_default().insert(key.clone());
        }
        self.filed.insert(key, now);
    }

    /// Forget the pod `key`.
    pub fn remove(&mut self, key: &ObjectRef<Pod>) {
        let Some(old) = self.filed.remove(key) else { return };
        if let Some(node) = old.node {
            unfile(&mut self.by_node, node, key);
        }
        if let Some(vm) = old.vm {
            unfile(&mut self.by_vm, vm, key);
        }
    }

    /// File exactly `pods` (after a list: pods deleted while the watch was
    /// down are forgotten).
    pub fn rebuild(&mut self, pods: impl IntoIterator<Item = Arc<Pod>>) {
        *self = PodIndex::default();
        for pod in pods {
            self.apply(&pod);
        }
    }

    /// The pods bound to `node`.
    pub fn on_node(&self, node: &str) -> Vec<ObjectRef<Pod>> {
        self.by_node.get(node).map(|pods| pods.iter().cloned().collect()).unwrap_or_default()
    }

    /// The pods labelled as VirtualMachine `name`'s in `namespace`.
    pub fn of_vm(&self, namespace: &str, name: &str) -> Vec<ObjectRef<Pod>> {
        let key = (namespace.to_owned(), name.to_owned());
        self.by_vm.get(&key).map(|pods| pods.iter().cloned().collect()).unwrap_or_default()
    }
}

fn unfile<K: std::hash::Hash + Eq>(map: &mut HashMap<K, HashSet<ObjectRef<Pod>>>, key: K, pod: &ObjectRef<Pod>) {
    if let Some(pods) = map.get_mut(&key) {
        pods.remove(pod);
        if pods.is_empty() {
            map.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    /// Pod `namespace/name`, labelled as VM `vm`'s, bound to `node`.
    fn pod(namespace: &str, name: &str, vm: Option<&str>, node: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                labels: vm.map(|vm| [(VM_LABEL.to_owned(), vm.to_owned())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec { node_name: node.map(Into::into), ..PodSpec::default() }),
            status: None,
        }
    }

    fn names(mut refs: Vec<ObjectRef<Pod>>) -> Vec<String> {
        refs.sort_by(|a, b| a.name.cmp(&b.name));
        refs.into_iter().map(|r| format!("{}/{}", r.namespace.unwrap_or_default(), r.name)).collect()
    }

    #[test]
    fn a_pod_is_found_by_its_node_and_its_vm_and_moves_when_bound_or_relabelled() {
        let mut index = PodIndex::default();
        let pending = pod("ns", "web-abc", Some("web"), None);
        index.apply(&pending);
        assert_eq!(names(index.of_vm("ns", "web")), ["ns/web-abc"]);
        assert!(index.on_node("host-a").is_empty(), "not bound yet");
        assert!(index.of_vm("other", "web").is_empty(), "a VM's key includes its namespace");

        let bound = pod("ns", "web-abc", Some("web"), Some("host-a"));
        index.apply(&bound);
        index.apply(&pod("ns", "db-1", Some("db"), Some("host-a")));
        assert_eq!(names(index.on_node("host-a")), ["ns/db-1", "ns/web-abc"]);

        // A tenant relabels its pod: it is no longer filed under the old VM.
        index.apply(&pod("ns", "web-abc", Some("mail"), Some("host-a")));
        assert!(index.of_vm("ns", "web").is_empty());
        assert_eq!(names(index.of_vm("ns", "mail")), ["ns/web-abc"]);

        index.remove(&ObjectRef::from_obj(&bound));
        assert_eq!(names(index.on_node("host-a")), ["ns/db-1"]);
        assert!(index.of_vm("ns", "mail").is_empty());
        assert_eq!(index.by_vm.len(), 1, "empty keys are dropped: {:?}", index.by_vm.keys());
    }

    #[test]
    fn a_rebuild_forgets_pods_the_list_no_longer_has() {
        let mut index = PodIndex::default();
        index.apply(&pod("ns", "gone", Some("gone"), Some("host-a")));
        let kept = Arc::new(pod("ns", "kept", None, Some("host-a")));
        index.rebuild([kept]);
        assert_eq!(names(index.on_node("host-a")), ["ns/kept"]);
        assert!(index.of_vm("ns", "gone").is_empty());
    }
}
