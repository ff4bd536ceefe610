//! Volumes ([`Volumes`]) in libvirt storage pools: on a real libvirtd with a
//! `dir` pool of the test's own, and on the test driver's in-memory pool.
//!
//! The real-libvirtd test needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh`
//! starts libvirtd and sets it) and root (it reads the pool's files with
//! qemu-img); without the variable it fails and says so. It defines, builds
//! and starts a pool named `vmlet-it-vol-<pid>-<n>` under
//! `/var/lib/libvirt/images/`, and removes it, its volumes and its directory
//! at the end, also when the test fails.

mod common;
use common::deadline::{output_within, run, VIRSH};
use common::qemu_uri;

use std::process::Command;
use std::time::Duration;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{DiskFormat, ErrorKind, Provider, Volume, VolumeRequest, VolumeSource};

/// Bound on one qemu-img run on a small, empty image.
const QEMU_IMG: Duration = Duration::from_secs(60);
const MIB: u64 = 1024 * 1024;

/// `virsh -c <uri> <args>`, which must succeed; its stdout.
fn virsh(uri: &str, args: &[&str]) -> String {
    let out = output_within(Command::new("virsh").args(["-c", uri]).args(args), VIRSH);
    assert!(out.status.success(), "virsh {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `dir` pool of this test's own, running; dropping it destroys and
/// undefines it and removes its directory with whatever is in it.
struct TestPool {
    uri: String,
    name: String,
    dir: String,
}

impl TestPool {
    fn start(uri: &str) -> TestPool {
        let (_, nanos) = common::unique_uid();
        let name = format!("vmlet-it-vol-{}-{}", std::process::id(), nanos % 1_000_000_000);
        let dir = format!("/var/lib/libvirt/images/{name}");
        virsh(uri, &["pool-define-as", &name, "dir", "--target", &dir]);
        let pool = TestPool { uri: uri.to_owned(), name, dir };
        virsh(uri, &["pool-build", &pool.name]);
        virsh(uri, &["pool-start", &pool.name]);
        pool
    }
}

impl Drop for TestPool {
    fn drop(&mut self) {
        // Best effort, and never a panic while a failed test unwinds.
        for args in [["pool-destroy", &self.name], ["pool-undefine", &self.name]] {
            match run(Command::new("virsh").args(["-c", &self.uri]).args(args), VIRSH) {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!("virsh {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)),
                Err(timed_out) => eprintln!("{timed_out}"),
            }
        }
        if let Err(err) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("removing {}: {err}", self.dir);
        }
    }
}

/// `qemu-img info -f <format> --output=json <path>`: the format it read the
/// file in and the disk's virtual size.
fn qemu_img_info(path: &str, format: DiskFormat) -> (String, u64) {
    let out = output_within(
        Command::new("qemu-img").args(["info", "-U", "-f", format.as_str(), "--output=json", path]),
        QEMU_IMG,
    );
    assert!(out.status.success(), "qemu-img info {path}: {}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img info JSON");
    (info["format"].as_str().expect("format").to_owned(), info["virtual-size"].as_u64().expect("virtual-size"))
}

fn request(pool: &str, name: &str, capacity_bytes: u64, format: DiskFormat) -> VolumeRequest {
    VolumeRequest { pool: pool.into(), name: name.into(), capacity_bytes, format, source: VolumeSource::Empty }
}

/// Checks what libvirt and the file say of `volume`: listed in its pool at
/// its path, its XML's format, and its size as qemu-img reads it in that
/// format (a raw file's length too).
fn assert_on_host(uri: &str, volume: &Volume) {
    let listed = virsh(uri, &["vol-list", &volume.pool]);
    assert!(
        listed.lines().any(|line| line.split_whitespace().collect::<Vec<_>>() == [&volume.name, &volume.path]),
        "{} at {} in `virsh vol-list {}`:\n{listed}",
        volume.name,
        volume.path,
        volume.pool
    );
    let xml = virsh(uri, &["vol-dumpxml", "--pool", &volume.pool, &volume.name]);
    let format = volume.format.expect("a format vmlet made");
    assert!(xml.contains(&format!("<format type='{format}'/>")), "{xml}");
    assert!(xml.contains(&format!("<capacity unit='bytes'>{}</capacity>", volume.capacity_bytes)), "{xml}");
    assert!(xml.contains("<mode>0600</mode>"), "{xml}");
    assert_eq!(qemu_img_info(&volume.path, format), (format.as_str().to_owned(), volume.capacity_bytes));
    if format == DiskFormat::Raw {
        let len = std::fs::metadata(&volume.path).expect("the raw volume's file").len();
        assert_eq!(len, volume.capacity_bytes, "{}", volume.path);
    }
}

#[tokio::test]
async fn volumes_in_a_dir_pool_are_made_grown_and_removed_through_libvirt() {
    let uri = qemu_uri();
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    let volumes = provider.volumes().expect("the libvirt provider has volumes");
    let pool = TestPool::start(&uri);
    let p = pool.name.as_str();

    // Made in each format, sparse, where the pool keeps its files.
    let raw = volumes.create_volume(&request(p, "ns_claim_raw", 64 * MIB, DiskFormat::Raw)).await.expect("raw");
    assert_eq!(raw.path, format!("{}/ns_claim_raw", pool.dir));
    assert_eq!((raw.capacity_bytes, raw.format), (64 * MIB, Some(DiskFormat::Raw)));
    assert!(raw.allocation_bytes < raw.capacity_bytes, "{raw:?}");
    assert_on_host(&uri, &raw);
    let qcow2 = volumes.create_volume(&request(p, "ns_claim_qcow2", 32 * MIB, DiskFormat::Qcow2)).await.expect("qcow2");
    assert_eq!(qcow2.path, format!("{}/ns_claim_qcow2", pool.dir));
    assert_eq!((qcow2.capacity_bytes, qcow2.format), (32 * MIB, Some(DiskFormat::Qcow2)));
    assert_on_host(&uri, &qcow2);

    // Again: the same volume; a smaller request too.
    let again = volumes.create_volume(&request(p, "ns_claim_raw", 64 * MIB, DiskFormat::Raw)).await.expect("again");
    assert_eq!(again.path, raw.path);
    assert_eq!(again.capacity_bytes, raw.capacity_bytes);
    let smaller = volumes.create_volume(&request(p, "ns_claim_raw", MIB, DiskFormat::Raw)).await.expect("smaller");
    assert_eq!(smaller.capacity_bytes, 64 * MIB);
    assert_eq!(volumes.volume(p, "ns_claim_qcow2").await.expect("read").as_ref(), Some(&qcow2));
    assert_eq!(volumes.volume(p, "ns_claim_none").await.expect("read a missing volume"), None);

    // Another format, or more room, under the same name: a conflict naming both.
    let err = volumes.create_volume(&request(p, "ns_claim_raw", 64 * MIB, DiskFormat::Qcow2)).await.expect_err("fmt");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert!(err.message.contains("raw") && err.message.contains("qcow2"), "{err}");
    let err = volumes.create_volume(&request(p, "ns_claim_raw", 128 * MIB, DiskFormat::Raw)).await.expect_err("size");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert!(err.message.contains(&(64 * MIB).to_string()) && err.message.contains(&(128 * MIB).to_string()), "{err}");

    // Grown in place, never shrunk.
    let grown = volumes.resize_volume(p, "ns_claim_qcow2", DiskFormat::Qcow2, 48 * MIB).await.expect("grow qcow2");
    assert_eq!((grown.path.as_str(), grown.capacity_bytes), (qcow2.path.as_str(), 48 * MIB));
    assert_on_host(&uri, &grown);
    let grown = volumes.resize_volume(p, "ns_claim_raw", DiskFormat::Raw, 96 * MIB).await.expect("grow raw");
    assert_eq!(grown.capacity_bytes, 96 * MIB);
    assert_on_host(&uri, &grown);
    let same = volumes.resize_volume(p, "ns_claim_raw", DiskFormat::Raw, 96 * MIB).await.expect("the same size again");
    assert_eq!(same.capacity_bytes, 96 * MIB);
    let err = volumes.resize_volume(p, "ns_claim_raw", DiskFormat::Raw, 32 * MIB).await.expect_err("shrink");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert_eq!(qemu_img_info(&raw.path, DiskFormat::Raw).1, 96 * MIB);
    let err = volumes.resize_volume(p, "ns_claim_none", DiskFormat::Raw, 32 * MIB).await.expect_err("missing volume");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");

    // A guest that writes a qcow2 header into its raw volume makes the pool
    // read the file as qcow2: growing it offline is refused, not done as qcow2.
    let header = std::env::temp_dir().join(format!("vmlet-header-{}.qcow2", std::process::id()));
    let made =
        output_within(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&header).arg("1G"), QEMU_IMG);
    assert!(made.status.success(), "qemu-img create: {}", String::from_utf8_lossy(&made.stderr));
    let bytes = std::fs::read(&header).expect("read the header");
    std::fs::remove_file(&header).expect("remove the header");
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().write(true).open(&raw.path).expect("open the raw volume");
        file.write_all(&bytes[..512]).expect("write the guest's header");
    }
    assert_eq!(volumes.volume(p, "ns_claim_raw").await.expect("read").and_then(|v| v.format), Some(DiskFormat::Qcow2));
    let err = volumes.resize_volume(p, "ns_claim_raw", DiskFormat::Raw, 128 * MIB).await.expect_err("probed qcow2");
    assert_eq!(err.kind, ErrorKind::Conflict, "{err}");
    assert!(err.message.contains("raw") && err.message.contains("qcow2"), "{err}");
    assert_eq!(std::fs::metadata(&raw.path).expect("stat").len(), 96 * MIB, "the file was left as it was");

    // Removed, twice.
    for name in ["ns_claim_raw", "ns_claim_qcow2"] {
        volumes.delete_volume(p, name).await.expect("delete");
        volumes.delete_volume(p, name).await.expect("delete again");
        assert_eq!(volumes.volume(p, name).await.expect("read"), None);
    }
    assert!(!std::path::Path::new(&raw.path).exists() && !std::path::Path::new(&qcow2.path).exists());
    assert!(!virsh(&uri, &["vol-list", p]).contains("ns_claim_"));

    // A pool the host does not have, and names that could leave the pool.
    let missing = format!("{p}-missing");
    let err = volumes.create_volume(&request(&missing, "v", MIB, DiskFormat::Raw)).await.expect_err("no pool");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains(&missing), "{err}");
    assert!(err.message.contains(p), "the message names the pools the host has: {err}");
    assert_eq!(volumes.delete_volume(&missing, "v").await.expect_err("no pool").kind, ErrorKind::NotFound);
    for name in ["../escape", ".hidden", "a/b", ""] {
        let err = volumes.create_volume(&request(p, name, MIB, DiskFormat::Raw)).await.expect_err(name);
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{name}: {err}");
    }
    drop(pool);
}

#[tokio::test]
async fn volumes_on_the_test_driver_live_in_its_in_memory_pool() {
    let provider = LibvirtProvider::connect("test:///default").await.expect("connect");
    let volumes = provider.volumes().expect("the libvirt provider has volumes");
    let made = volumes.create_volume(&request("default-pool", "ns_claim_uid", 8 * MIB, DiskFormat::Qcow2)).await;
    let made = made.expect("create");
    assert_eq!(made.path, "/default-pool/ns_claim_uid");
    assert_eq!((made.capacity_bytes, made.format), (8 * MIB, Some(DiskFormat::Qcow2)));
    let again = volumes.create_volume(&request("default-pool", "ns_claim_uid", 8 * MIB, DiskFormat::Qcow2)).await;
    assert_eq!(again.expect("create again"), made);
    let err = volumes.create_volume(&request("default-pool", "ns_claim_uid", 8 * MIB, DiskFormat::Raw)).await;
    assert_eq!(err.expect_err("another format").kind, ErrorKind::Conflict);
    assert_eq!(volumes.volume("default-pool", "ns_claim_uid").await.expect("read"), Some(made));

    let err = volumes.volume("no-such-pool", "ns_claim_uid").await.expect_err("missing pool");
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains("no-such-pool") && err.message.contains("default-pool"), "{err}");

    // The test driver has no virStorageVolResize.
    let err =
        volumes.resize_volume("default-pool", "ns_claim_uid", DiskFormat::Qcow2, 16 * MIB).await.expect_err("resize");
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");

    volumes.delete_volume("default-pool", "ns_claim_uid").await.expect("delete");
    volumes.delete_volume("default-pool", "ns_claim_uid").await.expect("delete again");
    assert_eq!(volumes.volume("default-pool", "ns_claim_uid").await.expect("read"), None);
}

/// A volume made from an image: a full copy (`VolumeSource::Copy`) holds
/// the image's bytes in its own format and stands alone, appears only once
/// complete, and is made once; a volume smaller than the image's disk is
/// refused (copy and overlay alike), and nothing is left in the pool.
#[tokio::test]
async fn a_copy_of_an_image_stands_alone_and_no_volume_is_smaller_than_its_image() {
    let uri = qemu_uri();
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    let volumes = provider.volumes().expect("the libvirt provider has volumes");
    let pool = TestPool::start(&uri);
    let p = pool.name.as_str();
    // The image: 2 MiB of raw disk with a mark at its start, outside the pool.
    let image_path = format!("{}.image.raw", pool.dir);
    let mut bytes = b"IMAGE-MARK\n".to_vec();
    bytes.resize(2 * MIB as usize, 0);
    bytes[MIB as usize] = 0x5a;
    std::fs::write(&image_path, &bytes).expect("write the image");
    let image = vmlet_provider::BackingFile { path: image_path.clone(), format: DiskFormat::Raw };
    let from = |name: &str, capacity_bytes: u64, format: DiskFormat, source: VolumeSource| VolumeRequest {
        source,
        ..request(p, name, capacity_bytes, format)
    };

    for format in [DiskFormat::Raw, DiskFormat::Qcow2] {
        let name = format!("ns_copy_{format}");
        let made = volumes
            .create_volume(&from(&name, 4 * MIB, format, VolumeSource::Copy(image.clone())))
            .await
            .unwrap_or_else(|e| panic!("copy into {format}: {e}"));
        assert_eq!((made.path.clone(), made.capacity_bytes), (format!("{}/{name}", pool.dir), 4 * MIB));
        assert_on_host(&uri, &made);
        // The image's bytes, then zeros; no backing file.
        let compared = output_within(
            Command::new("qemu-img").args([
                "compare",
                "-q",
                "-f",
                "raw",
                "-F",
                format.as_str(),
                &image_path,
                &made.path,
            ]),
            QEMU_IMG,
        );
        assert!(compared.status.success(), "qemu-img compare: {}", String::from_utf8_lossy(&compared.stderr));
        let xml = virsh(&uri, &["vol-dumpxml", "--pool", p, &name]);
        assert!(!xml.contains("<backingStore>"), "{xml}");
        // Made once: asking again returns it as it is.
        let again = volumes.create_volume(&from(&name, 4 * MIB, format, VolumeSource::Copy(image.clone()))).await;
        assert_eq!(again.expect("again").path, made.path);
    }
    assert_eq!(std::fs::read(&image_path).expect("the image"), bytes, "the image is only read");

    // Smaller than the image's 2 MiB disk: refused, naming both sizes.
    for source in [VolumeSource::Copy(image.clone()), VolumeSource::Overlay(image.clone())] {
        let err = volumes.create_volume(&from("ns_small", MIB, DiskFormat::Qcow2, source)).await.expect_err("small");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains(&MIB.to_string()) && err.message.contains(&(2 * MIB).to_string()), "{err}");
    }
    let listed = virsh(&uri, &["vol-list", p]);
    assert!(!listed.contains("ns_small") && !listed.contains(".partial"), "{listed}");
    std::fs::remove_file(&image_path).expect("remove the image");
    drop(pool);
}
