//! Backups of a VM with data disks on a real libvirtd with a real QEMU guest:
//! one backup job copies the boot disk and each data disk into its own file
//! at one point in time (with one checkpoint for all), an incremental backup
//! layers each disk's file on the base's file of the same disk, an inactive
//! VM's disks are copied with qemu-img, a request that leaves a data disk
//! out is refused, and an in-place restore puts every disk back.
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it) and root (the
//! guest files under `/var/lib/vmlet`). One guest, checked in order: its boot
//! is the expensive part.

mod common;
use common::deadline::output_within;
use common::disk::disk_head;
use common::guest::{exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, RunDir, BOOT_DEADLINE};
use common::qemu_uri;

use std::process::Command;
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{
    BackupRequest, Consistency, DataDisk, DataDiskCopy, DataDiskFile, DiskFormat, ErrorKind, IncrementalBase, Provider,
    VmId,
};

const NAMESPACE: &str = "vmlet-data-disks-it";
/// The guest's boot disk (`test-vms/guest/build.sh`): 64 MiB.
const DISK_BYTES: u64 = 64 << 20;
/// Each data disk: 16 MiB.
const DATA_BYTES: u64 = 16 << 20;
/// The data disks' names (`spec.disks[].name`, the guest's serials).
const DATA: [&str; 2] = ["data", "logs"];
/// Bound on one backup or restore.
const COPY_TIMEOUT: Duration = Duration::from_secs(180);
/// Bound on one external command (virsh, qemu-img).
const COMMAND: Duration = Duration::from_secs(60);
/// Bound on what should happen at once.
const PROMPT: Duration = Duration::from_secs(60);

/// The guest's shell function `dev <serial>`: the block device of the data
/// disk with that serial.
const DEV: &str =
    "dev() { for d in /sys/block/vd?; do [ \"$(cat $d/serial 2>/dev/null)\" = \"$1\" ] && echo /dev/${d##*/}; done; }";

/// The files of backup `tag` in `dir`: the boot disk's, then each data disk's.
fn files(dir: &str, tag: &str) -> (String, Vec<DataDiskFile>) {
    let data = DATA.iter().map(|disk| DataDiskFile { disk: (*disk).into(), path: format!("{dir}/{tag}.{disk}.qcow2") });
    (format!("{dir}/{tag}.qcow2"), data.collect())
}

fn request(dir: &str, tag: &str, checkpoint: Option<&str>) -> BackupRequest {
    let (target, data_disks) = files(dir, tag);
    BackupRequest {
        target,
        data_disks,
        quiesce: false,
        timeout: COPY_TIMEOUT,
        checkpoint: checkpoint.map(str::to_owned),
        incremental: None,
    }
}

/// Write `marker` and a newline at the start of each data disk, prefixed
/// with the disk's name (`data:<marker>`).
async fn write_markers(provider: &LibvirtProvider, id: &VmId, marker: &str, deadline: Duration) {
    let writes: Vec<String> =
        DATA.iter().map(|disk| format!("echo {disk}:{marker} | dd of=$(dev {disk}) bs=512 conv=fsync")).collect();
    let script = format!("{DEV}; {}", writes.join(" && "));
    exec_when_ready(provider, id, &["sh", "-c", &script], deadline).await;
}

/// What the guest reads at the start of each data disk (first line).
async fn read_markers(provider: &LibvirtProvider, id: &VmId, deadline: Duration) -> Vec<String> {
    let mut found = Vec::new();
    for disk in DATA {
        let script = format!("{DEV}; head -c 64 $(dev {disk}) | head -n 1");
        let out = exec_when_ready(provider, id, &["sh", "-c", &script], deadline).await;
        found.push(out.stdout.trim().to_owned());
    }
    found
}

/// Whether the qcow2 image `path` (read through its chain) starts with
/// `line` and a newline.
fn starts_with_line(path: &str, line: &str) -> bool {
    let needle = format!("{line}\n");
    disk_head(path, needle.len()) == needle.as_bytes()
}

fn qemu_img(args: &[&str]) -> String {
    let out = output_within(Command::new("qemu-img").args(args), COMMAND);
    assert!(out.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn checkpoints(uri: &str, domain: &str) -> Vec<String> {
    let out = output_within(Command::new("virsh").args(["-c", uri, "checkpoint-list", "--name", domain]), COMMAND);
    assert!(out.status.success(), "virsh checkpoint-list: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect()
}

/// Power the VM off and wait until libvirt says it is.
async fn stop(provider: &LibvirtProvider, id: &VmId) {
    common::guest::power_off(provider, id, PROMPT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_disk_is_backed_up_at_one_point_in_time_and_restored_in_place() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let backup = provider.backup().expect("QEMU has the backup capability");
    remove_leftovers(&provider, NAMESPACE).await;

    let mut spec = common::unique_spec(NAMESPACE, "data");
    let run = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    spec.image = Some(run.path("disk.qcow2"));
    spec.kernel_boot = Some(run.kernel_boot(&guest));
    spec.disks = DATA
        .iter()
        .map(|disk| {
            let path = run.path(&format!("{disk}.qcow2"));
            qemu_img(&["create", "-q", "-f", "qcow2", &path, &DATA_BYTES.to_string()]);
            DataDisk {
                name: (*disk).into(),
                path,
                format: DiskFormat::Qcow2,
                create_bytes: None,
                backing_chain: vec![],
            }
        })
        .collect();
    let id = spec.id.clone();
    let backups = run.path("backups");
    std::fs::create_dir_all(&backups).expect("backups directory");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");
    let domain = provider.get(&id).await.expect("get").expect("VM").backend_name;
    write_markers(&provider, &id, "one", BOOT_DEADLINE).await;

    // 1. A request that leaves a data disk out is refused, naming it; no
    //    file is written.
    let (target, mut data_disks) = files(&backups, "partial");
    data_disks.truncate(1);
    let partial = BackupRequest { target: target.clone(), data_disks, ..request(&backups, "partial", None) };
    let err = backup.backup(&id, &partial, &|_| {}).await.expect_err("logs left out");
    println!("a backup naming only one data disk: {err}");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("(spec.disks[logs]) that this copy names no file for"), "{err}");
    assert_eq!(std::fs::read_dir(&backups).expect("backups").count(), 0, "nothing written");

    // 2. A full backup with checkpoint b1: three files, one checkpoint with a
    //    bitmap in each disk.
    let full = request(&backups, "b1", Some("b1"));
    let first = backup.backup(&id, &full, &|_| {}).await.expect("full backup");
    println!("full backup: {first:?}");
    assert_eq!(first.bytes, DISK_BYTES + 2 * DATA_BYTES, "all disks copied: {first:?}");
    assert_eq!(first.checkpoint.as_deref(), Some("b1"));
    let expected: Vec<DataDiskCopy> = full
        .data_disks
        .iter()
        .map(|file| DataDiskCopy {
            disk: file.disk.clone(),
            path: file.path.clone(),
            virtual_bytes: DATA_BYTES,
            file_bytes: std::fs::metadata(&file.path).expect("data disk backup").len(),
        })
        .collect();
    assert_eq!(first.data_disks, expected);
    for (file, disk) in full.data_disks.iter().zip(DATA) {
        assert!(starts_with_line(&file.path, &format!("{disk}:one")), "{} holds {disk}'s marker", file.path);
    }
    assert_eq!(checkpoints(&uri, &domain), ["b1"]);
    let out = output_within(Command::new("virsh").args(["-c", &uri, "checkpoint-dumpxml", &domain, "b1"]), COMMAND);
    let xml = String::from_utf8_lossy(&out.stdout);
    for target in ["vda", "vdb", "vdc"] {
        assert!(xml.contains(&format!("<disk name='{target}' checkpoint='bitmap'")), "{target} in {xml}");
    }

    // 3. The guest writes new markers; an incremental backup from b1 layers
    //    each disk's file on b1's file of the same disk and copies little.
    write_markers(&provider, &id, "two", PROMPT).await;
    let (b1, b1_data) = files(&backups, "b1");
    let incremental = BackupRequest {
        incremental: Some(IncrementalBase { checkpoint: "b1".into(), backing_file: b1, data_backing_files: b1_data }),
        ..request(&backups, "b2", Some("b2"))
    };
    let second = backup.backup(&id, &incremental, &|_| {}).await.expect("incremental backup");
    println!("incremental backup: {second:?}");
    assert!(second.bytes < 4 << 20, "only the changed clusters: {second:?}");
    assert_eq!(second.data_disks.len(), 2);
    for ((file, disk), copy) in incremental.data_disks.iter().zip(DATA).zip(&second.data_disks) {
        let info = qemu_img(&["info", "-U", &file.path]);
        assert!(info.contains(&format!("backing file: {backups}/b1.{disk}.qcow2")), "{info}");
        assert_eq!((copy.disk.as_str(), copy.virtual_bytes), (disk, DATA_BYTES));
        assert!(starts_with_line(&file.path, &format!("{disk}:two")), "{} read through its chain", file.path);
    }
    assert_eq!(checkpoints(&uri, &domain), ["b2"]);

    // 4. Stopped, the VM's disks are copied with qemu-img, each into its file.
    stop(&provider, &id).await;
    let offline = backup.backup(&id, &request(&backups, "c1", None), &|_| {}).await.expect("offline backup");
    println!("offline backup: {offline:?}");
    assert_eq!((offline.bytes, &offline.consistency), (DISK_BYTES + 2 * DATA_BYTES, &Consistency::Offline));
    let names: Vec<(&str, u64)> = offline.data_disks.iter().map(|c| (c.disk.as_str(), c.virtual_bytes)).collect();
    assert_eq!(names, [("data", DATA_BYTES), ("logs", DATA_BYTES)]);
    for copy in &offline.data_disks {
        assert!(starts_with_line(&copy.path, &format!("{}:two", copy.disk)), "{copy:?}");
    }

    // 5. In place from b1: every disk gets b1's content back, each previous
    //    file kept beside it; the guest reads the first markers again.
    let (b1, b1_data) = files(&backups, "b1");
    let tag = "r-1";
    let restored = backup.restore_in_place(&id, &b1, &b1_data, tag, COPY_TIMEOUT).await.expect("restore in place");
    println!("in-place restore: {restored:?}");
    assert_eq!((restored.disk.as_str(), restored.bytes), (run.path("disk.qcow2").as_str(), DISK_BYTES));
    let put_back: Vec<(&str, &str, &str, u64)> =
        restored.data_disks.iter().map(|d| (d.name.as_str(), d.disk.as_str(), d.kept_as.as_str(), d.bytes)).collect();
    let (data, logs) = (run.path("data.qcow2"), run.path("logs.qcow2"));
    let (data_kept, logs_kept) = (format!("{data}.before-{tag}"), format!("{logs}.before-{tag}"));
    assert_eq!(
        put_back,
        [
            ("data", data.as_str(), data_kept.as_str(), DATA_BYTES),
            ("logs", logs.as_str(), logs_kept.as_str(), DATA_BYTES)
        ]
    );
    assert!(starts_with_line(&data_kept, "data:two") && starts_with_line(&logs_kept, "logs:two"), "kept");
    let again = backup.restore_in_place(&id, &b1, &b1_data, tag, COPY_TIMEOUT).await.expect("restore again");
    assert_eq!(again, restored, "a second call finds every disk done");
    provider.start(&id).await.expect("start after the restore");
    assert_eq!(read_markers(&provider, &id, BOOT_DEADLINE).await, ["data:one", "logs:one"]);

    stop(&provider, &id).await;
    provider.undefine(&id).await.expect("undefine");
    drop(run);
}
