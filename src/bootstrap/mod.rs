//! `vmlet bootstrap`: give a hypervisor host its own identity, as the
//! kubelet's TLS bootstrap does (<https://kubernetes.io/docs/reference/access-authn-authz/kubelet-tls-bootstrapping/>).
//!
//! Expected flow: with a bootstrap kubeconfig that may only create, get and
//! watch CertificateSigningRequests (ClusterRole `system:node-bootstrapper`,
//! see `deploy/bootstrap-rbac.yaml`), it
//! 1. makes an ECDSA P-256 key (kept as `pki/<name>.key.next`, mode 0600),
//! 2. creates a `certificates.k8s.io/v1` CertificateSigningRequest for it
//!    ([`request`]): the client certificate `system:vmlet:<host>` / O
//!    `system:vmlets` from `kubernetes.io/kube-apiserver-client`, and with
//!    `--serving` the kubelet API's serving certificate `system:node:<node>` /
//!    O `system:nodes` with the node's addresses as SANs from
//!    `kubernetes.io/kubelet-serving`,
//! 3. prints the approval command and watches the request until it has a
//!    certificate, is Denied or Failed, or `--wait-seconds` pass,
//! 4. writes key, certificate and (client) vmlet's kubeconfig under
//!    `--out-dir`, each by temporary file and rename ([`files`]).
//!
//! Guarantees: a rerun does nothing while the certificates have more than a
//! third of their lifetime left; it resumes a request that is still pending
//! (same key, same object name); it renews, with a new key, once less than a
//! third is left ([`certificate::Validity::renew_at`]). Renewal authenticates
//! with vmlet's own kubeconfig while its certificate is valid, so the
//! bootstrap token may have expired by then.
//!
//! Caveats: the API server approves neither request by itself; an
//! administrator (or an approver controller) runs `kubectl certificate
//! approve`. `vmlet run` reads its kubeconfig at start: after a client
//! renewal it must be restarted (`deploy/systemd/vmlet-restart.path` does).
//! The kubelet API re-reads its serving certificate files when they change
//! ([`crate::api::tls`]).
//!
//! Errors name the flag or file and the fix ([`Error`]); keys are never logged.

pub mod certificate;
pub mod files;
pub mod kubeconfig;
pub mod request;

use files::{Paths, Plan};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use rcgen::{KeyPair, PublicKeyData as _};
use request::{Credential, Request};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use tracing::{info, warn};

/// The flags of `vmlet bootstrap`.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// Kubeconfig allowed to create, get and watch CertificateSigningRequests
    /// (e.g. a bootstrap token's). Needed for the first run, and whenever
    /// vmlet's own client certificate has expired; otherwise vmlet's own
    /// kubeconfig is used.
    #[arg(long, env = "VMLET_BOOTSTRAP_KUBECONFIG")]
    pub bootstrap_kubeconfig: Option<PathBuf>,
    /// The host's name: the client certificate's CN is `system:vmlet:<host>`.
    #[arg(long)]
    pub host: String,
    /// Where the key, certificates and kubeconfig go.
    #[arg(long, default_value = "/etc/vmlet")]
    pub out_dir: PathBuf,
    /// Also obtain the kubelet API's serving certificate
    /// (`kubernetes.io/kubelet-serving`; always approved by hand).
    #[arg(long)]
    pub serving: bool,
    /// The node name of the serving certificate (CN `system:node:<node>`);
    /// default: `--host`.
    #[arg(long)]
    pub node_name: Option<String>,
    /// A subject alternative name of the serving certificate: an IP address
    /// or DNS name the API server uses to reach the kubelet API (the node's
    /// InternalIP). Repeat for more; the node name is always included.
    #[arg(long = "serving-san", value_name = "IP_OR_NAME")]
    pub serving_sans: Vec<String>,
    /// Seconds to wait for each certificate (approval and signing) before
    /// giving up; a rerun resumes the same request.
    #[arg(long, default_value_t = 900)]
    pub wait_seconds: u64,
    /// Lifetime to ask for, in seconds (`spec.expirationSeconds`, at least
    /// 600); default: the signer's (one year with kube-controller-manager).
    #[arg(long)]
    pub expiration_seconds: Option<i32>,
}

/// Why `vmlet bootstrap` failed. [`Error::exit_code`] is 64 for a bad flag or
/// bootstrap kubeconfig, 1 otherwise.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag has a value that cannot work.
    #[error("--{flag} {value:?}: {problem}")]
    InvalidFlag {
        /// The flag, without dashes.
        flag: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what to give instead.
        problem: String,
    },
    /// No credentials to talk to the API server.
    #[error(
        "--bootstrap-kubeconfig is required: {kubeconfig} holds no valid vmlet client certificate yet ({why}); \
         give a kubeconfig allowed to create CertificateSigningRequests (see deploy/bootstrap-rbac.yaml)"
    )]
    NoCredentials {
        /// vmlet's own kubeconfig.
        kubeconfig: PathBuf,
        /// Why it cannot be used.
        why: String,
    },
    /// The kubeconfig cannot be read or used.
    #[error("kubeconfig {path}: {source}; check --bootstrap-kubeconfig")]
    ReadKubeconfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig lacks what vmlet's own kubeconfig copies from it.
    #[error("kubeconfig {path} {what}; check --bootstrap-kubeconfig")]
    BootstrapKubeconfig {
        /// The file.
        path: PathBuf,
        /// What is missing.
        what: String,
    },
    /// The API client could not be built from the kubeconfig.
    #[error("connecting with kubeconfig {path}: {source}")]
    Connect {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("writing {path}: {source}; --out-dir must be writable (root for /etc/vmlet)")]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A key file holds no usable key.
    #[error("{path} is not a PEM private key ({reason}); delete it and run vmlet bootstrap again for a new key")]
    BadKey {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A key or request could not be built.
    #[error("building the {credential} certificate request: {source}")]
    BuildRequest {
        /// `client` or `serving`.
        credential: &'static str,
        /// The cause.
        #[source]
        source: rcgen::Error,
    },
    /// The request could not be created or read.
    #[error(
        "CertificateSigningRequest {name}: {operation} failed: {source}; the identity of the kubeconfig needs \
         create, get, list and watch on certificatesigningrequests (ClusterRole system:node-bootstrapper)"
    )]
    Api {
        /// The request's name.
        name: String,
        /// `create`, `get` or `watch`.
        operation: &'static str,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The watch of the request ended in an error.
    #[error("CertificateSigningRequest {name}: watching failed: {source}; run vmlet bootstrap again to resume")]
    Watch {
        /// The request's name.
        name: String,
        /// The cause.
        #[source]
        source: kube::runtime::wait::Error,
    },
    /// The request was denied.
    #[error(
        "CertificateSigningRequest {name} was denied: {reason}: {message}; fix the cause, then delete {next_key} \
         (and the request: kubectl delete csr {name}) and run vmlet bootstrap again"
    )]
    Denied {
        /// The request's name.
        name: String,
        /// The Denied condition's reason.
        reason: String,
        /// Its message.
        message: String,
        /// The pending key, which names the request.
        next_key: PathBuf,
    },
    /// The signer failed the request.
    #[error(
        "CertificateSigningRequest {name} failed: {reason}: {message}; fix the cause, then delete {next_key} \
         (and the request: kubectl delete csr {name}) and run vmlet bootstrap again"
    )]
    Failed {
        /// The request's name.
        name: String,
        /// The Failed condition's reason.
        reason: String,
        /// Its message.
        message: String,
        /// The pending key, which names the request.
        next_key: PathBuf,
    },
    /// No certificate within `--wait-seconds`.
    #[error(
        "CertificateSigningRequest {name} has no certificate after {seconds} s (--wait-seconds); approve it \
         (kubectl certificate approve {name}) and run vmlet bootstrap again: it resumes the same request"
    )]
    TimedOut {
        /// The request's name.
        name: String,
        /// The wait.
        seconds: u64,
    },
    /// The signer's certificate is not one for the request's key.
    #[error("CertificateSigningRequest {name}: the issued certificate {problem}; delete the request and run vmlet bootstrap again")]
    BadCertificate {
        /// The request's name.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

/// Exit status of a bad command line or bootstrap kubeconfig (sysexits EX_USAGE).
pub const EX_USAGE: u8 = 64;

impl Error {
    /// The process exit status: [`EX_USAGE`] for a bad flag or bootstrap
    /// kubeconfig, 1 for the rest.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::InvalidFlag { .. }
            | Error::NoCredentials { .. }
            | Error::ReadKubeconfig { .. }
            | Error::BootstrapKubeconfig { .. } => EX_USAGE,
            _ => 1,
        }
    }
}

/// What happened to one certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It was good; nothing was done until `renew_at`.
    Kept {
        /// Which certificate.
        credential: Credential,
        /// When a run will renew it.
        renew_at: SystemTime,
    },
    /// A new certificate was written.
    Issued {
        /// Which certificate.
        credential: Credential,
        /// The request it came from.
        request: String,
    },
}

/// The state of a request as its status tells it (the CSR API's conditions
/// and `status.certificate`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestState {
    /// Not decided, or approved and not yet signed.
    Pending {
        /// The Approved condition is there.
        approved: bool,
    },
    /// The signer wrote the certificate (PEM).
    Issued(Vec<u8>),
    /// Condition Denied: reason, message.
    Denied(String, String),
    /// Condition Failed: reason, message.
    Failed(String, String),
}

/// Read a request's status: Denied or Failed win over a certificate.
pub fn state_of(csr: &CertificateSigningRequest) -> RequestState {
    let status = csr.status.as_ref();
    let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
    let holds = |type_: &str| conditions.iter().find(|c| c.type_ == type_ && c.status == "True");
    let text = |c: &k8s_openapi::api::certificates::v1::CertificateSigningRequestCondition| {
        (c.reason.clone().unwrap_or_default(), c.message.clone().unwrap_or_default())
    };
    if let Some(denied) = holds("Denied") {
        let (reason, message) = text(denied);
        return RequestState::Denied(reason, message);
    }
    if let Some(failed) = holds("Failed") {
        let (reason, message) = text(failed);
        return RequestState::Failed(reason, message);
    }
    match status.and_then(|s| s.certificate.as_ref()) {
        Some(certificate) if !certificate.0.is_empty() => RequestState::Issued(certificate.0.clone()),
        _ => RequestState::Pending { approved: holds("Approved").is_some() },
    }
}

/// Run `vmlet bootstrap` with `args`: every certificate it is asked for is
/// kept, resumed or requested as the module documentation says.
pub async fn run(args: &Args) -> Result<Vec<Outcome>, Error> {
    let requests = requests(args)?;
    let now = SystemTime::now();
    let vmlet_kubeconfig = files::kubeconfig(&args.out_dir);
    let mut plans = Vec::new();
    for request in &requests {
        let paths = Paths::of(&args.out_dir, request.credential);
        let mut on_disk = files::read(&paths)?;
        if request.credential == Credential::Client && on_disk.current.is_some() && !vmlet_kubeconfig.exists() {
            on_disk.current = None;
            on_disk.unusable = Some(format!("{} is missing", vmlet_kubeconfig.display()));
        }
        let plan = files::plan(&on_disk, now);
        plans.push((request, paths, on_disk, plan));
    }
    let mut outcomes = Vec::new();
    if plans.iter().all(|(_, _, _, plan)| matches!(plan, Plan::Keep { .. })) {
        for (request, _, _, plan) in plans {
            if let Plan::Keep { renew_at } = plan {
                info!(credential = request.credential.as_str(), renew_at = %humanize(renew_at), "certificate is current");
                outcomes.push(Outcome::Kept { credential: request.credential, renew_at });
            }
        }
        return Ok(outcomes);
    }
    // vmlet's own identity while its certificate is valid, else the bootstrap one.
    let client_valid = plans
        .iter()
        .find(|(r, ..)| r.credential == Credential::Client)
        .and_then(|(_, _, on_disk, _)| on_disk.current.as_ref());
    let credentials = match client_valid {
        Some(facts) if facts.validity.is_valid_at(now) => vmlet_kubeconfig.clone(),
        _ => args.bootstrap_kubeconfig.clone().ok_or_else(|| Error::NoCredentials {
            kubeconfig: vmlet_kubeconfig.clone(),
            why: plans
                .iter()
                .find(|(r, ..)| r.credential == Credential::Client)
                .map(|(_, _, _, plan)| match plan {
                    Plan::ResumeWithNextKey { why } | Plan::RequestWithNewKey { why } => why.clone(),
                    Plan::Keep { .. } => "its certificate expired".into(),
                })
                .unwrap_or_default(),
        })?,
    };
    info!(kubeconfig = %credentials.display(), "authenticating with");
    let kubeconfig = Kubeconfig::read_from(&credentials)
        .map_err(|source| Error::ReadKubeconfig { path: credentials.clone(), source })?;
    let cluster = kubeconfig::cluster_of(&kubeconfig, &credentials)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| Error::ReadKubeconfig { path: credentials.clone(), source })?;
    let client =
        kube::Client::try_from(config).map_err(|source| Error::Connect { path: credentials.clone(), source })?;
    let api: Api<CertificateSigningRequest> = Api::all(client);
    let wait = Duration::from_secs(args.wait_seconds);
    for (request, paths, _, plan) in plans {
        let why = match plan {
            Plan::Keep { renew_at } => {
                info!(credential = request.credential.as_str(), renew_at = %humanize(renew_at), "certificate is current");
                outcomes.push(Outcome::Kept { credential: request.credential, renew_at });
                continue;
            }
            Plan::ResumeWithNextKey { why } | Plan::RequestWithNewKey { why } => why,
        };
        info!(credential = request.credential.as_str(), host = %request.host, %why, "requesting a certificate");
        let key = pending_key(&paths, request.credential)?;
        let name = request.name(&key);
        let pem = obtain(&api, request, &key, &name, &paths, wait).await?;
        store(request, &key, &name, &pem, &paths, &args.out_dir, &cluster)?;
        println!(
            "{}: wrote {} (CertificateSigningRequest {name})",
            request.credential.as_str(),
            paths.certificate.display()
        );
        outcomes.push(Outcome::Issued { credential: request.credential, request: name });
    }
    Ok(outcomes)
}

/// The requests `args` ask for, after checking the flags.
fn requests(args: &Args) -> Result<Vec<Request>, Error> {
    let invalid = |flag, value: &str, problem: &str| Error::InvalidFlag {
        flag,
        value: value.to_owned(),
        problem: problem.to_owned(),
    };
    if args.host.is_empty() || args.host.contains(char::is_whitespace) {
        return Err(invalid("host", &args.host, "give the host's name (no spaces), as its node is named"));
    }
    if let Some(seconds) = args.expiration_seconds.filter(|s| *s < 600) {
        return Err(invalid("expiration-seconds", &seconds.to_string(), "the CSR API's minimum is 600"));
    }
    let mut requests = vec![Request::client(&args.host, args.expiration_seconds)];
    if args.serving {
        let node = args.node_name.as_deref().unwrap_or(&args.host);
        let request = Request::serving(&args.host, node, &args.serving_sans, args.expiration_seconds);
        if let Some(bad) = args.serving_sans.iter().find(|san| !is_ip_or_dns_name(san)) {
            return Err(invalid("serving-san", bad, "give an IP address or a DNS name (RFC 1123)"));
        }
        requests.push(request);
    } else if !args.serving_sans.is_empty() || args.node_name.is_some() {
        return Err(invalid("serving", "false", "--serving-san and --node-name need --serving"));
    }
    Ok(requests)
}

/// Whether `san` is an IP address or a DNS name (RFC 1123 labels of at most
/// 63 letters, digits and hyphens, at most 253 characters in all).
fn is_ip_or_dns_name(san: &str) -> bool {
    if san.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    !san.is_empty() && san.len() <= 253 && san.split('.').all(label)
}

/// The pending key of `paths`, made (ECDSA P-256) and saved with mode 0600
/// when there is none.
fn pending_key(paths: &Paths, credential: Credential) -> Result<KeyPair, Error> {
    if paths.next_key.exists() {
        return files::read_key(&paths.next_key);
    }
    let key = KeyPair::generate().map_err(|source| Error::BuildRequest { credential: credential.as_str(), source })?;
    files::write_atomically(&paths.next_key, key.serialize_pem().as_bytes(), 0o600)?;
    Ok(key)
}

/// The certificate (PEM) for `request` and `key`: find or create the request
/// `name`, then watch it until it is issued, denied or failed, all within `wait`.
async fn obtain(
    api: &Api<CertificateSigningRequest>,
    request: &Request,
    key: &KeyPair,
    name: &str,
    paths: &Paths,
    wait: Duration,
) -> Result<Vec<u8>, Error> {
    let api_error = |operation| move |source| Error::Api { name: name.to_owned(), operation, source };
    let within = async {
        let existing = api.get_opt(name).await.map_err(api_error("get"))?;
        let state = match existing {
            Some(csr) => {
                info!(csr.name = name, "found the request made before");
                state_of(&csr)
            }
            None => {
                let pem = request
                    .pem(key)
                    .map_err(|source| Error::BuildRequest { credential: request.credential.as_str(), source })?;
                match api.create(&PostParams::default(), &request.object(name, &pem)).await {
                    Ok(_) => info!(csr.name = name, signer = request.signer, "created the request"),
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(e) => return Err(api_error("create")(e)),
                }
                RequestState::Pending { approved: false }
            }
        };
        let state = match state {
            RequestState::Pending { approved } => {
                if !approved {
                    println!(
                        "{}: CertificateSigningRequest {name} awaits approval; approve it with:\n  kubectl certificate approve {name}",
                        request.credential.as_str()
                    );
                }
                let decided = |csr: Option<&CertificateSigningRequest>| {
                    csr.is_some_and(|csr| !matches!(state_of(csr), RequestState::Pending { .. }))
                };
                let csr = kube::runtime::wait::await_condition(api.clone(), name, decided)
                    .await
                    .map_err(|source| Error::Watch { name: name.to_owned(), source })?;
                csr.as_ref().map_or(RequestState::Pending { approved: false }, state_of)
            }
            decided => decided,
        };
        let next_key = paths.next_key.clone();
        match state {
            RequestState::Issued(pem) => Ok(pem),
            RequestState::Denied(reason, message) => {
                Err(Error::Denied { name: name.to_owned(), reason, message, next_key })
            }
            RequestState::Failed(reason, message) => {
                Err(Error::Failed { name: name.to_owned(), reason, message, next_key })
            }
            RequestState::Pending { .. } => Err(Error::TimedOut { name: name.to_owned(), seconds: wait.as_secs() }),
        }
    };
    tokio::time::timeout(wait, within)
        .await
        .unwrap_or_else(|_| Err(Error::TimedOut { name: name.to_owned(), seconds: wait.as_secs() }))
}

/// Check that `pem` is a certificate for `key`, then make them current:
/// the pending key becomes the key, the certificate is written, and for the
/// client vmlet's kubeconfig too (each by temporary file and rename).
fn store(
    request: &Request,
    key: &KeyPair,
    name: &str,
    pem: &[u8],
    paths: &Paths,
    out: &Path,
    cluster: &kubeconfig::ClusterEntry,
) -> Result<(), Error> {
    let bad = |problem: String| Error::BadCertificate { name: name.to_owned(), problem };
    let facts = certificate::facts_from_pem(pem).map_err(|e| bad(format!("does not parse: {e}")))?;
    let public_key = certificate::public_key_contents(&key.subject_public_key_info()).map_err(|e| bad(e.to_owned()))?;
    if facts.public_key != public_key {
        return Err(bad("is not for the request's key".into()));
    }
    if facts.validity.not_after <= SystemTime::now() {
        warn!(csr.name = name, "the issued certificate has already expired; check the clocks");
    }
    files::promote(&paths.next_key, &paths.key)?;
    files::write_atomically(&paths.certificate, pem, 0o644)?;
    if request.credential == Credential::Client {
        let user = &request.common_name;
        let yaml = kubeconfig::render(cluster, user, pem, key.serialize_pem().as_bytes());
        files::write_atomically(&files::kubeconfig(out), yaml.as_bytes(), 0o600)?;
    }
    info!(
        csr.name = name,
        credential = request.credential.as_str(),
        renew_at = %humanize(facts.validity.renew_at()),
        "certificate written"
    );
    Ok(())
}

/// `instant` as seconds since the Unix epoch (for logs).
fn humanize(instant: SystemTime) -> String {
    let seconds = instant.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("@{seconds}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::certificates::v1::{CertificateSigningRequestCondition, CertificateSigningRequestStatus};

    fn csr(conditions: &[(&str, &str)], certificate: &[u8]) -> CertificateSigningRequest {
        let conditions = conditions
            .iter()
            .map(|(type_, reason)| CertificateSigningRequestCondition {
                type_: (*type_).into(),
                status: "True".into(),
                reason: Some((*reason).into()),
                message: Some(format!("{reason} says so")),
                ..Default::default()
            })
            .collect();
        CertificateSigningRequest {
            status: Some(CertificateSigningRequestStatus {
                conditions: Some(conditions),
                certificate: Some(k8s_openapi::ByteString(certificate.to_vec())),
            }),
            ..Default::default()
        }
    }

    fn args() -> Args {
        Args {
            bootstrap_kubeconfig: None,
            host: "kvm-1".into(),
            out_dir: "/nonexistent".into(),
            serving: false,
            node_name: None,
            serving_sans: vec![],
            wait_seconds: 1,
            expiration_seconds: None,
        }
    }

    #[test]
    fn a_request_without_decision_is_pending() {
        assert_eq!(state_of(&CertificateSigningRequest::default()), RequestState::Pending { approved: false });
        assert_eq!(state_of(&csr(&[("Approved", "KubectlApprove")], b"")), RequestState::Pending { approved: true });
    }

    #[test]
    fn an_approved_request_with_a_certificate_is_issued() {
        assert_eq!(state_of(&csr(&[("Approved", "KubectlApprove")], b"PEM")), RequestState::Issued(b"PEM".to_vec()));
    }

    #[test]
    fn denied_and_failed_requests_say_why() {
        let denied = state_of(&csr(&[("Denied", "KubectlDeny")], b""));
        assert_eq!(denied, RequestState::Denied("KubectlDeny".into(), "KubectlDeny says so".into()));
        let failed = state_of(&csr(&[("Approved", "A"), ("Failed", "SignerValidationFailure")], b"PEM"));
        assert!(matches!(failed, RequestState::Failed(reason, _) if reason == "SignerValidationFailure"));
    }

    #[test]
    fn flags_that_cannot_work_are_refused_naming_the_flag() {
        let short = Args { expiration_seconds: Some(60), ..args() };
        assert!(requests(&short).unwrap_err().to_string().starts_with("--expiration-seconds"));
        let stray = Args { serving_sans: vec!["10.0.0.1".into()], ..args() };
        assert!(requests(&stray).unwrap_err().to_string().contains("need --serving"));
        let bad = Args { serving: true, serving_sans: vec!["not a name".into()], ..args() };
        let error = requests(&bad).unwrap_err();
        assert!(error.to_string().starts_with("--serving-san"), "{error}");
        assert_eq!(error.exit_code(), EX_USAGE);
    }

    #[test]
    fn serving_asks_for_both_certificates() {
        let both = requests(&Args { serving: true, serving_sans: vec!["10.0.0.1".into()], ..args() }).unwrap();
        assert_eq!(both.iter().map(|r| r.credential).collect::<Vec<_>>(), [Credential::Client, Credential::Serving]);
        assert_eq!(both[1].common_name, "system:node:kvm-1");
    }

    #[tokio::test]
    async fn the_first_run_without_a_bootstrap_kubeconfig_says_which_flag_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let error = run(&Args { out_dir: dir.path().into(), ..args() }).await.unwrap_err();
        assert!(error.to_string().starts_with("--bootstrap-kubeconfig is required"), "{error}");
        assert_eq!(error.exit_code(), EX_USAGE);
    }
}
