//! [`Migration`] for Nova: to a named compute host.
//!
//! - Live: `os-migrateLive {"host": <target>, "block_migration": "auto"}`
//!   (2.25+; from 2.68 without `force`, so the scheduler checks the target),
//!   then poll the server until its host is the target and it is ACTIVE
//!   with no task. A migration that ends with the server ACTIVE on its
//!   source failed: the error names the migration's status. At the timeout
//!   the running migration is aborted (`DELETE
//!   /servers/{id}/migrations/{migration}`, 2.24+).
//! - Cold: `migrate {"host": <target>}` (2.56+), wait for VERIFY_RESIZE,
//!   `confirmResize`, wait until it is SHUTOFF on the target. Nova cannot
//!   abort a cold migration: at the timeout the error says so.
//! - Progress: `GET /servers/{id}/migrations` (live migrations in progress)
//!   `memory_*_bytes` plus `disk_*_bytes` where the driver reports them.

use std::time::Duration;

use serde_json::json;
use vmlet_provider::{Error, ErrorKind, Migration, MigrationMode, MigrationProgress, MigrationTarget, Result, VmId};

use crate::compute::Server;
use crate::provider::OpenStackProvider;
use crate::session::Cloud;

#[async_trait::async_trait]
impl Migration for OpenStackProvider {
    /// This host: `host` = its node name, `address` = the compute host.
    fn target(&self) -> MigrationTarget {
        MigrationTarget { host: self.node_name.clone(), address: self.host.clone() }
    }

    /// Errors: `NotFound` when this host has no such server; `InvalidInput`
    /// for a target without address, this host as target, or a state that
    /// does not fit the mode (live: ACTIVE; cold: SHUTOFF); `Transient`
    /// when Nova's migration failed or the timeout passed; `Permanent` when
    /// the server went into ERROR.
    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()> {
        const OP: &str = "migrate server";
        if to.address.is_empty() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("host {} has no Nova compute host name", to.host),
            ));
        }
        if to.address == self.host {
            return Err(Error::new(OP, ErrorKind::InvalidInput, format!("server is on {} already", self.host)));
        }
        let server = self.find_here(OP, id).await?;
        let wanted = match mode {
            MigrationMode::Live => "ACTIVE",
            MigrationMode::Cold => "SHUTOFF",
        };
        if server.status != wanted || server.task_state.is_some() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "a {} migration needs a {wanted} server without a task; server {} is {} (task {})",
                    if mode == MigrationMode::Live { "live" } else { "cold" },
                    server.id,
                    server.status,
                    server.task_state.as_deref().unwrap_or("none")
                ),
            ));
        }
        match mode {
            MigrationMode::Live => live_migrate(self, &server, &to.address, timeout).await,
            MigrationMode::Cold => cold_migrate(self, &server, &self.host, &to.address, timeout).await,
        }
    }

    async fn progress(&self, id: &VmId) -> Result<Option<MigrationProgress>> {
        let server = self.find_here("read migration progress", id).await?;
        let migrations = self.cloud.server_migrations(&server.id).await?;
        Ok(migrations.first().map(|m| {
            let sum = |a: Option<u64>, b: Option<u64>| a.unwrap_or(0) + b.unwrap_or(0);
            MigrationProgress {
                processed_bytes: sum(m.memory_processed_bytes, m.disk_processed_bytes),
                remaining_bytes: sum(m.memory_remaining_bytes, m.disk_remaining_bytes),
                total_bytes: sum(m.memory_total_bytes, m.disk_total_bytes),
            }
        }))
    }
}

/// The status of the server's newest migration of `kind` (`live-migration`,
/// `migration`), for messages.
async fn last_migration_status(cloud: &Cloud, server_id: &str, kind: &str) -> String {
    match cloud.migration_records(server_id).await {
        Ok(records) => records
            .into_iter()
            .find(|m| m.migration_type == kind)
            .map(|m| format!("{} (to {})", m.status, m.dest_compute.unwrap_or_default()))
            .unwrap_or_else(|| "no migration record".into()),
        Err(e) => format!("migration record unreadable: {e}"),
    }
}

async fn live_migrate(provider: &OpenStackProvider, server: &Server, target: &str, timeout: Duration) -> Result<()> {
    const OP: &str = "live-migrate server";
    let cloud = &provider.cloud;
    let body = json!({ "os-migrateLive": { "host": target, "block_migration": "auto" } });
    cloud.server_action(OP, &server.id, body).await?;
    tracing::info!(server.id = %server.id, from = %provider.host, to = target, "live migration started");
    let source = provider.host.as_str();
    let waited = provider
        .wait_server(OP, &server.id, &format!("live-migrating to {target}"), timeout, |s| {
            if s.status == "ERROR" {
                Some(Err(Error::new(
                    OP,
                    ErrorKind::Permanent,
                    format!("server {} went into ERROR during its live migration", s.id),
                )))
            } else {
                // ACTIVE with no task: the migration ended, one way or the other.
                (s.status == "ACTIVE" && s.task_state.is_none()).then_some(Ok(()))
            }
        })
        .await;
    match waited {
        Ok(after) if after.host.as_deref() == Some(target) => {
            tracing::info!(server.id = %server.id, to = target, "live migration completed");
            Ok(())
        }
        Ok(after) => {
            let status = last_migration_status(cloud, &server.id, "live-migration").await;
            Err(Error::new(
                OP,
                ErrorKind::Transient,
                format!(
                    "Nova's live migration of server {} to {target} failed: migration {status}; the server still \
                     runs on {}",
                    server.id,
                    after.host.as_deref().unwrap_or(source)
                ),
            ))
        }
        Err(e) if e.kind == ErrorKind::Transient => {
            // The deadline passed: abort what still runs.
            if let Ok(running) = cloud.server_migrations(&server.id).await {
                for m in running {
                    if let Err(abort) = cloud.abort_migration(&server.id, m.id).await {
                        tracing::warn!(server.id = %server.id, migration = m.id, error = %abort, "abort failed");
                    }
                }
            }
            Err(Error::new(OP, ErrorKind::Transient, format!("{}; the live migration was aborted", e.message)))
        }
        Err(e) => Err(e),
    }
}

/// Cold-migrate the stopped `server` from `source` to `target` and confirm;
/// returns once it is SHUTOFF on `target`.
pub(crate) async fn cold_migrate(
    provider: &OpenStackProvider,
    server: &Server,
    source: &str,
    target: &str,
    timeout: Duration,
) -> Result<()> {
    const OP: &str = "cold-migrate server";
    let cloud = &provider.cloud;
    cloud.server_action(OP, &server.id, json!({ "migrate": { "host": target } })).await?;
    tracing::info!(server.id = %server.id, from = source, to = target, "cold migration started");
    let waited = provider
        .wait_server(OP, &server.id, &format!("cold-migrating to {target} (Nova cannot abort it)"), timeout, |s| {
            match (s.status.as_str(), s.task_state.as_deref()) {
                ("VERIFY_RESIZE", _) => Some(Ok(())),
                // Stopped with no task: Nova gave up before moving it.
                ("SHUTOFF", None) => Some(Ok(())),
                ("ERROR", _) => Some(Err(Error::new(
                    OP,
                    ErrorKind::Permanent,
                    format!(
                        "server {} went into ERROR during its cold migration: {}",
                        s.id,
                        s.fault.as_ref().map(|f| f.message.as_str()).unwrap_or("no fault recorded")
                    ),
                ))),
                _ => None,
            }
        })
        .await?;
    if waited.status != "VERIFY_RESIZE" {
        let status = last_migration_status(cloud, &server.id, "migration").await;
        return Err(Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "Nova's cold migration of server {} to {target} failed: migration {status}; it stays on {source}",
                server.id
            ),
        ));
    }
    cloud.server_action("confirm migration", &server.id, json!({ "confirmResize": null })).await?;
    let after = provider.wait_settled("confirm migration", &server.id, "SHUTOFF", timeout).await?;
    if after.host.as_deref() != Some(target) {
        return Err(Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "server {} is on {} after its cold migration to {target}",
                after.id,
                after.host.unwrap_or_default()
            ),
        ));
    }
    tracing::info!(server.id = %server.id, to = target, "cold migration completed");
    Ok(())
}
