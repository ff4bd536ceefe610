//! TLS of the kubelet API: the serving certificate (from files, reloaded when
//! they change ([`super::serving_cert`]), or self-signed
//! as a logged fallback), client-certificate verification against the client
//! CA, and the user a client certificate names (CN = user, O = groups).

use super::auth::User;
use super::serving_cert::ServingCertificate;
use super::{ApiConfig, ApiError};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::path::Path;
use std::sync::Arc;

fn read_error(path: &Path, e: impl std::fmt::Display) -> ApiError {
    ApiError::ReadFile { path: path.to_owned(), source: std::io::Error::other(e.to_string()) }
}

/// Read every certificate of a PEM file.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, ApiError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| read_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| read_error(path, e))?;
    if certs.is_empty() {
        return Err(read_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The rustls server configuration for `config`.
pub fn server_config(config: &ApiConfig) -> Result<ServerConfig, ApiError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ApiError::Tls(e.to_string()))?;
    let builder = match &config.client_ca_file {
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certificates(path)? {
                roots.add(cert).map_err(|e| read_error(path, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .allow_unauthenticated()
                .build()
                .map_err(|e| ApiError::Tls(format!("client CA {}: {e}", path.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut tls = match (&config.tls_cert_file, &config.tls_key_file) {
        // Reloaded when the files change (renewed by `vmlet bootstrap`).
        (Some(cert), Some(key)) => builder.with_cert_resolver(Arc::new(ServingCertificate::load(cert, key, provider)?)),
        _ => {
            let (chain, key) = self_signed(&config.serving_cert_sans)?;
            builder.with_single_cert(chain, key).map_err(|e| ApiError::Tls(e.to_string()))?
        }
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tls)
}

/// A self-signed serving certificate for `sans` (IPs or DNS names).
pub fn self_signed(sans: &[String]) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ApiError> {
    let mut sans = sans.to_vec();
    if sans.is_empty() {
        sans.push("localhost".into());
    }
    let certified = rcgen::generate_simple_self_signed(sans.clone()).map_err(|e| ApiError::Tls(e.to_string()))?;
    tracing::warn!(
        sans = ?sans,
        "kubelet API: no tlsCertFile/tlsKeyFile configured; serving a SELF-SIGNED certificate \
         (the API server does not verify kubelet certificates by default, but clients that do will refuse it)"
    );
    let key =
        PrivateKeyDer::try_from(certified.signing_key.serialize_der()).map_err(|e| ApiError::Tls(e.to_string()))?;
    Ok((vec![certified.cert.der().clone()], key))
}

/// The user a verified client certificate names: CN is the user name, each O a
/// group (as the API server's x509 authenticator).
pub fn identity_from_certificate(cert: &[u8]) -> Result<User, &'static str> {
    let mut tbs = tbs_at_validity(cert)?;
    tbs.element()?; // validity
    let mut subject = tbs.sequence()?;
    let (mut name, mut groups) = (None, Vec::new());
    while !subject.0.is_empty() {
        let (tag, set) = subject.element()?;
        if tag != 0x31 {
            return Err("subject RDN is not a SET");
        }
        let mut set = Der(set);
        while !set.0.is_empty() {
            let mut attribute = set.sequence()?;
            let (tag, oid) = attribute.element()?;
            let (_, value) = attribute.element()?;
            if tag != 0x06 {
                return Err("attribute type is not an OID");
            }
            let value = String::from_utf8_lossy(value).into_owned();
            match oid {
                [0x55, 0x04, 0x03] => name = Some(value),
                [0x55, 0x04, 0x0a] => groups.push(value),
                _ => {}
            }
        }
    }
    let name = name.filter(|n| !n.is_empty()).ok_or("the subject has no common name")?;
    Ok(User { name, uid: None, groups, extra: Default::default() })
}

/// A minimal DER reader: enough to walk to a certificate's subject (and, for
/// [`crate::bootstrap`], its validity and public key).
/// The TBSCertificate of DER certificate `cert` (RFC 5280 §4.1), read up to
/// its `validity` (version, serialNumber, signature and issuer skipped).
pub(crate) fn tbs_at_validity(cert: &[u8]) -> Result<Der<'_>, &'static str> {
    let mut der = Der(cert);
    let mut certificate = der.sequence()?;
    let mut tbs = certificate.sequence()?;
    if tbs.peek() == Some(0xa0) {
        tbs.element()?; // [0] version
    }
    tbs.element()?; // serialNumber
    tbs.element()?; // signature algorithm
    tbs.element()?; // issuer
    Ok(tbs)
}

pub(crate) struct Der<'a>(pub(crate) &'a [u8]);

impl<'a> Der<'a> {
    pub(crate) fn peek(&self) -> Option<u8> {
        self.0.first().copied()
    }

    pub(crate) fn element(&mut self) -> Result<(u8, &'a [u8]), &'static str> {
        let short = "truncated DER";
        let (&tag, rest) = self.0.split_first().ok_or(short)?;
        let (&first, mut rest) = rest.split_first().ok_or(short)?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return Err("unsupported DER length");
            }
            let len = rest[..n].iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
            rest = &rest[n..];
            len
        };
        if rest.len() < len {
            return Err(short);
        }
        let (content, after) = rest.split_at(len);
        self.0 = after;
        Ok((tag, content))
    }

    pub(crate) fn sequence(&mut self) -> Result<Der<'a>, &'static str> {
        match self.element()? {
            (0x30, content) => Ok(Der(content)),
            _ => Err("expected a DER SEQUENCE"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_certificate_names_its_user_and_groups() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "system:masters");
        params.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let user = identity_from_certificate(cert.der()).unwrap();
        assert_eq!(user.name, "kube-apiserver-kubelet-client");
        assert_eq!(user.groups, ["system:masters"]);
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert!(identity_from_certificate(&[0x30, 0x82, 0xff]).is_err());
        assert!(identity_from_certificate(&[]).is_err());
    }

    #[test]
    fn the_self_signed_fallback_builds_a_server_config() {
        let config = ApiConfig { serving_cert_sans: vec!["127.0.0.1".into(), "host-a".into()], ..Default::default() };
        let tls = server_config(&config).unwrap();
        assert_eq!(tls.alpn_protocols, [b"http/1.1".to_vec()]);
    }
}
