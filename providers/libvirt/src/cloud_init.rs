//! cloud-init NoCloud seeds: a VM's [`CloudInit`] data as the ISO 9660 image
//! a cloud-init guest finds by its volume label `cidata`, with the files
//! `meta-data`, `user-data` and, when given, `network-config`
//! (<https://cloudinit.readthedocs.io/en/latest/reference/datasources/nocloud.html>).
//!
//! The image is built by `genisoimage` on this machine (Debian package
//! `genisoimage`), so only for local libvirt connections (the caller checks),
//! with a deadline; the child is killed when the deadline passes or its caller
//! stops waiting (`kill_on_drop`). The files go into a private directory
//! (0700) first; the image is written beside its final path and renamed into
//! place, so a reader never sees half an image.
//!
//! User data may hold secrets: nothing here logs the contents, only paths.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;
use vmlet_provider::{CloudInit, Error, ErrorKind, Result, VmId};

use crate::provider::is_local_uri;

/// Where seeds go unless [`crate::LibvirtProvider::with_seed_dir`] says
/// otherwise.
pub(crate) const DEFAULT_SEED_DIR: &str = "/var/lib/vmlet/seeds";

/// The program run; found on `PATH`.
const GENISOIMAGE: &str = "genisoimage";

/// How long one image build may take: a few KiB of files, so only a hung
/// program or file system reaches it.
pub(crate) const BUILD_DEADLINE: Duration = Duration::from_secs(60);

/// The operation named in this module's errors.
const OP: &str = "write cloud-init seed";

/// Refuse (`Unsupported`, naming `spec.cloudInit`) to write a seed for a
/// libvirt host reached over `uri` when that URI names a remote host: vmlet
/// writes the image on its own machine, where a remote libvirtd cannot read it.
pub(crate) fn require_local_host(uri: &str) -> Result<()> {
    if is_local_uri(uri) {
        return Ok(());
    }
    Err(Error::new(
        OP,
        ErrorKind::Unsupported,
        format!(
            "spec.cloudInit: this host's libvirtd is reached over a remote connection ({uri}), and vmlet writes a \
             VM's cloud-init seed image on its own machine, where that libvirtd cannot read it; run vmlet on the \
             libvirt host (qemu:///system) for VMs with spec.cloudInit"
        ),
    ))
}

/// The seed image of the VM `id` named `backend_name` in `dir`:
/// `<dir>/<backend_name>_<id>.iso`.
pub(crate) fn seed_path(dir: &Path, backend_name: &str, id: &VmId) -> PathBuf {
    dir.join(format!("{backend_name}_{id}.iso"))
}

/// The text of `meta-data`: `instance-id` and, when there is one,
/// `local-hostname`, each a YAML double-quoted string (JSON's string syntax,
/// which YAML reads the same way), so that no value can be read as a number,
/// a boolean or more YAML.
pub(crate) fn meta_data(cloud_init: &CloudInit) -> String {
    let quoted = |value: &str| serde_json::Value::from(value).to_string();
    let mut text = format!("instance-id: {}\n", quoted(&cloud_init.instance_id));
    if !cloud_init.hostname.is_empty() {
        text.push_str(&format!("local-hostname: {}\n", quoted(&cloud_init.hostname)));
    }
    text
}

/// Write the seed for `cloud_init` to `path` (a file in `dir`, see
/// [`seed_path`]), mode 0600 (libvirt hands it to QEMU at start), replacing
/// one that is there; `dir` is created (0755) when missing. Within
/// `deadline`.
///
/// Errors: `InvalidInput` for an empty instance id; `Unsupported` when
/// genisoimage is not installed; `Transient` when it did not finish in time;
/// `Permanent` with genisoimage's message or the file system's error
/// otherwise. Nothing is left behind but what was there before.
pub(crate) async fn write_seed(dir: &Path, path: &Path, cloud_init: &CloudInit, deadline: Duration) -> Result<()> {
    if cloud_init.instance_id.is_empty() {
        return Err(Error::new(
            OP,
            ErrorKind::InvalidInput,
            "spec.cloudInit: the instance id is empty; cloud-init needs one in meta-data",
        ));
    }
    let files = {
        let (dir, name, cloud_init) = (dir.to_owned(), file_name(path), cloud_init.clone());
        tokio::task::spawn_blocking(move || SeedFiles::write(&dir, &name, &cloud_init)).await.map_err(|e| {
            Error::new(OP, ErrorKind::Permanent, format!("writing the seed's files did not complete: {e}"))
        })??
    };
    // Removed again unless the image reaches `path`, also when the caller
    // stops waiting half-way.
    let partial = Partial(partial_path(path));
    // 0600 from the start: genisoimage truncates the file and keeps its mode,
    // so the user data is never readable by other users of the host.
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let made = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&partial.0);
        let private = made.and_then(|file| file.set_permissions(std::fs::Permissions::from_mode(0o600)));
        private.map_err(|e| {
            Error::new(OP, ErrorKind::Permanent, format!("cannot create {}: {e}", partial.0.display())).with_source(e)
        })?;
    }
    let mut command = Command::new(GENISOIMAGE);
    command.arg("-output").arg(&partial.0);
    // -rational-rock: Rock Ridge names with sane owners (root) and modes
    // (readable), not those of the private files; -joliet for Windows guests.
    command.args(["-volid", "cidata", "-joliet", "-rational-rock", "-input-charset", "utf-8", "-quiet"]);
    command.args(&files.paths);
    run(command, deadline).await?;
    drop(files);
    let (built, path) = (partial.0.clone(), path.to_owned());
    tokio::task::spawn_blocking(move || publish(&built, &path))
        .await
        .unwrap_or_else(|e| Err(Error::new(OP, ErrorKind::Permanent, format!("did not complete: {e}"))))
}

/// An image being built at this path: removed on drop when still there.
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        remove_file(&self.0, "partial cloud-init seed");
    }
}

/// Remove the seed at `path` if there is one; a failure is logged, not
/// returned (the VM is gone either way).
pub(crate) fn remove_seed(path: &Path) {
    if remove_file(path, "cloud-init seed") {
        tracing::info!(path = %path.display(), "cloud-init seed removed");
    }
}

/// Remove `path` (`what`, for the log); true when it was there. Failures are
/// logged.
fn remove_file(path: &Path, what: &str) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => false,
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err, "cannot remove the {what}");
            false
        }
    }
}

/// `<path>.tmp`: where the image is built before it is renamed to `path`.
fn partial_path(path: &Path) -> PathBuf {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".tmp");
    PathBuf::from(partial)
}

/// The file name of `path`, for naming the private directory after it.
fn file_name(path: &Path) -> String {
    path.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The seed's files in a private directory (0700) in the seed directory,
/// removed with it on drop.
struct SeedFiles {
    dir: PathBuf,
    /// `meta-data`, `user-data` and maybe `network-config`, in that order.
    paths: Vec<PathBuf>,
}

impl SeedFiles {
    /// Create `dir` (0755) if needed, then a private directory in it named
    /// after the seed `name`, and write the files into it (0600). Blocking.
    fn write(dir: &Path, name: &str, cloud_init: &CloudInit) -> Result<SeedFiles> {
        let failed = |what: String, err: std::io::Error| {
            Error::new(OP, ErrorKind::Permanent, format!("{what}: {err}")).with_source(err)
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| failed(format!("cannot create the seed directory {}", dir.display()), e))?;
        let private = dir.join(format!(".{name}.{}", uuid::Uuid::new_v4().simple()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&private)
            .map_err(|e| failed(format!("cannot create the private directory {}", private.display()), e))?;
        let mut files = SeedFiles { dir: private, paths: Vec::new() };
        let meta_data = meta_data(cloud_init);
        let mut contents = vec![("meta-data", meta_data.as_bytes()), ("user-data", cloud_init.user_data.as_slice())];
        if let Some(network_config) = &cloud_init.network_config {
            contents.push(("network-config", network_config.as_slice()));
        }
        for (file, data) in contents {
            let path = files.dir.join(file);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .and_then(|mut out| out.write_all(data))
                .map_err(|e| failed(format!("cannot write {}", path.display()), e))?;
            files.paths.push(path);
        }
        Ok(files)
    }
}

impl Drop for SeedFiles {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(path = %self.dir.display(), error = %err, "cannot remove the seed's private directory");
        }
    }
}

/// Make the built image at `partial` root's alone (0600: it holds user data,
/// which may hold secrets; libvirt's dynamic ownership hands it to QEMU when
/// the domain starts), flush it, and rename it to `path`, then flush the
/// directory entry. Blocking.
fn publish(partial: &Path, path: &Path) -> Result<()> {
    let failed = |what: &str, err: std::io::Error| {
        Error::new(OP, ErrorKind::Permanent, format!("cannot {what} {}: {err}", partial.display())).with_source(err)
    };
    let file = std::fs::File::open(partial).map_err(|e| failed("open", e))?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(|e| failed("set the mode of", e))?;
    file.sync_all().map_err(|e| failed("flush", e))?;
    std::fs::rename(partial, path).map_err(|e| failed(&format!("rename to {}", path.display()), e))?;
    // Best effort: the image is in place either way.
    if let Some(dir) = path.parent() {
        let _ = std::fs::File::open(dir).and_then(|dir| dir.sync_all());
    }
    Ok(())
}

/// Run `command` (a genisoimage command line) to its end within `deadline`.
async fn run(mut command: Command, deadline: Duration) -> Result<()> {
    let line = format!("{:?}", command.as_std()).replace('"', "");
    command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).kill_on_drop(true);
    let mut child = command.spawn().map_err(|err| {
        let kind =
            if err.kind() == std::io::ErrorKind::NotFound { ErrorKind::Unsupported } else { ErrorKind::Permanent };
        Error::new(
            OP,
            kind,
            format!(
                "cannot run {GENISOIMAGE} ({err}); install it on the libvirt host (Debian: genisoimage) \
                 to give VMs spec.cloudInit"
            ),
        )
        .with_source(err)
    })?;
    let Some(mut stderr) = child.stderr.take() else {
        return Err(Error::new(OP, ErrorKind::Permanent, format!("`{line}`: no pipe from the child")));
    };
    let finished = tokio::time::timeout(deadline, async {
        let mut errors = Vec::new();
        stderr.read_to_end(&mut errors).await?;
        let status = child.wait().await?;
        Ok::<_, std::io::Error>((status, errors))
    })
    .await;
    let (status, errors) = match finished {
        Ok(Ok(done)) => done,
        Ok(Err(err)) => return Err(Error::new(OP, ErrorKind::Permanent, format!("`{line}`: {err}")).with_source(err)),
        Err(_) => {
            // Killed and reaped before the caller removes what it wrote.
            let _ = child.kill().await;
            return Err(Error::new(
                OP,
                ErrorKind::Transient,
                format!("`{line}` did not finish within {}s and was killed", deadline.as_secs_f32()),
            ));
        }
    };
    if !status.success() {
        let message = String::from_utf8_lossy(&errors);
        return Err(Error::new(OP, ErrorKind::Permanent, format!("`{line}` failed ({status}): {}", message.trim())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cloud_init(hostname: &str) -> CloudInit {
        CloudInit {
            instance_id: "6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a".into(),
            hostname: hostname.into(),
            user_data: b"#cloud-config\n".to_vec(),
            network_config: None,
        }
    }

    #[test]
    fn meta_data_names_the_instance_and_the_hostname_as_yaml_strings() {
        assert_eq!(
            meta_data(&cloud_init("web-1")),
            "instance-id: \"6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a\"\nlocal-hostname: \"web-1\"\n"
        );
    }

    #[test]
    fn meta_data_values_cannot_be_read_as_other_yaml() {
        // A boolean, a number, a comment and a second key, each kept a string.
        let mut odd = cloud_init("yes");
        odd.instance_id = "1e3 # x\ninjected: \"true\"".into();
        assert_eq!(meta_data(&odd), "instance-id: \"1e3 # x\\ninjected: \\\"true\\\"\"\nlocal-hostname: \"yes\"\n");
    }

    #[test]
    fn meta_data_without_a_hostname_leaves_it_to_the_guest() {
        assert_eq!(meta_data(&cloud_init("")), "instance-id: \"6c8f1f4e-2b0a-4e53-9d1e-0f1e2d3c4b5a\"\n");
    }

    #[test]
    fn seeds_are_written_for_local_connections_only() {
        for uri in ["qemu:///system", "qemu+unix:///system", "test:///tmp/host.xml"] {
            assert!(require_local_host(uri).is_ok(), "{uri}");
        }
        let err = require_local_host("qemu+ssh://root@kvm-2/system").expect_err("remote");
        assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
        assert!(err.message.starts_with("spec.cloudInit: "), "{err}");
        assert!(err.message.contains("qemu+ssh://root@kvm-2/system"), "{err}");
    }

    #[tokio::test]
    async fn a_missing_genisoimage_is_unsupported_and_says_what_to_install() {
        let err = run(Command::new("vmlet-no-such-genisoimage"), Duration::from_secs(5)).await.expect_err("missing");
        assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
        assert!(err.message.contains("Debian: genisoimage"), "{err}");
    }

    #[tokio::test]
    async fn a_build_past_its_deadline_is_killed_and_transient() {
        let pid_file = std::env::temp_dir().join(format!("vmlet-seed-deadline-{}", std::process::id()));
        let mut sleep = Command::new("sh");
        sleep.args(["-c", &format!("echo $$ > {}; exec sleep 600", pid_file.display())]);
        let err = run(sleep, Duration::from_secs(3)).await.expect_err("too slow");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(err.message.contains("was killed"), "{err}");
        // The process is gone (or a zombie being reaped), not left running:
        // polled, up to a generous bound, never timed.
        let pid = std::fs::read_to_string(&pid_file).expect("the command wrote its pid").trim().to_owned();
        let _ = std::fs::remove_file(&pid_file);
        let running = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
        };
        for _ in 0..300 {
            if !running() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the command {pid} still runs after its deadline");
    }

    #[tokio::test]
    async fn a_failed_build_is_permanent_with_what_it_printed() {
        let mut fail = Command::new("sh");
        fail.args(["-c", "echo 'genisoimage: No space left on device' >&2; exit 1"]);
        let err = run(fail, Duration::from_secs(5)).await.expect_err("failed");
        assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
        assert!(err.message.ends_with("genisoimage: No space left on device"), "{err}");
    }

    #[test]
    fn the_seed_is_named_after_the_domain_and_the_uid() {
        let id = VmId("u-1".into());
        assert_eq!(
            seed_path(Path::new("/var/lib/vmlet/seeds"), "ns_vm", &id),
            Path::new("/var/lib/vmlet/seeds/ns_vm_u-1.iso")
        );
        assert_eq!(partial_path(Path::new("/s/ns_vm_u-1.iso")), Path::new("/s/ns_vm_u-1.iso.tmp"));
    }
}
