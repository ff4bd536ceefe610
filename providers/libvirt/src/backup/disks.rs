//! Which file each disk of a VM goes to (a backup) or comes from (an in-place
//! restore): the boot disk (the one disk without a `<serial>`) pairs with the
//! request's boot file, each data disk (`<serial>` = `spec.disks[].name`)
//! with the file the request names for it. A VM's disks and the request's
//! must match one to one: a backup or restore of some of a VM's disks only
//! would mix points in time.

use vmlet_provider::{DataDiskFile, Error, ErrorKind, Result, VmId};

use crate::xml::Disk;

/// A disk of the VM and its file on the other side of the copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Paired {
    /// The VM's disk.
    pub(crate) disk: Disk,
    /// The data disk's name (`spec.disks[].name`); `None` for the boot disk.
    pub(crate) name: Option<String>,
    /// The backup file (written by a backup, read by a restore).
    pub(crate) file: String,
}

impl Paired {
    /// How messages name the disk: `vda (boot disk)`, `vdb (spec.disks[data])`.
    pub(crate) fn describe(&self) -> String {
        match &self.name {
            Some(name) => format!("{} (spec.disks[{name}])", self.disk.target),
            None => format!("{} (boot disk)", self.disk.target),
        }
    }
}

/// Pair `found` (the VM's disks, in domain order) with `boot` and `data`:
/// the boot disk first, then the data disks in domain order.
///
/// Errors (`InvalidInput` for `operation`, naming the disk): no boot disk or
/// several; a data disk `data` names no file for; a file for a data disk the
/// VM does not have, or named twice.
pub(crate) fn pair(
    operation: &'static str,
    id: &VmId,
    found: Vec<Disk>,
    boot: &str,
    data: &[DataDiskFile],
) -> Result<Vec<Paired>> {
    let invalid = |message: String| Error::new(operation, ErrorKind::InvalidInput, message);
    let (boots, data_disks): (Vec<Disk>, Vec<Disk>) = found.into_iter().partition(|disk| disk.serial.is_none());
    let boot_disk = match <[Disk; 1]>::try_from(boots) {
        Ok([disk]) => disk,
        Err(boots) => {
            let targets: Vec<&str> = boots.iter().map(|disk| disk.target.as_str()).collect();
            return Err(invalid(format!(
                "VM {id} has {} disks without a data disk's serial ({}); vmlet copies a VM with exactly one boot \
                 disk and its spec.disks",
                boots.len(),
                targets.join(", ")
            )));
        }
    };
    for (at, file) in data.iter().enumerate() {
        if data[..at].iter().any(|earlier| earlier.disk == file.disk) {
            return Err(invalid(format!("data disk {} is named twice", file.disk)));
        }
        if !data_disks.iter().any(|disk| disk.serial.as_deref() == Some(file.disk.as_str())) {
            return Err(invalid(format!(
                "VM {id} has no data disk {} (spec.disks[{}]); its data disks are [{}]",
                file.disk,
                file.disk,
                names(&data_disks).join(", ")
            )));
        }
    }
    let mut paired = vec![Paired { disk: boot_disk, name: None, file: boot.to_owned() }];
    for disk in data_disks {
        let name = disk.serial.clone().unwrap_or_default();
        let Some(file) = data.iter().find(|file| file.disk == name) else {
            return Err(invalid(format!(
                "VM {id} has data disk {} (spec.disks[{name}]) that this copy names no file for; a backup holds all \
                 of a VM's disks: take a new backup of the VM as it is now",
                disk.target
            )));
        };
        paired.push(Paired { disk, name: Some(name), file: file.path.clone() });
    }
    Ok(paired)
}

/// The data disks' names (`spec.disks[].name`), in domain order.
fn names(disks: &[Disk]) -> Vec<String> {
    disks.iter().filter_map(|disk| disk.serial.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> VmId {
        VmId("6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into())
    }

    fn disk(target: &str, serial: Option<&str>) -> Disk {
        Disk {
            target: target.into(),
            kind: "file".into(),
            source: Some(format!("/d/{target}.qcow2")),
            format: None,
            serial: serial.map(str::to_owned),
        }
    }

    fn file(disk: &str, path: &str) -> DataDiskFile {
        DataDiskFile { disk: disk.into(), path: path.into() }
    }

    #[test]
    fn the_boot_disk_comes_first_and_each_data_disk_gets_its_named_file() {
        let found = vec![disk("vda", None), disk("vdb", Some("data")), disk("vdc", Some("logs"))];
        let paired = pair("op", &id(), found, "/b/x.qcow2", &[file("logs", "/b/x.logs"), file("data", "/b/x.data")])
            .expect("paired");
        let got: Vec<(&str, Option<&str>, &str)> =
            paired.iter().map(|p| (p.disk.target.as_str(), p.name.as_deref(), p.file.as_str())).collect();
        assert_eq!(
            got,
            [("vda", None, "/b/x.qcow2"), ("vdb", Some("data"), "/b/x.data"), ("vdc", Some("logs"), "/b/x.logs")]
        );
        assert_eq!(paired[1].describe(), "vdb (spec.disks[data])");
        assert_eq!(paired[0].describe(), "vda (boot disk)");
    }

    #[test]
    fn disks_that_do_not_match_one_to_one_are_refused_naming_the_disk() {
        let vm = || vec![disk("vda", None), disk("vdb", Some("data"))];
        let cases: [(Vec<Disk>, Vec<DataDiskFile>, &str); 5] = [
            (vm(), vec![], "has data disk vdb (spec.disks[data]) that this copy names no file for"),
            (
                vm(),
                vec![file("data", "/a"), file("logs", "/b")],
                "has no data disk logs (spec.disks[logs]); its data disks are [data]",
            ),
            (vm(), vec![file("data", "/a"), file("data", "/b")], "data disk data is named twice"),
            (vec![disk("vdb", Some("data"))], vec![file("data", "/a")], "has 0 disks without a data disk's serial ()"),
            (vec![disk("vda", None), disk("vdb", None)], vec![], "has 2 disks without a data disk's serial (vda, vdb)"),
        ];
        for (found, data, expected) in cases {
            let err = pair("op", &id(), found, "/b/x.qcow2", &data).expect_err(expected);
            assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
            assert!(err.message.contains(expected), "{err}");
        }
    }
}
