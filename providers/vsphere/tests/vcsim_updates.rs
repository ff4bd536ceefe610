//! The push cache of a vCenter's VMs (`PropertyCollector` +
//! `WaitForUpdatesEx`) against the real vSphere API server of
//! `hack/vsphere.sh` (see tests/common): changes made through a second
//! session reach the cache without vmlet reading any VM
//! ([`VCenter::pushed_vms`] never does), also after the cache's session
//! was logged out behind its back.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use vmlet_vsphere::{
    clone_vm, destroy_vm, list_hosts, list_templates, list_vms, power_off, power_on, CloneRequest, Hardware,
    PowerState, Session, VCenter, VCenterOptions, Vm,
};

const TASK_DEADLINE: Duration = Duration::from_secs(30);

/// Polls the push cache (never vSphere) until `wanted` holds of the VM
/// carrying `uid` (`None`: no such VM), at most 20 s.
async fn until_pushed(vcenter: &Arc<VCenter>, uid: &str, what: &str, wanted: impl Fn(Option<&Vm>) -> bool) {
    let until = Instant::now() + Duration::from_secs(20);
    let mut last = None;
    loop {
        if let Some(vms) = vcenter.pushed_vms() {
            let vm = vms.into_iter().find(|vm| vm.uid == uid);
            if wanted(vm.as_ref()) {
                return;
            }
            last = Some(vm);
        }
        assert!(Instant::now() < until, "the push cache never showed {what}; last it held {last:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Removes the VMs an interrupted run left carrying `uid`.
async fn remove_leftovers(session: &Session, uid: &str) {
    for vm in list_vms(session).await.expect("list VMs").into_iter().filter(|vm| vm.uid == uid) {
        power_off(session, &vm.moref, TASK_DEADLINE).await.expect("power a leftover off");
        destroy_vm(session, &vm.moref, TASK_DEADLINE).await.expect("destroy a leftover");
    }
}

#[tokio::test]
async fn a_vm_cloned_powered_and_destroyed_by_another_session_is_seen_by_push() {
    let Some(h) = common::harness("a_vm_cloned_powered_and_destroyed_by_another_session_is_seen_by_push") else {
        return;
    };
    let vcenter = Arc::new(VCenter::new("vcsim", h.config(), VCenterOptions::default()));
    // The first answer lists the VM the harness made vmlet's.
    until_pushed(&vcenter, &h.owned_uid, "the harness's VM", |vm| vm.is_some()).await;

    let other = Session::connect(h.config()).await.expect("a second session");
    let uid = "00000000-0000-4000-8000-0000000000c1";
    remove_leftovers(&other, uid).await;
    let template = list_templates(&other).await.unwrap().into_iter().find(|t| t.name == "template-c0").unwrap();
    let host = list_hosts(&other).await.unwrap().into_iter().find(|h| h.name == "DC0_C0_H2").unwrap();
    let request = CloneRequest {
        template: &template.moref,
        folder: template.folder.as_ref().unwrap(),
        name: "vmlet-vs-push",
        host: &host.moref,
        pool: host.resource_pool.as_ref().unwrap(),
        datastore: None,
        snapshot: None,
        uid,
        hardware: Hardware { cpus: 1, memory_mib: 128, max_cpus: 1, max_memory_mib: 128 },
        nics: &[],
    };
    let vm = clone_vm(&other, &request, TASK_DEADLINE).await.expect("clone");
    until_pushed(&vcenter, uid, "the clone, powered off on DC0_C0_H2", |pushed| {
        pushed.is_some_and(|p| {
            p.moref == vm && p.power_state == PowerState::PoweredOff && p.host.as_ref() == Some(&host.moref)
        })
    })
    .await;

    power_on(&other, &vm, TASK_DEADLINE).await.expect("power on");
    until_pushed(&vcenter, uid, "the clone powered on", |p| p.is_some_and(|p| p.power_state == PowerState::PoweredOn))
        .await;

    // The cache's session expires (logged out); the next call through it
    // logs in again, and the follower makes a new collector and still sees
    // the next change.
    let session = vcenter.session().await.expect("session");
    session.logout().await.expect("logout");
    list_hosts(session).await.expect("hosts after a re-login");
    power_off(&other, &vm, TASK_DEADLINE).await.expect("power off");
    until_pushed(&vcenter, uid, "the clone powered off after a re-login", |p| {
        p.is_some_and(|p| p.power_state == PowerState::PoweredOff)
    })
    .await;

    destroy_vm(&other, &vm, TASK_DEADLINE).await.expect("destroy");
    until_pushed(&vcenter, uid, "the clone gone", |p| p.is_none()).await;
    until_pushed(&vcenter, &h.owned_uid, "the harness's VM still there", |vm| vm.is_some()).await;
}
