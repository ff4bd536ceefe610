//! A domain's jobs as libvirt reports them: the domain job (a migration, a
//! backup, …) and a disk's block job, read and aborted through virt-sys.
//!
//! The `virt` crate's `job_stats` builds a `Vec` from libvirt's parameter
//! array, which is null when no job runs, and it wraps neither
//! `virDomainGetBlockJobInfo` nor `virDomainAbortJob`.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_ulonglong};

use virt::domain::Domain;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::sys;

use crate::xml::{attributes, start_of};

extern "C" {
    /// libc's `free`, for the XML string libvirt hands over.
    fn free(ptr: *mut std::ffi::c_void);
}

/// What `virDomainGetJobStats` reported about one job (current or completed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct JobStats {
    /// `virDomainJobType`: NONE, BOUNDED, UNBOUNDED (running), COMPLETED,
    /// FAILED, CANCELLED.
    pub(crate) job_type: u32,
    /// `VIR_DOMAIN_JOB_OPERATION` (`virDomainJobOperation`), when reported.
    pub(crate) operation: Option<u32>,
    /// Bytes of disk data copied (`VIR_DOMAIN_JOB_DISK_PROCESSED`, what
    /// backups report; else `VIR_DOMAIN_JOB_DATA_PROCESSED`).
    pub(crate) processed_bytes: Option<u64>,
    /// Bytes of disk data to copy in all (`VIR_DOMAIN_JOB_DISK_TOTAL`; else
    /// `VIR_DOMAIN_JOB_DATA_TOTAL`).
    pub(crate) total_bytes: Option<u64>,
    /// Why a failed job failed (`VIR_DOMAIN_JOB_ERRMSG`), when libvirt says.
    pub(crate) error: Option<String>,
}

impl JobStats {
    /// True while the job runs (BOUNDED or UNBOUNDED).
    pub(crate) fn is_running(&self) -> bool {
        self.job_type == sys::VIR_DOMAIN_JOB_BOUNDED || self.job_type == sys::VIR_DOMAIN_JOB_UNBOUNDED
    }

    /// True when the job is a backup (`VIR_DOMAIN_JOB_OPERATION_BACKUP`).
    pub(crate) fn is_backup(&self) -> bool {
        self.operation == Some(sys::VIR_DOMAIN_JOB_OPERATION_BACKUP)
    }
}

/// `virDomainGetJobStats(domain, flags)`: the current job (flags 0; type
/// NONE when none runs) or, with `VIR_DOMAIN_JOB_STATS_COMPLETED`, the last
/// completed one (type NONE when libvirt keeps none).
pub(crate) fn job_stats(domain: &Domain, flags: u32) -> Result<JobStats, VirtError> {
    let (mut job_type, mut params, mut nparams): (c_int, sys::virTypedParameterPtr, c_int) =
        (0, std::ptr::null_mut(), 0);
    // SAFETY: `domain` holds a valid virDomainPtr for the call; the
    // out-pointers are valid; libvirt allocates `params` (or leaves it null),
    // which is read below and freed once with virTypedParamsFree (which
    // accepts null).
    let ret = unsafe { sys::virDomainGetJobStats(domain.as_ptr(), &mut job_type, &mut params, &mut nparams, flags) };
    if ret < 0 {
        return Err(VirtError::last_error());
    }
    let ullong = |name: &CStr| {
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
    let mut errmsg: *const c_char = std::ptr::null();
    // SAFETY: as above; on success `errmsg` points into `params`, so it is
    // copied before `params` is freed.
    let has_error =
        unsafe { sys::virTypedParamsGetString(params, nparams, sys::VIR_DOMAIN_JOB_ERRMSG.as_ptr(), &mut errmsg) };
    let error = (has_error == 1 && !errmsg.is_null())
        // SAFETY: a NUL-terminated string inside `params`, still allocated.
        .then(|| unsafe { CStr::from_ptr(errmsg) }.to_string_lossy().into_owned());
    let stats = JobStats {
        job_type: u32::try_from(job_type).unwrap_or(sys::VIR_DOMAIN_JOB_NONE),
        operation: (has_operation == 1).then(|| u32::try_from(operation).unwrap_or(0)),
        processed_bytes: ullong(sys::VIR_DOMAIN_JOB_DISK_PROCESSED)
            .or_else(|| ullong(sys::VIR_DOMAIN_JOB_DATA_PROCESSED)),
        total_bytes: ullong(sys::VIR_DOMAIN_JOB_DISK_TOTAL).or_else(|| ullong(sys::VIR_DOMAIN_JOB_DATA_TOTAL)),
        error,
    };
    // SAFETY: frees what libvirt allocated, once; nothing reads it afterwards
    // (`error` was copied).
    unsafe { sys::virTypedParamsFree(params, nparams) };
    Ok(stats)
}

/// The type (`virDomainBlockJobType`) of the block job running on `disk` (a
/// target name such as `vda`), if one runs (`virDomainGetBlockJobInfo`).
pub(crate) fn block_job(domain: &Domain, disk: &str) -> Result<Option<u32>, VirtError> {
    // A name with a NUL byte names no disk, so no job runs on it.
    let Ok(disk) = CString::new(disk) else {
        return Ok(None);
    };
    let mut info = sys::virDomainBlockJobInfo { type_: 0, bandwidth: 0, cur: 0, end: 0 };
    // SAFETY: `domain` holds a valid virDomainPtr, `disk` is NUL-terminated
    // and `info` is a valid out-pointer for the call; libvirt keeps neither.
    let ret = unsafe { sys::virDomainGetBlockJobInfo(domain.as_ptr(), disk.as_ptr(), &mut info, 0) };
    match ret {
        r if r < 0 => Err(VirtError::last_error()),
        0 => Ok(None),
        _ => Ok(Some(u32::try_from(info.type_).unwrap_or(sys::VIR_DOMAIN_BLOCK_JOB_TYPE_UNKNOWN))),
    }
}

/// `virDomainAbortJob`: ask libvirt to end `domain`'s current job (it ends
/// asynchronously for backups; poll [`job_stats`] until it is gone).
pub(crate) fn abort_job(domain: &Domain) -> Result<(), VirtError> {
    // SAFETY: `domain` holds a valid virDomainPtr for the duration of the call;
    // virDomainAbortJob neither keeps nor frees it.
    let ret = unsafe { sys::virDomainAbortJob(domain.as_ptr()) };
    if ret < 0 {
        return Err(VirtError::last_error());
    }
    Ok(())
}

/// The files `domain`'s running backup job writes (each backed-up disk's
/// `<target file>` in `virDomainBackupGetXMLDesc`); `None` when no backup
/// job runs (`VIR_ERR_NO_DOMAIN_BACKUP`, or the domain is not running).
pub(crate) fn backup_targets(domain: &Domain) -> Result<Option<Vec<String>>, VirtError> {
    // SAFETY: `domain` holds a valid virDomainPtr for the call; the string
    // returned is the caller's, freed once right after it is copied.
    let xml = unsafe { sys::virDomainBackupGetXMLDesc(domain.as_ptr(), 0) };
    if xml.is_null() {
        let err = VirtError::last_error();
        if err.code().is_any(vec![ErrorNumber::NoDomainBackup, ErrorNumber::OperationInvalid]) {
            return Ok(None);
        }
        return Err(err);
    }
    // SAFETY: non-null and NUL-terminated; freed once, after the copy.
    let text = unsafe { CStr::from_ptr(xml) }.to_string_lossy().into_owned();
    unsafe { free(xml.cast()) };
    Ok(Some(push_targets(&text)))
}

/// The `<target file='…'>` of each disk a `<domainbackup>` XML backs up
/// (disks with `backup='no'` are left out), in document order.
pub(crate) fn push_targets(xml: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = xml;
    while let Some(start) = start_of(rest, "disk") {
        let element = &rest[start..];
        let head_end = element.find('>').map_or(element.len(), |end| end + 1);
        let end = if element[..head_end].ends_with("/>") {
            head_end
        } else {
            element.find("</disk>").map_or(element.len(), |end| end + "</disk>".len())
        };
        let (disk, after) = element.split_at(end);
        rest = after;
        let attrs = attributes(disk).unwrap_or_default();
        if attrs.iter().any(|(key, value)| key == "backup" && value == "no") {
            continue;
        }
        let file = start_of(disk, "target")
            .and_then(|at| attributes(&disk[at..]))
            .and_then(|attrs| attrs.into_iter().find(|(key, _)| key == "file").map(|(_, file)| file));
        targets.extend(file);
    }
    targets
}

/// A domain job's operation (`virDomainJobOperation`) in words, for messages.
pub(crate) fn operation_name(operation: Option<u32>) -> &'static str {
    use sys::*;
    match operation {
        Some(VIR_DOMAIN_JOB_OPERATION_START) => "a start",
        Some(VIR_DOMAIN_JOB_OPERATION_SAVE) => "a save",
        Some(VIR_DOMAIN_JOB_OPERATION_RESTORE) => "a restore",
        Some(VIR_DOMAIN_JOB_OPERATION_MIGRATION_IN) => "an incoming migration",
        Some(VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT) => "an outgoing migration",
        Some(VIR_DOMAIN_JOB_OPERATION_SNAPSHOT) => "a snapshot",
        Some(VIR_DOMAIN_JOB_OPERATION_SNAPSHOT_REVERT) => "a snapshot revert",
        Some(VIR_DOMAIN_JOB_OPERATION_DUMP) => "a memory dump",
        Some(VIR_DOMAIN_JOB_OPERATION_BACKUP) => "a backup",
        Some(VIR_DOMAIN_JOB_OPERATION_SNAPSHOT_DELETE) => "a snapshot deletion",
        _ => "a job",
    }
}

/// A block job's type (`virDomainBlockJobType`) in words, for messages.
pub(crate) fn block_job_name(job_type: u32) -> &'static str {
    use sys::*;
    match job_type {
        VIR_DOMAIN_BLOCK_JOB_TYPE_PULL => "a block pull",
        VIR_DOMAIN_BLOCK_JOB_TYPE_COPY => "a block copy",
        VIR_DOMAIN_BLOCK_JOB_TYPE_COMMIT | VIR_DOMAIN_BLOCK_JOB_TYPE_ACTIVE_COMMIT => "a block commit",
        VIR_DOMAIN_BLOCK_JOB_TYPE_BACKUP => "a backup",
        _ => "a block job",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_backups_targets_are_read_from_its_xml() {
        let xml = "<domainbackup mode='push'>\n  <disks>\n    <disk name='vda' backup='yes' type='file' \
                   backupmode='full' exportname='vda'>\n      <driver type='qcow2'/>\n      <target \
                   file='/b/it&apos;s.qcow2'/>\n    </disk>\n    <disk name='vdb' backup='no'/>\n    <disk \
                   name='vdc' backup='yes' type='file'><target file='/b/c.qcow2'/></disk>\n  </disks>\n\
                   </domainbackup>";
        assert_eq!(push_targets(xml), ["/b/it's.qcow2", "/b/c.qcow2"]);
        assert!(push_targets("<domainbackup mode='pull'><disks/></domainbackup>").is_empty());
    }
}
