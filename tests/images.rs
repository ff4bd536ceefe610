//! The image catalogue and trusted namespaces, through the real API server
//! and a real QEMU guest on libvirtd.
//!
//! vmlet does not trust the test's namespace here (`trustedNamespaces` of
//! its config leaves it out): a VM of it that names a host file itself
//! (`spec.image` as a path, `spec.kernelBoot`, a host image) is refused
//! with nothing defined, whoever creates it, the tenant's own credentials
//! included; the tenant cannot write the catalogue; a VM that names a
//! `VirtualMachineImage` that does not exist yet waits; once an
//! administrator creates it, booting the image's shared file itself is
//! refused, and a VM with its own root disk made from it boots the entry's
//! disk and kernel.

mod common;

use common::deadline::{output_within, VIRSH};
use common::{guest_accelerator, guest_for, guest_vm_spec, qemu_uri, Host, TestEnv};
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;
use std::process::Command;

/// Whether libvirtd has a domain named `name`.
fn domain_exists(name: &str) -> bool {
    output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(["dominfo", name]), VIRSH).status.success()
}

fn images_api(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("vmlet.io", "v1alpha1", "VirtualMachineImage");
    Api::all_with(client, &ApiResource::from_gvk(&gvk))
}

#[tokio::test]
async fn an_untrusted_namespace_names_no_host_file_and_boots_catalogue_images_by_name() {
    let mut env = TestEnv::new("images").await;
    env.untrusted = true;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.wait_node_ready(&env.node("q")).await;
    let by_hand = guest_vm_spec(&guest);

    // A tenant of the namespace, with its own credentials: it may manage
    // VirtualMachines, and creates one that names host files itself.
    let rules = json!([{"apiGroups": ["vmlet.io"], "resources": ["virtualmachines"], "verbs": ["*"]}]);
    let ns = env.ns.clone();
    let tenant = common::tenant::tenant(&env, &ns, rules).await;
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "metadata": {"name": "byhand"},
        "spec": by_hand,
    }))
    .unwrap();
    let gvk = GroupVersionKind::gvk("vmlet.io", "v1alpha1", "VirtualMachine");
    let tenant_vms: Api<DynamicObject> = Api::namespaced_with(tenant.client.clone(), &ns, &ApiResource::from_gvk(&gvk));
    tenant_vms.create(&PostParams::default(), &vm).await.expect("the tenant may create VirtualMachines");
    let message = env.wait_waiting("byhand", "StorageNotAllowed").await;
    assert!(
        message.starts_with(&format!(
            "spec.image {:?} names a file of host {}",
            by_hand["image"].as_str().unwrap(),
            env.node("q")
        )),
        "{message}"
    );
    assert!(
        message.contains(&format!("namespace {ns} is not one of them")) && message.contains("trustedNamespaces"),
        "{message}"
    );
    // Without the image, the kernel is the host file it names.
    let mut kernel_only = by_hand.clone();
    kernel_only.as_object_mut().unwrap().remove("image");
    env.apply_vm("kernel", kernel_only);
    let message = env.wait_waiting("kernel", "StorageNotAllowed").await;
    assert!(message.starts_with("spec.kernelBoot.kernel "), "{message}");

    // The tenant cannot write the catalogue.
    let name = format!("guest-{ns}");
    let entry: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachineImage", "metadata": {"name": name},
        "spec": {"libvirt": {"path": by_hand["image"], "kernelBoot": by_hand["kernelBoot"]}},
    }))
    .unwrap();
    let refused = images_api(tenant.client.clone()).create(&PostParams::default(), &entry).await;
    assert!(matches!(&refused, Err(kube::Error::Api(e)) if e.code == 403), "{refused:?}");

    // A VM naming an entry that does not exist yet waits for it.
    env.apply_vm("web", json!({"resources": {"cpu": 1, "memory": "256Mi"}, "image": name}));
    let message = env.wait_waiting("web", "ImageNotFound").await;
    assert!(message.starts_with(&format!("spec.image {name:?}: no VirtualMachineImage of that name")), "{message}");
    let domain = format!("{ns}_web");
    assert!(
        !domain_exists(&domain) && !domain_exists(&format!("{ns}_byhand")) && !domain_exists(&format!("{ns}_kernel"))
    );

    // The administrator adds it. Booting the image's file itself would make
    // the file every VM of the image shares this VM's writable disk: refused,
    // naming the fix, nothing defined and the image untouched.
    let image_path = by_hand["image"].as_str().unwrap().to_owned();
    let image_bytes = std::fs::read(&image_path).unwrap();
    let _entry = common::CatalogueImage::create(&env, &name, entry.data["spec"].clone());
    let message = env.wait_waiting("web", "StorageNotAllowed").await;
    assert!(message.starts_with(&format!("spec.image {name:?} is a catalogue image, and booting it")), "{message}");
    assert!(message.contains(&format!("namespace {ns} is not one of them")) && message.contains("spec.rootDisk"));
    assert!(!domain_exists(&domain));

    // With a root disk of its own, made from the image, the VM boots the
    // entry's disk (as the pinned base of its volume) and kernel.
    let pool = common::pool::Pool::new(&env);
    pool.class(&env, json!({"format": "qcow2"}), false);
    env.apply_vm(
        "own",
        json!({"resources": {"cpu": 1, "memory": "256Mi"}, "image": name,
               "rootDisk": {"size": "1Gi", "storageClassName": pool.name}}),
    );
    env.wait_vm_phase("own", "Running").await;
    let pod = env.pod_of("own").await;
    assert_eq!(env.exec_stdout(&pod, "echo up").await, "up");
    let xml =
        output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(["dumpxml", &format!("{ns}_own")]), VIRSH);
    let xml = String::from_utf8_lossy(&xml.stdout);
    assert!(xml.contains(&format!("<source file='{image_path}'/>")), "the image is the volume's base: {xml}");
    assert!(xml.contains(&format!("<kernel>{}</kernel>", by_hand["kernelBoot"]["kernel"].as_str().unwrap())), "{xml}");
    assert!(
        !domain_exists(&format!("{ns}_byhand")) && !domain_exists(&domain),
        "the refused VMs are still not defined"
    );
    env.kubectl(&["delete", "virtualmachine/own", "--wait=true"]);
    assert!(std::fs::read(&image_path).unwrap() == image_bytes, "the image is never written");
    drop(env);
    drop(pool);
}

/// The API server refuses a VM whose root disk has no catalogue image, or
/// that attaches a claim twice (its root claim as a data disk too, or one
/// claim in two disks), naming the field: QEMU would take the file's write
/// lock once and fail every start.
#[tokio::test]
async fn the_api_server_refuses_a_root_disk_without_an_image_and_a_claim_attached_twice() {
    let env = TestEnv::new("rootrules").await;
    let vm = |spec: serde_json::Value| -> DynamicObject {
        serde_json::from_value(json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
                                       "metadata": {"name": "web"}, "spec": spec}))
        .unwrap()
    };
    let gvk = GroupVersionKind::gvk("vmlet.io", "v1alpha1", "VirtualMachine");
    let vms: Api<DynamicObject> = Api::namespaced_with(env.client.clone(), &env.ns, &ApiResource::from_gvk(&gvk));
    let refused = |spec: serde_json::Value| {
        let vms = vms.clone();
        async move {
            match vms.create(&PostParams::default(), &vm(spec)).await {
                Err(kube::Error::Api(e)) if e.code == 422 => e.message,
                other => panic!("expected 422, got {other:?}"),
            }
        }
    };
    let message = refused(json!({"image": "/var/lib/libvirt/images/x.qcow2", "rootDisk": {"size": "1Gi"}})).await;
    assert!(message.contains("spec.rootDisk is made from a VirtualMachineImage"), "{message}");
    let message = refused(json!({"image": "tiny", "rootDisk": {"size": "1Gi"},
        "disks": [{"name": "again", "persistentVolumeClaim": {"claimName": "web-root"}}]}))
    .await;
    assert!(message.contains("names <vm>-root, the root disk's claim"), "{message}");
    let message = refused(json!({"disks": [{"name": "a", "persistentVolumeClaim": {"claimName": "data"}},
                                           {"name": "b", "persistentVolumeClaim": {"claimName": "data"}}]}))
    .await;
    assert!(message.contains("claimName must be unique"), "{message}");
    drop(env);
}
