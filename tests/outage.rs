//! A host that stops answering for a while: libvirtd itself is stopped for
//! 60 s (the guests keep running, as they do whenever libvirtd stops), then
//! started again. In a test binary of its own, so that no other test's
//! libvirt calls fail meanwhile.

mod common;

use common::deadline::{output_within, run, VIRSH};
use common::{pod_condition, qemu_uri, repo, Host, TestEnv};
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long libvirtd stays stopped.
const OUTAGE: Duration = Duration::from_secs(60);

fn virsh(args: &[&str]) -> (bool, String) {
    let out = output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(args), VIRSH);
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Starts libvirtd again (through the script that started it) however the
/// test ends.
struct RestartLibvirtd;

impl Drop for RestartLibvirtd {
    fn drop(&mut self) {
        let up = run(Command::new(repo().join("hack/libvirtd.sh")).arg("up"), Duration::from_secs(120));
        if !matches!(&up, Ok(out) if out.status.success()) && !std::thread::panicking() {
            panic!("hack/libvirtd.sh up failed after the outage: {up:?}");
        }
    }
}

#[tokio::test]
async fn a_host_that_stops_answering_for_a_minute_leaves_its_vm_running_and_nothing_restarted() {
    let mut env = TestEnv::new("outage").await;
    // Emulated (TCG): under nested KVM, a firmware-only guest now and then
    // stops on an emulation failure, which would be another test.
    env.start_vmlet(&[Host { accelerator: Some("tcg"), ..Host::qemu("q") }]);
    env.apply_vm("web", json!({"resources": {"cpu": 1, "memory": "64Mi"}}));
    env.wait_vm_phase("web", "Running").await;
    let pod_name = env.pod_of("web").await;
    let domain = format!("{}_web", env.ns);
    let (ok, domid) = virsh(&["domid", &domain]);
    assert!(ok, "virsh domid {domain}");
    let node = env.node("q");

    // Stop libvirtd alone: its guests run on. Only the one in this test's
    // network namespace: hack/hosts.sh's libvirtd in their own namespaces
    // serve other tests.
    let own_pid = std::process::id().to_string();
    let stopped =
        run(Command::new("pkill").args(["-TERM", "-x", "libvirtd", "--ns", &own_pid, "--nslist", "net"]), VIRSH)
            .expect("pkill");
    assert!(stopped.status.success(), "no libvirtd was running");
    let restart = RestartLibvirtd;
    let since = Instant::now();

    // The node goes NotReady, saying why (the agent reports it, keeping its
    // Lease); the pod stays Running, with a condition saying the host does
    // not answer. (Its Ready condition is Kubernetes' to set meanwhile: the
    // node lifecycle controller marks the pods of a NotReady node not Ready.)
    let nodes = env.nodes_api();
    env.wait_for("the node to go NotReady", || {
        let nodes = nodes.clone();
        let node = node.clone();
        async move {
            let n = nodes.get(&node).await.ok()?;
            let ready = n.status?.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
            let why = ready.reason.as_deref() == Some("HostNotResponding");
            (ready.status == "False" && why).then_some(())
        }
    })
    .await;
    let pods = env.pods();
    let silent = env
        .wait_for("the pod to say its host does not answer", || {
            let pods = pods.clone();
            let name = pod_name.clone();
            async move {
                let pod = pods.get(&name).await.ok()?;
                pod_condition(&pod, "vmlet.io/HostResponding").filter(|(status, _)| status == "False").map(|_| pod)
            }
        })
        .await;
    assert_eq!(silent.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
    assert!(silent.metadata.deletion_timestamp.is_none(), "the pod was not evicted");

    // Keep libvirtd stopped for the whole outage, watching that nothing
    // changes the pod's phase meanwhile.
    while since.elapsed() < OUTAGE {
        let pod = env.pods().get(&pod_name).await.unwrap();
        assert_eq!(pod.status.as_ref().unwrap().phase.as_deref(), Some("Running"), "during the outage");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    drop(restart);

    // Back: the same domain id runs (never restarted), the condition clears.
    let pods = env.pods();
    env.wait_for("the condition to clear once libvirtd answers", || {
        let pods = pods.clone();
        let name = pod_name.clone();
        async move {
            let pod = pods.get(&name).await.ok()?;
            pod_condition(&pod, "vmlet.io/HostResponding").is_none().then_some(())
        }
    })
    .await;
    let (ok, after) = virsh(&["domid", &domain]);
    assert!(ok);
    assert_eq!(after, domid, "the same domain id: the VM was never restarted");
    env.wait_node_ready(&node).await;
    env.wait_for("the pod to be Ready again", || {
        let pods = env.pods();
        let name = pod_name.clone();
        async move { (pod_condition(&pods.get(&name).await.ok()?, "Ready")?.0 == "True").then_some(()) }
    })
    .await;
    let pod = env.pods().get(&pod_name).await.unwrap();
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert_eq!(container.restart_count, 0);
    assert_eq!(env.pod_of("web").await, pod_name, "the same pod");
    let vm = env.wait_vm_phase("web", "Running").await;
    let host_responding = vm.status.unwrap().conditions.into_iter().find(|c| c.type_ == "HostResponding").unwrap();
    assert_eq!(host_responding.status, "True");
}
