//! The VMs vmlet owns and their power operations against the real vSphere
//! API server of `hack/vsphere.sh` (see tests/common): of its VMs only
//! DC0_C0_RP0_VM1 carries `vmlet.io.uid`.

mod common;

use std::time::Duration;

use vmlet_provider::ErrorKind;
use vmlet_vsphere::{list_hosts, list_vms, power_off, power_on, MoRef, PowerState, Session, Vm};

const TASK_DEADLINE: Duration = Duration::from_secs(30);

async fn owned_vm(session: &Session) -> Vm {
    let vms = list_vms(session).await.expect("list VMs");
    assert_eq!(vms.len(), 1, "only the VM carrying vmlet.io.uid: {vms:?}");
    vms.into_iter().next().unwrap()
}

#[tokio::test]
async fn only_the_vm_carrying_a_uid_is_listed_with_its_host() {
    let Some(harness) = common::harness("only_the_vm_carrying_a_uid_is_listed_with_its_host") else { return };
    let session = Session::connect(harness.config()).await.expect("connect");
    let vm = owned_vm(&session).await;
    assert_eq!((vm.uid.as_str(), vm.name.as_str()), (harness.owned_uid.as_str(), "DC0_C0_RP0_VM1"));
    let cluster_hosts: Vec<MoRef> = list_hosts(&session)
        .await
        .expect("list hosts")
        .into_iter()
        .filter(|h| h.cluster.as_deref() == Some("DC0_C0"))
        .map(|h| h.moref)
        .collect();
    let host = vm.host.expect("runtime.host");
    assert!(cluster_hosts.contains(&host), "{host} is not a host of DC0_C0: {cluster_hosts:?}");
}

#[tokio::test]
async fn power_off_and_on_reach_the_state_and_repeating_them_is_success() {
    let Some(harness) = common::harness("power_off_and_on_reach_the_state_and_repeating_them_is_success") else {
        return;
    };
    let session = Session::connect(harness.config()).await.expect("connect");
    let vm = owned_vm(&session).await.moref;
    for _ in 0..2 {
        power_off(&session, &vm, TASK_DEADLINE).await.expect("power off");
        assert_eq!(owned_vm(&session).await.power_state, PowerState::PoweredOff);
    }
    for _ in 0..2 {
        power_on(&session, &vm, TASK_DEADLINE).await.expect("power on");
        assert_eq!(owned_vm(&session).await.power_state, PowerState::PoweredOn);
    }
}

#[tokio::test]
async fn powering_on_a_vm_that_does_not_exist_is_not_found_with_vsphere_s_message() {
    let Some(harness) = common::harness("powering_on_a_vm_that_does_not_exist_is_not_found_with_vsphere_s_message")
    else {
        return;
    };
    let session = Session::connect(harness.config()).await.expect("connect");
    let missing = MoRef::new("VirtualMachine", "vm-999999");
    let error = power_on(&session, &missing, TASK_DEADLINE).await.expect_err("a missing VM powered on");
    assert_eq!((error.fault(), error.kind()), (Some("ManagedObjectNotFound"), ErrorKind::NotFound), "{error}");
    assert!(error.to_string().contains("vm-999999"), "{error}");
}
