//! The [`Resize`] capability on vSphere.

use super::clone::{hardware_of, has_hardware};
use super::*;

/// Resize (vSphere `ReconfigVM_Task`):
///
/// - Live: a running VM grows (`numCPUs`, `memoryMB`) when its clone has
///   CPU (memory) hot-add, which vmlet enables when the VM's `maxCpu`
///   (`maxMemory`) is above its size, and within those ceilings, recorded
///   in `config.extraConfig` ([`crate::MAX_CPUS_KEY`],
///   [`crate::MAX_MEMORY_KEY`]). vSphere takes neither vCPUs nor memory
///   from a running VM.
/// - Next start: a powered-off VM gets the size, hot-add and ceilings (one
///   core per socket, memory rounded up to a multiple of 4 MiB). A running
///   VM keeps its size; the new one is recorded in `config.extraConfig`
///   ([`crate::NEXT_CPUS_KEY`], [`crate::NEXT_MEMORY_KEY`]), reported as
///   [`VmStatus::next_start`], and the node agent gives it to the VM before
///   its next power-on (saying `RestartRequired`, as on every back end).
#[async_trait::async_trait]
impl Resize for VsphereProvider {
    /// Errors: `InvalidInput` for no vCPU or no memory, and for a live size
    /// above the VM's ceilings; `Unsupported` for a live resize of a VM that
    /// is not running, that shrinks it, or that grows what has no hot-add
    /// (each message says the size applies at its next start); `NotFound` when
    /// this host has no such VM; a task's fault by its kind
    /// ([`provider_error`]). Idempotent: a VM of that size (and, next
    /// start, ceilings) is left alone.
    #[instrument(skip(self), fields(provider = "vsphere", host = %self.host, vm.uid = %id))]
    async fn resize(&self, id: &VmId, to: Resources, ceilings: Resources, scope: ResizeScope) -> Result<()> {
        const OP: &str = "resize VM";
        if to.cpus == 0 || to.memory_bytes == 0 {
            return Err(ProviderError::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.resources: {} vCPUs and {} bytes of memory; both must be at least 1",
                    to.cpus, to.memory_bytes
                ),
            ));
        }
        let vm = self.find_here(OP, id).await?;
        let memory_mib = memory_mib_of(to.memory_bytes);
        let same_size = vm.cpus == Some(to.cpus) && vm.memory_bytes == Some(memory_mib << 20);
        let session = self.session(OP).await?;
        let deadline = self.vcenter.options.task_timeout;
        if scope == ResizeScope::Live {
            if same_size {
                return Ok(());
            }
            check_live(&vm, to.cpus, memory_mib)?;
            tracing::info!(vm.name = %vm.name, cpus = to.cpus, memory_mib, "resizing VM live");
            return reconfigure_live(session, &vm.moref, to.cpus, memory_mib, deadline)
                .await
                .map_err(provider_error(OP));
        }
        let hardware = hardware_of(to.cpus, to.memory_bytes, Some(ceilings.cpus), Some(ceilings.memory_bytes));
        if vm.power_state == PowerState::PoweredOff {
            if has_hardware(&vm, &hardware) {
                return Ok(());
            }
            return reconfigure_hardware(session, &vm.moref, &hardware, deadline).await.map_err(provider_error(OP));
        }
        // Running or suspended: vSphere holds one configuration, whose size
        // changes only by hot-add; the size is recorded for the next start.
        let next = (!same_size).then_some((to.cpus, memory_mib));
        let recorded = vm.sizing.next_cpus.zip(vm.sizing.next_memory_bytes.map(|bytes| bytes >> 20));
        if recorded == next {
            return Ok(());
        }
        tracing::info!(vm.name = %vm.name, ?next, "recording the size of the VM's next start");
        record_next_start(session, &vm.moref, next, deadline).await.map_err(provider_error(OP))
    }
}

/// Whether running `vm` can be given `cpus` and `memory_mib` live: errors
/// as [`Resize::resize`] says for [`ResizeScope::Live`].
pub(super) fn check_live(vm: &Vm, cpus: u32, memory_mib: u64) -> Result<()> {
    const OP: &str = "resize VM";
    let unsupported = |why: String| {
        ProviderError::new(OP, ErrorKind::Unsupported, format!("{why}; the new size applies at its next start"))
    };
    if vm.power_state != PowerState::PoweredOn {
        return Err(unsupported(format!("VM {} is {:?}, not running", vm.name, vm.power_state)));
    }
    let (now_cpus, now_bytes) = (vm.cpus.unwrap_or(0), vm.memory_bytes.unwrap_or(0));
    if cpus < now_cpus || memory_mib << 20 < now_bytes {
        return Err(unsupported(format!(
            "vSphere takes no vCPUs or memory from running VM {} (it has {now_cpus} vCPUs, {} MiB)",
            vm.name,
            now_bytes >> 20
        )));
    }
    for (grows, enabled, what) in [
        (cpus > now_cpus, vm.sizing.cpu_hot_add, "CPU"),
        (memory_mib << 20 > now_bytes, vm.sizing.memory_hot_add, "memory"),
    ] {
        if grows && !enabled {
            return Err(unsupported(format!(
                "VM {} has no {what} hot-add (vmlet enables it at the clone when spec.resources gives a maximum above \
                 the size)",
                vm.name
            )));
        }
    }
    let status = status_of(vm);
    if cpus > status.max_cpus || memory_mib << 20 > status.max_memory_bytes {
        return Err(ProviderError::new(
            OP,
            ErrorKind::InvalidInput,
            format!(
                "{cpus} vCPUs and {memory_mib} MiB exceed VM {}'s ceilings ({} vCPUs, {} MiB) fixed when it was cloned",
                vm.name,
                status.max_cpus,
                status.max_memory_bytes >> 20
            ),
        ));
    }
    Ok(())
}
