//! cloud-init: a VM's `spec.cloudInit` from a Secret reaches the real test
//! guest as a NoCloud seed, through the real API server, vmlet and libvirtd.
//! The test guest is a minimal NoCloud consumer (test-vms/guest/build.sh):
//! it takes `local-hostname` from the seed's meta-data and runs a `#!`
//! user-data script once.

mod common;

use common::deadline::{output_within, VIRSH};
use common::{guest_accelerator, guest_for, guest_vm_spec, qemu_uri, Host, TestEnv};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::json;
use std::process::Command;

fn exec_stdout(env: &TestEnv, pod: &str, script: &str) -> Option<String> {
    let out = env.kubectl_output(&["exec", pod, "--", "sh", "-c", script]);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn secret(name: &str, user_data: &str) -> Secret {
    serde_json::from_value(json!({"metadata": {"name": name}, "stringData": {"user-data": user_data}})).unwrap()
}

#[tokio::test]
async fn user_data_from_a_secret_configures_the_guest_and_a_missing_secret_defines_nothing() {
    let mut env = TestEnv::new("cloudinit").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    // A value that must never show up in vmlet's log.
    let token = format!("s3cret-{}", env.ns);
    let script = format!("#!/bin/sh\necho \"ran {token}\" > /run/cloud-init-ran\n");
    secrets.create(&PostParams::default(), &secret("web-init", &script)).await.expect("create the Secret");

    // vmlet reads no namespace's Secrets until an administrator binds the
    // cloud-init reader role there: the pod waits naming the command,
    // nothing is defined.
    let vmlet = "system:serviceaccount:kube-system:vmlet";
    let may_read = |ns: &str| env.kubectl_output(&["auth", "can-i", "get", "secrets", "-n", ns, "--as", vmlet]);
    assert_eq!(String::from_utf8_lossy(&may_read(&env.ns).stdout).trim(), "no", "before the binding");
    let mut spec = guest_vm_spec(&guest);
    spec["cloudInit"] = json!({"userData": {"secretKeyRef": {"name": "web-init", "key": "user-data"}},
        "hostname": "seeded-web"});
    env.apply_vm("web", spec.clone());
    let message = wait_cloud_init_waiting(&env, "web", "CloudInitDataForbidden").await;
    assert!(
        message.contains("spec.cloudInit.userData")
            && message.contains(&format!("kubectl create rolebinding vmlet-cloud-init -n {}", env.ns)),
        "{message}"
    );
    assert!(!domain_defined(&env, "web"), "a VM whose cloud-init data vmlet may not read must not be defined");
    env.kubectl(&[
        "create",
        "rolebinding",
        "vmlet-cloud-init",
        "--clusterrole=vmlet-cloud-init",
        "--serviceaccount=kube-system:vmlet",
    ]);
    assert_eq!(String::from_utf8_lossy(&may_read(&env.ns).stdout).trim(), "yes", "after the binding");
    assert_eq!(String::from_utf8_lossy(&may_read("default").stdout).trim(), "no", "in a namespace not bound");
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let hostname = env
        .wait_for("the guest to answer hostname", || {
            let out = exec_stdout(&env, &pod, "hostname");
            async move { out }
        })
        .await;
    assert_eq!(hostname, "seeded-web", "the hostname comes from the seed's meta-data");
    let ran = env
        .wait_for("the user-data script's file", || {
            let out = exec_stdout(&env, &pod, "cat /run/cloud-init-ran");
            async move { out }
        })
        .await;
    assert_eq!(ran, format!("ran {token}"));

    // A Secret that does not exist: the pod waits naming the field, nothing
    // is defined; once the Secret exists, the VM is defined and runs.
    let mut missing = spec;
    // Its own VM, without the first one's disk (QEMU locks a disk in use).
    missing.as_object_mut().unwrap().remove("image");
    missing["cloudInit"] = json!({"userData": {"secretKeyRef": {"name": "later-init", "key": "user-data"}}});
    env.apply_vm("later", missing);
    let message = wait_cloud_init_waiting(&env, "later", "CloudInitDataNotFound").await;
    assert!(message.contains("spec.cloudInit.userData") && message.contains("later-init"), "{message}");
    assert!(!domain_defined(&env, "later"), "a VM whose cloud-init data is missing must not be defined");
    secrets.create(&PostParams::default(), &secret("later-init", "#!/bin/sh\ntrue\n")).await.unwrap();
    env.wait_vm_phase("later", "Running").await;

    let log = std::fs::read_to_string(env.dir.join("vmlet.log")).expect("vmlet's log");
    assert!(log.contains("cloud-init seed written"), "the log is the one of this run");
    assert!(!log.contains(&token), "user data reached vmlet's log");
    let events = env.kubectl(&["get", "events", "-o", "yaml"]);
    assert!(!events.contains(&token), "user data reached an Event");
}

/// The waiting message of VM `vm`'s pod once its reason is `reason`.
async fn wait_cloud_init_waiting(env: &TestEnv, vm: &str, reason: &str) -> String {
    let pod = env.pod_of(vm).await;
    let pods = env.pods();
    env.wait_for(&format!("pod {pod} to wait with reason {reason}"), || {
        let (pods, pod) = (pods.clone(), pod.clone());
        async move {
            let status = pods.get(&pod).await.ok()?.status?;
            let waiting = status.container_statuses?.first()?.state.clone()?.waiting?;
            (waiting.reason.as_deref() == Some(reason)).then(|| waiting.message.unwrap_or_default())
        }
    })
    .await
}

/// Whether libvirt knows VM `vm`'s domain.
fn domain_defined(env: &TestEnv, vm: &str) -> bool {
    let domain = format!("{}_{vm}", env.ns);
    output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(["domstate", &domain]), VIRSH).status.success()
}
