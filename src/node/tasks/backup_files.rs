//! The files a VirtualMachineBackup holds on its host, as its status records
//! them, believed only when each is exactly the name vmlet gives it
//! ([`backup_file_name`], [`backup_data_file_name`]: namespace, backup
//! name, UID and disk) and lies under the host's backup roots. A status is
//! writable by whoever may write the backup's status; these checks are what
//! keep an edited `location` (or a hostile disk name) from pointing a
//! restore, an incremental backup or a claim at another namespace's backup
//! or at any other file.

use crate::storage::check_host_file;
use crate::v1alpha1::{backup_data_file_name, backup_file_name, VirtualMachineBackup};
use kube::ResourceExt;
use std::path::Path;
use vmlet_provider::DataDiskFile;

/// The files of one backup on its host, each checked (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BackupFiles {
    /// Absolute path of the boot disk's file (`status.location`).
    pub(crate) boot: String,
    /// Each data disk's file (`status.dataDisks`), in the recorded order.
    pub(crate) data_disks: Vec<DataDiskFile>,
}

impl BackupFiles {
    /// The file of data disk `disk` (`spec.disks[].name` of the backed-up
    /// VM), or the boot disk's for `None`. `Err(why)` naming the backup's
    /// data disks when the backup holds no such disk.
    pub(crate) fn file_of(&self, backup_name: &str, disk: Option<&str>) -> Result<&str, String> {
        let Some(disk) = disk else { return Ok(&self.boot) };
        match self.data_disks.iter().find(|file| file.disk == disk) {
            Some(file) => Ok(&file.path),
            None => Err(format!(
                "VirtualMachineBackup {backup_name} holds no data disk {disk:?} (its status.dataDisks: [{}])",
                self.data_disks.iter().map(|file| file.disk.as_str()).collect::<Vec<_>>().join(", ")
            )),
        }
    }
}

/// The files `backup` (of `namespace`) records, each named as vmlet names
/// it: `Err(why)` naming the field, for a status or an Event. Pure: where
/// the files lie is [`checked_files`]'s question.
pub(crate) fn recorded_files(namespace: &str, backup: &VirtualMachineBackup) -> Result<BackupFiles, String> {
    let backup_name = backup.name_any();
    let uid = backup.uid().unwrap_or_default();
    let status = backup.status.clone().unwrap_or_default();
    let file_name = |path: &str| Path::new(path).file_name().and_then(|f| f.to_str()).map(str::to_owned);
    let expected = backup_file_name(namespace, &backup_name, &uid);
    let boot = status.location.clone().unwrap_or_default();
    if file_name(&boot).as_deref() != Some(expected.as_str()) || !boot.starts_with('/') {
        return Err(format!(
            "VirtualMachineBackup {backup_name}'s status.location {boot:?} is not its file ({expected})"
        ));
    }
    let mut data_disks: Vec<DataDiskFile> = Vec::with_capacity(status.data_disks.len());
    for disk in &status.data_disks {
        let Some(expected) = backup_data_file_name(namespace, &backup_name, &uid, &disk.name) else {
            return Err(format!(
                "VirtualMachineBackup {backup_name}'s status.dataDisks names {:?}, which is no data disk's name \
                 (spec.disks[].name: a DNS label of at most 20 characters)",
                disk.name
            ));
        };
        if data_disks.iter().any(|file| file.disk == disk.name) {
            return Err(format!("VirtualMachineBackup {backup_name}'s status.dataDisks names {} twice", disk.name));
        }
        if file_name(&disk.location).as_deref() != Some(expected.as_str()) || !disk.location.starts_with('/') {
            return Err(format!(
                "VirtualMachineBackup {backup_name}'s status.dataDisks[{}].location {:?} is not its file ({expected})",
                disk.name, disk.location
            ));
        }
        data_disks.push(DataDiskFile { disk: disk.name.clone(), path: disk.location.clone() });
    }
    Ok(BackupFiles { boot, data_disks })
}

/// [`recorded_files`], and each file under `backup_roots` (symbolic links
/// resolved when `resolves_links`, as [`check_host_file`] does) of host
/// `host`. `Err(why)` naming the field and the roots.
pub(crate) async fn checked_files(
    namespace: &str,
    backup: &VirtualMachineBackup,
    host: &str,
    backup_roots: &[String],
    resolves_links: bool,
) -> Result<BackupFiles, String> {
    let files = recorded_files(namespace, backup).map_err(|why| format!("{why}; refusing to read it"))?;
    let all = std::iter::once(("status.location".to_owned(), &files.boot))
        .chain(files.data_disks.iter().map(|f| (format!("status.dataDisks[{}].location", f.disk), &f.path)));
    for (field, path) in all {
        if let Err(why) = check_host_file(backup_roots, resolves_links, path).await {
            return Err(format!(
                "VirtualMachineBackup {}'s {field} {path:?} is not its file: it {why} (host {host}'s backupRoots \
                 [{}]); refusing to read it",
                backup.name_any(),
                backup_roots.join(", ")
            ));
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1alpha1::{BackupDataDisk, VirtualMachineBackupStatus};

    fn backup(location: &str, data: &[(&str, &str)]) -> VirtualMachineBackup {
        let mut backup: VirtualMachineBackup = serde_json::from_value(serde_json::json!({
            "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineBackup",
            "metadata": {"name": "nightly", "namespace": "team-a", "uid": "u-1"},
            "spec": {"virtualMachine": "web"},
        }))
        .unwrap();
        backup.status = Some(VirtualMachineBackupStatus {
            location: Some(location.to_owned()),
            data_disks: data
                .iter()
                .map(|(name, location)| BackupDataDisk {
                    name: (*name).to_owned(),
                    location: (*location).to_owned(),
                    ..BackupDataDisk::default()
                })
                .collect(),
            ..VirtualMachineBackupStatus::default()
        });
        backup
    }

    #[test]
    fn a_backups_files_are_its_boot_file_and_one_file_per_data_disk() {
        let b = backup(
            "/b/team-a_nightly_u-1.qcow2",
            &[("data", "/b/team-a_nightly_u-1.data.qcow2"), ("logs", "/b/team-a_nightly_u-1.logs.qcow2")],
        );
        let files = recorded_files("team-a", &b).unwrap();
        assert_eq!(files.boot, "/b/team-a_nightly_u-1.qcow2");
        assert_eq!(files.file_of("nightly", None), Ok("/b/team-a_nightly_u-1.qcow2"));
        assert_eq!(files.file_of("nightly", Some("logs")), Ok("/b/team-a_nightly_u-1.logs.qcow2"));
        assert_eq!(
            files.file_of("nightly", Some("cache")).unwrap_err(),
            "VirtualMachineBackup nightly holds no data disk \"cache\" (its status.dataDisks: [data, logs])"
        );
    }

    #[test]
    fn an_edited_status_cannot_point_at_another_file() {
        // Another namespace's backup, another backup's file, another disk's file.
        let other_namespace = backup("/b/team-b_nightly_u-1.qcow2", &[]);
        assert!(recorded_files("team-a", &other_namespace).unwrap_err().contains("status.location"));
        let swapped = backup("/b/team-a_nightly_u-1.qcow2", &[("data", "/b/team-a_nightly_u-1.logs.qcow2")]);
        let why = recorded_files("team-a", &swapped).unwrap_err();
        assert_eq!(
            why,
            "VirtualMachineBackup nightly's status.dataDisks[data].location \"/b/team-a_nightly_u-1.logs.qcow2\" is \
             not its file (team-a_nightly_u-1.data.qcow2)"
        );
        let boot_as_data = backup("/b/team-a_nightly_u-1.qcow2", &[("data", "/b/team-a_nightly_u-1.qcow2")]);
        assert!(recorded_files("team-a", &boot_as_data).is_err());
        let relative = backup("/b/team-a_nightly_u-1.qcow2", &[("data", "team-a_nightly_u-1.data.qcow2")]);
        assert!(recorded_files("team-a", &relative).is_err(), "a relative path is no host file of vmlet's");
    }

    #[test]
    fn hostile_disk_names_in_a_status_are_refused() {
        for hostile in ["../../etc", "a/b", "..", "x.y", ""] {
            let b = backup("/b/team-a_nightly_u-1.qcow2", &[(hostile, "/b/team-a_nightly_u-1.data.qcow2")]);
            let why = recorded_files("team-a", &b).unwrap_err();
            assert!(why.contains("which is no data disk's name"), "{hostile:?}: {why}");
        }
        let twice = backup(
            "/b/team-a_nightly_u-1.qcow2",
            &[("data", "/b/team-a_nightly_u-1.data.qcow2"), ("data", "/c/team-a_nightly_u-1.data.qcow2")],
        );
        assert!(recorded_files("team-a", &twice).unwrap_err().ends_with("names data twice"));
    }

    #[tokio::test]
    async fn files_outside_the_backup_roots_are_refused_naming_the_field() {
        let b = backup("/b/team-a_nightly_u-1.qcow2", &[("data", "/etc/team-a_nightly_u-1.data.qcow2")]);
        let roots = ["/b".to_owned()];
        let why = checked_files("team-a", &b, "host-a", &roots, false).await.unwrap_err();
        assert!(why.starts_with("VirtualMachineBackup nightly's status.dataDisks[data].location \"/etc/"), "{why}");
        assert!(
            why.ends_with("is not under a storage root (host host-a's backupRoots [/b]); refusing to read it"),
            "{why}"
        );
        let inside = backup("/b/team-a_nightly_u-1.qcow2", &[("data", "/b/team-a_nightly_u-1.data.qcow2")]);
        assert_eq!(checked_files("team-a", &inside, "host-a", &roots, false).await.unwrap().data_disks.len(), 1);
    }
}
