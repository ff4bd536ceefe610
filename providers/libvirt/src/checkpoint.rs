//! libvirt checkpoints, the base of incremental backups: what vmlet creates
//! with a backup, looks up, and deletes.
//!
//! A checkpoint (`virDomainCheckpoint*`) names a point in time of a running
//! VM's disk; QEMU tracks the blocks written since in a dirty bitmap stored
//! in the qcow2 disk (persistent: it survives the VM's stop and start). vmlet
//! creates checkpoints only together with a backup (`virDomainBackupBegin`
//! with checkpoint XML), and marks them with the description
//! [`VMLET_MARK`], so that it deletes only its own.
//!
//! The `virt` crate has no checkpoint bindings: these are thin wrappers over
//! `virt::sys`.

use std::ffi::{c_void, CStr, CString};

use virt::domain::Domain;
use virt::error::{Error as VirtError, ErrorNumber};
use virt::sys;
use vmlet_provider::{Error, ErrorKind, Result};

use crate::xml::escape;

/// The description of the checkpoints vmlet creates.
pub(crate) const VMLET_MARK: &str = "vmlet incremental backup base";

/// The longest checkpoint name vmlet accepts, in bytes.
const NAME_MAX_BYTES: usize = 128;

extern "C" {
    /// libc's `free`, for what libvirt allocated and hands over (the list of
    /// checkpoints, an XML string).
    fn free(ptr: *mut c_void);
}

/// Refuse (`InvalidInput`) a checkpoint name (`what` says whose) that is not
/// 1 to 128 ASCII letters, digits, `-`, `_` and `.`: it goes into XML and
/// into the qcow2 image as its bitmap's name.
pub(crate) fn check_name(operation: &'static str, what: &str, name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > NAME_MAX_BYTES || !name.chars().all(allowed) || name.starts_with('.') {
        return Err(Error::new(
            operation,
            ErrorKind::InvalidInput,
            format!(
                "{what} {name:?} must be 1 to {NAME_MAX_BYTES} ASCII letters, digits, '-', '_' and '.', not \
                 starting with '.'"
            ),
        ));
    }
    Ok(())
}

/// The checkpoint XML vmlet gives `virDomainBackupBegin`: checkpoint `name`
/// of each of `disks` (target names, `vda`) as a bitmap, with vmlet's mark.
pub(crate) fn checkpoint_xml(name: &str, disks: &[&str]) -> String {
    let disks: String =
        disks.iter().map(|disk| format!("<disk name='{}' checkpoint='bitmap'/>", escape(disk))).collect();
    format!(
        "<domaincheckpoint><name>{}</name><description>{VMLET_MARK}</description><disks>{disks}</disks>\
         </domaincheckpoint>",
        escape(name)
    )
}

/// Whether checkpoint XML `xml` carries vmlet's mark.
fn is_vmlets(xml: &str) -> bool {
    xml.contains(&format!("<description>{VMLET_MARK}</description>"))
}

/// One checkpoint of a domain; freed on drop.
pub(crate) struct Checkpoint(sys::virDomainCheckpointPtr);

impl Drop for Checkpoint {
    fn drop(&mut self) {
        // SAFETY: `self.0` is a checkpoint reference this value owns.
        unsafe { sys::virDomainCheckpointFree(self.0) };
    }
}

impl Checkpoint {
    /// Its name.
    pub(crate) fn name(&self) -> String {
        // SAFETY: `self.0` is valid; the name belongs to the checkpoint and
        // lives as long as it does; copied at once.
        let name = unsafe { sys::virDomainCheckpointGetName(self.0) };
        if name.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, valid while `self` lives.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }

    /// Whether vmlet created it (its description is [`VMLET_MARK`]).
    pub(crate) fn is_vmlets(&self) -> Result<bool, VirtError> {
        // SAFETY: `self.0` is valid; the returned string is the caller's to
        // free, which happens right after it is copied.
        let xml = unsafe { sys::virDomainCheckpointGetXMLDesc(self.0, sys::VIR_DOMAIN_CHECKPOINT_XML_NO_DOMAIN) };
        if xml.is_null() {
            return Err(VirtError::last_error());
        }
        // SAFETY: non-null and NUL-terminated; freed once, after the copy.
        let text = unsafe { CStr::from_ptr(xml) }.to_string_lossy().into_owned();
        unsafe { free(xml.cast::<c_void>()) };
        Ok(is_vmlets(&text))
    }

    /// `virDomainCheckpointDelete`, no flags: its bitmap leaves the disk.
    pub(crate) fn delete(&self) -> Result<(), VirtError> {
        // SAFETY: `self.0` is valid for the call.
        if unsafe { sys::virDomainCheckpointDelete(self.0, 0) } < 0 {
            return Err(VirtError::last_error());
        }
        Ok(())
    }
}

/// Checkpoint `name` of `domain`, or `None` when it has none of that name.
pub(crate) fn lookup(domain: &Domain, name: &str) -> Result<Option<Checkpoint>, VirtError> {
    // Names are checked (no NUL byte) before they get here.
    let c_name = CString::new(name).unwrap_or_default();
    // SAFETY: `domain` is valid and `c_name` NUL-terminated for the call.
    let found = unsafe { sys::virDomainCheckpointLookupByName(domain.as_ptr(), c_name.as_ptr(), 0) };
    if !found.is_null() {
        return Ok(Some(Checkpoint(found)));
    }
    let err = VirtError::last_error();
    if err.code().is(ErrorNumber::NoDomainCheckpoint) {
        return Ok(None);
    }
    Err(err)
}

/// Every checkpoint of `domain`.
pub(crate) fn list(domain: &Domain) -> Result<Vec<Checkpoint>, VirtError> {
    let mut array: *mut sys::virDomainCheckpointPtr = std::ptr::null_mut();
    // SAFETY: `domain` is valid; libvirt allocates `array` (freed below)
    // and hands over one reference per element.
    let count = unsafe { sys::virDomainListAllCheckpoints(domain.as_ptr(), &mut array, 0) };
    let Ok(count) = usize::try_from(count) else {
        return Err(VirtError::last_error());
    };
    let mut found = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `array` holds `count` checkpoint pointers.
        found.push(Checkpoint(unsafe { *array.add(i) }));
    }
    if !array.is_null() {
        // SAFETY: the array itself is ours to free (its elements now are
        // owned by `found`).
        unsafe { free(array.cast::<c_void>()) };
    }
    Ok(found)
}

/// Delete `domain`'s checkpoints that vmlet created, except `keep`; the names
/// of those that could not be deleted (logged).
pub(crate) fn delete_vmlets_except(domain: &Domain, keep: Option<&str>) -> Result<Vec<String>, VirtError> {
    let mut left = Vec::new();
    for checkpoint in list(domain)? {
        let name = checkpoint.name();
        if Some(name.as_str()) == keep || !checkpoint.is_vmlets()? {
            continue;
        }
        match checkpoint.delete() {
            Ok(()) => tracing::info!(checkpoint.name = %name, "older checkpoint deleted"),
            Err(err) if err.code().is(ErrorNumber::NoDomainCheckpoint) => {}
            Err(err) => {
                tracing::warn!(checkpoint.name = %name, error = %err.message(), "cannot delete an older checkpoint");
                left.push(name);
            }
        }
    }
    Ok(left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names_are_checked_before_they_reach_xml_and_the_image() {
        for good in ["backup-1", "ns_web.2024-01-01", "a"] {
            assert!(check_name("op", "checkpoint", good).is_ok(), "{good}");
        }
        let long = "a".repeat(NAME_MAX_BYTES + 1);
        for bad in ["", "a b", "a/b", "<x>", ".hidden", "é", long.as_str()] {
            assert_eq!(check_name("op", "checkpoint", bad).expect_err(bad).kind, ErrorKind::InvalidInput, "{bad}");
        }
    }

    #[test]
    fn the_checkpoint_xml_marks_the_checkpoint_as_vmlets() {
        let xml = checkpoint_xml("b-1", &["vda", "vdb"]);
        assert_eq!(
            xml,
            "<domaincheckpoint><name>b-1</name><description>vmlet incremental backup base</description><disks>\
             <disk name='vda' checkpoint='bitmap'/><disk name='vdb' checkpoint='bitmap'/></disks></domaincheckpoint>"
        );
        assert!(is_vmlets(&xml));
        assert!(!is_vmlets("<domaincheckpoint><name>x</name><description>mine</description></domaincheckpoint>"));
    }
}
