//! Dynamically provisioned data disks, through the real API server,
//! kube-scheduler's volume binding (`WaitForFirstConsumer`, the
//! `volume.kubernetes.io/selected-node` annotation), kube-controller-manager's
//! PV controller, vmlet's provisioner and a real QEMU guest on libvirtd with
//! a real libvirt `dir` storage pool.
//!
//! A tenant's VM boots an image of the catalogue by name; a claim of a
//! `libvirt.vmlet.io` StorageClass gets a volume in the pool of
//! the host the scheduler picked and a PersistentVolume bound to it; the
//! guest sees the disk by its name at the claim's size and keeps its writes
//! across a stop and start, and a qcow2 header it writes into its raw volume
//! is never read as one; growing the claim grows the running VM's disk live
//! (and never as the qcow2 the pool probes); deleting the VM and then the claim deletes the
//! volume from the pool and the PersistentVolume. A claim of another
//! namespace that names that PersistentVolume gets nothing.

mod common;

use common::deadline::output_within;
use common::disk::{read_marker, wait_backup_ended, wait_restore_ended, write_marker};
use common::pool::Pool;
use common::{device_named, guest_accelerator, guest_for, guest_vm_spec, qemu_uri, storage_root, Host, TestEnv};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::process::Command;
use vmlet::v1alpha1::{OperationPhase, VirtualMachineBackup};

/// `virsh -c qemu:///system <args>`: (success, trimmed stdout, or stderr).
fn virsh(args: &[&str]) -> (bool, String) {
    common::pool::virsh_at(&qemu_uri(), args)
}

/// The test's pool ([`Pool::new`]) and its StorageClass making volumes in
/// `format`, with `allowVolumeExpansion` as `expansion`.
fn pool_and_class(env: &TestEnv, format: &str, expansion: bool) -> Pool {
    let pool = Pool::new(env);
    pool.class(env, json!({"format": format}), expansion);
    pool
}

/// A vmlet serving one QEMU host `q` for a new namespace `<prefix>-…`
/// (untrusted: its VMs name no host file), whose backup root is
/// `<storage root>/backups`, ready, and the test guest.
async fn untrusted_env(prefix: &str) -> (TestEnv, std::path::PathBuf) {
    let mut env = TestEnv::new(prefix).await;
    env.untrusted = true;
    let guest = guest_for(&env);
    let backups = storage_root(&env).join("backups");
    env.start_vmlet(&[
        Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }.with("backupRoots", json!([backups]))
    ]);
    env.wait_node_ready(&env.node("q")).await;
    (env, guest)
}

/// The test guest as the catalogue image `tiny-<namespace>` (its disk and
/// kernel), and the guest's spec with paths (for its files and size).
fn tiny_image(env: &TestEnv, guest: &std::path::Path) -> (common::CatalogueImage, serde_json::Value) {
    let by_path = guest_vm_spec(guest);
    let spec = json!({"libvirt": {"path": by_path["image"], "kernelBoot": by_path["kernelBoot"]}});
    (common::CatalogueImage::create(env, &format!("tiny-{}", env.ns), spec), by_path)
}

/// The spec of a VM booting catalogue image `image` (the test guest, whose
/// resources `by_path` gives) from its own root disk, a qcow2 overlay of
/// 128 MiB (the image is 64 MiB) in `pool`'s class `<pool>-root`
/// (made here when missing), with the data disks `disks`.
fn tiny_vm(
    env: &TestEnv,
    pool: &Pool,
    image: &str,
    by_path: &serde_json::Value,
    disks: serde_json::Value,
) -> serde_json::Value {
    let class = format!("{}-root", pool.name);
    pool.class_named(env, &class, json!({"format": "qcow2"}), false);
    json!({"resources": by_path["resources"], "image": image,
           "rootDisk": {"size": "128Mi", "storageClassName": class}, "disks": disks})
}

/// The first 4 KiB of a qcow2 image whose header names `backing` (raw) as
/// its backing file, made with qemu-img in `dir` (without opening `backing`).
fn qcow2_header_naming(backing: &str, dir: &std::path::Path) -> Vec<u8> {
    let file = dir.join("forged-header.qcow2");
    let path = file.display().to_string();
    let out = output_within(
        Command::new("qemu-img").args(["create", "-q", "-u", "-f", "qcow2", "-b", backing, "-F", "raw", &path, "1M"]),
        std::time::Duration::from_secs(60),
    );
    assert!(out.status.success(), "qemu-img create: {}", String::from_utf8_lossy(&out.stderr));
    let mut bytes = std::fs::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    bytes.truncate(4096);
    let at = bytes.windows(backing.len()).position(|w| w == backing.as_bytes());
    assert!(at.is_some(), "the header names {backing} within its first 4 KiB");
    bytes
}

/// Ask for `size` in claim `data`.
async fn grow(claims: &Api<PersistentVolumeClaim>, size: &str) {
    let patch = json!({"spec": {"resources": {"requests": {"storage": size}}}});
    claims.patch("data", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
}

/// Wait until claim `data` reports `bytes` in `status.capacity`.
async fn wait_claim_capacity(env: &TestEnv, claims: &Api<PersistentVolumeClaim>, bytes: u64) {
    env.wait_for(&format!("claim data to report {bytes} bytes"), || {
        let claims = claims.clone();
        async move {
            let capacity = claims.get("data").await.ok()?.status?.capacity?;
            (capacity.get("storage")?.0 == bytes.to_string()).then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn a_claim_gets_a_volume_in_the_pool_of_the_vms_host_and_both_go_with_the_claim() {
    // A tenant's namespace as vmlet serves it by default: no host path of
    // its own; the test guest is an image of the catalogue.
    let (env, guest) = untrusted_env("provision").await;
    let node = env.node("q");
    let (tiny, by_path) = tiny_image(&env, &guest);
    let pool = pool_and_class(&env, "raw", true);
    let data = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    let vm_spec = || tiny_vm(&env, &pool, &tiny.0, &by_path, data.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data"},
        "spec": {"storageClassName": pool.name, "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .unwrap();
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let uid = claim.uid().unwrap();
    assert_eq!(pool.volumes_of("data"), Vec::<String>::new(), "nothing before a VM uses the claim");

    env.apply_vm("web", vm_spec());
    env.wait_vm_phase("web", "Running").await;

    // The claim is bound to vmlet's PersistentVolume for a volume of
    // vmlet's name, in the pool, on the VM's host.
    let volume = format!("{}_data_{uid}", env.ns);
    assert_eq!(pool.volumes_of("data"), vec![volume.clone()]);
    let bound = claims.get("data").await.unwrap();
    let pv_name = format!("pvc-{uid}");
    assert_eq!(bound.spec.as_ref().unwrap().volume_name.as_deref(), Some(pv_name.as_str()));
    let pvs: Api<PersistentVolume> = Api::all(env.client.clone());
    let pv = pvs.get(&pv_name).await.unwrap();
    let csi = pv.spec.as_ref().unwrap().csi.clone().unwrap();
    assert_eq!(
        (csi.driver.as_str(), csi.volume_handle),
        ("libvirt.vmlet.io", format!("{node}/{}/{volume}", pool.name))
    );
    assert_eq!(pv.annotations().get("pv.kubernetes.io/provisioned-by").map(String::as_str), Some("libvirt.vmlet.io"));

    // The guest sees a 1 GiB disk by its name, and keeps what it writes.
    let pod = env.pod_of("web").await;
    let size = format!("cat /sys/block/$({})/size", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &size).await, (1u64 << 30 >> 9).to_string(), "512-byte sectors of 1 GiB");
    let mark = format!("kept-{}", env.ns);
    let write = format!(
        "dev=$({}) && printf '%s\\n' {mark} | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok",
        device_named("data")
    );
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let read = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &read).await, mark);

    // The guest writes a qcow2 header naming /etc/passwd as backing file
    // into its raw volume: after a stop and start the volume is still raw
    // (its format is the pool's record, never read from the file), QEMU
    // opens nothing else, and the guest reads back its own bytes.
    let header = qcow2_header_naming("/etc/passwd", &storage_root(&env));
    let octal: String = header.iter().map(|b| format!("\\{b:03o}")).collect();
    let write = format!("dev=$({}) && printf '{octal}' > /dev/$dev && sync && echo ok", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let domain = format!("{}_web", env.ns);
    let (ok, xml) = virsh(&["dumpxml", &domain]);
    assert!(ok, "{xml}");
    let volume_path = format!("{}/{volume}", storage_root(&env).join("pool").display());
    let disk = format!("<driver name='qemu' type='raw'/>\n      <source file='{volume_path}' index=");
    assert!(xml.contains(&disk), "{disk} in {xml}");
    assert!(!xml.contains("/etc/passwd"), "{xml}");
    let pid = std::fs::read_to_string(format!("/run/libvirt/qemu/{domain}.pid")).unwrap();
    let cmdline =
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{}/cmdline", pid.trim())).unwrap()).replace('\0', " ");
    assert!(!cmdline.contains("/etc/passwd") && cmdline.contains(&volume_path), "{cmdline}");
    let pod = env.pod_of("web").await;
    let magic = format!("head -c 3 /dev/$({})", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &magic).await, "QFI", "the guest's own bytes, as raw");

    // A new VM defined on the claim (libvirt's pool now calls the file
    // qcow2, from the guest's header) still gets it raw.
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true"]);
    assert!(virsh(&["pool-refresh", &pool.name]).0);
    let (ok, pool_says) = virsh(&["vol-dumpxml", &volume, "--pool", &pool.name]);
    assert!(ok && pool_says.contains("<format type='qcow2'/>"), "libvirt probes the header: {pool_says}");
    env.apply_vm("web2", vm_spec());
    env.wait_vm_phase("web2", "Running").await;
    let (ok, xml) = virsh(&["dumpxml", &format!("{}_web2", env.ns)]);
    assert!(ok, "{xml}");
    assert!(xml.contains(&disk), "{disk} in {xml}");
    assert!(!xml.contains("/etc/passwd"), "{xml}");
    let pod = env.pod_of("web2").await;
    assert_eq!(env.exec_stdout(&pod, &magic).await, "QFI", "the new VM reads the same raw bytes");

    // The tenant grows the claim: the running VM's disk grows live, in the
    // format its domain states (the pool's probe says qcow2), and the guest
    // sees 2 GiB at once.
    grow(&claims, "2Gi").await;
    wait_claim_capacity(&env, &claims, 2 << 30).await;
    let pv = pvs.get(&pv_name).await.unwrap();
    assert_eq!(pv.spec.unwrap().capacity.unwrap()["storage"].0, (2u64 << 30).to_string());
    let size = format!("cat /sys/block/$({})/size", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &size).await, (2u64 << 30 >> 9).to_string(), "512-byte sectors of 2 GiB");
    assert_eq!(env.exec_stdout(&pod, &magic).await, "QFI", "grown as raw: the guest's bytes are where they were");
    assert_eq!(std::fs::metadata(&volume_path).unwrap().len(), 2 << 30);

    // Stopped, the pool would grow the file as the qcow2 it probes: the
    // claim is marked infeasible and the file keeps its size; once the VM
    // runs again, the volume grows live.
    env.kubectl(&["scale", "virtualmachine/web2", "--replicas=0"]);
    env.wait_vm_phase("web2", "Stopped").await;
    grow(&claims, "3Gi").await;
    env.wait_for("the claim's resize to be marked infeasible", || {
        let claims = claims.clone();
        async move {
            let status = claims.get("data").await.ok()?.status?;
            let marked = status.allocated_resource_statuses?.get("storage")?.as_str() == "ControllerResizeInfeasible";
            marked.then_some(())
        }
    })
    .await;
    assert_eq!(std::fs::metadata(&volume_path).unwrap().len(), 2 << 30, "nothing grown as qcow2");
    env.kubectl(&["scale", "virtualmachine/web2", "--replicas=1"]);
    env.wait_vm_phase("web2", "Running").await;
    wait_claim_capacity(&env, &claims, 3 << 30).await;
    let pod = env.pod_of("web2").await;
    assert_eq!(env.exec_stdout(&pod, &size).await, (3u64 << 30 >> 9).to_string(), "512-byte sectors of 3 GiB");

    // Another namespace's claim that names the PersistentVolume binds to
    // nothing: the PersistentVolume is bound to this claim's UID.
    let intruder = TestEnv::new("provision-b").await;
    let stolen: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "stolen"},
        "spec": {"storageClassName": pool.name, "volumeName": pv_name, "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .unwrap();
    let intruder_claims: Api<PersistentVolumeClaim> = Api::namespaced(intruder.client.clone(), &intruder.ns);
    intruder_claims.create(&PostParams::default(), &stolen).await.unwrap();

    // Deleting the VM, then the claim: the volume leaves the pool and the
    // PersistentVolume goes.
    env.kubectl(&["delete", "virtualmachine/web2", "--wait=true"]);
    claims.delete("data", &DeleteParams::default()).await.unwrap();
    env.wait_for("the PersistentVolume to be gone", || {
        let pvs = pvs.clone();
        let pv_name = pv_name.clone();
        async move { pvs.get_opt(&pv_name).await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert_eq!(pool.volumes_of("data"), Vec::<String>::new());
    let stolen = intruder_claims.get("stolen").await.unwrap();
    assert_ne!(stolen.status.and_then(|s| s.phase).as_deref(), Some("Bound"), "the other namespace got nothing");
    drop(intruder);
    drop(env);
}

/// A claim whose `dataSourceRef` names a `VirtualMachineImage` gets a qcow2
/// volume that is an overlay on the image's file, with that chain pinned in
/// the domain (the base's format stated, never probed), so the guest reads
/// the image's bytes and its writes never reach the image.
#[tokio::test]
async fn a_claim_filled_from_a_catalogue_image_is_an_overlay_pinned_to_it() {
    let (env, guest) = untrusted_env("fromimage").await;
    let pool = pool_and_class(&env, "qcow2", false);
    let (tiny, by_path) = tiny_image(&env, &guest);

    // The administrator's image: 1 MiB of raw disk with a mark at its start.
    let base = storage_root(&env).join("base.raw");
    let mark = format!("IMAGE-{}", env.ns);
    let mut bytes = format!("{mark}\n").into_bytes();
    bytes.resize(1 << 20, 0);
    std::fs::write(&base, &bytes).unwrap();
    let image = format!("base-{}", env.ns);
    let _image = common::CatalogueImage::create(&env, &image, json!({"libvirt": {"path": base}}));

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data"},
        "spec": {"storageClassName": pool.name, "accessModes": ["ReadWriteOnce"],
            "dataSourceRef": {"apiGroup": "vmlet.io", "kind": "VirtualMachineImage", "name": image},
            "resources": {"requests": {"storage": "64Mi"}}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let data = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    env.apply_vm("web", tiny_vm(&env, &pool, &tiny.0, &by_path, data));
    env.wait_vm_phase("web", "Running").await;

    // The domain pins the overlay on the image, the image raw.
    let (ok, xml) = virsh(&["dumpxml", &format!("{}_web", env.ns)]);
    assert!(ok, "{xml}");
    let base_path = base.display().to_string();
    let pinned = "<backingStore type='file' index='";
    assert!(xml.contains(pinned) && xml.contains(&format!("<source file='{base_path}'/>")), "{xml}");
    // The data disk's element (the root disk has a chain of its own).
    let disk = xml.split("<disk ").find(|disk| disk.contains(&base_path)).unwrap();
    let layer = disk.split("<backingStore type='file'").nth(1).unwrap();
    assert!(layer.contains("<format type='raw'/>"), "the base's format is stated: {xml}");

    // The guest reads the image's bytes, and its writes stay in its volume.
    let pod = env.pod_of("web").await;
    let read = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &read).await, mark);
    let size = format!("cat /sys/block/$({})/size", device_named("data"));
    assert_eq!(env.exec_stdout(&pod, &size).await, (64u64 << 20 >> 9).to_string(), "the claim's size");
    let write = format!(
        "dev=$({}) && printf 'GUEST\\n' | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok",
        device_named("data")
    );
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");
    assert_eq!(env.exec_stdout(&pod, &read).await, "GUEST");
    assert_eq!(std::fs::read(&base).unwrap(), bytes, "the image is never written");
    drop(env);
}

/// A VM with `spec.rootDisk` boots its own volume, made by the provisioner
/// as a qcow2 overlay on its catalogue image (claim `<vm>-root`, owned by
/// the VM): the guest sees the root disk's size, keeps its writes across a
/// stop and start, never writes the image, and deleting the VM deletes the
/// claim and the volume.
#[tokio::test]
async fn a_vm_with_a_root_disk_boots_its_own_overlay_of_its_image_which_goes_with_it() {
    let (env, guest) = untrusted_env("rootdisk").await;
    let pool = pool_and_class(&env, "qcow2", false);
    let (tiny, by_path) = tiny_image(&env, &guest);
    let image_path = by_path["image"].as_str().unwrap().to_owned();
    let image_bytes = std::fs::read(&image_path).unwrap();

    env.apply_vm(
        "web",
        json!({"resources": by_path["resources"], "image": tiny.0,
               "rootDisk": {"size": "1Gi", "storageClassName": pool.name}}),
    );
    env.wait_vm_phase("web", "Running").await;

    // The claim the controller made, owned by the VM, bound to a qcow2
    // volume in the pool that the domain boots, pinned on the image.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let claim = claims.get("web-root").await.unwrap();
    assert_eq!(claim.owner_references().first().map(|o| o.name.as_str()), Some("web"));
    let volume = format!("{}_web-root_{}.qcow2", env.ns, claim.uid().unwrap());
    assert_eq!(pool.volumes(), vec![volume.clone()]);
    let (ok, xml) = virsh(&["dumpxml", &format!("{}_web", env.ns)]);
    assert!(ok, "{xml}");
    let volume_path = format!("{}/{volume}", storage_root(&env).join("pool").display());
    let boot = format!("<driver name='qemu' type='qcow2'/>\n      <source file='{volume_path}' index=");
    assert!(xml.contains(&boot), "{boot} in {xml}");
    assert!(xml.contains(&format!("<source file='{image_path}'/>")), "the image is the pinned base: {xml}");

    // The guest's root disk: the root disk's size, its writes kept.
    let pod = env.pod_of("web").await;
    assert_eq!(env.exec_stdout(&pod, "cat /sys/block/vda/size").await, (1u64 << 30 >> 9).to_string());
    let mark = format!("root-{}", env.ns);
    let write = format!("printf '%s\\n' {mark} | dd of=/dev/vda bs=512 count=1 conv=sync,fsync 2>/dev/null && echo ok");
    assert_eq!(env.exec_stdout(&pod, &write).await, "ok");
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    assert_eq!(env.exec_stdout(&pod, "dd if=/dev/vda bs=512 count=1 2>/dev/null | head -n 1").await, mark);
    assert!(std::fs::read(&image_path).unwrap() == image_bytes, "the image is never written");

    // Deleting the VM deletes its claim, and with it the volume.
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true"]);
    env.wait_for("the root disk's claim and volume to be gone", || {
        let claims = claims.clone();
        let pool = &pool;
        async move { (claims.get_opt("web-root").await.ok()?.is_none() && pool.volumes().is_empty()).then_some(()) }
    })
    .await;
    drop(env);
}

/// The note of the first Event of `reason` about object `name`, once there is one.
async fn wait_event(env: &TestEnv, name: &str, reason: &str) -> String {
    let selector = format!("involvedObject.name={name},reason={reason}");
    env.wait_for(&format!("a {reason} Event on {name}"), || {
        let out =
            env.kubectl_output(&["get", "events", "--field-selector", &selector, "-o", "jsonpath={.items[0].message}"]);
        let note = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        async move { (out.status.success() && !note.is_empty()).then_some(note) }
    })
    .await
}

/// A root disk of a class with `fromImage: copy` is a full, raw copy of
/// its image (no backing chain in the domain); raising `spec.rootDisk.size`
/// grows the running guest's disk, lowering it is refused with an Event;
/// a root disk smaller than its image gets no volume, and its claim's
/// Event names both sizes.
#[tokio::test]
async fn a_root_disk_copied_from_its_image_grows_with_its_size_and_is_never_smaller_than_it() {
    let (env, guest) = untrusted_env("rootcopy").await;
    let pool = Pool::new(&env);
    pool.class(&env, json!({"format": "raw", "fromImage": "copy"}), true);
    let (tiny, by_path) = tiny_image(&env, &guest);
    let image_path = by_path["image"].as_str().unwrap().to_owned();
    let spec = |size: &str| {
        json!({"resources": by_path["resources"], "image": tiny.0,
               "rootDisk": {"size": size, "storageClassName": pool.name}})
    };

    // The image's disk is 64 MiB: 32 MiB is refused, and nothing is made.
    env.apply_vm("small", spec("32Mi"));
    let note = wait_event(&env, "small-root", "ProvisioningFailed").await;
    assert!(
        note.contains(&format!("{} bytes is less than its image {image_path}'s disk of {} bytes", 32 << 20, 64 << 20)),
        "{note}"
    );
    assert_eq!(pool.volumes_of("small-root"), Vec::<String>::new());
    env.kubectl(&["delete", "virtualmachine/small", "--wait=true"]);

    env.apply_vm("web", spec("128Mi"));
    env.wait_vm_phase("web", "Running").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let uid = claims.get("web-root").await.unwrap().uid().unwrap();
    let volume = format!("{}_web-root_{uid}", env.ns);
    assert_eq!(pool.volumes_of("web-root"), vec![volume.clone()], "raw: no .qcow2 in its name");
    let volume_path = format!("{}/{volume}", Pool::dir(&env).display());
    let (ok, xml) = virsh(&["dumpxml", &format!("{}_web", env.ns)]);
    assert!(ok, "{xml}");
    let boot = format!("<driver name='qemu' type='raw'/>\n      <source file='{volume_path}' index=");
    assert!(xml.contains(&boot), "{boot} in {xml}");
    assert!(!xml.contains(&image_path) && !xml.contains("<backingStore type='file'"), "a copy has no chain: {xml}");
    let compared = output_within(
        Command::new("qemu-img").args(["compare", "-U", "-q", "-f", "qcow2", "-F", "raw", &image_path, &volume_path]),
        std::time::Duration::from_secs(60),
    );
    assert!(compared.status.success(), "the volume holds the image: {}", String::from_utf8_lossy(&compared.stderr));
    let pod = env.pod_of("web").await;
    assert_eq!(env.exec_stdout(&pod, "cat /sys/block/vda/size").await, (128u64 << 20 >> 9).to_string());

    // Raised: the running guest's disk grows; lowered: an Event, no change.
    env.apply_vm("web", spec("256Mi"));
    env.wait_for("the guest to see a 256 MiB root disk", || {
        let out = env.kubectl_output(&["exec", &pod, "--", "cat", "/sys/block/vda/size"]);
        let sectors = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        async move { (sectors == (256u64 << 20 >> 9).to_string()).then_some(()) }
    })
    .await;
    env.apply_vm("web", spec("64Mi"));
    let note = wait_event(&env, "web", "InvalidSpec").await;
    assert!(
        note.starts_with("spec.rootDisk.size 64Mi is less than claim web-root's 256Mi: a root disk never shrinks"),
        "{note}"
    );
    assert_eq!(std::fs::metadata(&volume_path).unwrap().len(), 256 << 20);

    env.kubectl(&["delete", "virtualmachine/web", "--wait=true"]);
    env.wait_for("the root disk's volume to be gone", || {
        let pool = &pool;
        async move { pool.volumes().is_empty().then_some(()) }
    })
    .await;
    drop(env);
}

/// A tenant's VM on a root disk is backed up, and restored as a new VM
/// whose root disk is a claim of its own that vmlet's provisioner fills
/// from the backup (an independent copy, no host file named): it runs in
/// the untrusted namespace, holds what the guest wrote before the backup
/// and not after, and goes with its VM. A claim naming a backup whose
/// `status.location` was pointed at another file gets nothing.
#[tokio::test]
async fn a_tenants_vm_is_restored_from_its_backup_onto_a_root_disk_claim_of_its_own() {
    let (env, guest) = untrusted_env("rootrestore").await;
    let node = env.node("q");
    let pool = Pool::new(&env);
    let (tiny, by_path) = tiny_image(&env, &guest);
    env.apply_vm("web", tiny_vm(&env, &pool, &tiny.0, &by_path, json!([])));
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let before = format!("before-{}", env.ns);
    write_marker(&env, &pod, &before).await;

    let backup = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineBackup",
        "metadata": {"name": "nightly", "namespace": env.ns}, "spec": {"virtualMachine": "web"}});
    assert!(env.apply(&backup.to_string()).status.success());
    let backed_up = wait_backup_ended(&env, "nightly").await.status.unwrap();
    assert_eq!(backed_up.phase, Some(OperationPhase::Succeeded), "{:?}", backed_up.message);
    assert_eq!(backed_up.total_bytes, Some(128 << 20), "the root disk is 128 MiB");
    write_marker(&env, &pod, &format!("after-{}", env.ns)).await;

    let restore = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "back", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web-restored"}}});
    assert!(env.apply(&restore.to_string()).status.success());
    let ended = wait_restore_ended(&env, "back").await;
    assert_eq!(ended.phase, Some(OperationPhase::Succeeded), "{:?}", ended.message);
    assert!(ended.message.unwrap().contains("claim web-restored-root filled from VirtualMachineBackup nightly"));
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(env.client.clone(), &env.ns);
    assert!(jobs.get_opt("back-restore").await.unwrap().is_none(), "the provisioner makes the disk: no Job");

    // The new VM boots its own claim's volume: a copy with no backing
    // file, in the pool, holding what was written before the backup.
    let vm = env.wait_vm_phase("web-restored", "Running").await;
    assert_eq!(vm.status.unwrap().node_name.as_deref(), Some(node.as_str()));
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let claim = claims.get("web-restored-root").await.unwrap();
    assert_eq!(claim.owner_references().first().map(|o| o.name.as_str()), Some("web-restored"));
    assert_eq!(claim.labels().get("vmlet.io/restored-from").map(String::as_str), Some("nightly"));
    let volume = format!("{}_web-restored-root_{}.qcow2", env.ns, claim.uid().unwrap());
    assert_eq!(pool.volumes_of("web-restored-root"), vec![volume.clone()]);
    let volume_path = format!("{}/{volume}", Pool::dir(&env).display());
    let info = output_within(
        Command::new("qemu-img").args(["info", "-U", "--output=json", "-f", "qcow2", &volume_path]),
        std::time::Duration::from_secs(60),
    );
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img info");
    assert_eq!(info["backing-filename"], serde_json::Value::Null, "independent of the backup: {info}");
    assert_eq!(info["virtual-size"], json!(128 << 20));
    let (ok, xml) = virsh(&["dumpxml", &format!("{}_web-restored", env.ns)]);
    assert!(ok, "{xml}");
    assert!(xml.contains(&format!("<source file='{volume_path}' index=")), "{xml}");
    assert!(!xml.contains("backups/"), "the backup file is not the VM's disk: {xml}");
    let restored_pod = env.pod_of("web-restored").await;
    assert_eq!(read_marker(&env, &restored_pod).await, before);

    // A status.location pointed at another file (here web's own root
    // volume): a claim filled from that backup gets nothing.
    let backups: Api<VirtualMachineBackup> = Api::namespaced(env.client.clone(), &env.ns);
    let web_uid = claims.get("web-root").await.unwrap().uid().unwrap();
    let elsewhere = format!("{}/{}_web-root_{web_uid}.qcow2", Pool::dir(&env).display(), env.ns);
    let forged = json!({"status": {"location": elsewhere}});
    backups.patch_status("nightly", &PatchParams::default(), &Patch::Merge(&forged)).await.unwrap();
    let grab: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "grab", "annotations": {"volume.kubernetes.io/selected-node": node}},
        "spec": {"storageClassName": format!("{}-root", pool.name), "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "128Mi"}},
            "dataSourceRef": {"apiGroup": "vmlet.io", "kind": "VirtualMachineBackup", "name": "nightly"}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &grab).await.unwrap();
    let note = wait_event(&env, "grab", "ProvisioningFailed").await;
    assert!(note.contains("is not its file") && note.contains(&elsewhere), "{note}");
    assert_eq!(pool.volumes_of("grab"), Vec::<String>::new());
    claims.delete("grab", &DeleteParams::default()).await.unwrap();

    // Deleting the restored VM deletes its claim and volume.
    env.kubectl(&["delete", "virtualmachine/web-restored", "--wait=true"]);
    env.wait_for("the restored root disk's claim and volume to be gone", || {
        let claims = claims.clone();
        let pool = &pool;
        async move {
            let gone = claims.get_opt("web-restored-root").await.ok()?.is_none();
            (gone && pool.volumes_of("web-restored-root").is_empty()).then_some(())
        }
    })
    .await;
    drop(env);
}

/// A tenant's VM with a 1 GiB data claim is backed up with its data disk at
/// the same point in time (a file per disk beside the boot disk's,
/// `status.dataDisks` with the claim, its class and real sizes) and restored
/// as a new VM whose data disk is a claim of its own (`<vm>-disk-<disk>`),
/// filled from that disk's copy: its guest reads on its data disk what was
/// written there before the backup, not after. A claim whose
/// `vmlet.io/backup-disk` names no disk of the backup, or no disk name at
/// all, gets nothing.
#[tokio::test]
async fn a_vm_with_a_data_claim_is_backed_up_with_it_and_restored_onto_claims_of_its_own() {
    let (env, guest) = untrusted_env("datarestore").await;
    let node = env.node("q");
    let pool = pool_and_class(&env, "raw", false);
    let (tiny, by_path) = tiny_image(&env, &guest);
    pool.claim(&env, "data", "1Gi").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), &env.ns);
    let disks = json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]);
    env.apply_vm("web", tiny_vm(&env, &pool, &tiny.0, &by_path, disks));
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let write_data = |marker: String| {
        format!(
            "dev=$({}) && printf '%s\\n' {marker} | dd of=/dev/$dev bs=512 count=1 conv=sync,fsync 2>/dev/null && \
             echo ok",
            device_named("data")
        )
    };
    let read_data = format!("dd if=/dev/$({}) bs=512 count=1 2>/dev/null | head -n 1", device_named("data"));
    let before = format!("data-before-{}", env.ns);
    assert_eq!(env.exec_stdout(&pod, &write_data(before.clone())).await, "ok");

    let backup = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineBackup",
        "metadata": {"name": "nightly", "namespace": env.ns}, "spec": {"virtualMachine": "web"}});
    assert!(env.apply(&backup.to_string()).status.success());
    let backed_up = wait_backup_ended(&env, "nightly").await;
    let uid = backed_up.uid().unwrap();
    let status = backed_up.status.unwrap();
    assert_eq!(status.phase, Some(OperationPhase::Succeeded), "{:?}", status.message);
    let backups_dir = storage_root(&env).join("backups");
    let boot_file = format!("{}/{}_nightly_{uid}.qcow2", backups_dir.display(), env.ns);
    let data_file = format!("{}/{}_nightly_{uid}.data.qcow2", backups_dir.display(), env.ns);
    assert_eq!(status.location.as_deref(), Some(boot_file.as_str()));
    assert_eq!(status.data_disks.len(), 1, "{:?}", status.data_disks);
    let copy = &status.data_disks[0];
    assert_eq!(
        (copy.name.as_str(), copy.claim_name.as_deref(), copy.storage_class_name.as_deref(), copy.location.as_str()),
        ("data", Some("data"), Some(pool.name.as_str()), data_file.as_str())
    );
    assert_eq!(copy.virtual_bytes, Some(1 << 30), "the claim's 1 GiB");
    let on_disk = std::fs::metadata(&data_file).expect("the data disk's file").len();
    assert!(copy.file_bytes.is_some_and(|bytes| bytes > 0), "{copy:?}");
    assert_eq!(copy.file_bytes, Some(on_disk as i64));
    assert_eq!(status.total_bytes, Some((128 << 20) + (1 << 30)), "both disks' virtual sizes");
    let message = status.message.unwrap_or_default();
    assert!(message.contains(&format!("data disk data in {data_file}")), "{message}");
    assert_eq!(env.exec_stdout(&pod, &write_data(format!("data-after-{}", env.ns))).await, "ok");

    let restore = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineRestore",
        "metadata": {"name": "back", "namespace": env.ns},
        "spec": {"source": {"backup": "nightly"}, "target": {"virtualMachine": "web-restored"}}});
    assert!(env.apply(&restore.to_string()).status.success());
    let ended = wait_restore_ended(&env, "back").await;
    assert_eq!(ended.phase, Some(OperationPhase::Succeeded), "{:?}", ended.message);
    let message = ended.message.unwrap_or_default();
    assert!(message.contains("data disk claim web-restored-disk-data"), "{message}");
    assert_eq!(ended.data_disks.len(), 1);
    assert_eq!(ended.data_disks[0].claim_name.as_deref(), Some("web-restored-disk-data"));

    // The new VM's data disk is a claim of its own, in the original's
    // class, filled from the data disk's copy: a raw volume of its own.
    let vm = env.wait_vm_phase("web-restored", "Running").await;
    assert_eq!(vm.status.as_ref().unwrap().node_name.as_deref(), Some(node.as_str()));
    assert_eq!(
        serde_json::to_value(&vm.spec.disks).unwrap(),
        json!([{"name": "data", "persistentVolumeClaim": {"claimName": "web-restored-disk-data"}}])
    );
    let restored = claims.get("web-restored-disk-data").await.unwrap();
    assert_eq!(restored.annotations().get("vmlet.io/backup-disk").map(String::as_str), Some("data"));
    assert_eq!(restored.spec.as_ref().unwrap().storage_class_name.as_deref(), Some(pool.name.as_str()));
    let volume = format!("{}_web-restored-disk-data_{}", env.ns, restored.uid().unwrap());
    assert_eq!(pool.volumes_of("web-restored-disk-data"), vec![volume]);
    let restored_pod = env.pod_of("web-restored").await;
    let size = format!("cat /sys/block/$({})/size", device_named("data"));
    assert_eq!(env.exec_stdout(&restored_pod, &size).await, (1u64 << 30 >> 9).to_string(), "1 GiB");
    assert_eq!(env.exec_stdout(&restored_pod, &read_data).await, before, "what the data disk held at the backup");
    assert_eq!(env.exec_stdout(&pod, &read_data).await, format!("data-after-{}", env.ns), "the original is its own");

    // The annotation reaches only disks the backup holds, by vmlet's name.
    for (claim_name, disk, refusal) in
        [("grab-logs", "logs", "holds no data disk \"logs\""), ("grab-up", "../data", "is no data disk's name")]
    {
        let grab: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": claim_name, "annotations": {"volume.kubernetes.io/selected-node": node,
                                                             "vmlet.io/backup-disk": disk}},
            "spec": {"storageClassName": pool.name, "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
                "dataSourceRef": {"apiGroup": "vmlet.io", "kind": "VirtualMachineBackup", "name": "nightly"}},
        }))
        .unwrap();
        claims.create(&PostParams::default(), &grab).await.unwrap();
        let note = wait_event(&env, claim_name, "ProvisioningFailed").await;
        assert!(note.contains(refusal), "{note}");
        assert_eq!(pool.volumes_of(claim_name), Vec::<String>::new());
        claims.delete(claim_name, &DeleteParams::default()).await.unwrap();
    }
    drop(env);
}
