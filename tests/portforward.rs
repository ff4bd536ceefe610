//! `kubectl port-forward` through the real API server to vmlet's kubelet
//! API, into a real qemu guest (test-vms/guest) on the isolated libvirt
//! network `vmlet-lan` of the real libvirtd: a TCP echo in the guest (busybox
//! `nc -ll -e cat`, started with `kubectl exec`) answers bytes sent to the
//! local port, over kubectl's WebSocket (SPDY tunnelled, passed through to
//! vmlet because its Node declares ExtendWebSocketsToKubelet) and over plain
//! SPDY, and over the WebSocket channel protocol (kube-rs); a port nothing
//! listens on is reported, not hung. And the refusals:
//! a tenant's token gets 403 from vmlet for another namespace's VM pod, and
//! a pod that is no VirtualMachine's own is refused through the API.

mod common;

use common::deadline::{kill_and_reap, KUBECTL};
use common::kubelet::{self, Caller};
use common::{guest_accelerator, guest_for, guest_vm_spec, Host, TestEnv};
use serde_json::json;
use std::process::{Child, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The guest port the echo listens on.
const ECHO_PORT: u16 = 7000;
/// A guest port nothing listens on.
const CLOSED_PORT: u16 = 7001;
/// How long one echo round trip through kubectl may take.
const ROUND_TRIP: Duration = Duration::from_secs(20);

/// A harness setting exported by `hack/test.sh` (from `hack/libvirtd.sh env`).
fn harness(var: &str) -> String {
    std::env::var(var).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| {
        panic!("{var} is unset: run the tests with hack/test.sh as root, which makes the test network vmlet-lan")
    })
}

/// `kubectl port-forward`, killed and reaped when dropped (also when the test fails).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if kill_and_reap(&mut self.0, KUBECTL).is_none() {
            eprintln!("kubectl port-forward (pid {}) still not reaped after SIGKILL", self.0.id());
        }
    }
}

/// A local port free now.
fn free_local_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Send `message` to 127.0.0.1:`port`, half-close, and read to the end:
/// what came back, or `None` on a failure or past [`ROUND_TRIP`].
async fn round_trip(port: u16, message: &[u8]) -> Option<Vec<u8>> {
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        conn.write_all(message).await.ok()?;
        conn.shutdown().await.ok()?;
        let mut back = Vec::new();
        conn.read_to_end(&mut back).await.ok()?;
        Some(back)
    };
    tokio::time::timeout(ROUND_TRIP, exchange).await.ok().flatten()
}

/// Start `kubectl port-forward pod/<pod> <echo>:7000 <closed>:7001` with
/// `env_vars`; stderr goes to `stderr_file`.
fn port_forward(
    env: &TestEnv,
    pod: &str,
    vars: &[(&str, &str)],
    echo: u16,
    closed: u16,
    stderr_file: &std::path::Path,
) -> KillOnDrop {
    let stderr = std::fs::File::create(stderr_file).unwrap();
    let child = env
        .kubectl_command()
        .envs(vars.iter().copied())
        .args([
            "port-forward",
            &format!("pod/{pod}"),
            &format!("{echo}:{ECHO_PORT}"),
            &format!("{closed}:{CLOSED_PORT}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("kubectl port-forward starts");
    KillOnDrop(child)
}

/// Forward through kubectl with `vars` and check the echo and the closed port.
async fn forward_and_echo(env: &TestEnv, pod: &str, vars: &[(&str, &str)], label: &str) {
    let (echo, closed) = (free_local_port(), free_local_port());
    let stderr_file = env.dir.join(format!("port-forward-{label}.stderr"));
    let forward = port_forward(env, pod, vars, echo, closed, &stderr_file);
    let message = format!("hello guest over {label}\n").into_bytes();
    // kubectl listens some moments after it starts; the guest's nc after exec returned.
    let back = env
        .wait_for(&format!("an echo through kubectl port-forward ({label})"), || {
            let message = message.clone();
            async move { round_trip(echo, &message).await.filter(|back| !back.is_empty()) }
        })
        .await;
    assert_eq!(String::from_utf8_lossy(&back), String::from_utf8_lossy(&message), "the guest's echo ({label})");
    // A second connection on the same session.
    let again = round_trip(echo, b"again\n").await;
    assert_eq!(again.as_deref(), Some(&b"again\n"[..]), "a second connection ({label})");

    // Nothing listens on the other port: the connection ends without data
    // and kubectl reports vmlet's error.
    let refused = round_trip(closed, b"anyone?\n").await;
    assert!(refused.as_ref().is_none_or(|back| back.is_empty()), "the closed port answered: {refused:?}");
    env.wait_for(&format!("kubectl to report the refused port ({label})"), || {
        let text = std::fs::read_to_string(&stderr_file).unwrap_or_default();
        async move { text.contains(&format!("error forwarding port {CLOSED_PORT}")).then_some(()) }
    })
    .await;
    drop(forward);
}

/// The WebSocket channel protocol (`v4.channel.k8s.io`, what kube-rs
/// speaks), which the API server passes through to vmlet as it is.
async fn echo_over_websocket_channels(env: &TestEnv, pod: &str) {
    let exchange = async {
        let mut forwarder = env.pods().portforward(pod, &[ECHO_PORT]).await.expect("the upgrade is accepted");
        let mut stream = forwarder.take_stream(ECHO_PORT).expect("a stream for the port");
        stream.write_all(b"over channels\n").await.unwrap();
        let mut back = vec![0u8; b"over channels\n".len()];
        stream.read_exact(&mut back).await.expect("the echo");
        drop(stream);
        forwarder.abort();
        back
    };
    let back = tokio::time::timeout(ROUND_TRIP, exchange).await.expect("an echo over WebSocket channels in time");
    assert_eq!(back, b"over channels\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_port_forward_reaches_a_guest_port_and_is_refused_for_pods_that_are_not_the_callers_vm() {
    let network = harness("VMLET_LIBVIRT_QEMU_NETWORK");
    let mut env = TestEnv::new("portfwd").await;
    let guest = guest_for(&env);
    let host = Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }
        .with("networks", json!([{"name": "lan", "network": network, "namespaces": [env.ns]}]));
    env.start_vmlet(&[host]);
    let mut spec = guest_vm_spec(&guest);
    spec.as_object_mut().unwrap().remove("image");
    spec["networks"] = json!([{"name": "lan"}]);
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    let pods = env.pods();
    env.wait_for(&format!("pod {pod} to report its IP (the guest's DHCP lease)"), || {
        let (pods, pod) = (pods.clone(), pod.clone());
        async move { pods.get_opt(&pod).await.ok()??.status?.pod_ip }
    })
    .await;

    // The echo: a persistent busybox nc that runs cat for each connection,
    // detached from the agent's output pipes so that exec returns.
    env.exec_stdout(
        &pod,
        &format!("setsid nc -ll -p {ECHO_PORT} -e /bin/cat </dev/null >/dev/null 2>&1 & echo started"),
    )
    .await;

    forward_and_echo(&env, &pod, &[], "websocket").await;
    forward_and_echo(&env, &pod, &[("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false")], "spdy").await;
    echo_over_websocket_channels(&env, &pod).await;

    // A tenant with every pod right in its own namespace only.
    let attacker = format!("{}-attacker", env.ns);
    let rules = json!([{"apiGroups": [""], "resources": ["pods", "pods/portforward", "pods/exec", "pods/log"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]);
    let tenant = common::tenant::tenant(&env, &attacker, rules).await;

    // Its token straight at vmlet's kubelet API for this namespace's VM
    // pod: 403 from vmlet's authorization (nodes/proxy), never an upgrade.
    let path = format!("/portForward/{}/{pod}", env.ns);
    let (status, body) =
        kubelet::get(env.kubelet_port_of(0), &path, Caller::Bearer(&tenant.token)).await.expect("vmlet answers");
    assert_eq!(status, 403, "the tenant's token at {path}: {body}");

    // A copy of the VM pod in the tenant's namespace (spec with its node,
    // labels, annotations) is no VirtualMachine's pod: port-forward to it
    // through the API, as the tenant, is refused and carries nothing.
    let victim = env.pods().get(&pod).await.unwrap();
    let mut copy: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "innocent", "namespace": attacker},
        "spec": victim.spec.clone().unwrap(),
    }))
    .unwrap();
    copy.metadata.labels = victim.metadata.labels.clone();
    copy.metadata.annotations = victim.metadata.annotations.clone();
    let tenant_pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(tenant.client.clone(), &attacker);
    tenant_pods.create(&Default::default(), &copy).await.expect("the tenant may create pods in its namespace");
    let reason = env.wait_pod_failed(&tenant_pods, "innocent").await;
    assert_eq!(reason.as_deref(), Some("NotAVirtualMachine"));
    // As the API server's kubelet client (allowed everything): vmlet itself refuses the pod.
    let path = format!("/portForward/{attacker}/innocent");
    let (status, body) = kubelet::get(env.kubelet_port_of(0), &path, Caller::ApiServer).await.expect("vmlet answers");
    assert_eq!(status, 403, "{path}: {body}");
    assert!(body.contains("not a VirtualMachine's pod"), "{body}");
    // Through the API as the tenant (kubectl itself would not try: the copy
    // is not Running): the upgrade is refused, nothing is forwarded.
    match tenant_pods.portforward("innocent", &[ECHO_PORT]).await {
        Err(e) => assert!(e.to_string().contains("403") || e.to_string().contains("orbidden"), "{e}"),
        Ok(_) => panic!("port-forward to the copy was upgraded"),
    }

    // Both sessions above reached vmlet as the transports they were meant to.
    let log = std::fs::read_to_string(env.dir.join("vmlet.log")).unwrap_or_default();
    for transport in ["websocket-spdy", "spdy", "websocket"] {
        let line = format!("port-forward session stream.transport=\"{transport}\"");
        assert!(log.contains(&line), "vmlet logged no {line:?}");
    }
}
