//! A hostile tenant: a namespace of its own and a ServiceAccount whose Role
//! grants only the rules given, in that namespace, with a client that
//! authenticates as it (through the API, not only kubectl).

use super::deadline::{run_with_stdin, KUBECTL};
use super::TestEnv;
use std::process::Command;

/// A tenant's namespace, token and client.
pub struct Tenant {
    /// Its namespace.
    pub namespace: String,
    /// A token of its ServiceAccount (for kubectl `--token`).
    pub token: String,
    /// A client that authenticates with the token only.
    pub client: kube::Client,
}

/// Create namespace `namespace`, ServiceAccount `tenant` in it and a Role
/// with `rules` (RBAC PolicyRules as JSON) bound to it.
pub async fn tenant(env: &TestEnv, namespace: &str, rules: serde_json::Value) -> Tenant {
    let setup = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "tenant", "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "tenant", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
         "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}]},
    ]});
    // Objects of several namespaces: no `-n` on this kubectl.
    let cluster = super::cluster();
    let mut kubectl = Command::new(cluster.bin.join("kubectl"));
    kubectl.env("KUBECONFIG", &cluster.kubeconfig).args(["apply", "-f", "-"]);
    let applied = run_with_stdin(&mut kubectl, serde_yaml::to_string(&setup).unwrap().as_bytes(), KUBECTL)
        .unwrap_or_else(|timed_out| panic!("{timed_out}"));
    assert!(applied.status.success(), "tenant setup: {}", String::from_utf8_lossy(&applied.stderr));
    let token = env.kubectl(&["create", "token", "tenant", "-n", namespace]).trim().to_owned();
    let client = client_with_token(&token).await;
    Tenant { namespace: namespace.to_owned(), token, client }
}

/// A client for the local control plane that authenticates with `token` only.
pub async fn client_with_token(token: &str) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(&super::cluster().kubeconfig).expect("read kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("kubeconfig");
    config.auth_info = kube::config::AuthInfo { token: Some(token.to_owned().into()), ..Default::default() };
    vmlet::api_client::client(config).expect("client")
}
