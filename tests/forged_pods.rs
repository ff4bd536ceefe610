//! A tenant's own pod for its VM, bound to a host of its choosing, through
//! the real API server with the tenant's own credentials.
//!
//! The hole this closes: a tenant that watches its VirtualMachine can make
//! a pod of the name the controller wrote in `status.podName`, owned by the
//! VM, with `spec.nodeName` set, before the controller's own create; the
//! scheduler, the VM's `nodeSelector` and the node's taints were then
//! bypassed. The race is made deterministic here: with the controller
//! stopped, the test writes `status.podName` as the controller would, and
//! the tenant makes that pod bound to the host the VM's selector excludes.
//! That host's agent rejects it (Failed, `NodeAffinity`) and defines
//! nothing; the controller, back, replaces it and the VM runs on the host
//! it asked for.

mod common;

use common::{test_driver_uri, Host, TestEnv};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use serde_json::json;

/// The tenant's copy of `model` (a VM pod it can read) for VM `vm` of UID
/// `uid`, named `name` and bound to `node`.
fn forged_pod(model: &Pod, vm: &str, uid: &str, name: &str, node: &str) -> Pod {
    let mut forged = serde_json::to_value(model).unwrap();
    forged["metadata"] = json!({
        "name": name,
        "labels": {"vmlet.io/vm": vm},
        "annotations": model.annotations(),
        "ownerReferences": [{"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "name": vm,
                             "uid": uid, "controller": true, "blockOwnerDeletion": true}],
    });
    forged["metadata"]["annotations"]["vmlet.io/vm-uid"] = json!(uid);
    forged["spec"]["nodeName"] = json!(node);
    forged.as_object_mut().unwrap().remove("status");
    serde_json::from_value(forged).unwrap()
}

/// The tenant of the test's namespace (its own credentials: VirtualMachines
/// and pods of its namespace only), its pods, and a model VM pinned to host
/// a by `spec`, whose pod (read as the tenant) is what it copies.
async fn tenant_with_model(env: &TestEnv, spec: &serde_json::Value) -> (common::tenant::Tenant, Api<Pod>, Pod) {
    let ns = env.ns.clone();
    let rules = json!([
        {"apiGroups": ["vmlet.io"], "resources": ["virtualmachines"], "verbs": ["*"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
    ]);
    let tenant = common::tenant::tenant(env, &ns, rules).await;
    let tenant_pods: Api<Pod> = Api::namespaced(tenant.client.clone(), &ns);
    env.apply_vm("model", spec.clone());
    let model = tenant_pods.get(&env.pod_of("model").await).await.unwrap();
    (tenant, tenant_pods, model)
}

/// Hosts a and b on libvirt's test driver.
fn two_hosts() -> [Host<'static>; 2] {
    [Host::new("a", test_driver_uri("host-a.xml")), Host::new("b", test_driver_uri("host-b.xml"))]
}

/// The race as a tenant runs it: watch its VM with its own credentials and
/// make the pod named in `status.podName` (bound to b) the moment it shows.
/// Whoever wins each try, the VM runs on a, the host its selector names.
#[tokio::test]
async fn a_tenant_racing_the_controllers_create_never_places_its_vm() {
    let mut env = TestEnv::new("race").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_vmlet(&two_hosts());
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    let ns = env.ns.clone();
    let spec = json!({"nodeSelector": {"kubernetes.io/hostname": a}});
    let (tenant, tenant_pods, model) = tenant_with_model(&env, &spec).await;
    let tenant_vms: Api<kube::api::DynamicObject> = Api::namespaced_with(
        tenant.client.clone(),
        &ns,
        &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "vmlet.io",
            "v1alpha1",
            "VirtualMachine",
        )),
    );

    let mut won = 0;
    for try_ in 0..6 {
        let vm = format!("web-{try_}");
        // Watch first, then create: the first podName is seen as it is written.
        let watch = watcher(tenant_vms.clone(), watcher::Config::default().fields(&format!("metadata.name={vm}")));
        let racer = {
            let (pods, model, vm, b) = (tenant_pods.clone(), model.clone(), vm.clone(), b.clone());
            tokio::spawn(async move {
                let mut events = std::pin::pin!(watch.applied_objects());
                while let Some(Ok(object)) = events.next().await {
                    let name = object.data["status"]["podName"].as_str().map(str::to_owned);
                    if let (Some(name), Some(uid)) = (name, object.metadata.uid.clone()) {
                        return pods
                            .create(&PostParams::default(), &forged_pod(&model, &vm, &uid, &name, &b))
                            .await
                            .is_ok();
                    }
                }
                false
            })
        };
        let vm_object: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "metadata": {"name": vm}, "spec": spec,
        }))
        .unwrap();
        tenant_vms.create(&PostParams::default(), &vm_object).await.expect("the tenant may create VMs");
        if tokio::time::timeout(std::time::Duration::from_secs(60), racer).await.expect("the racer ends").unwrap() {
            won += 1;
        }
        let status = env.wait_vm_phase(&vm, "Running").await.status.unwrap();
        assert_eq!(status.node_name.as_deref(), Some(a.as_str()), "try {try_}");
        assert_eq!(status.placement.map(|p| p.node_name), Some(a.clone()), "try {try_}");
    }
    eprintln!("the tenant's pod got the claimed name first in {won} of 6 tries; the VM ran on {a} every time");
    drop(env);
}

#[tokio::test]
async fn a_tenants_own_pod_bound_to_another_host_defines_nothing_there_and_the_vm_runs_where_it_asked() {
    let mut env = TestEnv::new("forged").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_split(&two_hosts());
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    // A model VM with the same spec: its pod is what a tenant can copy.
    let spec = json!({"nodeSelector": {"kubernetes.io/hostname": a}});
    let (_tenant, tenant_pods, model) = tenant_with_model(&env, &spec).await;
    env.kill_controller();

    env.apply_vm("web", spec);
    let uid = env.vms().get("web").await.unwrap().uid().unwrap();
    // The controller's claim, as it writes it before its create.
    let claim = json!({"status": {"podName": "web-forged"}});
    env.vms().patch_status("web", &PatchParams::default(), &Patch::Merge(&claim)).await.unwrap();

    // The tenant's pod of that name: owned by the VM, carrying its labels
    // and annotations, bound to b with spec.nodeName.
    let forged = forged_pod(&model, "web", &uid, "web-forged", &b);
    tenant_pods.create(&PostParams::default(), &forged).await.expect("the tenant may create pods");

    let pods = env.pods();
    let status = env
        .wait_for("b's agent to reject the forged pod", || {
            let pods = pods.clone();
            async move {
                let status = pods.get("web-forged").await.ok()?.status?;
                (status.phase.as_deref() == Some("Failed")).then_some(status)
            }
        })
        .await;
    assert_eq!(status.reason.as_deref(), Some("NodeAffinity"), "{status:?}");
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains(&format!("node {b} does not match spec.nodeSelector kubernetes.io/hostname={a}")),
        "{message}"
    );
    let vm_status = env.vms().get("web").await.unwrap().status.unwrap_or_default();
    assert_eq!(vm_status.placement, None, "b recorded nothing");

    // The controller, back, replaces the failed pod; the scheduler binds the
    // new one to a.
    env.start_controller();
    let running = env.wait_vm_phase("web", "Running").await;
    let status = running.status.unwrap();
    assert_eq!(status.node_name.as_deref(), Some(a.as_str()));
    assert_eq!(status.placement.map(|p| p.node_name), Some(a.clone()));
    assert_ne!(status.pod_name.as_deref(), Some("web-forged"));
    drop(env);
}
