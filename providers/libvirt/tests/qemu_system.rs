//! The libvirt provider against a real libvirtd with QEMU (`qemu:///system`).
//!
//! Needs `VMLET_LIBVIRT_QEMU_URI` (`hack/test.sh` starts libvirtd and sets it);
//! without it the test fails and says so, rather than passing unexercised.
//! The guest has no disk: QEMU idles in the firmware, which is a real, cheap
//! process for lifecycle checks. Names and uids are unique per run; VMs left by an
//! earlier, failed run (namespace `vmlet-it`) are removed first.

mod common;
use common::deadline::{output_within, VIRSH};
use common::qemu_uri;

use std::process::Command;

use vmlet_libvirt::LibvirtProvider;
use vmlet_provider::{PowerState, Provider, VmSpec};

const NAMESPACE: &str = "vmlet-it";

/// A spec unique to this run: a UUID-shaped uid from the clock and the pid.
fn unique_spec() -> VmSpec {
    let (id, nanos) = common::unique_uid();
    let pid = std::process::id();
    VmSpec {
        options: Default::default(),
        cloud_init: None,
        disks: vec![],
        networks: vec![],
        id,
        namespace: NAMESPACE.into(),
        name: format!("lifecycle-{pid}-{}", nanos % 1_000_000_000),
        cpus: 1,
        memory_bytes: 64 * 1024 * 1024,
        max_cpus: None,
        max_memory_bytes: None,
        image: None,
        image_backing_chain: None,
        kernel_boot: None,
    }
}

/// `virsh -c <uri> domstate <name>`, trimmed.
fn virsh_domstate(uri: &str, name: &str) -> String {
    let out = output_within(Command::new("virsh").args(["-c", uri, "domstate", name]), VIRSH);
    assert!(out.status.success(), "virsh domstate {name}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Destroy and undefine every VM an earlier run of these tests left behind.
async fn remove_leftovers(provider: &LibvirtProvider) {
    for vm in provider.list().await.expect("list") {
        if vm.backend_name.starts_with(&format!("{NAMESPACE}_")) {
            println!("removing leftover {} (uid {})", vm.backend_name, vm.id);
            provider.destroy(&vm.id).await.expect("destroy leftover");
            provider.undefine(&vm.id).await.expect("undefine leftover");
        }
    }
}

#[tokio::test]
async fn qemu_domain_lifecycle_survives_a_provider_restart() {
    let uri = qemu_uri();
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    provider.ping().await.expect("ping");
    remove_leftovers(&provider).await;

    let host = provider.host_info().await.expect("host info");
    assert!(host.cpus >= 1 && host.memory_bytes > 0, "{host:?}");
    assert!(host.hypervisor.starts_with("libvirt ") && host.hypervisor.ends_with("(QEMU)"), "{host:?}");

    let spec = unique_spec();
    let name = spec.backend_name();
    let defined = provider.ensure_defined(&spec).await.expect("define");
    assert_eq!(defined.backend_name, name);
    assert_eq!(defined.power, PowerState::Off);
    assert_eq!(defined.memory_bytes, spec.memory_bytes);
    assert_eq!(virsh_domstate(&uri, &name), "shut off");

    provider.start(&spec.id).await.expect("start");
    provider.start(&spec.id).await.expect("start again");
    assert_eq!(virsh_domstate(&uri, &name), "running");
    let running = provider.get(&spec.id).await.expect("get").expect("defined");
    assert_eq!(running.power, PowerState::Running);
    assert_eq!(running.backend_id, defined.backend_id);

    // A fresh connection, as after a vmlet restart, finds the same domain by uid.
    let restarted = LibvirtProvider::connect(&uri).await.expect("connect again");
    let found = restarted.get(&spec.id).await.expect("get").expect("found after restart");
    assert_eq!(found.backend_id, defined.backend_id);
    assert_eq!(found.backend_name, name);
    assert_eq!(found.power, PowerState::Running);
    assert!(restarted.list().await.expect("list").iter().any(|vm| vm.id == spec.id));

    // A paused guest cannot hear the power button: a shutdown powers it
    // off (libvirt refuses to press it), or the VM could never be stopped.
    let out = output_within(Command::new("virsh").args(["-c", &uri, "suspend", &name]), VIRSH);
    assert!(out.status.success(), "virsh suspend: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(restarted.get(&spec.id).await.expect("get").expect("defined").power, PowerState::Paused);
    restarted.shutdown(&spec.id).await.expect("shutdown of a paused domain");
    assert_eq!(virsh_domstate(&uri, &name), "shut off");
    provider.start(&spec.id).await.expect("start after the paused stop");

    // No guest OS answers ACPI: shutdown is accepted, destroy stops it.
    restarted.shutdown(&spec.id).await.expect("shutdown");
    restarted.destroy(&spec.id).await.expect("destroy");
    restarted.destroy(&spec.id).await.expect("destroy again");
    assert_eq!(virsh_domstate(&uri, &name), "shut off");
    let stopped = restarted.get(&spec.id).await.expect("get").expect("still defined");
    assert_eq!(stopped.power, PowerState::Off);
    assert_eq!(stopped.backend_id, defined.backend_id, "the same domain across stop/start");

    restarted.undefine(&spec.id).await.expect("undefine");
    restarted.undefine(&spec.id).await.expect("undefine again");
    assert_eq!(restarted.get(&spec.id).await.expect("get"), None);
    assert_eq!(provider.get(&spec.id).await.expect("get through the first connection"), None);
}

/// The default storage root the provider reports is what `virsh` shows: the
/// target path of the pool named `default`, or `/var/lib/libvirt/images` on a
/// daemon without one (a fresh hack/libvirtd.sh host has none).
#[tokio::test]
async fn the_default_storage_root_is_the_default_pools_target_or_libvirts_images_directory() {
    let uri = qemu_uri();
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    let info = provider.host_info().await.expect("host info");
    let out = output_within(Command::new("virsh").args(["-c", &uri, "pool-dumpxml", "default"]), VIRSH);
    let expected = if out.status.success() {
        let xml = String::from_utf8_lossy(&out.stdout).into_owned();
        let target = &xml[xml.find("<target>").expect("a <target> in the pool XML")..];
        let path = &target[target.find("<path>").expect("a target <path>") + "<path>".len()..];
        path[..path.find("</path>").unwrap()].trim().to_owned()
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("Storage pool not found"), "virsh pool-dumpxml default: {stderr}");
        "/var/lib/libvirt/images".to_owned()
    };
    assert_eq!(info.storage_roots, vec![expected]);
}

/// `qemu-img <args>`, which must succeed.
fn qemu_img(args: &[&str]) {
    let out = output_within(Command::new("qemu-img").args(args), std::time::Duration::from_secs(60));
    assert!(out.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The command line of the QEMU process of running domain `name`, read from
/// the pid file libvirt keeps for it.
fn qemu_command_line(name: &str) -> String {
    let pid =
        std::fs::read_to_string(format!("/run/libvirt/qemu/{name}.pid")).expect("libvirt's pid file of the domain");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid.trim())).expect("the QEMU process");
    String::from_utf8_lossy(&cmdline).replace('\0', " ")
}

/// The hole this closes, as it was shown on a real guest: a qcow2 image whose
/// header names a backing file under the roots at define, rewritten afterwards
/// (`qemu-img rebase -u`) to name `/etc/passwd`. The definition pins the chain
/// vmlet checked; a start or a migration refuses the changed header, naming
/// the field; and a start behind vmlet's back (`virsh start`) still gives QEMU
/// only the pinned files.
#[tokio::test]
async fn a_backing_file_rewritten_after_the_define_is_refused_and_never_opened() {
    use vmlet_provider::{BackingFile, DataDisk, DiskFormat, ErrorKind, Migration, MigrationMode, MigrationTarget};
    const NS: &str = "vmlet-it-chain";
    let uri = qemu_uri();
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    for vm in provider.list().await.expect("list") {
        if vm.backend_name.starts_with(&format!("{NS}_")) {
            provider.destroy(&vm.id).await.expect("destroy leftover");
            provider.undefine(&vm.id).await.expect("undefine leftover");
        }
    }
    let dir = format!("/var/lib/libvirt/images/{NS}-{}", std::process::id());
    std::fs::create_dir_all(&dir).unwrap();
    let (base, top) = (format!("{dir}/base.raw"), format!("{dir}/top.qcow2"));
    qemu_img(&["create", "-q", "-f", "raw", &base, "8M"]);
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", &base, "-F", "raw", &top]);

    let mut spec = VmSpec { namespace: NS.into(), ..unique_spec() };
    spec.disks = vec![DataDisk {
        name: "data".into(),
        path: top.clone(),
        format: DiskFormat::Qcow2,
        create_bytes: None,
        backing_chain: vec![BackingFile { path: base.clone(), format: DiskFormat::Raw }],
    }];
    let name = spec.backend_name();
    provider.ensure_defined(&spec).await.expect("define");
    provider.start(&spec.id).await.expect("a start on the chain as defined");
    let opened = qemu_command_line(&name);
    assert!(opened.contains(&base) && opened.contains(&top), "{opened}");
    provider.destroy(&spec.id).await.expect("destroy");

    qemu_img(&["rebase", "-u", "-b", "/etc/passwd", "-F", "raw", &top]);
    let refused = provider.start(&spec.id).await.unwrap_err();
    assert_eq!(refused.kind, ErrorKind::InvalidInput, "{refused}");
    assert!(
        refused.message.starts_with(&format!(
            "spec.disks[data].hostImage.path {top}: the header of \"{top}\" names the backing file \"/etc/passwd\" \
             (raw), but the definition pins the backing file \"{base}\" (raw)"
        )),
        "{refused}"
    );
    assert_eq!(virsh_domstate(&uri, &name), "shut off", "nothing started");

    // A migration checks before it reaches for the target: the refusal, not
    // the unreachable address, answers.
    let target = MigrationTarget { host: "nowhere".into(), address: "qemu+tcp://127.0.0.1:9/system".into() };
    let migrating = (&provider as &dyn Migration).migrate(
        &spec.id,
        &target,
        MigrationMode::Cold,
        std::time::Duration::from_secs(30),
    );
    let refused = migrating.await.unwrap_err();
    assert_eq!(refused.kind, ErrorKind::InvalidInput, "{refused}");
    assert!(refused.message.contains("\"/etc/passwd\""), "{refused}");

    // Started behind vmlet's back, QEMU still gets the pinned base only.
    let out = output_within(Command::new("virsh").args(["-c", &uri, "start", &name]), VIRSH);
    assert!(out.status.success(), "virsh start: {}", String::from_utf8_lossy(&out.stderr));
    let opened = qemu_command_line(&name);
    assert!(opened.contains(&base) && !opened.contains("/etc/passwd"), "{opened}");

    provider.destroy(&spec.id).await.expect("destroy");
    provider.undefine(&spec.id).await.expect("undefine");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `accelerator: auto` boots a probe guest before it trusts KVM: it chooses
/// what the test guest's own probe (`test-vms/guest/accelerator.sh`, a
/// kernel booted under KVM outside libvirt) found on this machine, and TCG
/// where the host has no kernel in /boot to probe with. Where KVM runs
/// firmware only (nested hosts here), the capabilities offer KVM and vmlet
/// turns it down.
#[tokio::test]
async fn auto_chooses_kvm_only_where_a_kernel_runs_under_it() {
    let uri = qemu_uri();
    // vmlet probes with the host's own kernel; without one it trusts no KVM.
    let host_kernel = std::fs::read_dir("/boot")
        .map(|dir| dir.flatten().any(|e| e.file_name().to_string_lossy().starts_with("vmlinuz")))
        .unwrap_or(false);
    let expected = match common::guest::guest_accelerator(&common::guest::guest_dir()) {
        vmlet_libvirt::AcceleratorSetting::Kvm if host_kernel => "kvm",
        _ => "tcg",
    };
    let provider = LibvirtProvider::connect(&uri).await.expect("connect");
    let chosen = provider.host_info().await.expect("host info").accelerator;
    println!("accelerator: auto chose {chosen:?}; the test guest's probe says {expected}");
    assert_eq!(chosen.as_deref(), Some(expected));

    // The probe itself, with the test guest's kernel where the host has none:
    // it agrees with the test guest's probe.
    let guest = common::guest::guest_dir();
    let run = common::guest::RunDir::new(&guest, &format!("kvm-probe-{}", std::process::id()), &["vmlinuz"]);
    let verdict =
        vmlet_libvirt::probe_kvm(&uri, &run.path("vmlinuz"), std::time::Duration::from_secs(20)).await.expect("probe");
    println!("KVM probe with the test guest's kernel: {verdict:?}");
    let guest_says = common::guest::guest_accelerator(&guest);
    assert_eq!(verdict.is_none(), guest_says == vmlet_libvirt::AcceleratorSetting::Kvm, "{verdict:?}");
    let out = output_within(Command::new("virsh").args(["-c", &uri, "list", "--all", "--name"]), VIRSH);
    let left = String::from_utf8_lossy(&out.stdout);
    assert!(!left.contains(&format!("vmlet-kvm-probe-{}-", std::process::id())), "the probe is gone: {left}");
}
