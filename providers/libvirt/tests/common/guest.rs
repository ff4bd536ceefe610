//! The small test guest (`test-vms/guest/build.sh`) on a real libvirtd: where
//! its files come from, where QEMU reads them, and commands in it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use vmlet_libvirt::{AcceleratorSetting, LibvirtProvider};
use vmlet_provider::{ErrorKind, KernelBoot, Provider, StreamIo, VmId};

use super::deadline::{run, GUEST_BUILD};

/// Where each run's copy of the guest lives: readable by QEMU's user, and by
/// every libvirtd of the machine at the same path (hack/hosts.sh keeps
/// `/var/lib/vmlet` shared between its hosts).
pub const RUN_DIRS: &str = "/var/lib/vmlet/test-guests";

/// Generous: the guest boots in ~12 s under emulation on an idle 2-core host,
/// and these hosts are shared with builders and other tests' guests.
pub const BOOT_DEADLINE: Duration = Duration::from_secs(240);

/// The built guest: `VMLET_GUEST_DIR`, or what `test-vms/guest/build.sh` prints.
pub fn guest_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VMLET_GUEST_DIR").filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../test-vms/guest/build.sh");
    let out = run(&mut Command::new(&script), GUEST_BUILD).unwrap_or_else(|timed_out| panic!("{timed_out}"));
    assert!(out.status.success(), "{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(stdout.lines().last().expect("build.sh printed the guest directory").trim())
}

/// The accelerator that boots the guest in `guest` on this machine, from
/// `test-vms/guest/accelerator.sh`: KVM where it runs the guest's kernel, TCG
/// where it does not (nested KVM that runs firmware only).
pub fn guest_accelerator(guest: &Path) -> AcceleratorSetting {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../test-vms/guest/accelerator.sh");
    let out = run(Command::new(&script).arg(guest), Duration::from_secs(120))
        .unwrap_or_else(|timed_out| panic!("{timed_out}"));
    assert!(out.status.success(), "{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    match String::from_utf8_lossy(&out.stdout).trim() {
        "kvm" => AcceleratorSetting::Kvm,
        _ => AcceleratorSetting::Tcg,
    }
}

/// The guest's files copied where QEMU can read them, removed on drop.
pub struct RunDir(PathBuf);

impl RunDir {
    /// A copy of `files` of the guest in `guest` under [`RUN_DIRS`]/`name`.
    pub fn new(guest: &Path, name: &str, files: &[&str]) -> RunDir {
        let dir = Path::new(RUN_DIRS).join(name);
        std::fs::create_dir_all(&dir).expect("create run dir");
        for file in files {
            std::fs::copy(guest.join(file), dir.join(file))
                .unwrap_or_else(|e| panic!("copy {} from {}: {e}", file, guest.display()));
        }
        RunDir(dir)
    }

    /// The path of `file` in this directory, as a string for a VmSpec.
    pub fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }

    /// Direct kernel boot of the guest from this directory.
    pub fn kernel_boot(&self, guest: &Path) -> KernelBoot {
        let cmdline = std::fs::read_to_string(guest.join("cmdline")).expect("cmdline").trim().to_owned();
        KernelBoot { kernel: self.path("vmlinuz"), initrd: Some(self.path("initrd.img")), cmdline: Some(cmdline) }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Destroy and undefine every VM of `namespace` an earlier run left on
/// `provider`'s host, and its run directory.
pub async fn remove_leftovers(provider: &LibvirtProvider, namespace: &str) {
    for vm in provider.list().await.expect("list") {
        if vm.backend_name.starts_with(&format!("{namespace}_")) {
            println!("removing leftover {} (uid {}) from {}", vm.backend_name, vm.id, provider.uri());
            provider.destroy(&vm.id).await.expect("destroy leftover");
            provider.undefine(&vm.id).await.expect("undefine leftover");
            if let Some((_, name)) = vm.backend_name.split_once('_') {
                let _ = std::fs::remove_dir_all(Path::new(RUN_DIRS).join(name));
            }
        }
    }
}

/// What a command printed and returned.
#[derive(Debug)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Run `argv` in the guest with optional stdin, collecting its output.
pub async fn exec(
    provider: &LibvirtProvider,
    id: &VmId,
    argv: &[&str],
    stdin: Option<&[u8]>,
) -> vmlet_provider::Result<Output> {
    let (stdout_tx, mut stdout_rx) = mpsc::channel(16);
    let (stderr_tx, mut stderr_rx) = mpsc::channel(16);
    let stdin_rx = stdin.map(|data| {
        let (tx, rx) = mpsc::channel(4);
        tx.try_send(data.to_vec()).expect("queue stdin");
        rx // tx dropped: stdin closes after the data
    });
    let io = StreamIo { stdin: stdin_rx, stdout: Some(stdout_tx), stderr: Some(stderr_tx), tty: false, resize: None };
    let argv: Vec<String> = argv.iter().map(|s| (*s).to_owned()).collect();
    let exec = provider.guest_exec().expect("QEMU has guest exec");
    let code = exec.exec(id, &argv, io).await?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    while let Some(data) = stdout_rx.recv().await {
        stdout.extend(data);
    }
    while let Some(data) = stderr_rx.recv().await {
        stderr.extend(data);
    }
    Ok(Output {
        code,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    })
}

/// Run `argv` in the guest once its agent answers (it starts a few seconds
/// after boot), waiting up to `deadline`; the command must exit 0.
pub async fn exec_when_ready(provider: &LibvirtProvider, id: &VmId, argv: &[&str], deadline: Duration) -> Output {
    let until = Instant::now() + deadline;
    loop {
        match exec(provider, id, argv, None).await {
            Ok(output) => {
                assert_eq!(output.code, 0, "{argv:?} in the guest: {output:?}");
                return output;
            }
            Err(err) if matches!(err.kind, ErrorKind::Unsupported | ErrorKind::Transient) && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(err) => panic!("{argv:?} in the guest: {err}"),
        }
    }
}

/// The guest's uptime in seconds (`cat /proc/uptime`, through its agent).
pub async fn uptime(provider: &LibvirtProvider, id: &VmId) -> f64 {
    let out = exec_when_ready(provider, id, &["cat", "/proc/uptime"], BOOT_DEADLINE).await;
    let first = out.stdout.split_whitespace().next().unwrap_or_default();
    first.parse().unwrap_or_else(|e| panic!("/proc/uptime {:?}: {e}", out.stdout))
}

/// Poll `check` every 250 ms until it returns `Ok`, for at most `deadline`;
/// then panics naming `what` and the last `Err` (what was seen instead).
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let until = Instant::now() + deadline;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= until => panic!("{what}: not within {deadline:?}; last: {last}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Power VM `id` off (`destroy`) and wait until libvirt says it is off.
pub async fn power_off(provider: &LibvirtProvider, id: &VmId, deadline: Duration) {
    provider.destroy(id).await.expect("power off");
    wait_for("the VM to be off", deadline, || async {
        match provider.get(id).await {
            Ok(Some(status)) if status.power == vmlet_provider::PowerState::Off => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}
