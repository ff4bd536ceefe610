//! Builders for test objects that read as sentences (unit tests only).

use crate::v1alpha1::{
    EvictionStrategy, Migration, MigrationPhase, VirtualMachine, VirtualMachineSpec, VirtualMachineStatus, VmResources,
};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ObjectMeta;

/// Builds a [`VirtualMachine`] in namespace `default` with a fixed UID.
#[must_use]
pub struct VmBuilder(VirtualMachine);

impl VmBuilder {
    /// A running (replicas 1) VM with the CRD's defaults.
    pub fn new(name: &str) -> Self {
        let spec: VirtualMachineSpec = serde_json::from_value(serde_json::json!({})).unwrap();
        let mut vm = VirtualMachine::new(name, spec);
        vm.metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            uid: Some("6d0c1e52-0000-4000-8000-000000000001".into()),
            generation: Some(1),
            ..ObjectMeta::default()
        };
        VmBuilder(vm)
    }
    /// `spec.disks`: a claim disk per `(name, claim)`, or a host image disk
    /// for a claim starting with `/` (its path).
    pub fn disks(mut self, disks: &[(&str, &str)]) -> Self {
        self.0.spec.disks = disks
            .iter()
            .map(|(name, source)| {
                let source = if source.starts_with('/') {
                    serde_json::json!({"name": name, "hostImage": {"path": source}})
                } else {
                    serde_json::json!({"name": name, "persistentVolumeClaim": {"claimName": source}})
                };
                serde_json::from_value(source).unwrap()
            })
            .collect();
        self
    }
    /// `spec.replicas: 0`.
    pub fn stopped(mut self) -> Self {
        self.0.spec.replicas = 0;
        self
    }
    /// `spec.resources.cpu`.
    pub fn cpu(mut self, cpu: i32) -> Self {
        self.0.spec.resources = VmResources { cpu, ..self.0.spec.resources };
        self
    }
    /// `spec.resources.memory`.
    pub fn memory(mut self, memory: &str) -> Self {
        self.0.spec.resources.memory = memory.into();
        self
    }
    /// `spec.image`.
    pub fn image(mut self, image: &str) -> Self {
        self.0.spec.image = Some(image.into());
        self
    }
    /// `spec.kernelBoot`.
    pub fn kernel_boot(mut self, kernel: &str, initrd: &str, cmdline: &str) -> Self {
        self.0.spec.kernel_boot = Some(crate::v1alpha1::KernelBoot {
            kernel: kernel.into(),
            initrd: Some(initrd.into()),
            cmdline: Some(cmdline.into()),
        });
        self
    }
    /// `status.nodeName`: the VM's domain is defined on this host.
    pub fn on_host(mut self, host: &str) -> Self {
        self.0.status.get_or_insert_with(VirtualMachineStatus::default).node_name = Some(host.into());
        self
    }
    /// `status.podName`: the controller named the VM's pod.
    pub fn pod_name(mut self, pod: &str) -> Self {
        self.0.status.get_or_insert_with(VirtualMachineStatus::default).pod_name = Some(pod.into());
        self
    }
    /// `status.migration`: a migration away from `source` (pod `source_pod`)
    /// to target pod `target_pod`, in `phase`.
    pub fn migrating(mut self, source: &str, source_pod: &str, target_pod: &str, phase: MigrationPhase) -> Self {
        self.0.status.get_or_insert_with(VirtualMachineStatus::default).migration = Some(Migration {
            source_node: source.into(),
            source_pod: source_pod.into(),
            target_pod: target_pod.into(),
            phase,
            ..Migration::default()
        });
        self
    }
    /// `spec.evictionStrategy`.
    pub fn eviction_strategy(mut self, strategy: EvictionStrategy) -> Self {
        self.0.spec.eviction_strategy = strategy;
        self
    }
    /// The built object.
    pub fn build(self) -> VirtualMachine {
        self.0
    }
}

/// Builds the pod of a VM as the API server would show it.
#[must_use]
pub struct PodBuilder(Pod);

impl PodBuilder {
    /// A pending, unscheduled pod for `vm`.
    pub fn for_vm(vm: &VirtualMachine) -> Self {
        let name = vm
            .status
            .as_ref()
            .and_then(|s| s.pod_name.clone())
            .unwrap_or_else(|| format!("{}-x7k2p", vm.metadata.name.as_deref().unwrap_or_default()));
        let mut pod = crate::vmpod::pod_for_vm(vm, &name, "AllNamespaces", None).unwrap();
        pod.metadata.uid = Some("pod-uid-1".into());
        pod.status = Some(PodStatus { phase: Some("Pending".into()), ..PodStatus::default() });
        PodBuilder(pod)
    }
    /// The scheduler could not place it.
    pub fn unschedulable(mut self, message: &str) -> Self {
        self.status().conditions = Some(vec![PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some(message.into()),
            ..PodCondition::default()
        }]);
        self
    }
    /// Bound to `node`.
    pub fn on_node(mut self, node: &str) -> Self {
        self.0.spec.get_or_insert_with(PodSpec::default).node_name = Some(node.into());
        self
    }
    /// Running and Ready with `ip`, the container ID `libvirt://<uuid>`.
    pub fn running(mut self, ip: &str) -> Self {
        let status = self.status();
        status.phase = Some("Running".into());
        status.pod_ip = Some(ip.into());
        status.pod_ips = Some(vec![k8s_openapi::api::core::v1::PodIP { ip: ip.into() }]);
        status.conditions =
            Some(vec![PodCondition { type_: "Ready".into(), status: "True".into(), ..PodCondition::default() }]);
        status.container_statuses = Some(vec![ContainerStatus {
            name: "vm".into(),
            ready: true,
            container_id: Some("libvirt://0b5c3b3e-0000-4000-8000-00000000000a".into()),
            ..ContainerStatus::default()
        }]);
        self
    }
    /// Evicted (the DisruptionTarget condition an eviction adds) and being
    /// deleted, as `kubectl drain` leaves a pod.
    pub fn evicted(mut self) -> Self {
        self.status().conditions.get_or_insert_with(Vec::new).push(PodCondition {
            type_: "DisruptionTarget".into(),
            status: "True".into(),
            reason: Some("EvictionByEvictionAPI".into()),
            ..PodCondition::default()
        });
        self.deleting()
    }
    /// Named `name` (another pod of the same VM).
    pub fn named(mut self, name: &str) -> Self {
        self.0.metadata.name = Some(name.into());
        self.0.metadata.uid = Some(format!("pod-uid-{name}"));
        self
    }
    /// Deletion requested.
    pub fn deleting(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(Time(jiff_now()));
        self
    }
    /// The built object.
    pub fn build(self) -> Pod {
        self.0
    }
    fn status(&mut self) -> &mut PodStatus {
        self.0.status.get_or_insert_with(PodStatus::default)
    }
}

fn jiff_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}

/// A VirtualMachine `namespace/name` (its UID derived from both, so VMs of
/// different names or namespaces differ) and the pod the controller makes for it.
pub fn vm_and_pod(namespace: &str, name: &str) -> (VirtualMachine, Pod) {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    (namespace, name).hash(&mut hasher);
    let pod_name = format!("{name}-x7k2p");
    let mut vm = VmBuilder::new(name).pod_name(&pod_name).build();
    vm.metadata.namespace = Some(namespace.into());
    vm.metadata.uid = Some(format!("6d0c1e52-0000-4000-8000-{:012x}", hasher.finish() & 0xffff_ffff_ffff));
    let pod = crate::vmpod::pod_for_vm(&vm, &pod_name, namespace, None).expect("a valid VM makes a pod");
    (vm, pod)
}

/// A host whose VMs run and report stats: `(VM id, CPU nanoseconds)`, each
/// with 1 MiB working set; any other id's stats fail `Transient` ("not
/// running"). Its `kind` is `statshost`; `start` fails `NotFound`, the rest
/// of the lifecycle does nothing.
pub struct StatsHost {
    cpu: std::collections::BTreeMap<String, u64>,
}

impl StatsHost {
    /// A host with the VMs `vms` running.
    pub fn new(vms: &[(&str, u64)]) -> Self {
        StatsHost { cpu: vms.iter().map(|(id, ns)| ((*id).to_owned(), *ns)).collect() }
    }
}

#[async_trait::async_trait]
impl vmlet_provider::Provider for StatsHost {
    fn kind(&self) -> &'static str {
        "statshost"
    }
    async fn ping(&self) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn host_info(&self) -> vmlet_provider::Result<vmlet_provider::HostInfo> {
        Err(vmlet_provider::Error::new("host info", vmlet_provider::ErrorKind::Transient, "not in these tests"))
    }
    async fn list(&self) -> vmlet_provider::Result<Vec<vmlet_provider::VmStatus>> {
        Ok(vec![])
    }
    async fn get(&self, _: &vmlet_provider::VmId) -> vmlet_provider::Result<Option<vmlet_provider::VmStatus>> {
        Ok(None)
    }
    async fn ensure_defined(&self, _: &vmlet_provider::VmSpec) -> vmlet_provider::Result<vmlet_provider::VmStatus> {
        Err(vmlet_provider::Error::new("define", vmlet_provider::ErrorKind::InvalidInput, "not in these tests"))
    }
    async fn start(&self, _: &vmlet_provider::VmId) -> vmlet_provider::Result<()> {
        Err(vmlet_provider::Error::new("start", vmlet_provider::ErrorKind::NotFound, "no such VM"))
    }
    async fn shutdown(&self, _: &vmlet_provider::VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    async fn destroy(&self, _: &vmlet_provider::VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
    fn stats(&self) -> Option<&dyn vmlet_provider::Stats> {
        Some(self)
    }
    async fn undefine(&self, _: &vmlet_provider::VmId) -> vmlet_provider::Result<()> {
        Ok(())
    }
}

#[async_trait::async_trait]
impl vmlet_provider::Stats for StatsHost {
    async fn stats(&self, id: &vmlet_provider::VmId) -> vmlet_provider::Result<vmlet_provider::VmStats> {
        match self.cpu.get(&id.0) {
            Some(&cpu_usage_ns) => Ok(vmlet_provider::VmStats { cpu_usage_ns, memory_working_set_bytes: 1 << 20 }),
            None => Err(vmlet_provider::Error::new("stats", vmlet_provider::ErrorKind::Transient, "not running")),
        }
    }
}
