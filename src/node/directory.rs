//! The kubelet API's view of the node agents: which pods this process serves,
//! on which host, with which provider, and where their console history is.

use super::{console, Hosts};
use crate::api::{PodDirectory, PodEntry};
use crate::identity::resolve_cached;
use crate::v1alpha1::VirtualMachine;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use std::path::PathBuf;
use std::sync::Arc;

/// [`PodDirectory`] over the agents' pod watch caches. A pod's VM is resolved
/// through [`crate::identity`] against the VirtualMachine watch cache at every
/// lookup, so a forged or edited pod leads to no VM.
pub struct Directory {
    hosts: Hosts,
    vms: Store<VirtualMachine>,
    state_dir: PathBuf,
}

impl Directory {
    /// A directory of the pods of `hosts`, their VMs checked against `vms`, with
    /// console history under `state_dir`.
    pub fn new(hosts: Hosts, vms: Store<VirtualMachine>, state_dir: PathBuf) -> Self {
        Directory { hosts, vms, state_dir }
    }

    fn entry(&self, host: &super::HostHandle, pod: Arc<Pod>) -> PodEntry {
        let vm = resolve_cached(&pod, &self.vms).ok();
        let log_dir = match &vm {
            Some(vm) => console::vm_log_dir(&self.state_dir, &vm.spec.namespace, &vm.spec.name, &vm.spec.id.0),
            // Not a VM pod: a directory that never exists, so logs are empty.
            None => self.state_dir.join("no-console").join(pod.uid().unwrap_or_default()),
        };
        PodEntry { pod, node: host.name.clone(), provider: host.provider.clone(), vm: vm.map(|vm| vm.spec.id), log_dir }
    }
}

impl PodDirectory for Directory {
    fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry> {
        let key = ObjectRef::<Pod>::new(name).within(namespace);
        self.hosts.list().iter().find_map(|host| host.pods.get(&key).map(|pod| self.entry(host, pod)))
    }

    fn pods(&self) -> Vec<PodEntry> {
        self.hosts
            .list()
            .iter()
            .flat_map(|host| host.pods.state().into_iter().map(|pod| self.entry(host, pod)))
            .collect()
    }
}
