//! Plain HTTPS requests to a test vmlet's kubelet API on 127.0.0.1, its
//! serving certificate checked against the cluster CA, as the API server's
//! kubelet client (its client certificate, in `system:masters`), with
//! another client certificate of the cluster CA, or with a bearer token.

use http_body_util::BodyExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Who asks.
#[derive(Clone, Copy)]
pub enum Caller<'a> {
    /// The API server's kubelet client certificate (`pki/kubelet-client.*`).
    ApiServer,
    /// The client certificate `pki/<name>.crt` (key `pki/<name>.key`), e.g.
    /// `metrics-server`, whose identity is its subject.
    Cert(&'a str),
    /// A bearer token, and no client certificate.
    Bearer(&'a str),
}

/// The control plane's certificates (`hack/cluster.sh`).
fn pki() -> PathBuf {
    super::cluster().kubeconfig.parent().unwrap().join("pki")
}

/// `GET <path>` on the kubelet API at `127.0.0.1:<port>` as `caller`: the
/// status and body, or `None` when no answer came within 30 s (not
/// listening yet, a broken connection).
pub async fn get(port: u16, path: &str, caller: Caller<'_>) -> Option<(u16, String)> {
    tokio::time::timeout(Duration::from_secs(30), request(port, path, caller)).await.ok()?
}

/// A TLS connection to the kubelet API at `127.0.0.1:<port>` as `caller`,
/// its serving certificate checked against the cluster CA; `None` when it
/// cannot be made (not listening, refused in the handshake).
pub async fn connect(port: u16, caller: Caller<'_>) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(pki().join("ca.crt")).ok()?).ok()?;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
    let cert = match caller {
        Caller::ApiServer => Some("kubelet-client"),
        Caller::Cert(name) => Some(name),
        Caller::Bearer(_) => None,
    };
    let config = match cert {
        Some(name) => {
            let chain: Vec<_> = CertificateDer::pem_file_iter(pki().join(format!("{name}.crt")))
                .ok()?
                .collect::<Result<_, _>>()
                .ok()?;
            let key = PrivateKeyDer::from_pem_file(pki().join(format!("{name}.key"))).ok()?;
            builder.with_client_auth_cert(chain, key).ok()?
        }
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .ok()
}

async fn request(port: u16, path: &str, caller: Caller<'_>) -> Option<(u16, String)> {
    let tls = connect(port, caller).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await.ok()?;
    tokio::spawn(conn);
    let mut request = hyper::Request::get(path).header("host", "127.0.0.1");
    if let Caller::Bearer(token) = caller {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = request.body(http_body_util::Empty::<hyper::body::Bytes>::new()).unwrap();
    let response = sender.send_request(request).await.ok()?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}
