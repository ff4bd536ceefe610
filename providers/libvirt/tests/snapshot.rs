//! The libvirt provider's snapshots, and in-place restores from a backup,
//! against a real guest on a real libvirtd with QEMU: a snapshot with memory
//! of a running guest, one of a stopped guest, reverts of a stopped guest's
//! disk, what is refused (and that it leaves the VM alone), undefine with
//! snapshots, and a backup put back in the place of the disk.
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it), root (the guest
//! files under `/var/lib/vmlet`) and `genisoimage` (the seed). The guest is
//! `test-vms/guest/build.sh`'s, whose empty 64 MiB qcow2 disk is its
//! `/dev/vda`: the tests write markers at its start with `dd`, through the
//! guest agent, and read them back in the guest or on the host. Each test
//! boots one guest and checks everything in order, since the boot is the
//! expensive part; each has its own namespace, so they run side by side.

mod common;
use common::deadline::output_within;
use common::disk::{disk_head, image_info, snapshot_names};
use common::guest::{exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, RunDir, BOOT_DEADLINE};
use common::qemu_uri;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{
    BackupRequest, CloudInit, DataDisk, DiskFormat, ErrorKind, InPlaceRestore, PowerState, Provider, RevertOutcome,
    SnapshotRequest, VmId, VmSpec,
};

/// The guest's disk (`test-vms/guest/build.sh`): 64 MiB.
const DISK_BYTES: u64 = 64 << 20;
/// Bound on one snapshot, backup or restore of the guest (a snapshot with
/// memory writes its 256 MiB): generous, so that only a hang reaches it on a
/// loaded CI host, never slowness.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on what should happen at once (the VM stopping, a command in the
/// guest).
const PROMPT: Duration = Duration::from_secs(60);
/// Bound on one virsh call.
const COMMAND: Duration = Duration::from_secs(60);

fn request(name: &str, memory: Option<bool>) -> SnapshotRequest {
    SnapshotRequest { name: name.to_owned(), memory, quiesce: false, timeout: JOB_TIMEOUT }
}

/// `virsh -c <uri> <args>`, which must succeed; its stdout.
fn virsh(uri: &str, args: &[&str]) -> String {
    let out = output_within(Command::new("virsh").arg("-c").arg(uri).args(args), COMMAND);
    assert!(out.status.success(), "virsh {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A spec for the test guest in `run`: its disk, direct kernel boot.
fn guest_spec(namespace: &str, what: &str, guest: &Path) -> (VmSpec, RunDir) {
    let mut spec = common::unique_spec(namespace, what);
    let run = RunDir::new(guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    spec.image = Some(run.path("disk.qcow2"));
    spec.kernel_boot = Some(run.kernel_boot(guest));
    (spec, run)
}

/// Write `marker` and a newline at the start of the guest's disk, flushed.
async fn write_marker(provider: &LibvirtProvider, id: &VmId, marker: &str, deadline: Duration) {
    let write = format!("echo {marker} | dd of=/dev/vda bs=512 conv=fsync");
    exec_when_ready(provider, id, &["sh", "-c", &write], deadline).await;
}

/// What the guest reads at the start of its disk.
async fn marker_in_guest(provider: &LibvirtProvider, id: &VmId, deadline: Duration) -> String {
    let read = "dd if=/dev/vda bs=512 count=1 2>/dev/null | head -n 1";
    exec_when_ready(provider, id, &["sh", "-c", read], deadline).await.stdout.trim().to_owned()
}

/// What the qcow2 disk `path` holds at its start, read on the host.
fn marker_on_disk(path: &str) -> String {
    let head = disk_head(path, 64);
    String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_owned()
}

/// The VM's power state, which must exist.
async fn power(provider: &LibvirtProvider, id: &VmId) -> PowerState {
    provider.get(id).await.expect("get").expect("the VM exists").power
}

/// Power the VM off and wait until libvirt says it is.
async fn stop(provider: &LibvirtProvider, id: &VmId) {
    common::guest::power_off(provider, id, PROMPT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_guest_is_snapshotted_running_and_stopped_and_reverted_while_stopped() {
    const NAMESPACE: &str = "vmlet-snapshot-it";
    let uri = qemu_uri();
    let guest = guest_dir();
    let (mut spec, run) = guest_spec(NAMESPACE, "snap", &guest);
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest))
        .await
        .expect("connect")
        .with_seed_dir(PathBuf::from(run.path("seeds")));
    let snapshots = provider.snapshots().expect("QEMU has snapshots");
    remove_leftovers(&provider, NAMESPACE).await;
    // A cloud-init seed: a read-only raw CD-ROM, which snapshots leave out.
    spec.cloud_init = Some(CloudInit {
        instance_id: spec.id.0.clone(),
        hostname: "snap".into(),
        user_data: b"#!/bin/sh\ntrue\n".to_vec(),
        network_config: None,
    });
    let id = spec.id.clone();
    let disk = run.path("disk.qcow2");
    let domain = provider.ensure_defined(&spec).await.expect("define").backend_name;
    assert!(virsh(&uri, &["domblklist", &domain]).contains("hdc"), "the seed is attached");
    provider.start(&id).await.expect("start");
    let (before, after) = (format!("before-{}", spec.name), format!("after-{}", spec.name));
    write_marker(&provider, &id, &before, BOOT_DEADLINE).await;

    // 1. A running guest: a snapshot with its memory; the guest runs on.
    let running = snapshots.create_snapshot(&id, &request("s-run", None)).await.expect("snapshot a running guest");
    println!("snapshot of the running guest: {running:?}");
    assert!(running.memory && running.vm_was_running, "{running:?}");
    assert_eq!(running.name, "s-run");
    assert_eq!(power(&provider, &id).await, PowerState::Running, "the VM keeps running");
    assert_eq!(marker_in_guest(&provider, &id, PROMPT).await, before, "the guest answers after the snapshot");
    assert_eq!(snapshot_names(&disk), ["s-run"], "an internal snapshot in the qcow2 disk");
    let again = snapshots.create_snapshot(&id, &request("s-run", Some(false))).await.expect("the same name again");
    assert_eq!(again, running, "a retried create returns the snapshot as it is");
    assert_eq!(snapshots.snapshot(&id, "s-run").await.expect("read"), Some(running.clone()));
    snapshots.create_snapshot(&id, &request("s-gone", None)).await.expect("another snapshot");
    snapshots.delete_snapshot(&id, "s-gone").await.expect("delete while running");
    assert_eq!(snapshots.snapshot(&id, "s-gone").await.expect("read"), None);
    assert_eq!(snapshot_names(&disk), ["s-run"], "its data left the disk");

    // What is refused leaves the VM and its disk alone.
    let err = snapshots.create_snapshot(&id, &request("disk-only", Some(false))).await.expect_err("disk-only");
    println!("disk-only snapshot of a running guest: {err}");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("memory") && err.message.contains("stop the VM"), "{err}");
    assert_eq!(snapshots.snapshot(&id, "disk-only").await.expect("read"), None);
    let err = snapshots.revert_to_snapshot(&id, "s-run").await.expect_err("revert while running");
    println!("revert of a running guest: {err}");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert_eq!(power(&provider, &id).await, PowerState::Running, "the VM is untouched");
    assert_eq!(marker_in_guest(&provider, &id, PROMPT).await, before, "the disk is untouched");

    // 2. Written after the snapshot: not in a new disk made from it while
    //    the guest runs on, and gone after stop, revert and start.
    write_marker(&provider, &id, &after, PROMPT).await;
    let clone = run.path("clone.qcow2");
    let bytes = snapshots.export_snapshot_disk(&id, "s-run", &clone, JOB_TIMEOUT).await.expect("disk from a snapshot");
    assert_eq!(bytes, DISK_BYTES);
    assert_eq!(image_info(&clone), ("qcow2".to_owned(), DISK_BYTES), "a qcow2 image of the disk's size");
    assert_eq!(marker_on_disk(&clone), before, "the new disk is the snapshot's, without {after}");
    assert!(snapshot_names(&clone).is_empty(), "an independent image, with no snapshots of its own");
    assert!(!Path::new(&format!("{clone}.partial")).exists(), "no partial copy left");
    assert_eq!(power(&provider, &id).await, PowerState::Running, "the VM ran on during the copy");
    assert_eq!(marker_in_guest(&provider, &id, PROMPT).await, after, "its disk is untouched");
    assert_eq!(snapshot_names(&disk), ["s-run"], "the snapshot is kept");
    let made = std::fs::metadata(&clone).expect("the new disk").modified().expect("mtime");
    let again = snapshots.export_snapshot_disk(&id, "s-run", &clone, JOB_TIMEOUT).await.expect("the same call again");
    assert_eq!(again, DISK_BYTES);
    assert_eq!(std::fs::metadata(&clone).expect("the new disk").modified().expect("mtime"), made, "left alone");
    let missing = run.path("missing.qcow2");
    let err = snapshots.export_snapshot_disk(&id, "no-such", &missing, JOB_TIMEOUT).await.expect_err("no snapshot");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(!Path::new(&missing).exists(), "nothing written for a missing snapshot");
    let err = snapshots.export_snapshot_disk(&id, "s-run", "clone.qcow2", JOB_TIMEOUT).await.expect_err("relative");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    stop(&provider, &id).await;
    assert_eq!(marker_on_disk(&disk), after);
    let err = snapshots.create_snapshot(&id, &request("memory", Some(true))).await.expect_err("memory of a stopped VM");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("start the VM"), "{err}");

    //    A stopped guest: a disk-only snapshot (of what holds `after`).
    let stopped = snapshots.create_snapshot(&id, &request("s-off", None)).await.expect("snapshot a stopped guest");
    println!("snapshot of the stopped guest: {stopped:?}");
    assert!(!stopped.memory && !stopped.vm_was_running, "{stopped:?}");
    assert!(stopped.created_unix_seconds >= running.created_unix_seconds, "{stopped:?} after {running:?}");

    let reverted = snapshots.revert_to_snapshot(&id, "s-run").await.expect("revert to the running snapshot");
    assert_eq!(reverted, RevertOutcome { memory_restored: false }, "a stopped VM gets its disk back only");
    assert_eq!(power(&provider, &id).await, PowerState::Off, "the VM stays stopped");
    assert_eq!(marker_on_disk(&disk), before, "the disk is as it was at the snapshot");
    assert_eq!(virsh(&uri, &["snapshot-current", &domain, "--name"]).trim(), "s-run", "libvirt's current snapshot");
    provider.start(&id).await.expect("start after the revert");
    assert_eq!(marker_in_guest(&provider, &id, BOOT_DEADLINE).await, before, "{after} is gone in the guest");
    stop(&provider, &id).await;

    //    And forward again to the stopped snapshot.
    let reverted = snapshots.revert_to_snapshot(&id, "s-off").await.expect("revert to the stopped snapshot");
    assert_eq!(reverted, RevertOutcome { memory_restored: false });
    assert_eq!(marker_on_disk(&disk), after);
    let err = snapshots.revert_to_snapshot(&id, "no-such").await.expect_err("a missing snapshot");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

    // 3. Deletes are idempotent; the data leaves the disk.
    snapshots.delete_snapshot(&id, "s-off").await.expect("delete");
    snapshots.delete_snapshot(&id, "s-off").await.expect("delete again");
    assert_eq!(snapshots.snapshot(&id, "s-off").await.expect("read"), None);
    assert_eq!(snapshot_names(&disk), ["s-run"]);
    let other = common::unique_uid().0;
    snapshots.delete_snapshot(&other, "s-run").await.expect("delete of a VM this host does not have");

    // 4. Undefine with a snapshot left: libvirt's record goes with the VM,
    //    the data stays in the disk, which vmlet never deletes.
    provider.undefine(&id).await.expect("undefine with a snapshot");
    assert!(provider.get(&id).await.expect("get").is_none());
    let domains = virsh(&uri, &["list", "--all", "--name"]);
    assert!(!domains.lines().any(|line| line.trim() == domain), "{domain} is gone: {domains}");
    assert_eq!(snapshot_names(&disk), ["s-run"]);
    drop(run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_is_restored_in_place_keeping_the_previous_disk_and_dropping_its_snapshots() {
    const NAMESPACE: &str = "vmlet-restore-in-place-it";
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let backup = provider.backup().expect("QEMU has backups");
    let snapshots = provider.snapshots().expect("QEMU has snapshots");
    remove_leftovers(&provider, NAMESPACE).await;
    let (spec, run) = guest_spec(NAMESPACE, "restore", &guest);
    let id = spec.id.clone();
    let disk = run.path("disk.qcow2");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");
    let (before, after) = (format!("before-{}", spec.name), format!("after-{}", spec.name));

    // A backup holding `before`; then `after` and a snapshot that holds it.
    write_marker(&provider, &id, &before, BOOT_DEADLINE).await;
    std::fs::create_dir_all(run.path("backups")).expect("backups directory");
    let source = run.path("backups/b.qcow2");
    let to_source = BackupRequest {
        target: source.clone(),
        data_disks: Vec::new(),
        quiesce: false,
        timeout: JOB_TIMEOUT,
        checkpoint: None,
        incremental: None,
    };
    backup.backup(&id, &to_source, &|_| {}).await.expect("backup");
    write_marker(&provider, &id, &after, PROMPT).await;
    snapshots.create_snapshot(&id, &request("s-after", None)).await.expect("snapshot");

    let tag = spec.name.clone();
    let err = backup.restore_in_place(&id, &source, &[], &tag, JOB_TIMEOUT).await.expect_err("while running");
    println!("in-place restore of a running VM: {err}");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert_eq!(power(&provider, &id).await, PowerState::Running, "the VM is untouched");
    assert!(!Path::new(&format!("{disk}.before-{tag}")).exists() && !Path::new(&format!("{disk}.partial")).exists());

    stop(&provider, &id).await;
    // A mode of the disk's own, which the restored disk must keep.
    std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o640)).expect("chmod the disk");
    let old = std::fs::metadata(&disk).expect("the disk");
    let err =
        backup.restore_in_place(&id, &run.path("backups/no-such.qcow2"), &[], &tag, JOB_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    let err = backup.restore_in_place(&id, &source, &[], "bad/tag", JOB_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");

    let restored = backup.restore_in_place(&id, &source, &[], &tag, JOB_TIMEOUT).await.expect("restore in place");
    println!("in-place restore: {restored:?}");
    let kept = format!("{disk}.before-{tag}");
    assert_eq!(
        restored,
        InPlaceRestore { disk: disk.clone(), kept_as: kept.clone(), bytes: DISK_BYTES, data_disks: Vec::new() }
    );
    assert_eq!(marker_on_disk(&disk), before, "the disk holds the backup");
    assert_eq!(marker_on_disk(&kept), after, "the previous disk is kept");
    assert_eq!(image_info(&disk), ("qcow2".to_owned(), DISK_BYTES));
    assert!(!Path::new(&format!("{disk}.partial")).exists());
    let new = std::fs::metadata(&disk).expect("the restored disk");
    assert_eq!(
        (new.uid(), new.gid(), new.mode() & 0o7777),
        (old.uid(), old.gid(), old.mode() & 0o7777),
        "the restored disk keeps the owner and mode of the one it replaced"
    );
    assert_ne!(new.ino(), old.ino(), "a new file");

    //    The snapshot was in the previous file: gone for vmlet, its data kept.
    assert_eq!(snapshot_names(&disk), Vec::<String>::new());
    assert_eq!(snapshot_names(&kept), ["s-after"]);
    assert_eq!(snapshots.snapshot(&id, "s-after").await.expect("read"), None);
    let err = snapshots.revert_to_snapshot(&id, "s-after").await.expect_err("revert to a snapshot of the old disk");
    println!("revert after the restore: {err}");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert_eq!(marker_on_disk(&disk), before, "the failed revert changed nothing");

    // A second call answers the same and touches nothing.
    let again = backup.restore_in_place(&id, &source, &[], &tag, JOB_TIMEOUT).await.expect("restore again");
    assert_eq!(again, restored);
    assert_eq!(std::fs::metadata(&disk).expect("disk").ino(), new.ino(), "the disk was not replaced again");

    // Cut short between the renames (the copy not yet in the disk's place):
    // the next call completes it.
    std::fs::rename(&disk, format!("{disk}.partial")).expect("undo the second rename");
    let completed = backup.restore_in_place(&id, &source, &[], &tag, JOB_TIMEOUT).await.expect("complete the restore");
    assert_eq!(completed, restored);
    assert_eq!(std::fs::metadata(&disk).expect("disk").ino(), new.ino(), "the copy took the disk's place");

    provider.start(&id).await.expect("start after the restore");
    assert_eq!(marker_in_guest(&provider, &id, BOOT_DEADLINE).await, before, "{after} is gone in the guest");
    stop(&provider, &id).await;
    provider.undefine(&id).await.expect("undefine");
    drop(run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_with_a_raw_data_disk_is_refused_naming_the_disk() {
    const NAMESPACE: &str = "vmlet-snapshot-raw-it";
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let snapshots = provider.snapshots().expect("QEMU has snapshots");
    remove_leftovers(&provider, NAMESPACE).await;
    let (mut spec, run) = guest_spec(NAMESPACE, "raw", &guest);
    let (path, format) = (run.path("data.img"), DiskFormat::Raw);
    spec.disks =
        vec![DataDisk { name: "data".into(), path, format, create_bytes: Some(16 << 20), backing_chain: Vec::new() }];
    let id = spec.id.clone();
    provider.ensure_defined(&spec).await.expect("define");

    let err = snapshots.create_snapshot(&id, &request("s", None)).await.expect_err("a raw data disk");
    println!("snapshot of a VM with a raw data disk: {err}");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("vdb") && err.message.contains("spec.disks[data]"), "{err}");
    assert_eq!(snapshots.snapshot(&id, "s").await.expect("read"), None);
    assert_eq!(snapshot_names(&run.path("disk.qcow2")), Vec::<String>::new(), "the boot disk is untouched");
    let err =
        provider.backup().expect("backup").restore_in_place(&id, "/b.qcow2", &[], "t", JOB_TIMEOUT).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "two disks: {err}");
    provider.undefine(&id).await.expect("undefine");
    drop(run);
}
