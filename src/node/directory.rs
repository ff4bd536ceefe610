//! The kubelet API's view of the node agents: which pods this process serves,
//! on which host, with which provider, and where their console history is.

use super::{console, Hosts};
use crate::api::{PodDirectory, PodEntry};
use crate::identity::resolve_cached;
use crate::watches::Watches;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use std::path::PathBuf;
use std::sync::Arc;

/// [`PodDirectory`] over the process's pod watch cache, limited to the pods
/// bound to its hosts' nodes. A pod's VM is resolved through
/// [`crate::identity`] against the VirtualMachine watch cache at every lookup,
/// so a forged or edited pod leads to no VM.
pub struct Directory {
    hosts: Hosts,
    watches: Watches,
    state_dir: PathBuf,
}

impl Directory {
    /// A directory of the pods of `hosts` found in `watches`, with console
    /// history under `state_dir`.
    pub fn new(hosts: Hosts, watches: Watches, state_dir: PathBuf) -> Self {
        Directory { hosts, watches, state_dir }
    }

    fn entry(&self, pod: Arc<Pod>) -> Option<PodEntry> {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone())?;
        let host = self.hosts.get(&node)?;
        let vm = resolve_cached(&pod, &self.watches.vms).ok();
        // A task pod's log is written by the agent only once it verified
        // the pod (crate::node::tasks), keyed by the pod's UID.
        let task = crate::identity::vm_owner(&pod).is_none() && super::tasks::claimed_task(&pod).is_some();
        let log_dir = match &vm {
            Some(vm) => console::vm_log_dir(&self.state_dir, &vm.spec.namespace, &vm.spec.name, &vm.spec.id.0),
            None if task => super::tasks::log_dir(&self.state_dir, &pod.uid().unwrap_or_default()),
            // Not a VM pod: a directory that never exists, so logs are empty.
            None => self.state_dir.join("no-console").join(pod.uid().unwrap_or_default()),
        };
        Some(PodEntry { pod, node: host.name, provider: host.provider, vm: vm.map(|vm| vm.spec.id), task, log_dir })
    }
}

impl PodDirectory for Directory {
    fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry> {
        let key = ObjectRef::<Pod>::new(name).within(namespace);
        self.watches.pods.get(&key).and_then(|pod| self.entry(pod))
    }

    fn pods(&self) -> Vec<PodEntry> {
        self.watches.pods.state().into_iter().filter_map(|pod| self.entry(pod)).collect()
    }
}
