//! [`Migration`]: moving a VM to another libvirt host, peer to peer.
//!
//! The source host's libvirtd does the work (`virDomainMigrateToURI3` with
//! `VIR_MIGRATE_PEER2PEER`): it connects to the target's libvirtd with the URI
//! the target provider names ([`LibvirtProvider::with_migration_uri`]), so vmlet
//! only talks to the source.
//!
//! - Live: `LIVE | PEER2PEER | PERSIST_DEST | UNDEFINE_SOURCE | ABORT_ON_ERROR`
//!   (plus `UNSAFE` where [`LibvirtProvider::with_unsafe_migration`] allows
//!   it). QEMU copies the guest's memory while it runs and switches over with
//!   a short pause; disks are not copied, so they must be on storage both hosts
//!   share (or the VM has none, e.g. a kernel and initramfs booted directly from
//!   files both hosts have).
//! - Cold: `OFFLINE | PEER2PEER | PERSIST_DEST | UNDEFINE_SOURCE`: an inactive
//!   domain's definition moves.
//!
//! Either way the target defines the domain persistently from the source's
//! definition, so the UUID (the backend id) and vmlet's metadata (the identity)
//! move with it, and the source undefines its copy.
//!
//! Deadlines: before it starts, the migration asks the target's libvirtd for
//! its version from vmlet ([`PROBE_DEADLINE`]): libvirt's peer-to-peer connect
//! has no timeout, and a target that accepts connections but never answers (a
//! hung libvirtd) would hold the VM's job on the source for as long as it
//! hangs. The migration call then runs on the blocking pool; when the caller's
//! timeout passes, vmlet calls `virDomainAbortJob` and waits up to
//! [`ABORT_GRACE`] for libvirt to end the migration, which leaves the VM running
//! here. A migration that finished in that window is reported as done.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::instrument;
use virt::connect::Connect;
use virt::domain::{Domain, MigrateParameters};
use virt::error::{Error as VirtError, ErrorNumber};
use vmlet_provider::{Error, ErrorKind, Migration, MigrationMode, MigrationProgress, MigrationTarget, Result, VmId};

use crate::connection::open_watched;
use crate::error::from_libvirt;
use crate::jobs::abort_job;
use crate::provider::{is_active, not_completed, Host, LibvirtProvider};
use crate::xml::DomainKind;

const OP: &str = "migrate domain";
const OP_PROGRESS: &str = "read migration progress";
const OP_ABORT: &str = "abort migration";

/// How long the target's libvirtd gets to answer vmlet's probe (at most the
/// migration's own timeout).
pub(crate) const PROBE_DEADLINE: Duration = Duration::from_secs(20);

/// How long `virDomainAbortJob` may take.
const ABORT_DEADLINE: Duration = Duration::from_secs(30);

/// How long libvirt gets to end an aborted migration before vmlet stops
/// waiting for it.
pub(crate) const ABORT_GRACE: Duration = Duration::from_secs(30);

/// How long reading a migration's progress may take.
const PROGRESS_DEADLINE: Duration = Duration::from_secs(30);

/// Target URIs whose probe has not answered yet, process-wide: a target that
/// hangs holds one blocking thread, not one per retry.
static PROBES: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The `virDomainMigrateToURI3` flags for `mode`.
fn migrate_flags(mode: MigrationMode, allow_unsafe: bool) -> u32 {
    use virt::sys::*;
    let common = VIR_MIGRATE_PEER2PEER | VIR_MIGRATE_PERSIST_DEST | VIR_MIGRATE_UNDEFINE_SOURCE;
    match mode {
        MigrationMode::Live => {
            let unsafe_flag = if allow_unsafe { VIR_MIGRATE_UNSAFE } else { 0 };
            common | VIR_MIGRATE_LIVE | VIR_MIGRATE_ABORT_ON_ERROR | unsafe_flag
        }
        MigrationMode::Cold => common | VIR_MIGRATE_OFFLINE,
    }
}

impl Host {
    /// Move VM `id` to the libvirtd at `uri` (blocking until libvirt is done).
    fn migrate(&self, conn: &Connect, id: &VmId, uri: &str, mode: MigrationMode, flags: u32) -> Result<()> {
        let domain = self.require(conn, OP, id)?;
        match (mode, is_active(&domain, OP)?) {
            (MigrationMode::Live, false) => {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!("VM {id} is not running: a live migration needs a running VM; migrate it cold"),
                ))
            }
            (MigrationMode::Cold, true) => {
                return Err(Error::new(
                    OP,
                    ErrorKind::InvalidInput,
                    format!("VM {id} is running: a cold migration needs it shut off; shut it down or migrate it live"),
                ))
            }
            _ => {}
        }
        let started = Instant::now();
        domain.migrate_to_uri3(Some(uri), MigrateParameters::default(), flags).map_err(|e| migrate_error(uri, e))?;
        self.forget(id);
        tracing::info!(vm.uid = %id, target = uri, ?mode, elapsed = ?started.elapsed(), "domain migrated");
        Ok(())
    }

    /// `virDomainAbortJob` on VM `id`'s current job.
    fn abort_job(&self, conn: &Connect, id: &VmId) -> Result<()> {
        let domain = self.require(conn, OP_ABORT, id)?;
        abort_job(&domain).map_err(|e| from_libvirt(OP_ABORT, e))
    }

    /// The progress of VM `id`'s outgoing migration, if one runs.
    fn migration_progress(&self, conn: &Connect, id: &VmId) -> Result<Option<MigrationProgress>> {
        let domain = match self.require(conn, OP_PROGRESS, id) {
            Ok(domain) => domain,
            Err(err) if err.kind == ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        if !is_active(&domain, OP_PROGRESS)? {
            return Ok(None);
        }
        match outgoing_migration(&domain) {
            Ok(progress) => Ok(progress),
            // Stopped or moved meanwhile.
            Err(err) if err.code().is_any(vec![ErrorNumber::OperationInvalid, ErrorNumber::NoDomain]) => Ok(None),
            Err(err) => Err(from_libvirt(OP_PROGRESS, err)),
        }
    }
}

/// `virDomainGetJobStats` of `domain`'s current job when it is an outgoing
/// migration. Called through virt-sys: the `virt` crate's `job_stats` builds a
/// `Vec` from libvirt's parameter array, which is null when no job runs.
fn outgoing_migration(domain: &Domain) -> Result<Option<MigrationProgress>, VirtError> {
    use std::os::raw::{c_int, c_ulonglong};
    use virt::sys;
    let (mut job_type, mut params, mut nparams): (c_int, sys::virTypedParameterPtr, c_int) =
        (0, std::ptr::null_mut(), 0);
    // SAFETY: the out-pointers are valid for the call; libvirt allocates
    // `params` (or leaves it null), which is read below and freed once with
    // virTypedParamsFree (which accepts null).
    let ret = unsafe { sys::virDomainGetJobStats(domain.as_ptr(), &mut job_type, &mut params, &mut nparams, 0) };
    if ret < 0 {
        return Err(VirtError::last_error());
    }
    let get = |name: &std::ffi::CStr| {
        let mut value: c_ulonglong = 0;
        // SAFETY: `params` holds `nparams` entries from libvirt (or is null
        // with 0 entries); `name` is NUL-terminated.
        let found = unsafe { sys::virTypedParamsGetULLong(params, nparams, name.as_ptr(), &mut value) };
        (found == 1).then_some(value)
    };
    let mut operation: c_int = 0;
    // SAFETY: as above.
    let has_operation =
        unsafe { sys::virTypedParamsGetInt(params, nparams, sys::VIR_DOMAIN_JOB_OPERATION.as_ptr(), &mut operation) };
    let progress = MigrationProgress {
        processed_bytes: get(sys::VIR_DOMAIN_JOB_DATA_PROCESSED).unwrap_or(0),
        remaining_bytes: get(sys::VIR_DOMAIN_JOB_DATA_REMAINING).unwrap_or(0),
        total_bytes: get(sys::VIR_DOMAIN_JOB_DATA_TOTAL).unwrap_or(0),
    };
    // SAFETY: frees what libvirt allocated, once; nothing reads it afterwards.
    unsafe { sys::virTypedParamsFree(params, nparams) };
    let outgoing = has_operation != 1 || operation == sys::VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT as c_int;
    Ok((job_type != sys::VIR_DOMAIN_JOB_NONE as c_int && outgoing).then_some(progress))
}

/// The provider error for a failed migration to `uri`.
///
/// - an unsafe disk (`VIR_ERR_MIGRATE_UNSAFE`) → `Unsupported`, saying why;
/// - an aborted job → `Transient`;
/// - a state that does not fit (`VIR_ERR_OPERATION_INVALID`, e.g. the domain
///   stopped meanwhile) → `InvalidInput`;
/// - otherwise the libvirt error's kind: a target that cannot be reached is a
///   system or RPC error (`Transient`); a target that is this host ("Attempt to
///   migrate guest to the same host", an internal error) is `Permanent`.
fn migrate_error(uri: &str, err: VirtError) -> Error {
    let code = err.code();
    let (kind, message) = if code.is(ErrorNumber::MigrateUnsafe) {
        (
            ErrorKind::Unsupported,
            format!(
                "{}: the VM's disks are not on storage libvirt knows to be shared (or not with cache='none'); \
                 disks are not copied, so vmlet migrates only VMs whose disks both hosts share",
                err.message()
            ),
        )
    } else if code.is(ErrorNumber::OperationAborted) {
        (ErrorKind::Transient, format!("the migration to {uri} was aborted: {}", err.message()))
    } else if code.is(ErrorNumber::OperationInvalid) {
        (ErrorKind::InvalidInput, format!("cannot migrate to {uri}: {}", err.message()))
    } else {
        let mut error = from_libvirt(OP, err);
        error.message = format!("migration to {uri} failed: {}", error.message);
        return error;
    };
    Error::new(OP, kind, message).with_source(err)
}

/// Whether the libvirtd at `uri` answers vmlet within `deadline`. Only a probe
/// that does not answer in time fails (`Transient`); one that fails at once
/// (vmlet may lack credentials the source daemon has) lets the migration try.
async fn probe_target(uri: &str, deadline: Duration) -> Result<()> {
    let hanging = || {
        Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "the target libvirtd at {uri} did not answer within {}s (a probe from vmlet waits for it); \
                 the VM stays here",
                deadline.as_secs_f32()
            ),
        )
    };
    {
        let mut probes = PROBES.lock().unwrap_or_else(PoisonError::into_inner);
        if !probes.get_or_insert_with(HashSet::new).insert(uri.to_owned()) {
            return Err(hanging());
        }
    }
    let target = uri.to_owned();
    let probe = tokio::task::spawn_blocking(move || {
        let answer = open_watched(&target).and_then(|conn| conn.lib_version().map(drop));
        PROBES.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert_with(HashSet::new).remove(&target);
        answer
    });
    match tokio::time::timeout(deadline, probe).await {
        Err(_) => Err(hanging()),
        Ok(Err(join)) => Err(not_completed(OP, join)),
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(err))) => {
            tracing::debug!(target = uri, error = %err, "vmlet cannot reach the migration target itself; migrating anyway");
            Ok(())
        }
    }
}

#[async_trait::async_trait]
impl Migration for LibvirtProvider {
    /// This host's name ([`LibvirtProvider::with_host_name`]) and the URI other
    /// hosts' libvirtd reach it with ([`LibvirtProvider::with_migration_uri`];
    /// empty when this host has none).
    fn target(&self) -> MigrationTarget {
        MigrationTarget { host: self.migration.host_name.clone(), address: self.migration.uri.clone() }
    }

    /// See the module docs. Returns at most a minute after `timeout` (the
    /// abort, then the wait for libvirt to end the migration). Errors as [`Migration::migrate`]
    /// documents; `Unsupported` on the test driver, and for a live migration of
    /// a VM whose disks libvirt does not know to be shared (unless
    /// [`LibvirtProvider::with_unsafe_migration`]); `InvalidInput` when `to`
    /// has no address.
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id, target = %to.host))]
    async fn migrate(&self, id: &VmId, to: &MigrationTarget, mode: MigrationMode, timeout: Duration) -> Result<()> {
        if self.domain_kind() == DomainKind::Test {
            return Err(Error::new(OP, ErrorKind::Unsupported, "libvirt's test driver cannot migrate VMs"));
        }
        if to.address.is_empty() {
            return Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "host {} has no migration URI that other hosts' libvirtd could use (its connection is local); \
                     configure one for it",
                    to.host
                ),
            ));
        }
        let started = Instant::now();
        // The target opens the disks along the definition's chains: they
        // must still be what the images' headers name.
        let live = mode == MigrationMode::Live;
        tokio::time::timeout(timeout, self.verify_chains(OP, id, live))
            .await
            .map_err(|_| Error::new(OP, ErrorKind::Transient, "checking the disks' backing chains took too long"))??;
        probe_target(&to.address, timeout.min(PROBE_DEADLINE)).await?;

        let flags = migrate_flags(mode, self.migration.allow_unsafe);
        let (task_id, uri) = (id.clone(), to.address.clone());
        let mut task =
            self.spawn_blocking(OP, move |host, conn| host.migrate(conn, &task_id, &uri, mode, flags)).await?;
        let left = timeout.saturating_sub(started.elapsed());
        if let Ok(done) = tokio::time::timeout(left, &mut task).await {
            return done.map_err(|e| not_completed(OP, e))?;
        }

        tracing::warn!(vm.uid = %id, ?timeout, "migration did not finish in time; aborting it");
        let abort_id = id.clone();
        let aborted = self.blocking_within(OP_ABORT, ABORT_DEADLINE, move |host, conn| host.abort_job(conn, &abort_id));
        if let Err(err) = aborted.await {
            tracing::warn!(vm.uid = %id, error = %err, "virDomainAbortJob failed");
        }
        let outcome = match tokio::time::timeout(ABORT_GRACE, task).await {
            // Finished before the abort reached it: the VM moved.
            Ok(Ok(Ok(()))) => return Ok(()),
            Ok(Ok(Err(err))) => format!("aborted ({})", err.message),
            Ok(Err(join)) => format!("aborted ({join})"),
            Err(_) => {
                format!("aborted, but libvirt had not ended it {}s later (it will not complete)", ABORT_GRACE.as_secs())
            }
        };
        Err(Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "the {mode:?} migration of VM {id} to {} did not finish within {}s and was {outcome}; the VM stays on \
                 this host as it was",
                to.host,
                timeout.as_secs_f32()
            ),
        ))
    }

    /// `virDomainGetJobStats` of the VM's current job when it is an outgoing
    /// migration: data processed, remaining and total (memory and any disks).
    /// `None` when no migration runs, also when this host has no such VM.
    #[instrument(level = "debug", skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn progress(&self, id: &VmId) -> Result<Option<MigrationProgress>> {
        let id = id.clone();
        self.blocking_within(OP_PROGRESS, PROGRESS_DEADLINE, move |host, conn| host.migration_progress(conn, &id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virt::sys::*;

    #[test]
    fn live_migration_moves_the_persistent_definition_peer_to_peer() {
        let live = migrate_flags(MigrationMode::Live, false);
        for flag in [VIR_MIGRATE_LIVE, VIR_MIGRATE_PEER2PEER, VIR_MIGRATE_PERSIST_DEST, VIR_MIGRATE_UNDEFINE_SOURCE] {
            assert_ne!(live & flag, 0, "{flag}");
        }
        for absent in [VIR_MIGRATE_OFFLINE, VIR_MIGRATE_UNSAFE, VIR_MIGRATE_NON_SHARED_DISK, VIR_MIGRATE_TUNNELLED] {
            assert_eq!(live & absent, 0, "{absent}");
        }
        assert_ne!(migrate_flags(MigrationMode::Live, true) & VIR_MIGRATE_UNSAFE, 0);
    }

    #[test]
    fn cold_migration_is_offline_and_never_unsafe() {
        let cold = migrate_flags(MigrationMode::Cold, true);
        assert_eq!(
            cold,
            VIR_MIGRATE_OFFLINE | VIR_MIGRATE_PEER2PEER | VIR_MIGRATE_PERSIST_DEST | VIR_MIGRATE_UNDEFINE_SOURCE
        );
    }
}
