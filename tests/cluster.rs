//! The walking skeleton on the real control plane with libvirt's test driver:
//! nodes, leases, scheduling, scale, delete, API validation, and `kubectl top`
//! through a real metrics-server.

mod common;

use common::kubelet::Caller;
use common::{pod_condition, test_driver_uri, Host, TestEnv};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::collections::BTreeMap;

fn two_hosts() -> [Host<'static>; 2] {
    [Host::new("a", test_driver_uri("host-a.xml")), Host::new("b", test_driver_uri("host-b.xml"))]
}

#[tokio::test]
async fn two_hosts_register_ready_with_probed_capacity_and_renewing_leases() {
    let mut env = TestEnv::new("nodes").await;
    env.start_vmlet(&two_hosts());
    // host-a.xml: 8 cpus, 16 GiB; host-b.xml: 4 cpus, 8 GiB.
    for (i, (suffix, cpu, memory)) in [("a", "8", "16Gi"), ("b", "4", "8Gi")].into_iter().enumerate() {
        let name = env.node(suffix);
        let node = env.wait_node_ready(&name).await;
        let status = node.status.clone().unwrap();
        for field in [status.capacity.as_ref().unwrap(), status.allocatable.as_ref().unwrap()] {
            assert_eq!(field["cpu"].0, cpu, "{name} cpu");
            assert_eq!(field["memory"].0, memory, "{name} memory");
            assert_eq!(field["pods"].0, "110", "{name} pods");
        }
        let labels = node.labels();
        assert_eq!(labels["type"], "virtual-kubelet");
        assert_eq!(labels["kubernetes.io/role"], "agent");
        assert_eq!(labels["kubernetes.io/hostname"], name);
        assert_eq!(labels["vmlet.io/provider"], "libvirt");
        let taints = node.spec.as_ref().unwrap().taints.clone().unwrap();
        assert!(
            taints.iter().any(|t| t.key == "virtual-kubelet.io/provider" && t.effect == "NoSchedule"),
            "{taints:?}"
        );
        let info = status.node_info.unwrap();
        assert_eq!(info.kubelet_version, format!("vmlet/{}", env!("CARGO_PKG_VERSION")));
        let port = status.daemon_endpoints.unwrap().kubelet_endpoint.unwrap().port;
        assert_eq!(port, i32::from(env.kubelet_port_of(i)), "{name}: a listener of its own");
        let types: Vec<_> = status.conditions.unwrap().into_iter().map(|c| c.type_).collect();
        for t in ["Ready", "MemoryPressure", "DiskPressure", "PIDPressure"] {
            assert!(types.contains(&t.to_owned()), "{t} missing from {types:?}");
        }
    }

    let leases: Api<Lease> = Api::namespaced(env.client.clone(), "kube-node-lease");
    let name = env.node("a");
    let first = leases.get(&name).await.unwrap().spec.unwrap();
    assert_eq!(first.holder_identity, Some(env.identity("vmlet")), "held as the process, not the node");
    assert_eq!(first.lease_duration_seconds, Some(40));
    let first_renew = first.renew_time.unwrap().0;
    env.wait_for("the lease to be renewed", || {
        let leases = leases.clone();
        let name = name.clone();
        async move {
            let renew = leases.get(&name).await.ok()?.spec?.renew_time?.0;
            (renew > first_renew).then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn vm_is_bound_by_the_scheduler_runs_stops_starts_and_is_deleted() {
    let mut env = TestEnv::new("lifecycle").await;
    env.start_vmlet(&two_hosts());
    env.apply_vm("web", json!({"resources": {"cpu": 2, "memory": "1Gi"}}));

    let vm = env.wait_vm_phase("web", "Running").await;
    let status = vm.status.unwrap();
    let node = status.node_name.clone().unwrap();
    assert!(node == env.node("a") || node == env.node("b"), "bound to {node}");
    assert_eq!((status.replicas, status.ready_replicas), (1, 1));
    let pod_name = status.pod_name.clone().unwrap();
    assert!(pod_name.starts_with("web-") && pod_name.len() == "web-".len() + 5, "pod {pod_name}");
    assert_eq!(status.selector.as_deref(), Some("vmlet.io/vm=web"));
    let provider_id = status.provider_id.clone().unwrap();
    assert!(provider_id.starts_with("libvirt://"), "{provider_id}");

    let pod = env.pods().get(&pod_name).await.unwrap();
    assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some(node.as_str()));
    assert_eq!(pod.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
    assert_eq!(pod_condition(&pod, "Ready").unwrap().0, "True");
    assert_eq!(pod_condition(&pod, "PodScheduled").unwrap().0, "True");
    let container = &pod.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0];
    assert!(container.ready && container.started == Some(true));
    assert_eq!(container.container_id.as_deref(), Some(provider_id.as_str()));
    assert_eq!(pod.status.as_ref().unwrap().host_ip.as_deref(), Some("127.0.0.1"));
    let owner = &pod.owner_references()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("VirtualMachine", "web"));

    // The binding came from kube-scheduler, not from vmlet. The scheduler
    // writes its Scheduled event in the background, in no set order with the
    // pod's progress, so wait for the event rather than expect it by now.
    let scheduled = env
        .wait_for("the Scheduled event of the VM's pod", || {
            let reporters = env.kubectl(&[
                "get",
                "events",
                "--field-selector",
                &format!("reason=Scheduled,involvedObject.name={pod_name}"),
                "-o",
                "jsonpath={.items[*].reportingComponent}",
            ]);
            async move { (!reporters.trim().is_empty()).then_some(reporters) }
        })
        .await;
    assert!(scheduled.contains("default-scheduler"), "Scheduled event reported by {scheduled:?}");

    let table = env.kubectl(&["get", "virtualmachines"]);
    let row = table.lines().find(|l| l.starts_with("web ")).unwrap();
    assert!(row.contains("Running") && row.contains(&node), "{table}");

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    let stopped = env.wait_vm_phase("web", "Stopped").await.status.unwrap();
    assert_eq!(stopped.node_name.as_deref(), Some(node.as_str()), "a stopped VM stays on its host");
    assert_eq!((stopped.replicas, stopped.ready_replicas), (0, 0));
    assert_eq!(stopped.pod_name, None, "a stopped VM names no pod");
    // vmlet's cache of VMs holds no annotations; its status writes (claim,
    // placement, Running, Stopped by now) must leave the stored ones alone.
    let stored = env.vms().get("web").await.unwrap();
    let applied = stored.annotations().get("kubectl.kubernetes.io/last-applied-configuration");
    assert!(applied.is_some_and(|a| a.contains("\"web\"")), "kubectl's annotation kept: {:?}", stored.annotations());

    env.kubectl(&["patch", "virtualmachine/web", "--type=merge", "-p", r#"{"spec":{"powerOffMode":"Hard"}}"#]);
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    let restarted = env.wait_vm_phase("web", "Running").await.status.unwrap();
    assert_eq!(restarted.node_name.as_deref(), Some(node.as_str()), "started again on the same host");
    assert_eq!(restarted.provider_id.as_deref(), Some(provider_id.as_str()), "the same domain (UUID) runs again");
    assert_ne!(restarted.pod_name.as_deref(), Some(pod_name.as_str()), "each start has a pod of its own");

    // The stop asked the guest and saw it off: ShuttingDown, then Stopped.
    let stop_events = env
        .wait_for("the stopped pod's Stopped event", || {
            let reasons = event_reasons(&env, &pod_name);
            async move { reasons.iter().any(|r| r == "Stopped").then_some(reasons) }
        })
        .await;
    assert!(stop_events.iter().any(|r| r == "ShuttingDown"), "{stop_events:?}");
    assert!(!stop_events.iter().any(|r| r == "Destroyed"), "{stop_events:?}");

    // A delete with powerOffMode Hard (which the pod of the start above
    // carries) cuts power: one Destroyed on the pod (no Stopped to say it
    // again), Undefined on the VM.
    let last_pod = restarted.pod_name.unwrap();
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true", "--timeout=120s"]);
    assert!(env.vms().get_opt("web").await.unwrap().is_none());
    env.wait_vm_pods_gone("web").await;
    // Events are written in the background; Undefined comes last of them.
    env.wait_for("the deleted VM's Undefined event", || {
        let reasons = event_reasons(&env, "web");
        async move { reasons.iter().any(|r| r == "Undefined").then_some(()) }
    })
    .await;
    let delete_events = event_reasons(&env, &last_pod);
    assert!(delete_events.iter().any(|r| r == "Destroyed"), "{delete_events:?}");
    assert!(!delete_events.iter().any(|r| r == "Stopped" || r == "ShuttingDown"), "{delete_events:?}");
}

/// The reasons of the Events about the object named `name` in the test's
/// namespace.
fn event_reasons(env: &TestEnv, name: &str) -> Vec<String> {
    let selector = format!("involvedObject.name={name}");
    let out = env.kubectl(&[
        "get",
        "events",
        "--field-selector",
        &selector,
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}",
    ]);
    out.lines().map(str::to_owned).collect()
}

/// deploy/admission.yaml (applied with the CRDs): the API server adds the
/// finalizer as it creates a VM, beside the creator's own, with no vmlet
/// running to add it.
#[tokio::test]
async fn the_api_server_adds_the_finalizer_at_create_beside_the_creators_own() {
    let env = TestEnv::new("admit").await;
    let vms = env.vms();
    let mut attempt = 0;
    // The policy takes effect once the API server has loaded it: a VM made
    // before that lacks the finalizer, so each try is a new VM.
    let vm = env
        .wait_for("a VM created with vmlet's finalizer", || {
            attempt += 1;
            let name = format!("web-{attempt}");
            let mut vm = env.vm_object(&name, &json!({"replicas": 0}));
            vm["metadata"]["finalizers"] = json!(["example.com/keep"]);
            let vms = vms.clone();
            async move {
                let vm: vmlet::v1alpha1::VirtualMachine = serde_json::from_value(vm).unwrap();
                let created = vms.create(&PostParams::default(), &vm).await.unwrap();
                created.finalizers().iter().any(|f| f == vmlet::v1alpha1::FINALIZER).then_some(created)
            }
        })
        .await;
    assert_eq!(vm.finalizers(), ["example.com/keep", vmlet::v1alpha1::FINALIZER], "the creator's entry is kept");
    let managers: Vec<_> = vm.managed_fields().iter().filter_map(|f| f.manager.clone()).collect();
    assert!(!managers.iter().any(|m| m.contains("vmlet")), "no vmlet wrote it: {managers:?}");
}

#[tokio::test]
async fn oversized_vms_and_plain_pods_stay_off_virtual_nodes() {
    let mut env = TestEnv::new("unsched").await;
    env.start_vmlet(&two_hosts());
    // Larger than both hosts (8 and 4 cpus).
    env.apply_vm("huge", json!({"resources": {"cpu": 64, "memory": "1Gi"}}));
    let vms = env.vms();
    let message = env
        .wait_for("the scheduler's message in the VM status", || {
            let vms = vms.clone();
            async move {
                let vm = vms.get("huge").await.ok()?;
                let c = vm.status?.conditions.into_iter().find(|c| c.type_ == "Scheduled" && c.status == "False")?;
                c.message.contains("Insufficient cpu").then_some(c.message)
            }
        })
        .await;
    assert!(message.contains("nodes are available"), "{message}");
    let vm = env.vms().get("huge").await.unwrap();
    assert_eq!(serde_json::to_value(vm.status.unwrap().phase).unwrap(), "Scheduling");

    let plain: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"nodeSelector": {"vmlet.io/test": env.ns}, "containers": [{"name": "c", "image": "busybox"}]}
    }))
    .unwrap();
    env.pods().create(&PostParams::default(), &plain).await.unwrap();
    let pods = env.pods();
    let why = env
        .wait_for("the plain pod to be refused by the scheduler", || {
            let pods = pods.clone();
            async move {
                let pod = pods.get("plain").await.ok()?;
                let (status, message) = pod_condition(&pod, "PodScheduled")?;
                (status == "False").then_some(message)
            }
        })
        .await;
    assert!(why.contains("untolerated taint"), "{why}");
    assert!(env.pods().get("plain").await.unwrap().spec.unwrap().node_name.is_none());
}

/// The shared cases: each bad object is refused by the API server with the
/// field named; the good ones are accepted and behave.
#[tokio::test]
async fn api_server_refuses_bad_virtual_machines_naming_the_field() {
    let mut env = TestEnv::new("validate").await;
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    let cases = common::repo().join("../shared/cases/vm-objects");
    let refused = [
        ("bad-replicas-2.yaml", "spec.replicas"),
        ("bad-cpu-zero.yaml", "spec.resources.cpu"),
        ("bad-memory-words.yaml", "spec.resources.memory"),
        ("bad-unknown-field.yaml", "spec.resources.cpus"),
        ("bad-negative-shutdown.yaml", "spec.shutdownTimeoutSeconds"),
        ("bad-name.yaml", "metadata.name"),
        ("bad-toleration-operator.yaml", "spec.tolerations[].operator"),
        ("bad-priority-class.yaml", "spec.priorityClassName"),
        ("bad-image-empty.yaml", "spec.image"),
    ];
    for (file, field) in refused {
        let yaml = std::fs::read_to_string(cases.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let out = env.apply(&yaml);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{file} was accepted");
        assert!(stderr.contains(field), "{file}: message does not name {field}: {stderr}");
    }
    // More of what the pod would refuse later, each named at admission: a
    // toleration's effect, key and value rules, and control characters (a NUL
    // byte, a newline) in host paths.
    let refused_specs = [
        (
            json!({"tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "Sometimes"}]}),
            "spec.tolerations[].effect",
        ),
        (json!({"tolerations": [{"operator": "Equal", "value": "v"}]}), "spec.tolerations[].key"),
        (json!({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}), "spec.tolerations[].value"),
        (json!({"image": "/var/lib/images/a\u{0}b.qcow2"}), "spec.image"),
        (json!({"kernelBoot": {"kernel": "/boot/vmlinuz\nx"}}), "spec.kernelBoot.kernel"),
        // A data disk names exactly one source; a host image an absolute
        // path without control characters, and never a format.
        (
            json!({"disks": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"},
                              "hostImage": {"path": "/var/lib/images/data.qcow2"}}]}),
            "name exactly one of persistentVolumeClaim and hostImage",
        ),
        (json!({"disks": [{"name": "data"}]}), "name exactly one of persistentVolumeClaim and hostImage"),
        (json!({"disks": [{"name": "data", "hostImage": {"path": "data.qcow2"}}]}), "spec.disks[0].hostImage.path"),
        (
            json!({"disks": [{"name": "data", "hostImage": {"path": "/var/lib/images/a\nb.qcow2"}}]}),
            "spec.disks[0].hostImage.path",
        ),
        (
            json!({"disks": [{"name": "data", "hostImage": {"path": "/var/lib/images/data.qcow2", "format": "raw"}}]}),
            "spec.disks[0].hostImage.format",
        ),
    ];
    for (spec, field) in refused_specs {
        let vm = json!({"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
                        "metadata": {"name": "refused"}, "spec": spec});
        let out = env.apply(&serde_json::to_string(&vm).unwrap());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{spec} was accepted");
        assert!(stderr.contains(field), "{spec}: message does not name {field}: {stderr}");
    }
    assert!(env.kubectl(&["get", "virtualmachines", "-o", "name"]).trim().is_empty(), "a bad object was stored");

    // good-minimal: accepted, defaults 1 cpu and 512Mi. It would run on any
    // vmlet host, so pin it to this test's host before applying.
    let minimal = std::fs::read_to_string(cases.join("good-minimal.yaml")).unwrap();
    let mut minimal: serde_json::Value = serde_yaml::from_str(&minimal).unwrap();
    minimal["spec"]["nodeSelector"] = json!({"vmlet.io/test": env.ns});
    assert!(env.apply(&serde_yaml::to_string(&minimal).unwrap()).status.success());
    let vm = env.wait_vm_phase("web-1", "Running").await;
    assert_eq!((vm.spec.resources.cpu, vm.spec.resources.memory.as_str()), (1, "512Mi"));
    let pod = env.vm_pod("web-1").await;
    let requests = pod.spec.unwrap().containers[0].resources.clone().unwrap().requests.unwrap();
    assert_eq!((requests["cpu"].0.as_str(), requests["memory"].0.as_str()), ("1", "512Mi"));

    // Beyond the shared cases: a size no host could hold, and a hot-plug
    // ceiling out of range, are refused with the field named.
    let mut huge = minimal.clone();
    huge["metadata"]["name"] = json!("huge");
    huge["spec"]["resources"] = json!({"cpu": 1, "memory": "99999999Ei"});
    let out = env.apply(&serde_yaml::to_string(&huge).unwrap());
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("spec.resources.memory"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (patch, field) in [
        (r#"{"spec":{"resources":{"maxMemory":"99999999Ei"}}}"#, "spec.resources.maxMemory"),
        (r#"{"spec":{"resources":{"maxCpu":0}}}"#, "spec.resources.maxCpu"),
        (r#"{"spec":{"resizePolicy":"Sometimes"}}"#, "spec.resizePolicy"),
    ] {
        let out = env.kubectl_output(&["patch", "vm", "web-1", "--type=merge", "-p", patch]);
        assert!(!out.status.success(), "{patch} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(field), "{patch}: {stderr}");
    }

    // good-stopped: accepted, Stopped, and no pod is ever created.
    let stopped = std::fs::read_to_string(cases.join("good-stopped.yaml")).unwrap();
    assert!(env.apply(&stopped).status.success());
    let vm = env.wait_vm_phase("batch-7", "Stopped").await;
    assert_eq!(vm.status.as_ref().unwrap().observed_generation, vm.metadata.generation);
    let pods = env.pods().list(&kube::api::ListParams::default().labels("vmlet.io/vm=batch-7")).await.unwrap();
    assert!(pods.items.is_empty(), "a stopped VM got a pod");
    assert_eq!(vm.status.unwrap().pod_name, None);
}

/// A hand-made pod that names a running VM's UID (and even claims its owner)
/// is refused, and deleting it leaves the VM running.
#[tokio::test]
async fn a_forged_pod_naming_a_vm_cannot_start_stop_or_adopt_it() {
    let mut env = TestEnv::new("forged").await;
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let uid = vm.metadata.uid.clone().unwrap();
    let provider_id = vm.status.unwrap().provider_id.unwrap();

    let forged: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": "web-evil1",
            "labels": {"vmlet.io/vm": "web"},
            "annotations": {"vmlet.io/vm-uid": uid, "vmlet.io/power-off-mode": "Hard"},
            "ownerReferences": [{"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine", "name": "web",
                                  "uid": uid, "controller": true}],
        },
        "spec": {
            "nodeName": env.node("a"),
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "containers": [{"name": "vm", "image": "x",
                            "resources": {"limits": {"cpu": "1", "memory": "512Mi"}}}],
        }
    }))
    .unwrap();
    env.pods().create(&PostParams::default(), &forged).await.unwrap();
    let pods = env.pods();
    let reason = env.wait_pod_failed(&pods, "web-evil1").await;
    assert_eq!(reason.as_deref(), Some("NotAVirtualMachine"));

    env.kubectl(&["delete", "pod", "web-evil1", "--wait=true", "--timeout=60s"]);
    let pod = env.vm_pod("web").await;
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert_eq!(container.restart_count, 0, "the VM was not powered off");
    assert!(container.state.as_ref().unwrap().running.is_some());
    let vm = env.vms().get("web").await.unwrap().status.unwrap();
    assert_eq!(vm.provider_id.as_deref(), Some(provider_id.as_str()));
}

/// Editing a VM pod's `vmlet.io/vm-uid` annotation to another VM's UID does
/// not retarget it: the pod is refused, and both VMs keep running, each in its
/// own domain (the edited one adopted again by its replacement pod).
#[tokio::test]
async fn an_annotation_edited_to_another_vms_uid_retargets_nothing() {
    let mut env = TestEnv::new("retarget").await;
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({}));
    env.apply_vm("db", json!({}));
    let web = env.wait_vm_phase("web", "Running").await;
    let db = env.wait_vm_phase("db", "Running").await;
    let web_domain = web.status.unwrap().provider_id.unwrap();
    let db_domain = db.status.unwrap().provider_id.unwrap();
    let db_uid = db.metadata.uid.unwrap();
    let web_pod = env.pod_of("web").await;

    let patch = json!({"metadata": {"annotations": {"vmlet.io/vm-uid": db_uid}}});
    env.pods().patch(&web_pod, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.unwrap();
    // The edited pod is refused and replaced; the replacement runs web's own domain.
    let (vms, pods) = (env.vms(), env.pods());
    env.wait_for("web's pod to be replaced", || {
        let (vms, pods) = (vms.clone(), pods.clone());
        let old = web_pod.clone();
        async move {
            let name = vms.get("web").await.ok()?.status?.pod_name?;
            let pod = pods.get_opt(&name).await.ok()??;
            let running = pod.status?.phase.as_deref() == Some("Running");
            (name != old && running).then_some(())
        }
    })
    .await;
    let web = env.wait_vm_phase("web", "Running").await;
    assert_eq!(web.status.unwrap().provider_id.as_deref(), Some(web_domain.as_str()), "web's own domain runs");
    let db = env.wait_vm_phase("db", "Running").await;
    assert_eq!(db.status.unwrap().provider_id.as_deref(), Some(db_domain.as_str()), "db's domain is untouched");
    let db_pod = env.vm_pod("db").await;
    assert_eq!(db_pod.status.unwrap().container_statuses.unwrap()[0].restart_count, 0, "db was not power-cycled");
}

/// `kubectl drain` of the only host: the VM's pod is evicted, and the VM
/// keeps running there (held) while the target pod of its migration finds no
/// other host. Uncordoning the host before anything moved cancels the
/// migration: the VM ends with a new, Ready pod on the same host, the same
/// domain never restarted, and the evicted pod's deletion completes. A later
/// stop still asks the guest to shut down before cutting power.
#[tokio::test]
async fn a_drained_vm_with_nowhere_to_go_keeps_running_and_uncordoning_cancels_its_migration() {
    let mut env = TestEnv::new("drain").await;
    let a = env.node("a");
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let domain = vm.status.unwrap().provider_id.unwrap();
    let evicted = env.pod_of("web").await;

    // Drain cannot finish while the VM has nowhere to go: it gives up after its timeout.
    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=5s"]);
    assert!(!drained.status.success(), "drain finished although the VM must keep running");
    let vm = env.wait_vm_phase("web", "Migrating").await;
    let status = vm.status.unwrap();
    let migration = status.migration.expect("status.migration");
    assert_eq!((migration.source_node.as_str(), migration.source_pod.as_str()), (a.as_str(), evicted.as_str()));
    assert_eq!(serde_json::to_value(migration.phase).unwrap(), "Pending");
    // The scheduler finds no host for the target pod (the only one is
    // cordoned): the VM says so with its message (how fast is no test's
    // business; the wait has the harness's deadline).
    let migrating = env
        .wait_for("Migrating=False/TargetUnschedulable", || {
            let vms = env.vms();
            async move {
                let status = vms.get("web").await.ok()?.status?;
                let c = status.conditions.into_iter().find(|c| c.type_ == "Migrating")?;
                (c.reason == "TargetUnschedulable").then_some(c)
            }
        })
        .await;
    assert_eq!(migrating.status, "False");
    assert!(
        migrating.message.starts_with(&format!("target pod {} has no host: ", migration.target_pod))
            && migrating.message.contains("unschedulable"),
        "{}",
        migrating.message
    );
    let pod = env.pods().get(&evicted).await.unwrap();
    assert!(pod.metadata.deletion_timestamp.is_some(), "the evicted pod is terminating");
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert!(container.state.as_ref().unwrap().running.is_some(), "the VM was not powered off");

    env.kubectl(&["uncordon", &a]);
    let vms = env.vms();
    let vm = env
        .wait_for("the migration cancelled and the VM Running on a new pod", || {
            let vms = vms.clone();
            let evicted = evicted.clone();
            async move {
                let vm = vms.get("web").await.ok()?;
                let status = vm.status.as_ref()?;
                let cancelled = serde_json::to_value(status.migration.as_ref()?.phase).ok()? == "Cancelled";
                let running = serde_json::to_value(status.phase?).ok()? == "Running";
                (cancelled && running && status.pod_name.as_deref() != Some(evicted.as_str())).then_some(vm)
            }
        })
        .await;
    assert_eq!(vm.status.unwrap().provider_id.unwrap(), domain, "the same domain kept running");
    let pods = env.pods();
    env.wait_for("the evicted pod's deletion to complete", || {
        let pods = pods.clone();
        let evicted = evicted.clone();
        async move { pods.get_opt(&evicted).await.ok()?.is_none().then_some(()) }
    })
    .await;
    let current = env.vm_pod("web").await;
    assert_eq!(current.spec.unwrap().node_name.as_deref(), Some(a.as_str()));
    assert_eq!(current.status.unwrap().container_statuses.unwrap()[0].restart_count, 0, "never power-cycled");

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    let reasons = env.kubectl(&["get", "events", "-o", "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}"]);
    let reasons: Vec<&str> = reasons.lines().collect();
    for expected in
        ["EvictionHeld", "Migrating", "TargetUnschedulable", "MigrationCancelled", "ShuttingDown", "Stopped"]
    {
        assert!(reasons.contains(&expected), "no {expected} event: {reasons:?}");
    }
}

/// A VM whose host's back end cannot move VMs (libvirt's test driver): drain
/// cannot finish, the VM keeps running where it is, and its status and a
/// Warning Event name the VM's back end and what to do instead.
#[tokio::test]
async fn a_vm_that_cannot_migrate_blocks_drain_and_says_why() {
    let mut env = TestEnv::new("nomove").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_vmlet(&two_hosts());
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    env.kubectl(&["cordon", &b]);
    env.apply_vm("web", json!({}));
    env.wait_vm_phase("web", "Running").await;
    env.kubectl(&["uncordon", &b]);
    let evicted = env.pod_of("web").await;

    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=10s"]);
    assert!(!drained.status.success(), "drain finished although the VM cannot move");
    let vms = env.vms();
    let status = env
        .wait_for("the migration to say why it cannot move the VM", || {
            let vms = vms.clone();
            async move {
                let status = vms.get("web").await.ok()?.status?;
                let failed = status.conditions.iter().any(|c| c.type_ == "Migrating" && c.reason == "MigrationFailed");
                failed.then_some(status)
            }
        })
        .await;
    let message = status.migration.unwrap().message.unwrap();
    assert!(message.contains("cannot move VMs") && message.contains("--replicas=0"), "{message}");
    assert_eq!(serde_json::to_value(status.phase.unwrap()).unwrap(), "Migrating");
    let pod = env.pods().get(&evicted).await.unwrap();
    assert!(pod.metadata.deletion_timestamp.is_some(), "the evicted pod waits");
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert!(container.state.as_ref().unwrap().running.is_some(), "the VM keeps running on {a}");
    let events = env.kubectl(&["get", "events", "--field-selector", "reason=MigrationFailed", "-o", "name"]);
    assert!(!events.trim().is_empty(), "no MigrationFailed event");

    // Stopping it still works: the stop ends the migration and the drain's wait.
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    let drained = env.kubectl_output(&["drain", &a, "--ignore-daemonsets", "--timeout=60s"]);
    assert!(drained.status.success(), "{}", String::from_utf8_lossy(&drained.stderr));
}

/// The placement record is written by the agent that defines the VM, before
/// it powers it on: it exists even when the controller was down the whole
/// time. The VM's next pod is pinned to that host, waits while that host is
/// cordoned (however free another host is), and runs there once it is back;
/// no other host ever defines the VM.
#[tokio::test]
async fn a_vm_placed_while_the_controller_was_down_returns_to_its_host() {
    let mut env = TestEnv::new("placed").await;
    let (a, b) = (env.node("a"), env.node("b"));
    env.start_split(&two_hosts());
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    env.kubectl(&["cordon", &a]);
    env.kubectl(&["cordon", &b]);
    env.apply_vm("web", json!({}));
    let first = env.pod_of("web").await;
    env.kill_controller();

    // Only b is open: the scheduler binds the pod there, the agent defines
    // the VM, records b and powers it on. Nobody mirrors the pod into the
    // VM's status: the record is the agent's own.
    env.kubectl(&["uncordon", &b]);
    assert_eq!(env.wait_pod_running(&first).await, b);
    let placement = env.vms().get("web").await.unwrap().status.unwrap().placement.expect("a placement record");
    assert_eq!(placement.node_name, b);
    assert!(placement.backend_id.as_ref().is_some_and(|id| !id.is_empty()), "the record names the domain");

    // Stopped through its pod while the controller is still down, then the
    // scheduler would pick a (b is cordoned now) if the pod were not pinned.
    env.kubectl(&["delete", "pod", &first, "--wait=true", "--timeout=90s"]);
    env.kubectl(&["uncordon", &a]);
    env.kubectl(&["cordon", &b]);
    env.start_controller();
    let vms = env.vms();
    let second = env
        .wait_for("a new pod named by the controller", || {
            let vms = vms.clone();
            let first = first.clone();
            async move { vms.get("web").await.ok()?.status?.pod_name.filter(|p| *p != first) }
        })
        .await;
    let pod = env.pods().get(&second).await.unwrap();
    let spec = pod.spec.unwrap();
    assert_eq!(spec.node_selector.unwrap().get("kubernetes.io/hostname"), Some(&b), "pinned to the recorded host");
    let scheduled = env
        .wait_for("the pinned pod to be found unschedulable", || {
            let pods = env.pods();
            let second = second.clone();
            async move {
                let pod = pods.get(&second).await.ok()?;
                pod_condition(&pod, "PodScheduled").filter(|(status, _)| status == "False")
            }
        })
        .await;
    assert!(env.pods().get(&second).await.unwrap().spec.unwrap().node_name.is_none(), "{scheduled:?}");

    env.kubectl(&["uncordon", &b]);
    assert_eq!(env.wait_pod_running(&second).await, b);
    let vm = env.wait_vm_phase("web", "Running").await;
    assert_eq!(vm.status.unwrap().node_name.as_deref(), Some(b.as_str()));
    // The same domain as the first time: b's agent powered on what it
    // defined then (a define elsewhere would have named another domain, and
    // the record's guard keeps another host from ever powering one on).
    let again = env.vms().get("web").await.unwrap().status.unwrap().placement.expect("a placement record");
    assert_eq!(again.node_name, b);
    assert_eq!(again.backend_id, placement.backend_id, "the VM was defined anew");
    let started = env.kubectl(&[
        "get",
        "events",
        "--field-selector",
        "reason=Started",
        "-o",
        "jsonpath={range .items[*]}{.reportingComponent} {.note}{.message}{\"\\n\"}{end}",
    ]);
    assert!(!started.trim().is_empty(), "no Started event for the start on {b}");
    for line in started.lines() {
        assert!(line.starts_with(&format!("vmlet/{b} powered ")), "a start elsewhere than on {b}: {line}");
    }
}

/// `kubectl delete node` while vmlet runs: the agent registers the Node again
/// (within one lease period: vmlet notices when the garbage collector removes
/// the Node's Lease), and the VM keeps running on that host, the same domain,
/// never restarted.
#[tokio::test]
async fn a_deleted_node_is_registered_again_and_its_vm_keeps_running_there() {
    let mut env = TestEnv::new("renode").await;
    let a = env.node("a");
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let domain = vm.status.unwrap().provider_id.unwrap();
    let old_uid = env.wait_node_ready(&a).await.metadata.uid.unwrap();

    env.kubectl(&["delete", "node", &a, "--wait=true", "--timeout=60s"]);
    let deleted_at = std::time::Instant::now();
    let nodes = env.nodes_api();
    let node = env
        .wait_for("the deleted Node to be registered again", || {
            let nodes = nodes.clone();
            let (old_uid, a) = (old_uid.clone(), a.clone());
            async move { nodes.get_opt(&a).await.ok()?.filter(|n| n.metadata.uid.as_deref() != Some(old_uid.as_str())) }
        })
        .await;
    eprintln!(
        "node registered again {:.1} s after its deletion (lease period 40 s)",
        deleted_at.elapsed().as_secs_f64()
    );
    let labels = node.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("type").map(String::as_str), Some("virtual-kubelet"), "registered as before");
    env.wait_node_ready(&a).await;

    let vm = env.wait_vm_phase("web", "Running").await;
    let status = vm.status.unwrap();
    assert_eq!(status.node_name.as_deref(), Some(a.as_str()));
    assert_eq!(status.provider_id.as_deref(), Some(domain.as_str()), "the same domain runs");
    let pod = env.vm_pod("web").await;
    assert_eq!(pod.spec.unwrap().node_name.as_deref(), Some(a.as_str()));
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert_eq!(container.restart_count, 0, "the VM was not power-cycled");
    let table = env.kubectl(&["get", "vm", "web"]);
    assert!(table.lines().any(|l| l.starts_with("web ") && l.contains("Running") && l.contains(&a)), "{table}");
}

/// The pods named in a `/stats/summary` document, sorted, and its node name.
fn summary_of(body: &str) -> Option<(String, Vec<String>)> {
    let summary: serde_json::Value = serde_json::from_str(body).ok()?;
    let node = summary["node"]["nodeName"].as_str()?.to_owned();
    let mut pods: Vec<String> =
        summary["pods"].as_array()?.iter().filter_map(|p| p["podRef"]["name"].as_str().map(str::to_owned)).collect();
    pods.sort();
    Some((node, pods))
}

/// The value of the sample `series` (name and labels, as encoded) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.split(' ').next()?.parse().ok())
}

#[tokio::test]
async fn each_node_of_one_process_answers_stats_summary_for_its_own_vms_only() {
    let mut env = TestEnv::new("pernode").await;
    env.start_vmlet(&two_hosts());
    let (a, b) = (env.node("a"), env.node("b"));
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    let pinned = |node: &str| json!({"resources": {"cpu": 1, "memory": "256Mi"}, "nodeSelector": {"kubernetes.io/hostname": node}});
    env.apply_vm("on-a", pinned(&a));
    env.apply_vm("on-b", pinned(&b));
    let pod_a = env.wait_vm_phase("on-a", "Running").await.status.unwrap().pod_name.unwrap();
    let pod_b = env.wait_vm_phase("on-b", "Running").await.status.unwrap().pod_name.unwrap();

    // Straight at each node's listener, as metrics-server reads it.
    for (i, node, pod) in [(0, &a, &pod_a), (1, &b, &pod_b)] {
        let port = env.kubelet_port_of(i);
        let (name, pods) = env
            .wait_for(&format!("{node}'s /stats/summary on port {port} to list its VM"), || async {
                let (status, body) = common::kubelet::get(port, "/stats/summary", Caller::ApiServer).await?;
                let summary = summary_of(&body).filter(|_| status == 200)?;
                (!summary.1.is_empty()).then_some(summary)
            })
            .await;
        assert_eq!((&name, &pods), (node, &vec![pod.clone()]), "port {port} answers for {node} alone");
        let (status, text) = common::kubelet::get(port, "/metrics/resource", Caller::ApiServer).await.unwrap();
        assert_eq!(status, 200, "{text}");
        assert!(text.contains(&format!("pod=\"{pod}\"")), "{text}");
        let other = if i == 0 { &pod_b } else { &pod_a };
        assert!(!text.contains(&format!("pod=\"{other}\"")), "{node} must not report {other}: {text}");
        // One router serves both listeners; the listener alone decides the
        // node: the other node's pod is not found here, whoever asks.
        for path in [format!("/containerLogs/{}/{other}/vm", env.ns), format!("/portForward/{}/{other}", env.ns)] {
            let (status, body) = common::kubelet::get(port, &path, Caller::ApiServer).await.unwrap();
            assert_eq!(status, 404, "{path} on {node}'s port {port}: {body}");
            assert!(body.contains("does not exist on any node of this vmlet"), "{body}");
        }
    }

    // Through the API server, which dials each Node's InternalIP and
    // daemonEndpoints port (its nodes/proxy refuses a loopback address, so
    // ask for logs): the test driver has no console, and the answer comes
    // from node b's listener, which found the pod (node a's would not).
    for (node, pod) in [(&a, &pod_a), (&b, &pod_b)] {
        let out = env.kubectl_output(&["logs", pod]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a test-driver VM has no console log: {stderr}");
        assert!(stderr.contains(&format!("provider of host {node} has no serial console")), "{stderr}");
    }

    // The provider calls that started the VMs are counted per node and back
    // end, and each agent's queue depth is published.
    let (status, text) = common::kubelet::get(env.kubelet_port_of(1), "/metrics", Caller::ApiServer).await.unwrap();
    assert_eq!(status, 200, "{text}");
    for node in [&a, &b] {
        let defined = format!(
            "vmlet_provider_call_duration_seconds_count{{node=\"{node}\",backend=\"libvirt\",operation=\"ensure_defined\",result=\"ok\"}}"
        );
        assert!(sample(&text, &defined).is_some_and(|n| n >= 1.0), "{defined} missing or 0:\n{text}");
        let depth = format!("vmlet_workqueue_depth{{controller=\"pod\",node=\"{node}\"}}");
        assert!(sample(&text, &depth).is_some(), "{depth} missing:\n{text}");
    }
}

const MIB: u64 = 1 << 20;

/// The rows of `kubectl top ... --no-headers` output by their first column.
fn top_rows(out: &str) -> BTreeMap<String, Vec<String>> {
    out.lines()
        .filter_map(|l| {
            let mut fields = l.split_whitespace().map(str::to_owned);
            Some((fields.next()?, fields.collect()))
        })
        .collect()
}

/// A `kubectl top` memory figure (`<n>Mi`) in MiB.
fn mebibytes(quantity: &str) -> u64 {
    quantity.strip_suffix("Mi").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("memory {quantity:?}: not <n>Mi"))
}

/// A `kubectl top` CPU figure (`<n>m`) in millicores.
fn millicores(quantity: &str) -> u64 {
    quantity.strip_suffix('m').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("cpu {quantity:?}: not <n>m"))
}

/// `kubectl top` through a real metrics-server (hack/metrics-server.sh): it
/// scrapes each Node's `/metrics/resource` at the node's InternalIP and
/// status port as `system:metrics-server`, verifying vmlet's serving cert,
/// and the API server's aggregator serves what it keeps. Each host's row
/// carries its own VMs, with the figures its `/stats/summary` reports.
#[tokio::test]
async fn kubectl_top_shows_each_hosts_own_vms_through_metrics_server() {
    common::metrics_server();
    let mut env = TestEnv::new("top").await;
    env.start_vmlet(&two_hosts());
    let (a, b) = (env.node("a"), env.node("b"));
    env.wait_node_ready(&a).await;
    env.wait_node_ready(&b).await;
    // Other memory sizes on each host: each node's figure can only be the
    // sum of its own VMs'. The test driver reports a VM's memory as used.
    let pinned = |node: &str, memory: &str| json!({"resources": {"cpu": 1, "memory": memory}, "nodeSelector": {"kubernetes.io/hostname": node}});
    env.apply_vm("a1", pinned(&a, "256Mi"));
    env.apply_vm("b1", pinned(&b, "512Mi"));
    env.apply_vm("b2", pinned(&b, "256Mi"));
    let mut node_of = BTreeMap::new();
    for vm in ["a1", "b1", "b2"] {
        let status = env.wait_vm_phase(vm, "Running").await.status.unwrap();
        node_of.insert(status.pod_name.unwrap(), status.node_name.unwrap());
    }

    // What each node's listener reports, in MiB, by pod and node name.
    let mut reported = BTreeMap::new();
    for (i, node) in [(0, &a), (1, &b)] {
        let port = env.kubelet_port_of(i);
        let own = node_of.values().filter(|n| *n == node).count();
        let summary = env
            .wait_for(&format!("{node}'s /stats/summary to list its {own} VMs"), || async {
                let (status, body) = common::kubelet::get(port, "/stats/summary", Caller::ApiServer).await?;
                let summary: serde_json::Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
                (summary["pods"].as_array()?.len() == own).then_some(summary)
            })
            .await;
        reported.insert(node.clone(), summary["node"]["memory"]["workingSetBytes"].as_u64().unwrap() / MIB);
        for pod in summary["pods"].as_array().unwrap() {
            let name = pod["podRef"]["name"].as_str().unwrap().to_owned();
            assert_eq!(node_of.get(&name), Some(node), "{node} reports {name}");
            reported.insert(name, pod["memory"]["workingSetBytes"].as_u64().unwrap() / MIB);
        }
    }
    assert_eq!((reported[&a], reported[&b]), (256, 768), "{reported:?}");

    // metrics-server keeps a node or pod once it has two scrapes of it (one
    // every 10 s): until then `kubectl top` says the metrics are not there.
    let mut node_cpu = BTreeMap::new();
    for node in [&a, &b] {
        let row = env
            .wait_for(&format!("`kubectl top node {node}` to show its figures"), || {
                let out = env.kubectl_output(&["top", "node", node, "--no-headers"]);
                async move { out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned()) }
            })
            .await;
        let rows = top_rows(&row);
        let fields = rows.get(node).unwrap_or_else(|| panic!("no row for {node}: {row}"));
        // NAME CPU(cores) CPU(%) MEMORY(bytes) MEMORY(%)
        node_cpu.insert(node, millicores(&fields[0]));
        assert_eq!(mebibytes(&fields[2]), reported[node], "{node}: {row}");
    }
    let pods = env
        .wait_for("`kubectl top pod` to show the three VM pods", || {
            let out = env.kubectl_output(&["top", "pod", "--no-headers"]);
            let rows = out.status.success().then(|| top_rows(&String::from_utf8_lossy(&out.stdout)));
            async move { rows.filter(|rows| rows.len() == 3) }
        })
        .await;
    let (mut memory_per_node, mut cpu_per_node) = (BTreeMap::new(), BTreeMap::<&String, u64>::new());
    for (pod, fields) in &pods {
        let node = node_of.get(pod).unwrap_or_else(|| panic!("`kubectl top pod` shows {pod}, no VM's pod: {pods:?}"));
        // The test driver's CPU counter runs with the clock: about a core.
        let cpu = millicores(&fields[0]);
        assert!(cpu > 0, "{pod}: {fields:?}");
        *cpu_per_node.entry(node).or_default() += cpu;
        let memory = mebibytes(&fields[1]);
        assert_eq!(memory, reported[pod], "{pod}: {fields:?}");
        *memory_per_node.entry(node).or_default() += memory;
    }
    assert_eq!(memory_per_node, BTreeMap::from([(&a, 256), (&b, 768)]), "each node's pods add up to its row");
    for (node, pods_cpu) in cpu_per_node {
        // Rates over windows of other scrapes: close, not equal.
        let cpu = node_cpu[node];
        assert!(cpu.abs_diff(pods_cpu) <= pods_cpu / 10 + 10, "{node}: {cpu}m, its pods {pods_cpu}m: {pods:?}");
    }

    // metrics-server's identity reads nodes/metrics and no other part of the
    // kubelet API: its role grants no nodes/stats or nodes/proxy.
    let port = env.kubelet_port_of(0);
    let (status, text) = common::kubelet::get(port, "/metrics/resource", Caller::Cert("metrics-server")).await.unwrap();
    assert_eq!(status, 200, "{text}");
    for path in ["/stats/summary", "/pods"] {
        let (status, body) = common::kubelet::get(port, path, Caller::Cert("metrics-server")).await.unwrap();
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("user=system:metrics-server"), "{path}: {body}");
    }
}
