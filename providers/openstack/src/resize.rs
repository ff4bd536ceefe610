//! [`Resize`] for Nova: by flavor, never live.
//!
//! Nova changes a server's size only by moving it to another flavor (`resize`
//! action), which restarts a running guest; vmlet therefore offers
//! [`ResizeScope::NextStart`] only:
//!
//! - a stopped server (SHUTOFF) is resized at once: `resize` to the smallest
//!   flavor that fits (see [`crate::mapping`]), wait for VERIFY_RESIZE,
//!   `confirmResize`, wait until it is SHUTOFF again (Nova keeps a stopped
//!   server stopped). Where the cloud does not allow resizing on the same
//!   host (`allow_resize_to_same_host = False`, Nova's default), the
//!   scheduler moves the server; vmlet then cold-migrates it back, so that
//!   it stays where vmlet placed it.
//! - a running server gets the flavor id recorded in its metadata
//!   ([`NEXT_FLAVOR_KEY`]); [`vmlet_provider::VmStatus::next_start`] reports it
//!   and `start` applies it before `os-start`.
//!
//! A flavor the user chose (`spec.providerOptions.flavor`, recorded as
//! [`FLAVOR_PIN_KEY`]) is kept as long as it has at least the wanted vCPUs
//! and memory; otherwise the smallest fitting flavor replaces it.
//!
//! Ceilings do not apply: a Nova server's ceilings are its size.

use serde_json::json;
use vmlet_provider::{Error, ErrorKind, Resize, ResizeScope, Resources, Result, VmId};

use crate::compute::Server;
use crate::mapping::{mib_ceil, smallest_fitting, FLAVOR_PIN_KEY, NEXT_FLAVOR_KEY};
use crate::migration::cold_migrate;
use crate::provider::OpenStackProvider;

#[async_trait::async_trait]
impl Resize for OpenStackProvider {
    /// Errors: `Unsupported` for [`ResizeScope::Live`]; `InvalidInput` when
    /// no flavor fits `to`; `Conflict` when the server is busy (paused,
    /// mid-task); `NotFound`; `Transient`.
    async fn resize(&self, id: &VmId, to: Resources, _ceilings: Resources, scope: ResizeScope) -> Result<()> {
        const OP: &str = "resize server";
        if scope == ResizeScope::Live {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                "Nova resizes by flavor and restarts the guest; no live resize (vmlet applies it at the next start)",
            ));
        }
        let server = self.find_here(OP, id).await?;
        let flavors = self.cloud.flavors(false).await?;
        let flavor = smallest_fitting(&flavors, to.cpus, to.memory_bytes).cloned().ok_or_else(|| {
            Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.resources: no flavor has at least {} vCPUs and {} MiB; ask the cloud's operators for one",
                    to.cpus,
                    mib_ceil(to.memory_bytes)
                ),
            )
        })?;
        // The flavor the user chose stays while it is the wanted size (never
        // a bigger one than Kubernetes counts).
        let pinned_fits = server.metadata.contains_key(FLAVOR_PIN_KEY)
            && server.flavor.vcpus == to.cpus
            && server.flavor.ram == mib_ceil(to.memory_bytes);
        let has_it = pinned_fits || (server.flavor.vcpus, server.flavor.ram) == (flavor.vcpus, flavor.ram);
        if has_it {
            if server.metadata.contains_key(NEXT_FLAVOR_KEY) {
                self.cloud.delete_server_metadata(&server.id, NEXT_FLAVOR_KEY).await?;
            }
            return Ok(());
        }
        match (server.status.as_str(), server.task_state.as_deref()) {
            ("SHUTOFF", None) => resize_stopped_to(self, &server, &flavor.id).await.map(|_| ()),
            ("ACTIVE", _) => {
                if server.metadata.get(NEXT_FLAVOR_KEY) != Some(&flavor.id) {
                    self.cloud.set_server_metadata(&server.id, NEXT_FLAVOR_KEY, &flavor.id).await?;
                    tracing::info!(server.id = %server.id, flavor = %flavor.name, "resize waits for the next start");
                }
                Ok(())
            }
            (status, task) => Err(Error::new(
                OP,
                ErrorKind::Conflict,
                format!(
                    "server {} is {status} (task {}); vmlet resizes a running or stopped server",
                    server.id,
                    task.unwrap_or("none")
                ),
            )),
        }
    }
}

/// Resize the stopped `server` to `flavor_id`, confirm, move it back to
/// this host when Nova put it elsewhere, and clear a recorded next flavor.
/// Returns the server as it is afterwards (SHUTOFF, on this host).
pub(crate) async fn resize_stopped_to(
    provider: &OpenStackProvider,
    server: &Server,
    flavor_id: &str,
) -> Result<Server> {
    const OP: &str = "resize server";
    let cloud = &provider.cloud;
    let timeout = cloud.options.task_timeout;
    let known = cloud.flavors(false).await?.iter().any(|f| f.id == flavor_id)
        || cloud.flavors(true).await?.iter().any(|f| f.id == flavor_id);
    if !known {
        tracing::warn!(server.id = %server.id, flavor = flavor_id, "the recorded next flavor is gone; not resizing");
        cloud.delete_server_metadata(&server.id, NEXT_FLAVOR_KEY).await?;
        return cloud.server(&server.id).await?.ok_or_else(|| Error::new(OP, ErrorKind::NotFound, "server gone"));
    }
    cloud.server_action(OP, &server.id, json!({ "resize": { "flavorRef": flavor_id } })).await?;
    let original_vcpus_ram = (server.flavor.vcpus, server.flavor.ram);
    let resized = provider
        .wait_server(OP, &server.id, "waiting for VERIFY_RESIZE", timeout, |s| {
            match (s.status.as_str(), s.task_state.as_deref()) {
                ("VERIFY_RESIZE", _) => Some(Ok(())),
                ("ERROR", _) => Some(Err(Error::new(
                    OP,
                    ErrorKind::Permanent,
                    format!(
                        "Nova's resize of server {} failed: {}",
                        s.id,
                        s.fault.as_ref().map(|f| f.message.as_str()).unwrap_or("no fault recorded")
                    ),
                ))),
                ("SHUTOFF", None) if (s.flavor.vcpus, s.flavor.ram) == original_vcpus_ram => Some(Err(Error::new(
                    OP,
                    ErrorKind::Transient,
                    format!("Nova did not resize server {} (no host could take the new flavor?); vmlet retries", s.id),
                ))),
                _ => None,
            }
        })
        .await?;
    cloud.server_action("confirm resize", &resized.id, json!({ "confirmResize": null })).await?;
    let mut after = provider.wait_settled("confirm resize", &resized.id, "SHUTOFF", timeout).await?;
    if after.host.as_deref() != Some(provider.host.as_str()) {
        tracing::info!(
            server.id = %after.id,
            moved_to = after.host.as_deref().unwrap_or(""),
            "Nova resized the server on another host (allow_resize_to_same_host = False); moving it back"
        );
        let from = after.host.clone().unwrap_or_default();
        cold_migrate(provider, &after, &from, &provider.host, timeout).await?;
        after = cloud.server(&after.id).await?.ok_or_else(|| Error::new(OP, ErrorKind::NotFound, "server gone"))?;
    }
    if after.metadata.contains_key(NEXT_FLAVOR_KEY) {
        cloud.delete_server_metadata(&after.id, NEXT_FLAVOR_KEY).await?;
    }
    tracing::info!(server.id = %after.id, vcpus = after.flavor.vcpus, ram_mib = after.flavor.ram, "resized");
    Ok(after)
}
