//! Data disks from host images (`spec.disks[].hostImage.path`), through the
//! real API server, vmlet and a real libvirtd (`qemu:///system`, started by
//! `hack/test.sh`), checked with virsh and in a real QEMU guest.
//!
//! Images inside the host's storage root are attached in spec order, each in
//! the format its file has, named by its disk, and keep their writes across a
//! stop and start; a backing file named anew in a header after the define is
//! refused at the next start. Files outside the root (directly, through a symbolic link,
//! or as a qcow2 image's backing file) are refused before anything is
//! defined, and a missing image waits until it exists.

mod common;

use common::deadline::{output_within, VIRSH};
use common::{device_named, guest_accelerator, guest_for, guest_vm_spec, qemu_uri, storage_root, Host, TestEnv};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// `virsh -c <uri> <args>`: (success, trimmed stdout).
fn virsh(args: &[&str]) -> (bool, String) {
    let out = output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(args), VIRSH);
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn domain(env: &TestEnv, vm: &str) -> String {
    format!("{}_{vm}", env.ns)
}

/// Domain names of this test's namespace defined on the daemon.
fn namespace_domains(env: &TestEnv) -> Vec<String> {
    let (ok, names) = virsh(&["list", "--all", "--name"]);
    assert!(ok);
    let prefix = format!("{}_", env.ns);
    let mut names: Vec<String> = names.lines().filter(|n| n.starts_with(&prefix)).map(str::to_owned).collect();
    names.sort();
    names
}

/// `qemu-img <args>`, which must succeed.
fn qemu_img(args: &[&str]) {
    let out = output_within(Command::new("qemu-img").args(args), Duration::from_secs(60));
    assert!(out.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn path_of(path: &Path) -> String {
    path.display().to_string()
}

#[tokio::test]
async fn host_images_attach_in_spec_order_in_their_own_format_by_name_and_keep_their_writes() {
    let mut env = TestEnv::new("hostdisk").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.wait_node_ready(&env.node("q")).await;

    // A qcow2 overlay on a raw base (both under the root, the base named
    // relative to the overlay), and a raw image; made as an administrator
    // would, with qemu-img.
    let root = storage_root(&env);
    let (base, data, scratch) = (root.join("base.raw"), root.join("web-data.qcow2"), root.join("scratch.img"));
    qemu_img(&["create", "-q", "-f", "raw", &path_of(&base), "32M"]);
    let base_mark = format!("base-{}", env.ns);
    write_at(&base, 512, format!("{base_mark}\n").as_bytes());
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", &path_of(&data)]);
    qemu_img(&["create", "-q", "-f", "raw", &path_of(&scratch), "16M"]);

    let mut spec = guest_vm_spec(&guest);
    spec["disks"] = json!([
        {"name": "data", "hostImage": {"path": data}},
        {"name": "scratch", "hostImage": {"path": scratch}},
    ]);
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.vm_pod("web").await;
    assert_eq!(pod.spec.as_ref().unwrap().volumes, None, "host images are no pod volumes");
    let pod = pod.metadata.name.unwrap();

    let (ok, xml) = virsh(&["dumpxml", &domain(&env, "web")]);
    assert!(ok);
    for (format, file, target, serial) in [("qcow2", &data, "vdb", "data"), ("raw", &scratch, "vdc", "scratch")] {
        let disk = format!("<driver name='qemu' type='{format}'/>\n      <source file='{}'", file.display());
        assert!(xml.contains(&disk), "{disk} in {xml}");
        assert!(xml.contains(&format!("<target dev='{target}' bus='virtio'/>")), "{target} in {xml}");
        assert!(xml.contains(&format!("<serial>{serial}</serial>")), "{serial} in {xml}");
    }

    // The guest finds each disk by its name, in spec order.
    assert_eq!(env.exec_stdout(&pod, &device_named("data")).await, "vdb");
    assert_eq!(env.exec_stdout(&pod, &device_named("scratch")).await, "vdc");
    let mark = format!("kept-{}", env.ns);
    let write = format!(
        "dev=$({}) && printf '%s\\n' {mark} | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok",
        device_named("data")
    );
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");

    // Stop and start: the image keeps what was written (in the overlay).
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let read = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &read).await, mark);

    // The overlay's header rewritten while the VM is off, as anyone who can
    // write the file as raw could: the start is refused, naming the field,
    // and the domain stays off.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    qemu_img(&["rebase", "-u", "-b", "/etc/passwd", "-F", "raw", &path_of(&data)]);
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    let message = env.wait_waiting("web", "InvalidSpec").await;
    assert!(
        message.contains(&format!(
            "spec.disks[data].hostImage.path {}: the header of {:?} names the backing file \"/etc/passwd\" (raw), \
             but the definition pins the backing file {:?} (raw)",
            data.display(),
            path_of(&data),
            path_of(&base)
        )),
        "{message}"
    );
    assert_eq!(virsh(&["domstate", &domain(&env, "web")]), (true, "shut off".to_owned()));

    // The header put back and the VM touched: it starts on its pinned base.
    qemu_img(&["rebase", "-u", "-b", "base.raw", "-F", "raw", &path_of(&data)]);
    env.kubectl(&["annotate", "virtualmachine/web", "example.com/header-restored=yes"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let read_base = format!("dd if=/dev/$({}) bs=512 skip=1 count=1 2>/dev/null | head -n 1", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &read_base).await, base_mark);
    drop(env);
    let _ = std::fs::remove_dir_all(root);
}

/// Write `bytes` into the file at `path` at byte `offset`, in place.
fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt as _;
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(bytes, offset).unwrap();
    file.sync_all().unwrap();
}

#[tokio::test]
async fn host_images_outside_the_storage_root_are_refused_and_a_missing_one_waits_with_nothing_defined() {
    let mut env = TestEnv::new("hostdisk-refused").await;
    let root = storage_root(&env);
    std::fs::create_dir_all(&root).unwrap();
    // A link inside the root that leads out of it, and a qcow2 image inside
    // it whose backing file is outside (made without reading it: -u).
    let innocent = root.join("innocent.raw");
    std::os::unix::fs::symlink("/etc/passwd", &innocent).unwrap();
    let overlay = root.join("overlay.qcow2");
    qemu_img(&["create", "-q", "-u", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", &path_of(&overlay), "1M"]);
    let missing = root.join("later.raw");
    env.start_vmlet(&[Host::qemu("q")]);

    let vm_with = |path: &Path| json!({"resources": {"cpu": 1, "memory": "64Mi"}, "disks": [{"name": "data", "hostImage": {"path": path}}]});
    env.apply_vm("passwd", vm_with(Path::new("/etc/passwd")));
    env.apply_vm("linked", vm_with(&innocent));
    env.apply_vm("backing", vm_with(&overlay));
    env.apply_vm("later", vm_with(&missing));
    // The same overlay as a boot image: its chain is followed as a data
    // disk's is.
    env.apply_vm("boot", json!({"resources": {"cpu": 1, "memory": "64Mi"}, "image": overlay}));

    let field = "spec.disks[data].hostImage.path";
    let roots = format!("storage roots [{}]", root.display());
    let message = env.wait_waiting("passwd", "StorageNotAllowed").await;
    assert!(message.starts_with(&format!("{field} \"/etc/passwd\" is not under a storage root;")), "{message}");
    assert!(message.contains(&roots), "{message}");
    let message = env.wait_waiting("linked", "StorageNotAllowed").await;
    assert!(message.starts_with(&format!("{field} {:?} resolves to \"/etc/passwd\"", path_of(&innocent))), "{message}");
    let message = env.wait_waiting("backing", "StorageNotAllowed").await;
    assert!(
        message.starts_with(&format!(
            "{field} {:?} names the backing file \"/etc/passwd\", which is not under a storage root;",
            path_of(&overlay)
        )),
        "{message}"
    );
    let message = env.wait_waiting("boot", "StorageNotAllowed").await;
    assert!(
        message.starts_with(&format!(
            "spec.image {:?} names the backing file \"/etc/passwd\", which is not under a storage root;",
            path_of(&overlay)
        )),
        "{message}"
    );
    let message = env.wait_waiting("later", "HostImageNotFound").await;
    assert!(message.starts_with(&format!("{field}: there is no file {:?}", path_of(&missing))), "{message}");
    assert!(message.contains("vmlet never makes host images"), "{message}");

    for vm in ["passwd", "linked", "backing", "later", "boot"] {
        let status = env.vms().get(vm).await.unwrap().status.unwrap();
        let ready = status.conditions.iter().find(|c| c.type_ == "Ready").expect("a Ready condition");
        assert_eq!(ready.status, "False", "{vm}");
        let field = if vm == "boot" { "spec.image" } else { field };
        assert!(ready.message.contains(field), "{vm}: {}", ready.message);
        assert_eq!(status.provider_id, None, "{vm}");
        assert!(!virsh(&["domuuid", &domain(&env, vm)]).0, "no domain was defined for {vm}");
    }
    assert_eq!(namespace_domains(&env), Vec::<String>::new());
    assert_eq!(std::fs::read_link(&innocent).unwrap(), Path::new("/etc/passwd"), "the link is left alone");
    assert!(!missing.exists(), "vmlet made no image");

    // The missing image, once made, is attached: the VM starts by itself.
    qemu_img(&["create", "-q", "-f", "raw", &path_of(&missing), "1M"]);
    env.wait_vm_phase("later", "Running").await;
    assert_eq!(namespace_domains(&env), vec![domain(&env, "later")]);
    drop(env);
    let _ = std::fs::remove_dir_all(root);
}
