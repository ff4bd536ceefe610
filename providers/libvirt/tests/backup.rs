//! The libvirt provider's backup capability against a real guest on a real
//! libvirtd with QEMU: push-mode backups of a running VM (quiesced through its
//! agent, and without one), a target whose file system is full, a VM busy with
//! another job, an inactive VM's disk copied with qemu-img, and restores.
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it) and root (the guest
//! files under `/var/lib/vmlet`, a tmpfs mount). The guest is
//! `test-vms/guest/build.sh`'s, whose empty 64 MiB qcow2 disk is its
//! `/dev/vda`. One test boots one guest and checks everything in order, since
//! the boot is the expensive part.

mod common;
use common::deadline::{output_within, run};
use common::disk::{disk_head, image_info};
use common::guest::BOOT_DEADLINE;
use common::guest::{
    exec, exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, wait_for, RunDir, RUN_DIRS,
};
use common::qemu_uri;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{BackupProgress, BackupRequest, Consistency, ErrorKind, PowerState, Provider, VmId};

const NAMESPACE: &str = "vmlet-backup-it";
/// The guest's disk (`test-vms/guest/build.sh`): 64 MiB.
const DISK_BYTES: u64 = 64 << 20;
/// Bound on one backup or restore of the 64 MiB disk: generous, so that only a
/// hang reaches it on a loaded CI host, never slowness.
const COPY_TIMEOUT: Duration = Duration::from_secs(180);
/// Bound on one external command (mount, qemu-img, virsh).
const COMMAND: Duration = Duration::from_secs(60);
/// Bound on what should happen at once (the VM stopping, the agent going).
const PROMPT: Duration = Duration::from_secs(60);

/// A tmpfs mounted for the test, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mount a tmpfs of `size` (`1m`) at `path`, creating the directory.
    fn mount(path: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(path).expect("create the mount point");
        let out = output_within(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "vmlet-backup-it"])
                .arg(path),
            COMMAND,
        );
        assert!(
            out.status.success(),
            "mount a tmpfs at {} (needs root: run hack/test.sh as root): {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(path.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        match run(Command::new("umount").arg(&self.0), COMMAND) {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!("umount {}: {}", self.0.display(), String::from_utf8_lossy(&out.stderr)),
            Err(timed_out) => eprintln!("{timed_out}"),
        }
    }
}

/// Unmount what an earlier, interrupted run of this test left mounted under
/// its run directories.
fn unmount_leftovers() {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("/proc/self/mountinfo");
    for point in mounts.lines().filter_map(|line| line.split(' ').nth(4)) {
        if point.starts_with(&format!("{RUN_DIRS}/backup-")) {
            println!("unmounting leftover {point}");
            let _ = run(Command::new("umount").arg(point), COMMAND);
        }
    }
}

/// What the guest reads at the start of its disk.
async fn guest_disk_head(provider: &LibvirtProvider, id: &VmId) -> String {
    exec_when_ready(provider, id, &["sh", "-c", "dd if=/dev/vda bs=512 count=1 2>/dev/null | head -c 64"], PROMPT)
        .await
        .stdout
}

/// Every progress report of one backup.
#[derive(Clone, Default)]
struct Reports(Arc<Mutex<Vec<BackupProgress>>>);

impl Reports {
    fn push(&self, progress: BackupProgress) {
        self.0.lock().unwrap().push(progress);
    }

    fn all(&self) -> Vec<BackupProgress> {
        self.0.lock().unwrap().clone()
    }
}

fn request(target: &str, quiesce: bool) -> BackupRequest {
    BackupRequest {
        target: target.to_owned(),
        data_disks: Vec::new(),
        quiesce,
        timeout: COPY_TIMEOUT,
        checkpoint: None,
        incremental: None,
    }
}

/// `virsh -c <uri> <args>`, which must succeed; its stdout.
fn virsh(uri: &str, args: &[&str]) -> String {
    let out = output_within(Command::new("virsh").arg("-c").arg(uri).args(args), COMMAND);
    assert!(out.status.success(), "virsh {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_guest_backs_up_quiesced_refuses_full_targets_and_busy_vms_and_restores() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let backup = provider.backup().expect("QEMU has the backup capability");
    unmount_leftovers();
    remove_leftovers(&provider, NAMESPACE).await;

    let mut spec = common::unique_spec(NAMESPACE, "backup");
    let run_dir = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    let disk = run_dir.path("disk.qcow2");
    spec.image = Some(disk.clone());
    spec.kernel_boot = Some(run_dir.kernel_boot(&guest));
    let id = spec.id.clone();
    let backups = run_dir.path("backups");
    std::fs::create_dir_all(&backups).expect("backups directory");
    // Mounted before the VM starts: QEMU sees the host's mounts as they were
    // when it started (its own mount namespace).
    let full_dir = PathBuf::from(run_dir.path("full"));
    let full = Tmpfs::mount(&full_dir, "1m");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");

    // 1. A marker at the start of the disk and 4 MiB of random data after it
    //    (more than the full file system below holds), then a quiesced backup.
    let tag = spec.name.clone();
    let before = format!("before-{tag}");
    let after = format!("after-{tag}");
    let write = format!(
        "echo {before} | dd of=/dev/vda bs=512 conv=fsync && \
         dd if=/dev/urandom of=/dev/vda bs=1M seek=1 count=4 conv=fsync"
    );
    exec_when_ready(&provider, &id, &["sh", "-c", &write], BOOT_DEADLINE).await;
    let target = format!("{backups}/quiesced.qcow2");
    let reports = Reports::default();
    let seen = reports.clone();
    let outcome = backup.backup(&id, &request(&target, true), &move |p| seen.push(p)).await.expect("backup");
    println!("quiesced backup: {outcome:?}; progress {:?}", reports.all());
    assert!(matches!(outcome.consistency, Consistency::Quiesced { .. }), "the guest has an agent: {outcome:?}");
    assert_eq!((outcome.path.as_str(), outcome.bytes), (target.as_str(), DISK_BYTES), "{outcome:?}");
    let file_bytes = std::fs::metadata(&target).expect("the backup file").len();
    assert_eq!(outcome.file_bytes, file_bytes, "{outcome:?}");
    assert!(file_bytes > 4 << 20 && file_bytes < DISK_BYTES, "4 MiB of data, zeros not stored: {file_bytes}");
    let progress = reports.all();
    assert!(progress.iter().all(|p| p.total_bytes == DISK_BYTES && p.processed_bytes <= DISK_BYTES), "{progress:?}");
    assert_eq!(progress.last().map(|p| p.processed_bytes), Some(DISK_BYTES), "{progress:?}");
    assert_eq!(image_info(&target), ("qcow2".to_owned(), DISK_BYTES));

    // The guest writes on; the backup keeps what the disk held when it began.
    exec_when_ready(&provider, &id, &["sh", "-c", &format!("echo {after} | dd of=/dev/vda bs=512 conv=fsync")], PROMPT)
        .await;
    assert!(guest_disk_head(&provider, &id).await.starts_with(&after), "the guest wrote {after}");
    let restored = run_dir.path("restored.qcow2");
    let bytes = backup.restore_disk(&target, &restored, COPY_TIMEOUT).await.expect("restore");
    assert_eq!(bytes, DISK_BYTES);
    let head = String::from_utf8_lossy(&disk_head(&restored, 64)).into_owned();
    assert!(head.starts_with(&format!("{before}\n")) && !head.contains(&after), "restored disk starts {head:?}");
    assert_eq!(image_info(&restored), ("qcow2".to_owned(), DISK_BYTES));
    // Independent: the backup can go without harming the restored disk.
    let backing = output_within(Command::new("qemu-img").args(["info", "-U", &restored]), COMMAND);
    assert!(!String::from_utf8_lossy(&backing.stdout).contains("backing file"), "a full copy, no backing file");

    // A retried restore leaves the target alone and answers the same.
    let written = std::fs::metadata(&restored).expect("restored");
    let again = backup.restore_disk(&target, &restored, COPY_TIMEOUT).await.expect("restore again");
    let untouched = std::fs::metadata(&restored).expect("restored");
    assert_eq!(again, bytes);
    assert_eq!((untouched.len(), untouched.modified().ok()), (written.len(), written.modified().ok()));
    let missing = backup
        .restore_disk(&format!("{backups}/no-such.qcow2"), &run_dir.path("other.qcow2"), COPY_TIMEOUT)
        .await
        .expect_err("a missing backup file");
    assert_eq!(missing.kind, ErrorKind::NotFound, "{missing}");
    assert!(!Path::new(&run_dir.path("other.qcow2")).exists());

    // 2. A target on a full file system: the backup fails and says why, the
    //    partial file goes, the VM runs on.
    let full_target = format!("{}/backup.qcow2", full_dir.display());
    let err = backup.backup(&id, &request(&full_target, false), &|_| {}).await.expect_err("no room left");
    println!("backup onto a full file system: {err}");
    assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
    assert!(err.message.contains("No space left on device"), "{err}");
    assert!(!Path::new(&full_target).exists(), "the partial file is removed");
    let status = provider.get(&id).await.expect("get").expect("the VM is still there");
    assert_eq!(status.power, PowerState::Running, "{status:?}");

    // 3. Busy VMs. A second backup while this vmlet runs one: refused at once,
    //    the first one completes. Its first progress report holds it running
    //    until the second was refused.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let hold = Mutex::new(Some((started_tx, release_rx)));
    let first_target = format!("{backups}/first.qcow2");
    let first = {
        let (provider, id, first_target) = (provider.clone(), id.clone(), first_target.clone());
        tokio::spawn(async move {
            let progress = move |_: BackupProgress| {
                if let Some((started, release)) = hold.lock().unwrap().take() {
                    let _ = started.send(());
                    let _ = release.recv_timeout(PROMPT);
                }
            };
            provider.backup().unwrap().backup(&id, &request(&first_target, false), &progress).await
        })
    };
    tokio::time::timeout(COPY_TIMEOUT, started_rx).await.expect("the first backup reports progress").expect("started");
    let second = backup
        .backup(&id, &request(&format!("{backups}/second.qcow2"), false), &|_| {})
        .await
        .expect_err("a second backup while one runs");
    assert_eq!(second.kind, ErrorKind::Conflict, "{second}");
    assert!(!Path::new(&format!("{backups}/second.qcow2")).exists());
    release_tx.send(()).expect("release the first backup");
    let first = tokio::time::timeout(COPY_TIMEOUT, first).await.expect("the first backup ends").expect("task");
    assert_eq!(first.expect("the first backup completes").bytes, DISK_BYTES);

    //    Another job libvirt runs on the disk (a block copy, throttled so that
    //    it lasts): refused naming it, the VM untouched.
    let domain = status.backend_name.clone();
    let copy = run_dir.path("copy.qcow2");
    virsh(&uri, &["blockcopy", &domain, "vda", &copy, "--transient-job", "--bandwidth", "1", "--format", "qcow2"]);
    let busy = backup
        .backup(&id, &request(&format!("{backups}/busy.qcow2"), false), &|_| {})
        .await
        .expect_err("a backup while a block copy runs");
    println!("backup during a block copy: {busy}");
    assert_eq!(busy.kind, ErrorKind::Conflict, "{busy}");
    assert!(busy.message.contains("block copy"), "{busy}");
    virsh(&uri, &["blockjob", &domain, "vda", "--abort"]);
    wait_for("the block copy to end", PROMPT, || {
        let info = virsh(&uri, &["blockjob", &domain, "vda", "--info"]);
        async move {
            if info.contains("No current block job") {
                Ok(())
            } else {
                Err(info)
            }
        }
    })
    .await;

    // 4. Quiesce without a guest agent: the backup goes on crash-consistent
    //    and says why. The guest restarts its agent when it exits, so the
    //    loop that restarts it goes first (in the background: the agent that
    //    runs the command is killed too).
    let stop_agent = "p=$(pidof qemu-ga); l=$(awk '/^PPid/{print $2}' /proc/$p/status); \
                      (sleep 1; kill $l; kill $p) </dev/null >/dev/null 2>&1 &";
    // Its answer may be lost with the agent: what counts is that it goes.
    let _ = exec(&provider, &id, &["sh", "-c", stop_agent], None).await;
    wait_for("the guest agent to go", PROMPT, || async {
        match exec(&provider, &id, &["true"], None).await {
            Err(err) if err.kind == ErrorKind::Unsupported => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let no_agent = format!("{backups}/no-agent.qcow2");
    let outcome = backup.backup(&id, &request(&no_agent, true), &|_| {}).await.expect("backup without an agent");
    println!("backup without an agent: {outcome:?}");
    match &outcome.consistency {
        Consistency::CrashConsistent { reason } => assert!(reason.contains("agent"), "{reason}"),
        other => panic!("crash-consistent without an agent, not {other:?}"),
    }
    assert_eq!(outcome.bytes, DISK_BYTES);
    assert!(String::from_utf8_lossy(&disk_head(&no_agent, 64)).starts_with(&after));

    // 5. The VM stopped: its disk is copied as it is, with qemu-img.
    provider.destroy(&id).await.expect("destroy");
    wait_for("the VM to be off", PROMPT, || async {
        match provider.get(&id).await {
            Ok(Some(status)) if status.power == PowerState::Off => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let offline = format!("{backups}/offline.qcow2");
    let reports = Reports::default();
    let seen = reports.clone();
    let outcome = backup.backup(&id, &request(&offline, true), &move |p| seen.push(p)).await.expect("offline backup");
    println!("offline backup: {outcome:?}; progress {:?}", reports.all());
    assert_eq!(outcome.consistency, Consistency::Offline);
    assert_eq!(outcome.bytes, DISK_BYTES);
    assert_eq!(outcome.file_bytes, std::fs::metadata(&offline).expect("offline backup file").len());
    assert_eq!(image_info(&offline), ("qcow2".to_owned(), DISK_BYTES));
    let progress = reports.all();
    assert!(progress.iter().all(|p| p.total_bytes == DISK_BYTES), "{progress:?}");
    assert_eq!(progress.last().map(|p| p.processed_bytes), Some(DISK_BYTES), "{progress:?}");
    assert!(String::from_utf8_lossy(&disk_head(&offline, 64)).starts_with(&after));
    assert_eq!(provider.get(&id).await.expect("get").expect("VM").power, PowerState::Off, "still off");

    provider.undefine(&id).await.expect("undefine");
    drop(full);
    drop(run_dir);
}

/// Namespace of the restart test's VM (apart from the test above, whose
/// leftover removal would take it for its own).
const RESUME_NAMESPACE: &str = "vmlet-backup-resume-it";
/// The restart test's disk: random data, so that a backup job takes long
/// enough to be paused (through QMP) before it completed.
const RANDOM_DISK_BYTES: u64 = 1 << 30;

/// A qcow2 at `path` holding `bytes` of random data, made on the host (the
/// guest boots from its initrd and leaves its disk alone).
fn random_disk(path: &str, bytes: u64) {
    let raw = format!("{path}.raw");
    let out = output_within(
        Command::new("dd").args(["if=/dev/urandom", &format!("of={raw}"), "bs=1M", &format!("count={}", bytes >> 20)]),
        COMMAND,
    );
    assert!(out.status.success(), "dd: {}", String::from_utf8_lossy(&out.stderr));
    let out =
        output_within(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "qcow2", &raw, path]), COMMAND);
    assert!(out.status.success(), "qemu-img convert: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_file(&raw).expect("remove the raw image");
}

/// `qemu-img compare -U`: the backup holds what the (running VM's) disk does.
fn assert_same_image(disk: &str, backup: &str) {
    let out = output_within(Command::new("qemu-img").args(["compare", "-U", disk, backup]), COMMAND);
    assert!(
        out.status.success(),
        "{backup} differs from {disk}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A QMP command to the VM's QEMU (`virsh qemu-monitor-command`); its answer.
fn qmp(uri: &str, domain: &str, command: &serde_json::Value) -> serde_json::Value {
    let answer = virsh(uri, &["qemu-monitor-command", domain, &command.to_string()]);
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("QMP answer {answer:?}: {e}"))
}

/// Begin a push-mode backup of the VM's disk into `target` behind the
/// provider's back, as a vmlet that was restarted since would have.
fn begin_backup_with_virsh(uri: &str, domain: &str, target: &str, dir: &str) {
    let xml = format!(
        "<domainbackup mode='push'><disks><disk name='vda' backup='yes' type='file'><driver type='qcow2'/>\
         <target file='{target}'/></disk></disks></domainbackup>"
    );
    let file = format!("{dir}/backup-begin.xml");
    std::fs::write(&file, xml).expect("write the backup XML");
    virsh(uri, &["backup-begin", domain, "--backupxml", &file]);
}

/// Pause the VM's backup job in QEMU (`job-pause`), so that it is still
/// running (to libvirt) for as long as the test needs; its QEMU job id.
/// Panics when the job had completed already (the disk copied too fast).
fn pause_backup_job(uri: &str, domain: &str) -> String {
    let jobs = qmp(uri, domain, &serde_json::json!({"execute": "query-jobs"}));
    let job = jobs["return"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|job| job["type"] == "backup"))
        .unwrap_or_else(|| panic!("no backup job in QEMU: {jobs}"));
    let job_id = job["id"].as_str().expect("the job's id").to_owned();
    let paused = qmp(uri, domain, &serde_json::json!({"execute": "job-pause", "arguments": {"id": job_id}}));
    assert!(
        paused.get("error").is_none(),
        "pausing backup job {job_id} ({job}): {paused}; the copy of {RANDOM_DISK_BYTES} bytes ended too soon"
    );
    job_id
}

/// Whether libvirt reports a job on the VM (`virsh domjobinfo`).
fn libvirt_job_runs(uri: &str, domain: &str) -> bool {
    let info = virsh(uri, &["domjobinfo", domain]);
    !info.lines().any(|line| line.starts_with("Job type:") && line.contains("None"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_guest_backup_is_adopted_after_a_restart_and_aborted_by_target() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest)).await.expect("connect");
    let backup = provider.backup().expect("QEMU has the backup capability");
    remove_leftovers(&provider, RESUME_NAMESPACE).await;

    let mut spec = common::unique_spec(RESUME_NAMESPACE, "resume");
    let run_dir = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img"]);
    let disk = run_dir.path("disk.qcow2");
    random_disk(&disk, RANDOM_DISK_BYTES);
    spec.image = Some(disk.clone());
    spec.kernel_boot = Some(run_dir.kernel_boot(&guest));
    let id = spec.id.clone();
    let backups = run_dir.path("backups");
    std::fs::create_dir_all(&backups).expect("backups directory");
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&id).await.expect("start");
    let domain = provider.get(&id).await.expect("get").expect("the VM").backend_name;

    // 1. A backup job a vmlet began before it restarted, still running
    //    (paused in QEMU until the provider follows it).
    let adopted = format!("{backups}/adopted.qcow2");
    begin_backup_with_virsh(&uri, &domain, &adopted, &backups);
    let job = pause_backup_job(&uri, &domain);
    assert!(libvirt_job_runs(&uri, &domain), "libvirt reports the paused backup as running");

    //    A backup to another target meanwhile: refused naming the busy one;
    //    an abort of that other target: nothing to abort, the job untouched.
    let other = format!("{backups}/other.qcow2");
    let busy = backup.backup(&id, &request(&other, false), &|_| {}).await.expect_err("a backup to another target");
    println!("backup to another target during a job: {busy}");
    assert_eq!(busy.kind, ErrorKind::Conflict, "{busy}");
    assert!(busy.message.contains(&adopted), "{busy}");
    assert!(!Path::new(&other).exists());
    assert!(!backup.abort_backup(&id, &other).await.expect("abort another target"), "no backup to {other}");
    assert!(libvirt_job_runs(&uri, &domain), "the job runs on");

    //    The same target: followed to its end, not begun again. The first
    //    progress report (while the job is still paused) lets it go on.
    let (reported_tx, reported_rx) = tokio::sync::oneshot::channel();
    let reported = Mutex::new(Some(reported_tx));
    let reports = Reports::default();
    let follower = {
        let (provider, id, adopted, reports) = (provider.clone(), id.clone(), adopted.clone(), reports.clone());
        tokio::spawn(async move {
            let progress = move |p: BackupProgress| {
                reports.push(p);
                if let Some(reported) = reported.lock().unwrap().take() {
                    let _ = reported.send(());
                }
            };
            provider.backup().unwrap().backup(&id, &request(&adopted, true), &progress).await
        })
    };
    tokio::time::timeout(PROMPT, reported_rx).await.expect("the follower reports progress").expect("reported");
    assert!(libvirt_job_runs(&uri, &domain), "followed while running");
    let resumed = qmp(&uri, &domain, &serde_json::json!({"execute": "job-resume", "arguments": {"id": job}}));
    assert!(resumed.get("error").is_none(), "job-resume: {resumed}");
    let outcome = tokio::time::timeout(COPY_TIMEOUT, follower)
        .await
        .expect("the followed backup ends")
        .expect("task")
        .expect("the followed backup completes");
    println!("followed backup: {outcome:?}; progress {:?}", reports.all());
    assert_eq!((outcome.path.as_str(), outcome.bytes), (adopted.as_str(), RANDOM_DISK_BYTES), "{outcome:?}");
    let reason = "followed after a restart of vmlet: whether the guest's filesystems were frozen is not known";
    assert_eq!(outcome.consistency, Consistency::CrashConsistent { reason: reason.to_owned() });
    assert_eq!(outcome.checkpoint, None);
    assert_eq!(outcome.file_bytes, std::fs::metadata(&adopted).expect("the backup file").len());
    assert_eq!(reports.all().last().map(|p| p.processed_bytes), Some(RANDOM_DISK_BYTES));
    assert_same_image(&disk, &adopted);

    // 2. A backup job that completed while no vmlet ran: its outcome, from
    //    libvirt's record, and the file left as it is.
    let completed = format!("{backups}/completed.qcow2");
    begin_backup_with_virsh(&uri, &domain, &completed, &backups);
    wait_for("the backup begun with virsh to end", COPY_TIMEOUT, || {
        let runs = libvirt_job_runs(&uri, &domain);
        async move {
            if runs {
                Err("a job runs".to_owned())
            } else {
                Ok(())
            }
        }
    })
    .await;
    let written = std::fs::metadata(&completed).expect("the completed backup").modified().ok();
    let outcome = backup.backup(&id, &request(&completed, false), &|_| {}).await.expect("the completed backup");
    println!("completed backup: {outcome:?}");
    assert_eq!((outcome.path.as_str(), outcome.bytes), (completed.as_str(), RANDOM_DISK_BYTES), "{outcome:?}");
    let reason = "quiesce was not asked".to_owned();
    assert_eq!(outcome.consistency, Consistency::CrashConsistent { reason });
    assert_eq!(std::fs::metadata(&completed).expect("still there").modified().ok(), written, "not written again");
    assert_same_image(&disk, &completed);

    // 3. A file of that name but no job that wrote it: the leftover of an
    //    interrupted attempt, replaced by a fresh backup.
    let leftover = format!("{backups}/leftover.qcow2");
    std::fs::write(&leftover, b"what an interrupted attempt left").expect("write a leftover");
    let outcome = backup.backup(&id, &request(&leftover, false), &|_| {}).await.expect("a fresh backup");
    println!("backup over a leftover: {outcome:?}");
    assert_eq!(outcome.bytes, RANDOM_DISK_BYTES, "{outcome:?}");
    assert_eq!(image_info(&leftover), ("qcow2".to_owned(), RANDOM_DISK_BYTES));
    assert_same_image(&disk, &leftover);

    // 4. Aborting a running backup by its target: the job ends, the partial
    //    file goes, the VM runs on; again, there is nothing to abort.
    let aborted = format!("{backups}/aborted.qcow2");
    begin_backup_with_virsh(&uri, &domain, &aborted, &backups);
    pause_backup_job(&uri, &domain);
    assert!(Path::new(&aborted).exists(), "libvirt created the target");
    assert!(backup.abort_backup(&id, &aborted).await.expect("abort"), "a backup to {aborted} ran");
    assert!(!libvirt_job_runs(&uri, &domain), "the job ended");
    assert!(!Path::new(&aborted).exists(), "the partial file is removed");
    let status = provider.get(&id).await.expect("get").expect("the VM is still there");
    assert_eq!(status.power, PowerState::Running, "{status:?}");
    assert!(!backup.abort_backup(&id, &aborted).await.expect("abort again"), "nothing runs any more");

    provider.destroy(&id).await.expect("destroy");
    provider.undefine(&id).await.expect("undefine");
    drop(run_dir);
}
