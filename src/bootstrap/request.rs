//! The two certificates a host asks for, as CertificateSigningRequest objects
//! (`certificates.k8s.io/v1`, <https://kubernetes.io/docs/reference/access-authn-authz/certificate-signing-requests/>):
//! what each says, and the name that makes a rerun find its own request.

use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PublicKeyData as _};
use std::collections::BTreeMap;

/// The signer of vmlet's client certificate (built into kube-controller-manager).
pub const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// The signer of the kubelet API's serving certificate; the API server never
/// approves its requests by itself.
pub const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";
/// The group of every vmlet client certificate (the certificate's O), which
/// `deploy/bootstrap-rbac.yaml` binds to vmlet's ClusterRole.
pub const CLIENT_GROUP: &str = "system:vmlets";
/// The group the `kubernetes.io/kubelet-serving` signer requires as O.
pub const SERVING_GROUP: &str = "system:nodes";
/// Annotation on each request: the host it is for.
pub const HOST_ANNOTATION: &str = "vmlet.io/host";

/// Which of a host's two certificates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Credential {
    /// vmlet's identity towards the API server: CN `system:vmlet:<host>`, O
    /// `system:vmlets`, signer [`CLIENT_SIGNER`].
    Client,
    /// The kubelet API's serving certificate: CN `system:node:<node>`, O
    /// `system:nodes`, SANs the node's addresses, signer [`SERVING_SIGNER`].
    Serving,
}

impl Credential {
    /// A short word for names and logs: `client` or `serving`.
    pub fn as_str(self) -> &'static str {
        match self {
            Credential::Client => "client",
            Credential::Serving => "serving",
        }
    }
}

/// What one certificate request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Which certificate.
    pub credential: Credential,
    /// The host it is for (names the request).
    pub host: String,
    /// Subject CN.
    pub common_name: String,
    /// Subject O.
    pub organization: String,
    /// Subject alternative names: IP addresses or DNS names (serving only).
    pub sans: Vec<String>,
    /// `spec.signerName`.
    pub signer: &'static str,
    /// `spec.usages`, as the CSR API spells them.
    pub usages: &'static [&'static str],
    /// `spec.expirationSeconds`: the lifetime asked for (the signer may give
    /// less; at least 600). `None`: the signer's default
    /// (kube-controller-manager `--cluster-signing-duration`, one year).
    pub expiration_seconds: Option<i32>,
}

impl Request {
    /// The client certificate of `host`: CN `system:vmlet:<host>`, O
    /// `system:vmlets`, usages digital signature and client auth.
    pub fn client(host: &str, expiration_seconds: Option<i32>) -> Request {
        Request {
            credential: Credential::Client,
            host: host.to_owned(),
            common_name: format!("system:vmlet:{host}"),
            organization: CLIENT_GROUP.to_owned(),
            sans: Vec::new(),
            signer: CLIENT_SIGNER,
            usages: &["digital signature", "client auth"],
            expiration_seconds,
        }
    }

    /// The serving certificate of the kubelet API on `host` for the node
    /// `node`: CN `system:node:<node>`, O `system:nodes`, usages digital
    /// signature, key encipherment and server auth; `sans` are the node's IP
    /// addresses and DNS names (the node name is added when missing).
    pub fn serving(host: &str, node: &str, sans: &[String], expiration_seconds: Option<i32>) -> Request {
        let mut all = sans.to_vec();
        if !all.iter().any(|san| san == node) {
            all.push(node.to_owned());
        }
        Request {
            credential: Credential::Serving,
            host: host.to_owned(),
            common_name: format!("system:node:{node}"),
            organization: SERVING_GROUP.to_owned(),
            sans: all,
            signer: SERVING_SIGNER,
            usages: &["digital signature", "key encipherment", "server auth"],
            expiration_seconds,
        }
    }

    /// The PEM PKCS#10 request (RFC 2986) for `key`: the subject and SANs,
    /// no other extension (the kubelet-serving signer refuses others).
    pub fn pem(&self, key: &KeyPair) -> Result<String, rcgen::Error> {
        let mut params = CertificateParams::new(self.sans.clone())?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::OrganizationName, self.organization.as_str());
        params.distinguished_name.push(DnType::CommonName, self.common_name.as_str());
        params.serialize_request(key)?.pem()
    }

    /// The request's object name: `vmlet-<client|serving>-<host>-<hash>`, where
    /// the hash (16 hex digits of SHA-256) covers the public key and every
    /// field of the request. The same key and flags give the same name, so a
    /// rerun finds the request it made before; a new key (renewal) or changed
    /// SANs give a new one. The host part is lowercased, characters outside
    /// `[a-z0-9.-]` become `-`, and it is cut to keep the name within 253
    /// characters (a DNS subdomain, as the API requires).
    pub fn name(&self, key: &KeyPair) -> String {
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        digest.update(&key.subject_public_key_info());
        for field in [self.signer, &self.common_name, &self.organization] {
            digest.update(&[0]);
            digest.update(field.as_bytes());
        }
        for san in &self.sans {
            digest.update(&[1]);
            digest.update(san.as_bytes());
        }
        for usage in self.usages {
            digest.update(&[2]);
            digest.update(usage.as_bytes());
        }
        digest.update(&self.expiration_seconds.unwrap_or(0).to_be_bytes());
        let hash: String = digest.finish().as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
        let host: String = self
            .host
            .to_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '-' })
            .take(200)
            .collect();
        let host = host.trim_matches(|c| c == '-' || c == '.');
        format!("vmlet-{}-{host}-{hash}", self.credential.as_str())
    }

    /// The CertificateSigningRequest object named `name` carrying `pem`.
    pub fn object(&self, name: &str, pem: &str) -> CertificateSigningRequest {
        CertificateSigningRequest {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                annotations: Some(BTreeMap::from([(HOST_ANNOTATION.to_owned(), self.host.clone())])),
                ..ObjectMeta::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(pem.as_bytes().to_vec()),
                signer_name: self.signer.to_owned(),
                usages: Some(self.usages.iter().map(|u| (*u).to_owned()).collect()),
                expiration_seconds: self.expiration_seconds,
                ..CertificateSigningRequestSpec::default()
            },
            status: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Subject attributes (CN, O) and SAN count of a PEM CSR, read by rcgen.
    fn parsed(pem: &str) -> rcgen::CertificateSigningRequestParams {
        rcgen::CertificateSigningRequestParams::from_pem(pem).unwrap()
    }

    #[test]
    fn a_client_request_names_the_host_and_the_vmlets_group() {
        let key = KeyPair::generate().unwrap();
        let request = Request::client("kvm-1", None);
        let csr = parsed(&request.pem(&key).unwrap());
        let subject = &csr.params.distinguished_name;
        assert_eq!(subject.get(&DnType::CommonName), Some(&"system:vmlet:kvm-1".into()));
        assert_eq!(subject.get(&DnType::OrganizationName), Some(&"system:vmlets".into()));
        assert!(csr.params.subject_alt_names.is_empty());
        let object = request.object("n", "PEM");
        assert_eq!(object.spec.signer_name, "kubernetes.io/kube-apiserver-client");
        assert_eq!(object.spec.usages.unwrap(), ["digital signature", "client auth"]);
    }

    #[test]
    fn a_serving_request_names_the_node_and_its_addresses() {
        let key = KeyPair::generate().unwrap();
        let request = Request::serving("kvm-1", "kvm-1", &["10.0.0.7".into(), "kvm-1.example".into()], Some(3600));
        let csr = parsed(&request.pem(&key).unwrap());
        let subject = &csr.params.distinguished_name;
        assert_eq!(subject.get(&DnType::CommonName), Some(&"system:node:kvm-1".into()));
        assert_eq!(subject.get(&DnType::OrganizationName), Some(&"system:nodes".into()));
        let sans: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .map(|san| match san {
                rcgen::SanType::IpAddress(ip) => ip.to_string(),
                rcgen::SanType::DnsName(name) => name.as_str().to_owned(),
                other => panic!("unexpected SAN {other:?}"),
            })
            .collect();
        assert_eq!(sans, ["10.0.0.7", "kvm-1.example", "kvm-1"]);
        let object = request.object("n", "PEM");
        assert_eq!(object.spec.signer_name, "kubernetes.io/kubelet-serving");
        assert_eq!(object.spec.usages.unwrap(), ["digital signature", "key encipherment", "server auth"]);
        assert_eq!(object.spec.expiration_seconds, Some(3600));
    }

    #[test]
    fn the_same_key_and_flags_give_the_same_name() {
        let key = KeyPair::generate().unwrap();
        let name = Request::client("kvm-1", None).name(&key);
        assert_eq!(name, Request::client("kvm-1", None).name(&key));
        assert!(name.starts_with("vmlet-client-kvm-1-") && name.len() == "vmlet-client-kvm-1-".len() + 16);
    }

    #[test]
    fn a_new_key_or_new_sans_give_a_new_name() {
        let key = KeyPair::generate().unwrap();
        let other = KeyPair::generate().unwrap();
        let request = Request::serving("kvm-1", "kvm-1", &["10.0.0.7".into()], None);
        assert_ne!(request.name(&key), request.name(&other));
        let moved = Request::serving("kvm-1", "kvm-1", &["10.0.0.8".into()], None);
        assert_ne!(request.name(&key), moved.name(&key));
        assert_ne!(Request::client("kvm-1", None).name(&key), request.name(&key));
    }

    #[test]
    fn a_host_name_becomes_a_valid_object_name() {
        let key = KeyPair::generate().unwrap();
        let name = Request::client("KVM_1.Example", None).name(&key);
        assert!(name.starts_with("vmlet-client-kvm-1.example-"), "{name}");
        let long = Request::client(&"a".repeat(400), None).name(&key);
        assert!(long.len() <= 253);
    }
}
