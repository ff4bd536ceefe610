//! The vSphere provider against the real vSphere API server of
//! `hack/vsphere.sh` (see tests/common), for what the conformance suite
//! does not check: where the clone lands and what it carries, the host's
//! capacity, the template boundary, and two VMs with one UID.

mod common;

use std::sync::Arc;
use std::time::Duration;

use vmlet_provider::{ErrorKind, Provider, VmSpec};
use vmlet_vsphere::{
    clone_vm, destroy_vm, list_hosts, list_templates, list_vms, CloneRequest, Hardware, Session, VCenter,
    VCenterOptions, VsphereProvider,
};

const NS: &str = "vmlet-vs-provider";

fn vcenter(h: &common::Harness) -> Arc<VCenter> {
    let options = VCenterOptions {
        datacenter: Some("DC0".into()),
        templates: vec!["template-c0".into(), "template-h0".into()],
        clone_timeout: Duration::from_secs(60),
        task_timeout: Duration::from_secs(30),
        ..VCenterOptions::default()
    };
    Arc::new(VCenter::new("vcsim", h.config(), options))
}

fn spec(name: &str, uid: &str, image: &str) -> VmSpec {
    VmSpec {
        cpus: 2,
        // Not a multiple of 4 MiB: vSphere's memoryMB must be, so 384 MiB.
        memory_bytes: (381 << 20) + 1,
        ..common::vm_spec(NS, name, uid, image)
    }
}

#[tokio::test]
async fn a_host_reports_the_simulators_cores_and_memory_and_answers_ping() {
    let Some(h) = common::harness("a_host_reports_the_simulators_cores_and_memory_and_answers_ping") else { return };
    let provider = VsphereProvider::new(vcenter(&h), "DC0_H0");
    provider.ping().await.expect("ping");
    let info = provider.host_info().await.expect("host_info");
    assert_eq!((info.cpus, info.memory_bytes, info.architecture.as_str()), (2, 4_294_430_720, "amd64"));
    assert!(info.hypervisor.starts_with("VMware"), "{}", info.hypervisor);
    let missing = VsphereProvider::new(vcenter(&h), "no-such-host").ping().await.expect_err("an unknown host");
    assert_eq!(missing.kind, ErrorKind::NotFound, "{missing}");
    assert!(missing.message.contains("no-such-host"), "{missing}");
}

#[tokio::test]
async fn a_clone_lands_on_the_standalone_host_powered_off_with_its_uid_and_size() {
    let Some(h) = common::harness("a_clone_lands_on_the_standalone_host_powered_off_with_its_uid_and_size") else {
        return;
    };
    let vcenter = vcenter(&h);
    let provider = VsphereProvider::new(vcenter.clone(), "DC0_H0");
    let uid = "00000000-0000-4000-8000-0000000000a1";
    let spec = spec("standalone", uid, "template-h0");
    let status = provider.ensure_defined(&spec).await.expect("ensure_defined");
    let session = vcenter.session().await.expect("session");
    let vms = list_vms(session).await.expect("list VMs");
    let vm = vms.iter().find(|v| v.uid == uid).expect("the clone carries vmlet.io.uid");
    let host = list_hosts(session).await.expect("hosts").into_iter().find(|h| h.name == "DC0_H0").unwrap();
    assert_eq!(vm.host.as_ref(), Some(&host.moref));
    assert_eq!(
        (vm.name.as_str(), vm.moref.value.as_str()),
        ("vmlet-vs-provider_standalone", status.backend_id.as_str())
    );
    assert_eq!((vm.cpus, vm.memory_bytes), (Some(2), Some(384 << 20)));
    assert_eq!(vm.power_state, vmlet_vsphere::PowerState::PoweredOff);
    let again = provider.ensure_defined(&spec).await.expect("ensure_defined again");
    assert_eq!(again.backend_id, status.backend_id);
    let elsewhere = VsphereProvider::new(vcenter.clone(), "DC0_C0_H0");
    let conflict = elsewhere.ensure_defined(&spec).await.expect_err("a twin on another host");
    assert_eq!(conflict.kind, ErrorKind::Conflict, "{conflict}");
    assert_eq!(list_vms(session).await.unwrap().iter().filter(|v| v.uid == uid).count(), 1);
    provider.undefine(&spec.id).await.expect("undefine");
    assert!(provider.get(&spec.id).await.expect("get").is_none());
}

#[tokio::test]
async fn a_tenant_cannot_clone_a_vm_or_template_the_config_does_not_allow() {
    let Some(h) = common::harness("a_tenant_cannot_clone_a_vm_or_template_the_config_does_not_allow") else { return };
    let provider = VsphereProvider::new(vcenter(&h), "DC0_C0_H0");
    for image in ["DC0_C0_RP0_VM1", "template-other"] {
        let error =
            provider.ensure_defined(&spec("hostile", "00000000-0000-4000-8000-0000000000a2", image)).await.unwrap_err();
        assert_eq!(error.kind, ErrorKind::InvalidInput, "{error}");
        assert!(error.message.starts_with("spec.image:"), "{error}");
        assert!(error.message.contains("allowed: [template-c0, template-h0]"), "{error}");
    }
    // Allowed by name, but not a template in vSphere: nothing to clone.
    let restricted = VCenterOptions {
        datacenter: Some("DC0".into()),
        templates: vec!["DC0_C0_RP0_VM1".into()],
        ..VCenterOptions::default()
    };
    let loose = VsphereProvider::new(Arc::new(VCenter::new("vcsim", h.config(), restricted)), "DC0_C0_H0");
    let error =
        loose.ensure_defined(&spec("not-template", "00000000-0000-4000-8000-0000000000a3", "DC0_C0_RP0_VM1")).await;
    let error = error.expect_err("a VM that is no template was cloned");
    assert_eq!(error.kind, ErrorKind::InvalidInput, "{error}");
    assert!(error.message.contains("no template named \"DC0_C0_RP0_VM1\""), "{error}");
}

#[tokio::test]
async fn two_vms_with_one_uid_stop_vmlet_from_touching_either() {
    let Some(h) = common::harness("two_vms_with_one_uid_stop_vmlet_from_touching_either") else { return };
    let vcenter = vcenter(&h);
    let provider = VsphereProvider::new(vcenter.clone(), "DC0_C0_H1");
    let uid = "00000000-0000-4000-8000-0000000000a4";
    let spec = spec("twin", uid, "template-c0");
    let first = provider.ensure_defined(&spec).await.expect("ensure_defined");
    // A copy made behind vmlet's back, carrying the same UID.
    let session: &Session = vcenter.session().await.expect("session");
    let template = list_templates(session).await.unwrap().into_iter().find(|t| t.name == "template-c0").unwrap();
    let host = list_hosts(session).await.unwrap().into_iter().find(|h| h.name == "DC0_C0_H1").unwrap();
    let request = CloneRequest {
        template: &template.moref,
        folder: template.folder.as_ref().unwrap(),
        name: "twin-copy",
        host: &host.moref,
        pool: host.resource_pool.as_ref().unwrap(),
        datastore: None,
        snapshot: None,
        uid,
        hardware: Hardware { cpus: 1, memory_mib: 128, max_cpus: 1, max_memory_mib: 128 },
        nics: &[],
    };
    let copy = clone_vm(session, &request, Duration::from_secs(30)).await.expect("clone the copy");
    let error = provider.start(&spec.id).await.expect_err("started one of two VMs with one UID");
    assert_eq!(error.kind, ErrorKind::Permanent, "{error}");
    assert!(error.message.contains(&first.backend_id) && error.message.contains(&copy.value), "{error}");
    assert!(provider.undefine(&spec.id).await.is_err(), "undefined one of two VMs with one UID");
    assert!(provider.list().await.unwrap().iter().all(|s| s.id != spec.id), "a doubled UID is listed");
    destroy_vm(session, &copy, Duration::from_secs(30)).await.expect("remove the copy");
    provider.undefine(&spec.id).await.expect("undefine once the UID is single again");
}
