//! cloud-init NoCloud data through the libvirt provider, against a real guest
//! on a real libvirtd with QEMU: the seed image vmlet writes at define time,
//! what the guest makes of it, and the seed's life with the domain.
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` sets it), root (the guest
//! files under `/var/lib/vmlet`) and `genisoimage`, whose `isoinfo` the test
//! also uses (`hack/deps.sh` installs it). The guest is
//! `test-vms/guest/build.sh`'s, a minimal NoCloud consumer: it takes the
//! hostname from meta-data and runs a `#!` user-data once. One test boots one
//! guest and checks everything in order, since the boot is the expensive part.

mod common;
use common::deadline::output_within;
use common::guest::{exec_when_ready, guest_accelerator, guest_dir, remove_leftovers, wait_for, RunDir, BOOT_DEADLINE};
use common::qemu_uri;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{CloudInit, Provider, VmId};

const NAMESPACE: &str = "vmlet-cloud-init-it";
/// What the test's user-data script leaves in the guest.
const USER_DATA: &[u8] = b"#!/bin/sh\necho hello-from-user-data > /run/cloud-init-ran\n";
/// Bound on one external command (isoinfo).
const COMMAND: Duration = Duration::from_secs(60);

/// The guest's serial console so far (this boot), through the provider.
async fn console_text(provider: &LibvirtProvider, id: &VmId) -> String {
    let console = provider.console().expect("QEMU has a console");
    let chunk = console.console_output(id, 0, 1 << 20).await.expect("console output");
    String::from_utf8_lossy(&chunk.data).into_owned()
}

/// The seed image's volume id, as `isoinfo -d` reads it.
fn volume_id(image: &Path) -> String {
    let out = output_within(Command::new("isoinfo").arg("-d").arg("-i").arg(image), COMMAND);
    assert!(out.status.success(), "isoinfo -d -i {}: {}", image.display(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|line| line.strip_prefix("Volume id:"))
        .map(|id| id.trim().to_owned())
        .unwrap_or_else(|| panic!("no volume id in isoinfo's answer:\n{text}"))
}

/// Modification time and inode of `path`: what a rewrite would change.
fn identity_of(path: &Path) -> (i64, i64, u64) {
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (meta.mtime(), meta.mtime_nsec(), meta.ino())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_guest_takes_its_hostname_and_runs_its_user_data() {
    let uri = qemu_uri();
    let guest = guest_dir();
    let mut spec = common::unique_spec(NAMESPACE, "seeded");
    let run = RunDir::new(&guest, &spec.name, &["vmlinuz", "initrd.img", "disk.qcow2"]);
    let seed_dir = PathBuf::from(run.path("seeds"));
    let provider = LibvirtProvider::connect_with(&uri, guest_accelerator(&guest))
        .await
        .expect("connect")
        .with_seed_dir(seed_dir.clone());
    remove_leftovers(&provider, NAMESPACE).await;

    let hostname = format!("seeded-{}", spec.name.rsplit('-').next().expect("a numbered name"));
    spec.image = Some(run.path("disk.qcow2"));
    spec.kernel_boot = Some(run.kernel_boot(&guest));
    spec.cloud_init = Some(CloudInit {
        instance_id: spec.id.0.clone(),
        hostname: hostname.clone(),
        user_data: USER_DATA.to_vec(),
        network_config: None,
    });
    let id = spec.id.clone();
    let defined = provider.ensure_defined(&spec).await.expect("define");

    // The seed: named after the domain and the uid, root's alone until
    // libvirt hands it to QEMU at start, an ISO 9660 image labelled cidata,
    // in a directory the provider created.
    let seed = seed_dir.join(format!("{}_{}.iso", spec.backend_name(), id));
    let mode = |path: &Path| std::fs::metadata(path).expect("metadata").permissions().mode() & 0o7777;
    assert_eq!(mode(&seed), 0o600, "user data may hold secrets: {}", seed.display());
    assert_eq!(mode(&seed_dir), 0o755, "{}", seed_dir.display());
    assert_eq!(volume_id(&seed), "cidata");
    let leftovers: Vec<_> = std::fs::read_dir(&seed_dir).expect("read the seed directory").flatten().collect();
    assert_eq!(leftovers.len(), 1, "only the seed, no private files or partial image: {leftovers:?}");

    // Defining again returns the domain as it is and leaves its seed alone.
    let written = identity_of(&seed);
    let again = provider.ensure_defined(&spec).await.expect("define again");
    assert_eq!(again.backend_id, defined.backend_id);
    assert_eq!(identity_of(&seed), written, "the seed was not rewritten");

    // The guest finds the seed, takes its hostname and runs its user data.
    provider.start(&id).await.expect("start");
    let seeded = format!("vmlet-guest: cloud-init seed {id} hostname {hostname}");
    let text = wait_for("the guest booted", BOOT_DEADLINE, || async {
        let text = console_text(&provider, &id).await;
        if text.contains("vmlet-guest: booted") {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await;
    assert!(text.contains(&seeded), "no {seeded:?} on the console:\n{text}");
    assert!(text.contains("vmlet-guest: user-data exited 0"), "{text}");
    let shown = exec_when_ready(&provider, &id, &["hostname"], BOOT_DEADLINE).await;
    assert_eq!(shown.stdout.trim(), hostname);
    let ran = exec_when_ready(&provider, &id, &["cat", "/run/cloud-init-ran"], BOOT_DEADLINE).await;
    assert_eq!(ran.stdout, "hello-from-user-data\n");
    let mounted = exec_when_ready(&provider, &id, &["cat", "/run/cidata/meta-data"], BOOT_DEADLINE).await;
    assert_eq!(mounted.stdout, format!("instance-id: \"{id}\"\nlocal-hostname: \"{hostname}\"\n"));

    // Undefining the VM removes its seed, and nothing else of the directory.
    provider.destroy(&id).await.expect("destroy");
    assert!(seed.exists(), "stopping keeps the seed for the next start");
    provider.undefine(&id).await.expect("undefine");
    assert!(!seed.exists(), "{} is left after undefine", seed.display());
    assert!(seed_dir.is_dir(), "the seed directory stays");
    drop(run);
}
