//! [`vmlet_provider::Backup::abort_backup`]: the VM's backup job to one
//! target cancelled (`virDomainAbortJob`) and waited out, its partial files
//! (that target and the job's other disks' targets) removed. Only a backup
//! job whose push targets (`virDomainBackupGetXMLDesc`) include that file is
//! touched: a migration, or a backup to other files, is left alone.

use std::time::Instant;

use virt::connect::Connect;
use vmlet_provider::{Error, ErrorKind, Result, VmId};

use super::{ABORT_DEADLINE, ABORT_GRACE, OP_ABORT, POLL_DEADLINE, POLL_INTERVAL};
use crate::error::{from_libvirt, is_operation_invalid};
use crate::jobs::{abort_job, backup_targets};
use crate::provider::{Host, LibvirtProvider};

impl Host {
    /// The files VM `id`'s backup job writes when one of them is `target`;
    /// `None` when no such job runs (or this host has no such VM).
    fn backup_job_to(&self, conn: &Connect, id: &VmId, target: &str) -> Result<Option<Vec<String>>> {
        let domain = match self.require(conn, OP_ABORT, id) {
            Ok(domain) => domain,
            Err(err) if err.kind == ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        let targets = backup_targets(&domain).map_err(|e| from_libvirt(OP_ABORT, e))?;
        Ok(targets.filter(|targets| targets.iter().any(|t| t == target)))
    }

    /// `virDomainAbortJob` on VM `id` while its backup job writes `target`;
    /// the files the job writes when it was asked to end (`None` when no
    /// such job runs, or it ended just before).
    fn abort_backup_to(&self, conn: &Connect, id: &VmId, target: &str) -> Result<Option<Vec<String>>> {
        let Some(files) = self.backup_job_to(conn, id, target)? else {
            return Ok(None);
        };
        let domain = self.require(conn, OP_ABORT, id)?;
        match abort_job(&domain) {
            Ok(()) => Ok(Some(files)),
            // No job any more: it ended by itself meanwhile.
            Err(err) if is_operation_invalid(&err) => Ok(None),
            Err(err) => Err(from_libvirt(OP_ABORT, err)),
        }
    }
}

impl LibvirtProvider {
    /// See [`vmlet_provider::Backup::abort_backup`]: returns within about a
    /// minute and a half (the abort, then the wait for QEMU to end the job).
    pub(super) async fn abort_backup_job(&self, id: &VmId, target: &str) -> Result<bool> {
        super::check_path(OP_ABORT, "backup target", target)?;
        let (task_id, task_target) = (id.clone(), target.to_owned());
        let aborted = self
            .blocking_within(OP_ABORT, ABORT_DEADLINE, move |host, conn| {
                host.abort_backup_to(conn, &task_id, &task_target)
            })
            .await?;
        let Some(files) = aborted else {
            return Ok(false);
        };
        tracing::info!(vm.uid = %id, backup.target = %target, "backup job aborted; waiting for it to end");
        let until = Instant::now() + ABORT_GRACE;
        loop {
            let (task_id, task_target) = (id.clone(), target.to_owned());
            let running = self
                .blocking_within(OP_ABORT, POLL_DEADLINE, move |host, conn| {
                    host.backup_job_to(conn, &task_id, &task_target).map(|job| job.is_some())
                })
                .await;
            match running {
                Ok(false) => break,
                Ok(true) | Err(_) if Instant::now() < until => tokio::time::sleep(POLL_INTERVAL / 4).await,
                Ok(true) => {
                    return Err(Error::new(
                        OP_ABORT,
                        ErrorKind::Transient,
                        format!(
                            "the backup of VM {id} to {target} was aborted but had not ended {}s later; call again",
                            ABORT_GRACE.as_secs()
                        ),
                    ))
                }
                Err(err) => return Err(err),
            }
        }
        let partial = self.discard_partials(files.iter().map(String::as_str));
        tracing::info!(vm.uid = %id, backup.target = %target, partial, "aborted backup ended");
        Ok(true)
    }
}
