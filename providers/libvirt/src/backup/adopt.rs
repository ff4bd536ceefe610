//! A backup that an earlier vmlet process began for the same target, found on
//! the VM when [`vmlet_provider::Backup::backup`] is called again after a
//! restart: followed while libvirt's job still writes the target, answered
//! from libvirt's record of the last completed job once it completed into
//! it, removed (and begun afresh) when it is a leftover.
//!
//! Decide, then act: [`Host::observe_backups`] reads what libvirt says in one
//! blocking call, [`earlier_attempt`] decides from that and the file's
//! presence (a pure function), and [`LibvirtProvider::resume_earlier`] acts.
//!
//! Caveats: libvirt's record of a completed job does not name its target.
//! vmlet takes the last completed backup for the one into the target when
//! the file exists (libvirt removes the target of a failed full backup it
//! created, and nothing but a backup of this caller writes that name) and
//! - for a full backup, the files (the boot disk's target and the data
//!   disks') are qcow2 images whose virtual sizes add up to what the record
//!   says was copied (the disks' virtual sizes);
//! - for a request that names a checkpoint, that checkpoint exists (libvirt
//!   creates it atomically with the backup's beginning; vmlet creates an
//!   incremental backup's file before, so only the checkpoint tells).
//!
//! A full backup without a checkpoint whose earlier attempt was an inactive
//! VM's qemu-img copy, interrupted, after which the VM started and completed
//! a backup to another target, would be mistaken for it. On a remote
//! connection vmlet cannot see the file: only a running job is adopted
//! there.

use std::time::Instant;

use virt::connect::Connect;
use virt::sys;
use vmlet_provider::{BackupOutcome, BackupProgress, BackupRequest, Consistency, Error, ErrorKind, Result, VmId};

use super::{files, INFO_DEADLINE, OP};
use crate::checkpoint::{self, check_name};
use crate::error::from_libvirt;
use crate::jobs::{backup_targets, job_stats, JobStats};
use crate::provider::{is_active, is_local_uri, Host, LibvirtProvider};
use crate::qemu_img;

/// The consistency reported for a job vmlet follows without having begun it.
pub(crate) const UNKNOWN_FREEZE: &str =
    "followed after a restart of vmlet: whether the guest's filesystems were frozen is not known";

/// What libvirt said about a VM's backup jobs ([`Host::observe_backups`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// The VM runs (only a running VM has backup jobs).
    pub(super) active: bool,
    /// The files the VM's running backup job writes; `None` when none runs.
    pub(super) running_targets: Option<Vec<String>>,
    /// libvirt's record of the VM's last completed job (read when no backup
    /// job runs).
    pub(super) completed: Option<JobStats>,
    /// The request's checkpoint exists on the VM.
    pub(super) checkpoint_exists: bool,
    /// One of the request's files (the target, a data disk's) exists;
    /// `None` where vmlet cannot tell (a remote connection).
    pub(super) file_exists: Option<bool>,
    /// The files' virtual sizes added up when all are qcow2 images (read
    /// only where a completed backup may have written them).
    pub(super) file_qcow2_bytes: Option<u64>,
}

/// What became of an earlier attempt at the same backup ([`earlier_attempt`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Earlier {
    /// No trace of one: begin.
    None,
    /// libvirt's backup job writes the target: follow it; it creates this
    /// checkpoint.
    Running { checkpoint: Option<String> },
    /// It completed into the target as `job` records, with this checkpoint.
    Completed { job: JobStats, checkpoint: Option<String> },
    /// The target exists, but nothing writes or completed into it: remove
    /// it, then begin.
    Leftover,
}

/// What to make of what was `seen` for a backup to `request.target`.
/// Errors: `Conflict` while the VM's backup job writes another target.
pub(super) fn earlier_attempt(id: &VmId, request: &BackupRequest, seen: Seen) -> Result<Earlier> {
    let checkpoint = request.checkpoint.clone().filter(|_| seen.checkpoint_exists);
    if let Some(targets) = seen.running_targets {
        if targets.contains(&request.target) {
            return Ok(Earlier::Running { checkpoint });
        }
        return Err(Error::new(
            OP,
            ErrorKind::Conflict,
            format!(
                "VM {id} is busy with a backup to {} (a libvirt job, `virsh domjobinfo`); a backup to {} can begin \
                 once it ended",
                targets.join(", "),
                request.target
            ),
        ));
    }
    if seen.file_exists != Some(true) {
        return Ok(Earlier::None);
    }
    let completed = seen.completed.filter(|job| job.is_backup() && job.job_type == sys::VIR_DOMAIN_JOB_COMPLETED);
    let written = |job: &JobStats| {
        request.incremental.is_some() || (seen.file_qcow2_bytes.is_some() && seen.file_qcow2_bytes == job.total_bytes)
    };
    match completed {
        Some(job) if seen.active && (request.checkpoint.is_none() || seen.checkpoint_exists) && written(&job) => {
            Ok(Earlier::Completed { job, checkpoint })
        }
        _ => Ok(Earlier::Leftover),
    }
}

/// How consistent a backup vmlet did not begin itself is, as far as the
/// request tells: an unquiesced one never froze anything.
fn adopted_consistency(request: &BackupRequest) -> Consistency {
    let reason = if request.quiesce { UNKNOWN_FREEZE } else { "quiesce was not asked" };
    Consistency::CrashConsistent { reason: reason.to_owned() }
}

impl Host {
    /// What libvirt says about VM `id`'s backup jobs, and whether it has
    /// `checkpoint`.
    fn observe_backups(&self, conn: &Connect, id: &VmId, checkpoint: Option<&str>) -> Result<Seen> {
        let domain = self.require(conn, OP, id)?;
        if !is_active(&domain, OP)? {
            return Ok(Seen::default());
        }
        let running_targets = backup_targets(&domain).map_err(|e| from_libvirt(OP, e))?;
        let completed = if running_targets.is_none() {
            // Kept for other readers (and a later call of this one).
            let flags = sys::VIR_DOMAIN_JOB_STATS_COMPLETED | sys::VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED;
            Some(job_stats(&domain, flags).map_err(|e| from_libvirt(OP, e))?)
        } else {
            None
        };
        let checkpoint_exists = match checkpoint {
            Some(name) => checkpoint::lookup(&domain, name).map_err(|e| from_libvirt(OP, e))?.is_some(),
            None => false,
        };
        Ok(Seen { active: true, running_targets, completed, checkpoint_exists, ..Seen::default() })
    }
}

/// The virtual sizes of `request`'s files added up; `None` when one of them
/// is missing or no qcow2 image (a file that is no image is no backup: a
/// leftover).
async fn qcow2_bytes(request: &BackupRequest) -> Option<u64> {
    let mut total = 0;
    for file in files(request) {
        let info = qemu_img::info(OP, file, None, INFO_DEADLINE).await.ok().filter(|info| info.format == "qcow2")?;
        total += info.virtual_size;
    }
    Some(total)
}

impl LibvirtProvider {
    /// Find what an earlier attempt at `request` left and carry it on: the
    /// outcome when it is followed to its end or had completed; `None` when a
    /// backup is to begin (a leftover file removed first).
    pub(super) async fn resume_earlier(
        &self,
        id: &VmId,
        request: &BackupRequest,
        progress: &(dyn Fn(BackupProgress) + Send + Sync),
    ) -> Result<Option<BackupOutcome>> {
        if let Some(name) = &request.checkpoint {
            check_name(OP, "checkpoint", name)?;
        }
        let (task_id, checkpoint) = (id.clone(), request.checkpoint.clone());
        let mut seen = self
            .blocking_within(OP, super::POLL_DEADLINE, move |host, conn| {
                host.observe_backups(conn, &task_id, checkpoint.as_deref())
            })
            .await?;
        if is_local_uri(self.uri()) {
            let mut exists = false;
            for file in files(request) {
                exists |= tokio::fs::symlink_metadata(file).await.is_ok();
            }
            seen.file_exists = Some(exists);
            let completed_backup = seen.completed.as_ref().is_some_and(JobStats::is_backup);
            if exists && completed_backup && request.incremental.is_none() {
                seen.file_qcow2_bytes = qcow2_bytes(request).await;
            }
        }
        let (outcome, checkpoint) = match earlier_attempt(id, request, seen)? {
            Earlier::None => return Ok(None),
            Earlier::Leftover => {
                tracing::info!(vm.uid = %id, backup.target = %request.target, "removing what an interrupted attempt of this backup left");
                files(request).for_each(|file| {
                    qemu_img::remove_partial(file);
                });
                return Ok(None);
            }
            Earlier::Running { checkpoint } => {
                tracing::info!(vm.uid = %id, backup.target = %request.target, "following the backup job an earlier vmlet began");
                let deadline = Instant::now() + request.timeout;
                let consistency = adopted_consistency(request);
                let ended = self.follow_backup(id, request, consistency, deadline, progress).await;
                self.tidy_checkpoints(id, checkpoint.as_deref(), ended.is_ok()).await;
                (ended?, checkpoint)
            }
            Earlier::Completed { job, checkpoint } => {
                tracing::info!(vm.uid = %id, backup.target = %request.target, "the backup an earlier vmlet began has completed");
                let ended = self.backup_ended(id, request, job, adopted_consistency(request), progress).await;
                self.tidy_checkpoints(id, checkpoint.as_deref(), ended.is_ok()).await;
                (ended?, checkpoint)
            }
        };
        Ok(Some(BackupOutcome { checkpoint, ..outcome }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> VmId {
        VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into())
    }

    fn request(checkpoint: Option<&str>) -> BackupRequest {
        BackupRequest {
            target: "/b/this.qcow2".into(),
            data_disks: Vec::new(),
            quiesce: true,
            timeout: std::time::Duration::from_secs(60),
            checkpoint: checkpoint.map(str::to_owned),
            incremental: None,
        }
    }

    fn completed_backup() -> JobStats {
        JobStats {
            job_type: sys::VIR_DOMAIN_JOB_COMPLETED,
            operation: Some(sys::VIR_DOMAIN_JOB_OPERATION_BACKUP),
            processed_bytes: Some(64 << 20),
            total_bytes: Some(64 << 20),
            error: None,
        }
    }

    fn running(targets: &[&str]) -> Seen {
        let running_targets = Some(targets.iter().map(|t| (*t).to_owned()).collect());
        Seen { active: true, running_targets, checkpoint_exists: true, file_exists: Some(true), ..Seen::default() }
    }

    fn ended(completed: Option<JobStats>, file_exists: Option<bool>) -> Seen {
        let file_qcow2_bytes = file_exists.filter(|exists| *exists).map(|_| 64 << 20);
        Seen { active: true, completed, checkpoint_exists: true, file_exists, file_qcow2_bytes, ..Seen::default() }
    }

    #[test]
    fn a_job_writing_the_target_is_followed_with_the_checkpoint_it_creates() {
        let earlier = earlier_attempt(&id(), &request(Some("c-1")), running(&["/b/this.qcow2"])).expect("adopted");
        assert_eq!(earlier, Earlier::Running { checkpoint: Some("c-1".into()) });
        let without = Seen { checkpoint_exists: false, ..running(&["/b/this.qcow2"]) };
        let earlier = earlier_attempt(&id(), &request(Some("c-1")), without).expect("adopted");
        assert_eq!(earlier, Earlier::Running { checkpoint: None }, "a checkpoint the job does not create");
    }

    #[test]
    fn a_job_writing_another_target_is_a_conflict_naming_it() {
        let err = earlier_attempt(&id(), &request(None), running(&["/b/other.qcow2"])).expect_err("busy");
        assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
        assert!(err.message.contains("/b/other.qcow2"), "{err}");
    }

    #[test]
    fn a_completed_backup_is_taken_only_with_its_file_and_checkpoint() {
        let done = earlier_attempt(&id(), &request(Some("c-1")), ended(Some(completed_backup()), Some(true)));
        assert_eq!(done.expect("done"), Earlier::Completed { job: completed_backup(), checkpoint: Some("c-1".into()) });
        let no_file = earlier_attempt(&id(), &request(None), ended(Some(completed_backup()), Some(false)));
        assert_eq!(no_file.expect("begin"), Earlier::None);
        let no_checkpoint = Seen { checkpoint_exists: false, ..ended(Some(completed_backup()), Some(true)) };
        assert_eq!(earlier_attempt(&id(), &request(Some("c-1")), no_checkpoint).expect("leftover"), Earlier::Leftover);
    }

    #[test]
    fn a_full_backups_file_must_be_a_qcow2_of_the_size_copied() {
        for file_qcow2_bytes in [None, Some(1 << 20)] {
            let seen = Seen { file_qcow2_bytes, ..ended(Some(completed_backup()), Some(true)) };
            assert_eq!(earlier_attempt(&id(), &request(None), seen).expect("leftover"), Earlier::Leftover);
        }
        // An incremental backup copies less than the disk: its checkpoint tells.
        let base = vmlet_provider::IncrementalBase {
            checkpoint: "c-0".into(),
            backing_file: "/b/0.qcow2".into(),
            data_backing_files: Vec::new(),
        };
        let incremental = BackupRequest { incremental: Some(base), ..request(Some("c-1")) };
        let seen = Seen { file_qcow2_bytes: None, ..ended(Some(completed_backup()), Some(true)) };
        assert!(matches!(earlier_attempt(&id(), &incremental, seen), Ok(Earlier::Completed { .. })));
    }

    #[test]
    fn a_file_nothing_wrote_into_is_a_leftover() {
        let failed = JobStats { job_type: sys::VIR_DOMAIN_JOB_FAILED, ..completed_backup() };
        let migration = JobStats { operation: Some(sys::VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT), ..completed_backup() };
        for completed in [None, Some(failed), Some(migration)] {
            let seen = ended(completed.clone(), Some(true));
            assert_eq!(
                earlier_attempt(&id(), &request(None), seen).expect("leftover"),
                Earlier::Leftover,
                "{completed:?}"
            );
        }
        let inactive = Seen { active: false, ..ended(Some(completed_backup()), Some(true)) };
        assert_eq!(earlier_attempt(&id(), &request(None), inactive).expect("leftover"), Earlier::Leftover);
    }

    #[test]
    fn without_sight_of_the_file_only_a_running_job_is_adopted() {
        let remote = ended(Some(completed_backup()), None);
        assert_eq!(earlier_attempt(&id(), &request(None), remote).expect("begin"), Earlier::None);
    }

    #[test]
    fn an_adopted_backup_says_its_freeze_is_unknown_unless_none_was_asked() {
        let Consistency::CrashConsistent { reason } = adopted_consistency(&request(None)) else { panic!() };
        assert_eq!(reason, UNKNOWN_FREEZE);
        let unquiesced = BackupRequest { quiesce: false, ..request(None) };
        assert_eq!(
            adopted_consistency(&unquiesced),
            Consistency::CrashConsistent { reason: "quiesce was not asked".into() }
        );
    }
}
