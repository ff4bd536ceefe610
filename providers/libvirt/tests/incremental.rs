//! Incremental backups on a real libvirtd with a real QEMU guest: a full
//! backup that leaves a checkpoint, an incremental one on top of it that
//! copies only what the guest wrote since, restores of the chain, a base
//! checkpoint that does not exist, the checkpoint across a stop and start,
//! and vmlet's checkpoint housekeeping.
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it) and root (the
//! guest files under `/var/lib/vmlet`). One guest, checked in order: its boot
//! is the expensive part.

mod common;
use common::deadline::output_within;
use common::disk::{disk_head, image_info};
use common::guest::{exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, wait_for, RunDir, BOOT_DEADLINE};
use common::qemu_uri;

use std::process::Command;
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{BackupRequest, ErrorKind, IncrementalBase, PowerState, Provider, VmId};

const NAMESPACE: &str = "vmlet-incremental-it";
/// The guest's disk (`test-vms/guest/build.sh`): 64 MiB.
const DISK_BYTES: u64 = 64 << 20;
/// Bound on one backup or restore of the 64 MiB disk.
const COPY_TIMEOUT: Duration = Duration::from_secs(180);
/// Bound on one external command (virsh, qemu-img).
const COMMAND: Duration = Duration::from_secs(60);
/// Bound on what should happen at once.
const PROMPT: Duration = Duration::from_secs(60);

fn full(target: &str, checkpoint: &str) -> BackupRequest {
    BackupRequest {
        target: target.to_owned(),
        data_disks: Vec::new(),
        quiesce: false,
        timeout: COPY_TIMEOUT,
        checkpoint: Some(checkpoint.to_owned()),
        incremental: None,
    }
}

fn incremental(target: &str, checkpoint: &str, base: &str, backing_file: &str) -> BackupRequest {
    BackupRequest {
        incremental: Some(IncrementalBase {
            checkpoint: base.to_owned(),
            backing_file: backing_file.to_owned(),
            data_backing_files: Vec::new(),
        }),
        ..full(target, checkpoint)
    }
}

/// The names of the domain's checkpoints (`virsh checkpoint-list --name`).
fn checkpoints(uri: &str, domain: &str) -> Vec<String> {
    let out = output_within(Command::new("virsh").args(["-c", uri, "checkpoint-list", "--name", domain]), COMMAND);
    assert!(out.status.success(), "virsh checkpoint-list: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect()
}

/// `qemu-img info -U` of `path`, as text.
fn info_text(path: &str) -> String {
    let out = output_within(Command::new("qemu-img").args(["info", "-U", path]), COMMAND);
    assert!(out.status.success(), "qemu-img info {path}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether bytes `offset..offset+needle.len()` of the qcow2 disk `path` (read
/// through its chain) are `needle`.
fn disk_holds_at(path: &str, offset: usize, needle: &[u8]) -> bool {
    let head = disk_head(path, offset + needle.len());
    &head[offset..] == needle
}

async fn power(provider: &LibvirtProvider, id: &VmId) -> Result<(), String> {
    match provider.get(id).await {
        Ok(Some(status)) if status.power == PowerState::Off => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_backup_copies_only_what_changed_and_restores_through_its_chain() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let backup = provider.backup().expect("QEMU has the backup capability");
    remove_leftovers(&provider, NAMESPACE).await;

    let mut spec = common::unique_spec(NAMESPACE, "incr");
    let run_dir = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    spec.image = Some(run_dir.path("disk.qcow2"));
    spec.kernel_boot = Some(run_dir.kernel_boot(&guest));
    let id = spec.id.clone();
    let backups = run_dir.path("backups");
    std::fs::create_dir_all(&backups).expect("backups directory");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");
    let domain = provider.get(&id).await.expect("get").expect("VM").backend_name;

    // 1. 8 MiB of random data, then a full backup that leaves checkpoint b1.
    let fill = "dd if=/dev/urandom of=/dev/vda bs=1M seek=8 count=8 conv=fsync";
    exec_when_ready(&provider, &id, &["sh", "-c", fill], BOOT_DEADLINE).await;
    let full_file = format!("{backups}/b1.qcow2");
    let first = backup.backup(&id, &full(&full_file, "b1"), &|_| {}).await.expect("full backup");
    println!("full backup: {first:?}");
    assert_eq!((first.bytes, first.checkpoint.as_deref()), (DISK_BYTES, Some("b1")), "{first:?}");
    assert_eq!(checkpoints(&uri, &domain), ["b1"]);

    // 2. The guest writes a marker at the start and 2 MiB further on.
    let marker = format!("incremental-{}", spec.name);
    let write = format!(
        "echo {marker} | dd of=/dev/vda bs=512 conv=fsync && \
         dd if=/dev/urandom of=/dev/vda bs=1M seek=32 count=2 conv=fsync"
    );
    exec_when_ready(&provider, &id, &["sh", "-c", &write], PROMPT).await;

    // 3. Incremental from b1: only the changed blocks, b2 now the only checkpoint.
    let incr_file = format!("{backups}/b2.qcow2");
    let progress = std::sync::Mutex::new(Vec::new());
    let second = backup
        .backup(&id, &incremental(&incr_file, "b2", "b1", &full_file), &|p| progress.lock().unwrap().push(p))
        .await
        .expect("incremental backup");
    println!("incremental backup: {second:?}; progress {:?}", progress.lock().unwrap());
    assert_eq!(second.checkpoint.as_deref(), Some("b2"));
    assert!(second.bytes >= 2 << 20 && second.bytes < 8 << 20, "about 2 MiB changed: {second:?}");
    let (full_size, incr_size) = (
        std::fs::metadata(&full_file).expect("full file").len(),
        std::fs::metadata(&incr_file).expect("incremental file").len(),
    );
    assert!(full_size > 8 << 20, "the full backup holds the 8 MiB: {full_size}");
    assert!(incr_size < full_size / 2 && incr_size < 4 << 20, "incremental {incr_size} vs full {full_size}");
    assert_eq!(second.file_bytes, incr_size);
    let info = info_text(&incr_file);
    assert!(info.contains(&format!("backing file: {full_file}")), "{info}");
    assert_eq!(checkpoints(&uri, &domain), ["b2"], "housekeeping leaves only the newest checkpoint");

    // 4. A restore of the incremental reads the chain into an independent
    //    image holding the marker; one of the full backup alone does not.
    let restored = run_dir.path("restored.qcow2");
    assert_eq!(backup.restore_disk(&incr_file, &restored, COPY_TIMEOUT).await.expect("restore"), DISK_BYTES);
    assert!(!info_text(&restored).contains("backing file"), "an independent image");
    assert_eq!(image_info(&restored), ("qcow2".to_owned(), DISK_BYTES));
    assert!(disk_holds_at(&restored, 0, format!("{marker}\n").as_bytes()), "the restored disk holds the marker");
    let full_data = disk_head(&full_file, (17 << 20) as usize);
    let restored_data = disk_head(&restored, (17 << 20) as usize);
    assert_eq!(full_data[8 << 20..], restored_data[8 << 20..], "the full backup's data, read through the chain");
    let older = run_dir.path("older.qcow2");
    backup.restore_disk(&full_file, &older, COPY_TIMEOUT).await.expect("restore the full backup");
    assert!(!disk_holds_at(&older, 0, marker.as_bytes()), "the full backup predates the marker");

    // 5. A base checkpoint the VM does not have: NotFound, no file left.
    let stray = format!("{backups}/stray.qcow2");
    let err = backup
        .backup(&id, &incremental(&stray, "b3", "b1", &full_file), &|_| {})
        .await
        .expect_err("b1 was deleted by the housekeeping");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains("full backup"), "{err}");
    assert!(!std::path::Path::new(&stray).exists(), "the pre-created target is removed");
    let missing = backup
        .backup(&id, &incremental(&stray, "b3", "b2", &format!("{backups}/gone.qcow2")), &|_| {})
        .await
        .expect_err("a backing file that does not exist");
    assert_eq!(missing.kind, ErrorKind::NotFound, "{missing}");
    assert_eq!(checkpoints(&uri, &domain), ["b2"], "failed backups leave the checkpoints alone");

    // 6. The checkpoint survives a power-off and start (QEMU writes the
    //    persistent bitmap into the qcow2 as it exits), and
    //    a stopped VM takes no incremental backup.
    provider.destroy(&id).await.expect("power off");
    wait_for("the VM to be off", PROMPT, || power(&provider, &id)).await;
    let offline = backup
        .backup(&id, &incremental(&stray, "b3", "b2", &incr_file), &|_| {})
        .await
        .expect_err("no incremental backup of a stopped VM");
    assert_eq!(offline.kind, ErrorKind::InvalidInput, "{offline}");
    assert!(!std::path::Path::new(&stray).exists());
    provider.start(&id).await.expect("start again");
    assert_eq!(checkpoints(&uri, &domain), ["b2"]);
    let after_restart = format!("after-restart-{}", spec.name);
    let write = format!("echo {after_restart} | dd of=/dev/vda bs=512 seek=1 conv=fsync");
    exec_when_ready(&provider, &id, &["sh", "-c", &write], BOOT_DEADLINE).await;
    let third_file = format!("{backups}/b3.qcow2");
    let third = backup
        .backup(&id, &incremental(&third_file, "b3", "b2", &incr_file), &|_| {})
        .await
        .expect("incremental backup after a restart");
    println!("incremental backup after a restart: {third:?}");
    assert!(third.bytes < 4 << 20, "{third:?}");
    assert_eq!(checkpoints(&uri, &domain), ["b3"]);
    let chain = run_dir.path("chain.qcow2");
    backup.restore_disk(&third_file, &chain, COPY_TIMEOUT).await.expect("restore the three-file chain");
    assert!(disk_holds_at(&chain, 0, format!("{marker}\n").as_bytes()));
    assert!(disk_holds_at(&chain, 512, format!("{after_restart}\n").as_bytes()));

    provider.destroy(&id).await.expect("destroy");
    wait_for("the VM to be off", PROMPT, || power(&provider, &id)).await;
    provider.undefine(&id).await.expect("undefine a VM with a checkpoint");
    assert!(provider.get(&id).await.expect("get").is_none());
    drop(run_dir);
}
