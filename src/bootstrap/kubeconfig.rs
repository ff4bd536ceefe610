//! Kubeconfigs of `vmlet bootstrap`: the cluster (server, CA) read from the
//! bootstrap kubeconfig, and vmlet's own kubeconfig written with its client
//! certificate and key inline.

use super::Error;
use kube::config::Kubeconfig;
use std::path::Path;

/// The cluster a kubeconfig's current context points at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterEntry {
    /// `server` (https URL).
    pub server: String,
    /// The CA bundle, base64 of PEM as in `certificate-authority-data`;
    /// `None` when the kubeconfig names none (the system roots are used).
    pub certificate_authority_data: Option<String>,
    /// `insecure-skip-tls-verify`, copied as it is.
    pub insecure_skip_tls_verify: Option<bool>,
}

/// The cluster of `kubeconfig`'s current context (read from `path`, for
/// messages); a `certificate-authority` file is read and inlined.
pub fn cluster_of(kubeconfig: &Kubeconfig, path: &Path) -> Result<ClusterEntry, Error> {
    let invalid = |what: String| Error::BootstrapKubeconfig { path: path.to_owned(), what };
    let context_name = kubeconfig.current_context.as_deref().ok_or_else(|| invalid("has no current-context".into()))?;
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| invalid(format!("has no context {context_name:?} (its current-context)")))?;
    let cluster =
        kubeconfig.clusters.iter().find(|c| c.name == context.cluster).and_then(|c| c.cluster.as_ref()).ok_or_else(
            || invalid(format!("has no cluster {:?} (named by context {context_name:?})", context.cluster)),
        )?;
    let server =
        cluster.server.clone().ok_or_else(|| invalid(format!("cluster {:?} has no server", context.cluster)))?;
    let certificate_authority_data = match (&cluster.certificate_authority_data, &cluster.certificate_authority) {
        (Some(data), _) => Some(data.clone()),
        (None, Some(file)) => {
            let file = Path::new(file);
            let pem = std::fs::read(file).map_err(|source| Error::ReadFile { path: file.to_owned(), source })?;
            Some(base64(&pem))
        }
        (None, None) => None,
    };
    Ok(ClusterEntry { server, certificate_authority_data, insecure_skip_tls_verify: cluster.insecure_skip_tls_verify })
}

/// vmlet's kubeconfig (YAML) for `cluster`, as user `user` with the PEM
/// client certificate and key inline (one file, so one rename replaces
/// both together).
pub fn render(cluster: &ClusterEntry, user: &str, certificate_pem: &[u8], key_pem: &[u8]) -> String {
    let mut entry = serde_json::json!({ "server": cluster.server });
    if let Some(ca) = &cluster.certificate_authority_data {
        entry["certificate-authority-data"] = ca.clone().into();
    }
    if let Some(insecure) = cluster.insecure_skip_tls_verify {
        entry["insecure-skip-tls-verify"] = insecure.into();
    }
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "default", "cluster": entry }],
        "users": [{ "name": user, "user": {
            "client-certificate-data": base64(certificate_pem),
            "client-key-data": base64(key_pem),
        }}],
        "contexts": [{ "name": "default", "context": { "cluster": "default", "user": user } }],
        "current-context": "default",
    });
    serde_yaml::to_string(&kubeconfig).expect("a JSON value serializes as YAML")
}

/// Standard base64 with padding (as kubeconfig `*-data` fields hold), by
/// way of the API machinery's `ByteString`.
fn base64(bytes: &[u8]) -> String {
    match serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec())) {
        Ok(serde_json::Value::String(encoded)) => encoded,
        _ => unreachable!("ByteString serializes as a base64 string"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOTSTRAP: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: { server: "https://127.0.0.1:6443", certificate-authority-data: Q0E= }
users:
- name: bootstrap
  user: { token: abcdef.0123456789abcdef }
contexts:
- name: boot
  context: { cluster: local, user: bootstrap }
current-context: boot
"#;

    #[test]
    fn the_cluster_comes_from_the_current_context() {
        let kubeconfig: Kubeconfig = serde_yaml::from_str(BOOTSTRAP).unwrap();
        let cluster = cluster_of(&kubeconfig, Path::new("b.kubeconfig")).unwrap();
        assert_eq!(cluster.server, "https://127.0.0.1:6443");
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
    }

    #[test]
    fn a_kubeconfig_without_current_context_is_refused_naming_the_file() {
        let mut kubeconfig: Kubeconfig = serde_yaml::from_str(BOOTSTRAP).unwrap();
        kubeconfig.current_context = None;
        let error = cluster_of(&kubeconfig, Path::new("b.kubeconfig")).unwrap_err().to_string();
        assert!(error.contains("b.kubeconfig") && error.contains("current-context"), "{error}");
    }

    #[test]
    fn the_written_kubeconfig_reads_back_with_the_same_cluster_and_credentials() {
        let kubeconfig: Kubeconfig = serde_yaml::from_str(BOOTSTRAP).unwrap();
        let cluster = cluster_of(&kubeconfig, Path::new("b")).unwrap();
        let yaml = render(&cluster, "system:vmlet:kvm-1", b"CERT", b"KEY");
        let written: Kubeconfig = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(cluster_of(&written, Path::new("k")).unwrap(), cluster);
        let user = written.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.client_certificate_data.as_deref(), Some("Q0VSVA=="));
        assert!(user.client_key_data.is_some());
    }
}
