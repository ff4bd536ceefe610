//! The cloud's compute hosts: [`Cloud::hypervisors`], one entry per
//! nova-compute hypervisor, for the caller to make one node per host.
//!
//! Sources: `GET /os-hypervisors/detail` pinned to microversion 2.87 (the
//! last that shows `vcpus`, `memory_mb` and `cpu_info`), `GET
//! /os-services?binary=nova-compute` for the availability zone, and, when the
//! catalog has Placement, `GET /resource_providers/{hypervisor id}/inventories`
//! (a compute node's resource provider has the hypervisor's UUID) for
//! totals, reserved amounts and allocation ratios.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde::Deserialize;
use serde_json::Value;
use vmlet_provider::{ErrorKind, Result};

use crate::microversion::HYPERVISOR_CAPACITY;
use crate::session::{Call, Cloud, Service};

const MIB: u64 = 1024 * 1024;

/// How long one reading of the hypervisors serves every host.
const HOSTS_TTL: Duration = Duration::from_secs(10);

/// Whether Nova hears from a hypervisor's compute service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostState {
    /// Its nova-compute reports in.
    Up,
    /// Its nova-compute stopped reporting.
    Down,
}

/// Whether the scheduler may place servers on a hypervisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostStatus {
    /// Enabled.
    Enabled,
    /// Disabled by an operator (see [`Hypervisor::disabled_reason`]).
    Disabled,
}

/// A resource's amounts as Placement holds them for a host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Inventory {
    /// The raw amount (vCPUs; memory in bytes).
    pub total: u64,
    /// Kept back for the host itself.
    pub reserved: u64,
    /// Overcommit factor: Placement allows `(total - reserved) * ratio`.
    pub allocation_ratio: f64,
}

impl Inventory {
    /// What Placement lets servers use: `(total - reserved) * allocation_ratio`,
    /// rounded down.
    pub fn schedulable(&self) -> u64 {
        (self.total.saturating_sub(self.reserved) as f64 * self.allocation_ratio).floor() as u64
    }
}

/// One nova-compute hypervisor.
#[derive(Clone, Debug, PartialEq)]
pub struct Hypervisor {
    /// The compute service's host name (`service.host`): what
    /// `OS-EXT-SRV-ATTR:host`, server create's `host` and migrations name;
    /// the name an [`crate::OpenStackProvider`] is made for.
    pub host: String,
    /// The hypervisor's own name (`hypervisor_hostname`; often the host's FQDN).
    pub hypervisor_hostname: String,
    /// The hypervisor's UUID (also its Placement resource provider's).
    pub id: String,
    /// Up or down.
    pub state: HostState,
    /// Enabled or disabled.
    pub status: HostStatus,
    /// Why an operator disabled it, when they said.
    pub disabled_reason: Option<String>,
    /// The availability zone of its compute service (`os-services` `zone`).
    pub availability_zone: Option<String>,
    /// `hypervisor_type`, e.g. `QEMU`, `fake`.
    pub hypervisor_type: String,
    /// CPU architecture in Kubernetes' terms (`amd64` unless the
    /// hypervisor's `cpu_info.arch` says otherwise).
    pub architecture: String,
    /// The host's IP as Nova knows it.
    pub host_ip: Option<String>,
    /// vCPUs of the host, raw (Placement's `VCPU` total, else
    /// os-hypervisors `vcpus`).
    pub cpus: u32,
    /// Memory of the host in bytes, raw (Placement's `MEMORY_MB` total, else
    /// os-hypervisors `memory_mb`).
    pub memory_bytes: u64,
    /// Placement's `VCPU` inventory, when the catalog has Placement.
    pub vcpu_inventory: Option<Inventory>,
    /// Placement's `MEMORY_MB` inventory in bytes, when the catalog has
    /// Placement.
    pub memory_inventory: Option<Inventory>,
}

#[derive(Deserialize)]
struct RawHypervisor {
    id: Value,
    #[serde(default)]
    hypervisor_hostname: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    hypervisor_type: String,
    #[serde(default)]
    vcpus: Option<u32>,
    #[serde(default)]
    memory_mb: Option<u64>,
    #[serde(default)]
    cpu_info: Value,
    #[serde(default)]
    host_ip: Option<String>,
    service: RawService,
}

#[derive(Deserialize)]
struct RawService {
    host: String,
    #[serde(default)]
    disabled_reason: Option<String>,
}

/// Kubernetes' name for a CPU architecture as Nova (libvirt) names it.
pub(crate) fn kubernetes_arch(nova_arch: &str) -> String {
    match nova_arch {
        "" | "x86_64" | "amd64" => "amd64".into(),
        "aarch64" | "arm64" => "arm64".into(),
        "i686" | "i386" => "386".into(),
        "armv7l" | "armv7" => "arm".into(),
        "ppc64le" => "ppc64le".into(),
        "s390x" => "s390x".into(),
        "riscv64" => "riscv64".into(),
        other => other.into(),
    }
}

/// `cpu_info` is an object since 2.28, a JSON string before.
fn arch_of(cpu_info: &Value) -> String {
    let from_object = |v: &Value| v.get("arch").and_then(Value::as_str).map(str::to_owned);
    let arch = match cpu_info {
        Value::String(text) => serde_json::from_str::<Value>(text).ok().as_ref().and_then(from_object),
        other => from_object(other),
    };
    kubernetes_arch(arch.as_deref().unwrap_or_default())
}

impl Cloud {
    /// Every nova-compute hypervisor of the cloud, with raw capacity and,
    /// where Placement has them, reserved amounts and allocation ratios
    /// (vmlet's caller decides whether to apply the ratios). One reading
    /// serves all callers for 10 s.
    ///
    /// Errors: `PermissionDenied` without the admin role; `Transient`.
    pub async fn hypervisors(&self) -> Result<Arc<Vec<Hypervisor>>> {
        let mut guard = self.hosts.lock().await;
        if let Some((fetched, hosts)) = guard.as_ref() {
            if fetched.elapsed() < HOSTS_TTL {
                return Ok(hosts.clone());
            }
        }
        let hosts = Arc::new(self.read_hypervisors().await?);
        *guard = Some((Instant::now(), hosts.clone()));
        Ok(hosts)
    }

    async fn read_hypervisors(&self) -> Result<Vec<Hypervisor>> {
        const OP: &str = "list hypervisors";
        #[derive(Deserialize)]
        struct Page {
            hypervisors: Vec<RawHypervisor>,
            #[serde(default)]
            hypervisors_links: Vec<serde_json::Map<String, Value>>,
        }
        let mut raw = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let mut call = Call::get("/os-hypervisors/detail").at_most(HYPERVISOR_CAPACITY);
            if let Some(marker) = &marker {
                call = call.query("marker", marker.clone());
            }
            let page: Page = self.json(OP, &call).await?;
            let has_next = page.hypervisors_links.iter().any(|l| l.get("rel").and_then(Value::as_str) == Some("next"));
            let last = page.hypervisors.last().map(|h| id_text(&h.id));
            raw.extend(page.hypervisors);
            match last {
                Some(last) if has_next && Some(&last) != marker.as_ref() => marker = Some(last),
                _ => break,
            }
        }
        let zones = self.service_zones().await?;
        let placement = self.has_service(Service::Placement).await?;
        let mut out = Vec::with_capacity(raw.len());
        for h in raw {
            let id = id_text(&h.id);
            let (vcpu_inventory, memory_inventory) = if placement { self.inventories(&id).await } else { (None, None) };
            out.push(Hypervisor {
                availability_zone: zones.get(&h.service.host).cloned(),
                cpus: vcpu_inventory.map(|i| i.total as u32).or(h.vcpus).unwrap_or(0),
                memory_bytes: memory_inventory.map(|i| i.total).or(h.memory_mb.map(|m| m * MIB)).unwrap_or(0),
                architecture: arch_of(&h.cpu_info),
                host: h.service.host,
                hypervisor_hostname: h.hypervisor_hostname,
                id,
                state: if h.state == "up" { HostState::Up } else { HostState::Down },
                status: if h.status == "enabled" { HostStatus::Enabled } else { HostStatus::Disabled },
                disabled_reason: h.service.disabled_reason.filter(|r| !r.is_empty()),
                hypervisor_type: h.hypervisor_type,
                host_ip: h.host_ip,
                vcpu_inventory,
                memory_inventory,
            });
        }
        Ok(out)
    }

    /// Host → availability zone of its nova-compute service.
    async fn service_zones(&self) -> Result<HashMap<String, String>> {
        #[derive(Deserialize)]
        struct Services {
            services: Vec<RawZone>,
        }
        #[derive(Deserialize)]
        struct RawZone {
            host: String,
            #[serde(default)]
            zone: Option<String>,
        }
        let call = Call::get("/os-services").query("binary", "nova-compute");
        let services: Services = self.json("list compute services", &call).await?;
        Ok(services.services.into_iter().filter_map(|s| Some((s.host, s.zone?))).collect())
    }

    /// Placement's VCPU and MEMORY_MB inventories of the resource provider
    /// `id`; `None`s (with a warning) when Placement has none or fails: they
    /// only refine what Nova said.
    async fn inventories(&self, id: &str) -> (Option<Inventory>, Option<Inventory>) {
        #[derive(Deserialize)]
        struct Inventories {
            inventories: HashMap<String, RawInventory>,
        }
        #[derive(Deserialize)]
        struct RawInventory {
            total: u64,
            #[serde(default)]
            reserved: u64,
            #[serde(default = "one")]
            allocation_ratio: f64,
        }
        fn one() -> f64 {
            1.0
        }
        let call = Call::new(Service::Placement, Method::GET, format!("/resource_providers/{id}/inventories"));
        match self.json::<Inventories>("read placement inventory", &call).await {
            Ok(inv) => {
                let read = |class: &str, unit: u64| {
                    inv.inventories.get(class).map(|i| Inventory {
                        total: i.total * unit,
                        reserved: i.reserved * unit,
                        allocation_ratio: i.allocation_ratio,
                    })
                };
                (read("VCPU", 1), read("MEMORY_MB", MIB))
            }
            Err(e) => {
                if e.kind != ErrorKind::NotFound {
                    tracing::warn!(hypervisor.id = id, error = %e, "no Placement inventory; using os-hypervisors");
                }
                (None, None)
            }
        }
    }
}

/// A hypervisor id as text (a UUID since 2.53, a number before).
fn id_text(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn architecture_comes_from_cpu_info_in_kubernetes_terms() {
        assert_eq!(arch_of(&json!({"arch": "x86_64", "model": "Nehalem"})), "amd64");
        assert_eq!(arch_of(&json!("{\"arch\": \"aarch64\"}")), "arm64");
        assert_eq!(arch_of(&json!({})), "amd64");
        assert_eq!(arch_of(&Value::Null), "amd64");
        assert_eq!(kubernetes_arch("ppc64le"), "ppc64le");
    }

    #[test]
    fn schedulable_capacity_applies_reserved_and_ratio() {
        let inv = Inventory { total: 16, reserved: 2, allocation_ratio: 4.0 };
        assert_eq!(inv.schedulable(), 56);
        let mem = Inventory { total: 8192 * MIB, reserved: 512 * MIB, allocation_ratio: 1.5 };
        assert_eq!(mem.schedulable(), 11520 * MIB);
    }
}
