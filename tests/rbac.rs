//! vmlet under the identity `deploy/rbac.yaml` gives it (ServiceAccount
//! kube-system/vmlet and its ClusterRole), not the cluster admin's, as every
//! test's vmlet runs (`common::vmlet_identity`): it
//! registers its node, runs, stops and deletes a VM, and its kubelet API
//! authenticates bearer tokens (TokenReview) and authorizes callers
//! (SubjectAccessReview) in Webhook mode. A permission the role lacks shows
//! as a step that never happens, or as "forbidden" in vmlet's log, which the
//! test reads.

mod common;

use common::{cluster, test_driver_uri, Host, TestEnv};
use serde_json::json;
use std::process::Command;
use std::time::Duration;

/// Bound on one kubectl call.
const COMMAND: Duration = Duration::from_secs(60);

/// kubectl as the cluster admin, without a namespace (the manifests name
/// theirs); its stdout.
fn admin_kubectl(args: &[&str]) -> String {
    let cluster = cluster();
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(args);
    let out = common::deadline::output_within(&mut kubectl, COMMAND);
    assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `GET https://127.0.0.1:<port><path>` with `token` as bearer, checked
/// against the cluster CA: HTTP status and body.
async fn kubelet_get(port: u16, path: &str, token: &str) -> (u16, String) {
    common::kubelet::get(port, path, common::kubelet::Caller::Bearer(token)).await.expect("an answer")
}

#[tokio::test]
async fn vmlet_runs_vms_and_serves_its_kubelet_api_under_the_deployed_role() {
    let mut env = TestEnv::new("rbac").await;
    // Every test's vmlet runs as kube-system/vmlet (common::vmlet_identity);
    // this one names it, to be sure.
    env.vmlet_kubeconfig = Some(common::vmlet_identity().clone());
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    let node = env.node("a");
    env.wait_node_ready(&node).await;

    env.apply_vm("web", json!({"resources": {"cpu": 1, "memory": "256Mi"}}));
    let vm = env.wait_vm_phase("web", "Running").await;
    let pod = vm.status.and_then(|s| s.pod_name).expect("a running VM names its pod");

    // A bearer token straight at the kubelet API: TokenReview, then the
    // SubjectAccessReview of the user it names.
    let ns = env.ns.clone();
    let reader = format!("rbac-reader-{ns}");
    admin_kubectl(&["create", "serviceaccount", "reader", "-n", &ns]);
    admin_kubectl(&["create", "serviceaccount", "nobody", "-n", &ns]);
    admin_kubectl(&["create", "clusterrole", &reader, "--verb=get", "--resource=nodes/proxy"]);
    let subject = format!("--serviceaccount={ns}:reader");
    admin_kubectl(&["create", "clusterrolebinding", &reader, "--clusterrole", &reader, &subject]);
    let reader_token = admin_kubectl(&["create", "token", "reader", "-n", &ns]);
    let nobody_token = admin_kubectl(&["create", "token", "nobody", "-n", &ns]);
    let port = env.kubelet_port;
    let (status, body) = env
        .wait_for("the reader's binding to reach the authorizer", || async {
            let (status, body) = kubelet_get(port, "/pods", reader_token.trim()).await;
            (status == 200).then_some((status, body))
        })
        .await;
    assert!(status == 200 && body.contains(&pod), "{status}: {body}");
    let (status, body) = kubelet_get(port, "/pods", nobody_token.trim()).await;
    assert_eq!(status, 403, "a token without nodes/proxy is refused: {body}");
    let (status, body) = kubelet_get(port, "/pods", "not-a-token").await;
    assert_eq!(status, 401, "an unknown token is not authenticated: {body}");
    admin_kubectl(&["delete", "clusterrolebinding", &reader]);
    admin_kubectl(&["delete", "clusterrole", &reader]);

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true", "--timeout=120s"]);
    assert!(env.vms().get_opt("web").await.unwrap().is_none(), "vmlet removed its finalizer");

    let log = std::fs::read_to_string(env.dir.join("vmlet.log")).expect("vmlet's log");
    // (Its own refusals of the test's `nobody` are not the API server's.)
    let forbidden: Vec<&str> = log
        .lines()
        .filter(|l| (l.contains("forbidden") || l.contains("Forbidden")) && !l.contains("kubelet API request refused"))
        .collect();
    assert!(forbidden.is_empty(), "the role lacks something vmlet asked for:\n{}", forbidden.join("\n"));
}
