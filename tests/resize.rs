//! Resize through kubectl on the real control plane with libvirt's test driver:
//! the VM's pod is resized in place (`pods/resize`), the agent hot-plugs
//! within the VM's ceilings, defers beyond them to the next start, and the
//! node's accounting follows; and a real guest (`qemu:///system`) sees it.

mod common;

use common::{guest_accelerator, guest_for, guest_vm_spec, pod_condition, test_driver_uri, Host, TestEnv};
use serde_json::json;
use vmlet::v1alpha1::{CurrentResources, VirtualMachine};

/// The VM's `status.currentResources` and its `ResourcesSynced` condition
/// (status, reason), once both are reported.
fn resize_state(vm: &VirtualMachine) -> Option<(CurrentResources, (String, String))> {
    let status = vm.status.as_ref()?;
    let synced = status.conditions.iter().find(|c| c.type_ == "ResourcesSynced")?;
    Some((status.current_resources.clone()?, (synced.status.clone(), synced.reason.clone())))
}

fn size(cpu: i32, memory: &str) -> CurrentResources {
    CurrentResources { cpu, memory: memory.to_owned() }
}

/// Wait until VM `name` runs with `want` and its ResourcesSynced condition
/// has `(status, reason)`.
async fn wait_resize(env: &TestEnv, name: &str, want: CurrentResources, synced: (&str, &str)) -> VirtualMachine {
    let vms = env.vms();
    let what = format!("VirtualMachine {name} at {want:?} with ResourcesSynced {synced:?}");
    env.wait_for(&what, || {
        let (vms, want) = (vms.clone(), want.clone());
        async move {
            let vm = vms.get_opt(name).await.ok()??;
            let (current, (status, reason)) = resize_state(&vm)?;
            (current == want && status == synced.0 && reason == synced.1).then_some(vm)
        }
    })
    .await
}

/// `kubectl patch vm <name> --type=merge -p <patch>`.
fn patch_vm(env: &TestEnv, name: &str, patch: serde_json::Value) {
    env.kubectl(&["patch", "virtualmachine", name, "--type=merge", "-p", &patch.to_string()]);
}

#[tokio::test]
async fn a_running_vm_grows_live_within_its_ceilings_and_at_its_next_start_beyond_them() {
    let mut env = TestEnv::new("resize").await;
    let a = env.node("a");
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({"resources": {"cpu": 1, "memory": "256Mi", "maxCpu": 2, "maxMemory": "512Mi"}}));
    env.wait_vm_phase("web", "Running").await;
    wait_resize(&env, "web", size(1, "256Mi"), ("True", "Synced")).await;
    let pod = env.pod_of("web").await;

    // Within the ceilings: live, on the same pod.
    patch_vm(&env, "web", json!({"spec": {"resources": {"cpu": 2, "memory": "384Mi"}}}));
    let vm = wait_resize(&env, "web", size(2, "384Mi"), ("True", "Synced")).await;
    assert_eq!(vm.status.as_ref().unwrap().pod_name.as_deref(), Some(pod.as_str()), "resized in place");
    let resized = env.pods().get(&pod).await.unwrap();
    let limits = resized.spec.unwrap().containers[0].resources.clone().unwrap().limits.unwrap();
    assert_eq!((limits["cpu"].0.as_str(), limits["memory"].0.as_str()), ("2", "384Mi"));
    let domain = vm.status.unwrap().provider_id.unwrap();
    // The node's accounting follows the pod's new requests.
    let described = env.kubectl(&["describe", "node", &a]);
    let allocated = described.split("Allocated resources:").nth(1).expect("describe shows allocated resources");
    let cpu_line = allocated.lines().find(|l| l.trim_start().starts_with("cpu")).unwrap();
    assert_eq!(cpu_line.split_whitespace().nth(1), Some("2"), "{allocated}");
    let memory_line = allocated.lines().find(|l| l.trim_start().starts_with("memory")).unwrap();
    assert_eq!(memory_line.split_whitespace().nth(1), Some("384Mi"), "{allocated}");

    // Beyond maxCpu: the definition changes, the running VM waits for a restart.
    patch_vm(&env, "web", json!({"spec": {"resources": {"cpu": 3}}}));
    wait_resize(&env, "web", size(2, "384Mi"), ("False", "RestartRequired")).await;
    let events = env.kubectl(&["get", "events", "--field-selector", "reason=RestartRequired", "-o", "name"]);
    assert!(!events.trim().is_empty(), "no RestartRequired event");

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    let vm = wait_resize(&env, "web", size(3, "384Mi"), ("True", "Synced")).await;
    assert_eq!(vm.status.unwrap().provider_id.unwrap(), domain, "the same domain, started with its new size");
}

#[tokio::test]
async fn a_live_only_resize_beyond_the_ceilings_or_the_node_is_pending_as_kubernetes_reports_it() {
    let mut env = TestEnv::new("resize-live").await;
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-b.xml"))]);
    env.apply_vm("db", json!({"resources": {"cpu": 1, "memory": "256Mi"}, "resizePolicy": "Live"}));
    env.wait_vm_phase("db", "Running").await;
    wait_resize(&env, "db", size(1, "256Mi"), ("True", "Synced")).await;
    let pod = env.pod_of("db").await;

    // No ceiling above 1 vCPU, policy Live: infeasible, the VM keeps its size.
    patch_vm(&env, "db", json!({"spec": {"resources": {"cpu": 2}}}));
    wait_resize(&env, "db", size(1, "256Mi"), ("False", "Infeasible")).await;
    let resized = env.pods().get(&pod).await.unwrap();
    let (status, message) = pod_condition(&resized, "PodResizePending").expect("PodResizePending on the pod");
    assert_eq!(status, "True");
    let reason = resized
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "PodResizePending")
        .and_then(|c| c.reason);
    assert_eq!(reason.as_deref(), Some("Infeasible"), "{message}");
    assert!(message.contains("maxCpu"), "the message says how to get there: {message}");

    // More than host-b can allocate at all (4 CPUs): the API server refuses
    // the pod's resize, whatever the policy, and the VM says why.
    patch_vm(&env, "db", json!({"spec": {"resources": {"cpu": 6}, "resizePolicy": "LiveOrRestart"}}));
    let vms = env.vms();
    let message = env
        .wait_for("ResourcesSynced to say the node cannot hold 6 vCPUs", || {
            let vms = vms.clone();
            async move {
                let status = vms.get("db").await.ok()?.status?;
                let synced = status.conditions.into_iter().find(|c| c.type_ == "ResourcesSynced")?;
                (synced.reason == "Infeasible" && synced.message.contains("allocatable")).then_some(synced.message)
            }
        })
        .await;
    assert!(message.contains("cpu"), "{message}");
    let unchanged = env.pods().get(&pod).await.unwrap();
    let limits = unchanged.spec.unwrap().containers[0].resources.clone().unwrap().limits.unwrap();
    assert_eq!(limits["cpu"].0, "2", "the pod keeps the size it was last resized to");

    // Back to the size it has: in sync again, nothing pending.
    patch_vm(&env, "db", json!({"spec": {"resources": {"cpu": 1}}}));
    wait_resize(&env, "db", size(1, "256Mi"), ("True", "Synced")).await;
    let resized = env.pods().get(&pod).await.unwrap();
    assert_eq!(pod_condition(&resized, "PodResizePending"), None);
}

/// `kubectl exec <pod> -- <command>` once the guest agent answers: its stdout.
async fn exec_in_guest(env: &TestEnv, pod: &str, command: &[&str]) -> String {
    env.wait_for(&format!("{command:?} in the guest of pod {pod}"), || {
        let mut args = vec!["exec", pod, "--"];
        args.extend_from_slice(command);
        let out = env.kubectl_output(&args);
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        async move { out.status.success().then_some(stdout) }
    })
    .await
}

/// The guest's `MemTotal` in KiB, and its uptime in seconds.
async fn memory_and_uptime(env: &TestEnv, pod: &str) -> (u64, f64) {
    let meminfo = exec_in_guest(env, pod, &["cat", "/proc/meminfo"]).await;
    let total = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:")).expect("MemTotal in /proc/meminfo");
    let kib = total.split_whitespace().next().unwrap().parse().unwrap();
    let uptime = exec_in_guest(env, pod, &["cat", "/proc/uptime"]).await;
    (kib, uptime.split_whitespace().next().unwrap().parse().unwrap())
}

/// The acceptance case on a real guest (`qemu:///system`): 1 → 2 vCPUs and
/// 256 → 384 MiB through `kubectl patch`; `kubectl exec -- nproc` prints 2,
/// the guest's memory grew, and its uptime kept increasing (no reboot).
#[tokio::test]
async fn a_real_guest_gets_a_vcpu_and_memory_live_through_kubectl_without_a_reboot() {
    let mut env = TestEnv::new("resize-guest").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    let mut spec = guest_vm_spec(&guest);
    spec["resources"] = json!({"cpu": 1, "memory": "256Mi", "maxCpu": 2, "maxMemory": "512Mi"});
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    assert_eq!(exec_in_guest(&env, &pod, &["nproc"]).await.trim(), "1");
    // The guest boots with its ceiling (512 MiB) until its balloon driver
    // takes the rest back: measure once it has.
    let (memory_before, uptime_before) = env
        .wait_for("the guest's balloon to settle at 256 MiB", || {
            let env = &env;
            let pod = pod.clone();
            async move {
                let (kib, uptime) = memory_and_uptime(env, &pod).await;
                (kib <= 256 * 1024).then_some((kib, uptime))
            }
        })
        .await;

    patch_vm(&env, "web", json!({"spec": {"resources": {"cpu": 2, "memory": "384Mi"}}}));
    wait_resize(&env, "web", size(2, "384Mi"), ("True", "Synced")).await;
    env.wait_for("nproc 2 in the guest", || {
        let out = env.kubectl_output(&["exec", &pod, "--", "nproc"]);
        async move { (String::from_utf8_lossy(&out.stdout).trim() == "2").then_some(()) }
    })
    .await;
    let memory_after = env
        .wait_for("the guest's memory to grow", || {
            let env = &env;
            let pod = pod.clone();
            async move {
                let (kib, _) = memory_and_uptime(env, &pod).await;
                (kib > memory_before + 64 * 1024).then_some(kib)
            }
        })
        .await;
    let (_, uptime_after) = memory_and_uptime(&env, &pod).await;
    assert!(uptime_after > uptime_before, "the guest rebooted: uptime {uptime_before} s, then {uptime_after} s");
    assert_eq!(env.pod_of("web").await, pod, "resized in place, same pod");
    assert!(memory_after <= 384 * 1024, "MemTotal {memory_after} KiB is more than the 384 MiB asked for");
}
