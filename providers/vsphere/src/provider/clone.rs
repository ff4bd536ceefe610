//! Making a VM: the clone of its template onto this host, where the
//! config says, with the size, hot-add and ceilings it asks for.

use super::*;

impl VsphereProvider {
    /// Clone `template` onto this host as `spec`'s VM ([`VsphereProvider::placement`]
    /// says where and how), then make sure it has `spec`'s size, hot-add and
    /// ceilings (`ReconfigVM_Task` when the clone did not apply the clone
    /// spec's, as govmomi's simulator, which copies only `numCPUs`,
    /// `memoryMB` and `extraConfig`).
    pub(super) async fn clone_here(&self, spec: &VmSpec, template_name: &str) -> Result<()> {
        const OP: &str = "define VM";
        let host = self.resolved(OP).await?;
        let session = self.session(OP).await?;
        let datacenter = self.vcenter.options.datacenter.as_deref().unwrap_or(&host.datacenter);
        let templates = list_templates(session).await.map_err(provider_error(OP))?;
        let mut matching = templates.iter().filter(|t| t.name == template_name && t.datacenter == datacenter);
        let template = matching.next().ok_or_else(|| {
            ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!("spec.image: datacenter {datacenter} has no template named {template_name:?}"),
            )
        })?;
        if matching.next().is_some() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!(
                    "spec.image: datacenter {datacenter} has two templates named {template_name:?}; vmlet clones \
                     neither until an administrator renames one"
                ),
            ));
        }
        let place = self.placement(session, spec, host, datacenter, template).await?;
        let hardware = hardware_of(spec.cpus, spec.memory_bytes, spec.max_cpus, spec.max_memory_bytes);
        let name = spec.backend_name();
        let request = CloneRequest {
            template: &template.moref,
            folder: &place.folder,
            name: &name,
            host: &host.moref,
            pool: &place.pool,
            datastore: place.datastore.as_ref(),
            snapshot: place.snapshot.as_ref(),
            uid: &spec.id.0,
            hardware,
            nics: &place.nics,
        };
        tracing::info!(
            template = %template_name, vm.backend_name = %name, linked = place.snapshot.is_some(),
            folder = %place.folder.value, pool = %place.pool.value, "cloning template"
        );
        let vm = clone_vm(session, &request, self.vcenter.options.clone_timeout).await.map_err(|e| {
            if e.fault() == Some("DuplicateName") {
                ProviderError::new(
                    OP,
                    ErrorKind::Permanent,
                    format!("a VM named {name} that does not carry this VM's {UID_KEY} exists in vSphere: {e}"),
                )
                .with_source(e)
            } else {
                provider_error(OP)(e)
            }
        })?;
        tracing::info!(vm.moref = %vm.value, "VM cloned");
        let made = self.find_here(OP, &spec.id).await?;
        if !has_hardware(&made, &hardware) {
            reconfigure_hardware(session, &vm, &hardware, self.vcenter.options.task_timeout)
                .await
                .map_err(provider_error(OP))?;
        }
        Ok(())
    }

    /// Where `spec`'s clone of `template` goes and how: the configured VM
    /// folder (default the template's), the pool under this host's compute
    /// resource (default its root pool), the datastore
    /// ([`VsphereProvider::datastore_of`]; default the template's), the
    /// template's current snapshot (a linked clone), and the template's
    /// first network cards re-backed to `spec.networks`.
    ///
    /// Errors: `Permanent` naming the `vcenters[]` field whose name the
    /// datacenter lacks (or has twice); `InvalidInput` naming
    /// `spec.networks` when the template has fewer network cards, or the
    /// datastore `spec.providerOptions.datastore` names is missing;
    /// `Unsupported` for an opaque (NSX) network; those of the reads.
    pub(super) async fn placement(
        &self,
        session: &Session,
        spec: &VmSpec,
        host: &Host,
        datacenter: &str,
        template: &crate::Template,
    ) -> Result<Placement> {
        const OP: &str = "define VM";
        let options = &self.vcenter.options;
        let config_error = |field: &str, why: String| self.config_error(field, why);
        let inventory = read_datacenter(session, datacenter).await.map_err(provider_error(OP))?;
        let folder = match &options.folder {
            Some(name) => inventory.vm_folder(name).map_err(|why| config_error("folder", why))?.clone(),
            None => template.folder.clone().ok_or_else(|| {
                ProviderError::new(
                    OP,
                    ErrorKind::Permanent,
                    format!("template {} has no folder in vSphere", template.name),
                )
            })?,
        };
        let pool = self.pool_of(&inventory, host)?;
        let datastore = match self.datastore_of(spec)? {
            None => None,
            Some(name) => Some(inventory.datastore(name).map_err(|why| {
                if spec.options.contains_key(DATASTORE_OPTION) && options.datastore.as_deref() != Some(name) {
                    config_error("datastores", why)
                } else {
                    config_error("datastore", why)
                }
            })?),
        }
        .cloned();
        let facts = read_template(session, &template.moref).await.map_err(provider_error(OP))?;
        let offers = self.networks_of(spec)?;
        if offers.len() > facts.nics.len() {
            return Err(ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.networks: {} networks, but template {} has {} network cards; name at most {}",
                    offers.len(),
                    template.name,
                    facts.nics.len(),
                    facts.nics.len()
                ),
            ));
        }
        let mut nics = Vec::new();
        for (offer, nic) in offers.iter().zip(&facts.nics) {
            let moref = inventory.network(&offer.network).map_err(|why| config_error("networks[].network", why))?;
            let network = match moref.kind.as_str() {
                "Network" => NicNetwork::Standard { name: offer.network.clone(), moref: moref.clone() },
                "DistributedVirtualPortgroup" => {
                    NicNetwork::Portgroup(read_portgroup(session, moref).await.map_err(provider_error(OP))?)
                }
                other => {
                    return Err(ProviderError::new(
                        OP,
                        ErrorKind::Unsupported,
                        format!(
                            "vcenters[].networks[].network {:?} is a {other}; vmlet joins standard networks and \
                             distributed portgroups",
                            offer.network
                        ),
                    ))
                }
            };
            nics.push(NicBacking { kind: nic.kind.clone(), key: nic.key, network });
        }
        Ok(Placement { folder, pool, datastore, snapshot: facts.snapshot, nics })
    }
}

impl VsphereProvider {
    /// `Permanent`: the `vcenters[]` field `field` does not fit the
    /// inventory (`why`).
    pub(super) fn config_error(&self, field: &str, why: String) -> ProviderError {
        ProviderError::new(
            "define VM",
            ErrorKind::Permanent,
            format!("vcenters[].{field} of vCenter {}: {why}; fix vmlet's configuration", self.vcenter.name),
        )
    }

    /// The pool a VM made on `host` goes to: `resourcePool` under the
    /// host's compute resource, default its root pool. Errors: `Permanent`
    /// when vSphere names no root pool or the configured one is missing.
    pub(super) fn pool_of(&self, inventory: &crate::Datacenter, host: &Host) -> Result<crate::MoRef> {
        let root = host.resource_pool.as_ref().ok_or_else(|| {
            ProviderError::new(
                "define VM",
                ErrorKind::Permanent,
                format!("vSphere reports no resource pool for host {}", self.host),
            )
        })?;
        match &self.vcenter.options.resource_pool {
            Some(name) => Ok(inventory.pool(name, root).map_err(|why| self.config_error("resourcePool", why))?.clone()),
            None => Ok(root.clone()),
        }
    }
}

/// Where and how a clone is made ([`VsphereProvider::placement`]).
pub(super) struct Placement {
    folder: crate::MoRef,
    pool: crate::MoRef,
    datastore: Option<crate::MoRef>,
    snapshot: Option<crate::MoRef>,
    nics: Vec<NicBacking>,
}

/// The size and live-resize ceilings of a VM asked for `cpus` and
/// `memory_bytes` with ceilings `max_cpus` and `max_memory_bytes` (`None`
/// or below the size: the size), memory in vSphere's 4 MiB multiples.
pub(super) fn hardware_of(
    cpus: u32,
    memory_bytes: u64,
    max_cpus: Option<u32>,
    max_memory_bytes: Option<u64>,
) -> Hardware {
    let memory_mib = memory_mib_of(memory_bytes);
    Hardware {
        cpus,
        memory_mib,
        max_cpus: max_cpus.unwrap_or(cpus).max(cpus),
        max_memory_mib: memory_mib_of(max_memory_bytes.unwrap_or(memory_bytes)).max(memory_mib),
    }
}

/// Whether `vm` has `hardware`'s size, hot-add and recorded ceilings.
pub(super) fn has_hardware(vm: &Vm, hardware: &Hardware) -> bool {
    vm.cpus == Some(hardware.cpus)
        && vm.memory_bytes == Some(hardware.memory_mib << 20)
        && vm.sizing.cpu_hot_add == (hardware.max_cpus > hardware.cpus)
        && vm.sizing.memory_hot_add == (hardware.max_memory_mib > hardware.memory_mib)
        && vm.sizing.max_cpus == Some(hardware.max_cpus)
        && vm.sizing.max_memory_bytes == Some(hardware.max_memory_mib << 20)
        && vm.sizing.next_cpus.is_none()
        && vm.sizing.next_memory_bytes.is_none()
}
