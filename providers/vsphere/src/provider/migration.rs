//! The [`Migration`] capability on vSphere.

use super::*;

/// Migration: `RelocateVM_Task` to another ESXi host of the same vCenter and
/// that host's root pool, disks left on their datastore (shared within a
/// cluster): vMotion of a running VM, a cold relocation of one that is off.
/// A target is named `<vcenter>/<host name>` ([`qualified`]).
#[async_trait::async_trait]
impl Migration for VsphereProvider {
    fn target(&self) -> MigrationTarget {
        MigrationTarget { host: self.node_name.clone(), address: qualified(&self.vcenter, &self.host) }
    }

    /// Errors: `NotFound` when this host has no such VM (it may have moved
    /// already); `InvalidInput` for a target of another vCenter, one the
    /// vCenter does not have, this host itself, or a power state that does
    /// not fit the mode (live: powered on; cold: powered off); the task's
    /// fault by its kind ([`provider_error`]); `Transient` when the task
    /// outlives `timeout` (the move may still finish: the VM is then found
    /// on the target).
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id, target = %to.host))]
    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()> {
        const OP: &str = "migrate VM";
        let invalid = |message: String| ProviderError::new(OP, ErrorKind::InvalidInput, message);
        let Some((vcenter, host_name)) = to.address.split_once('/') else {
            return Err(invalid(format!(
                "target {} has no vSphere address (<vcenter>/<host>): {:?}",
                to.host, to.address
            )));
        };
        if vcenter != self.vcenter.name {
            return Err(invalid(format!(
                "target {} is on vCenter {vcenter}, this VM on {}: vmlet moves VMs within one vCenter",
                to.host, self.vcenter.name
            )));
        }
        if host_name == self.host {
            return Err(invalid(format!("target {} is the VM's own host {}", to.host, self.host)));
        }
        let vm = self.find_here(OP, id).await?;
        let wanted = match mode {
            MigrationMode::Live => PowerState::PoweredOn,
            MigrationMode::Cold => PowerState::PoweredOff,
        };
        if vm.power_state != wanted {
            return Err(invalid(format!(
                "VM {} is {:?}; a {mode:?} migration moves a VM that is {wanted:?}",
                vm.name, vm.power_state
            )));
        }
        let hosts = self.vcenter.hosts().await.map_err(provider_error(OP))?;
        let target = hosts
            .iter()
            .find(|h| h.name == host_name)
            .ok_or_else(|| invalid(format!("vCenter {vcenter} has no host {host_name} (target {})", to.host)))?;
        let pool = target.resource_pool.as_ref().ok_or_else(|| {
            ProviderError::new(
                OP,
                ErrorKind::Permanent,
                format!("vSphere reports no resource pool for host {host_name}"),
            )
        })?;
        let session = self.session(OP).await?;
        tracing::info!(vm.name = %vm.name, to = %host_name, ?mode, "relocating VM");
        relocate_vm(session, &vm.moref, &target.moref, pool, timeout).await.map_err(provider_error(OP))
    }

    /// vmlet does not read a relocation task's progress: `None`.
    async fn progress(&self, _id: &VmId) -> Result<Option<MigrationProgress>> {
        Ok(None)
    }
}
