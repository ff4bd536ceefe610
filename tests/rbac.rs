//! vmlet under the identities `deploy/rbac.yaml` gives it (ServiceAccount
//! kube-system/vmlet with the agent's and the controller's ClusterRoles,
//! kube-system/vmlet-agent with the agent's only), not the cluster admin's,
//! as every test's vmlet runs (`common::vmlet_identity`,
//! `common::agent_identity`): it
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
    let forbidden = forbidden_lines(&log);
    assert!(forbidden.is_empty(), "the role lacks something vmlet asked for:\n{}", forbidden.join("\n"));
}

/// The `forbidden` lines of a vmlet log (its own refusals of kubelet API
/// callers aside).
fn forbidden_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| (l.contains("forbidden") || l.contains("Forbidden")) && !l.contains("kubelet API request refused"))
        .collect()
}

/// `kubectl auth can-i <verb> <resource> [--subresource s] [-n ns]` as
/// `user`; `resource` may name a subresource as `pods/status`.
fn can_i(user: &str, verb: &str, resource: &str, namespace: Option<&str>) -> bool {
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let mut args = vec!["auth", "can-i", verb, resource, "--as", user];
    if !subresource.is_empty() {
        args.extend(["--subresource", subresource]);
    }
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    let cluster = cluster();
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(&args);
    let out = common::deadline::output_within(&mut kubectl, COMMAND);
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => true,
        "no" => false,
        other => panic!("kubectl {args:?}: {other} {}", String::from_utf8_lossy(&out.stderr)),
    }
}

#[tokio::test]
async fn an_agent_without_the_controllers_role_runs_its_hosts_vms_and_can_do_nothing_else() {
    let mut env = TestEnv::new("rbacagent").await;
    // The agent runs as kube-system/vmlet-agent (start_split); the
    // controller as kube-system/vmlet.
    env.start_split(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.wait_node_ready(&env.node("a")).await;
    env.apply_vm(
        "web",
        json!({"resources": {"cpu": 1, "memory": "256Mi"},
        "nodeSelector": {"kubernetes.io/hostname": env.node("a")}}),
    );
    env.wait_vm_phase("web", "Running").await;
    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.kubectl(&["delete", "virtualmachine/web", "--wait=true", "--timeout=120s"]);
    assert!(env.vms().get_opt("web").await.unwrap().is_none(), "the controller removed its finalizer");
    for log in ["vmlet.log", "controller.log"] {
        let text = std::fs::read_to_string(env.dir.join(log)).expect("a vmlet log");
        let forbidden = forbidden_lines(&text);
        assert!(forbidden.is_empty(), "{log}: the role lacks something vmlet asked for:\n{}", forbidden.join("\n"));
    }

    // What only the controller does, and what neither does, the agent may not.
    let agent = "system:serviceaccount:kube-system:vmlet-agent";
    let ns = Some(env.ns.as_str());
    for (verb, resource) in [
        ("create", "pods"),
        ("patch", "pods"),
        ("create", "jobs.batch"),
        ("create", "virtualmachines.vmlet.io"),
        ("delete", "virtualmachines.vmlet.io"),
        ("create", "persistentvolumeclaims"),
        ("get", "secrets"),
        ("get", "configmaps"),
        ("create", "endpointslices.discovery.k8s.io"),
        ("patch", "leases.coordination.k8s.io"),
    ] {
        assert!(!can_i(agent, verb, resource, ns), "the agent may {verb} {resource}");
    }
    for (verb, resource) in [("update", "pods/status"), ("update", "virtualmachines.vmlet.io/status")] {
        assert!(can_i(agent, verb, resource, ns), "the agent may not {verb} {resource}");
    }
    assert!(can_i(agent, "create", "persistentvolumes", None), "the agent may not create persistentvolumes");
    assert!(!can_i(agent, "delete", "nodes", None), "the agent may delete nodes");
}
