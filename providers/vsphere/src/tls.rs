//! TLS trust for a vCenter: a CA file, or the SHA-256 thumbprint of the
//! server's certificate. There is no mode without either.
//!
//! A thumbprint pins the certificate itself, as vSphere's own clients do
//! (govc's `GOVC_TLS_KNOWN_HOSTS`, ESXi host thumbprints): the host name in
//! the URL is not checked against it and expiry does not matter, but the
//! handshake signature must verify with the pinned certificate's key. A
//! mismatch ends the handshake, so no request (no credentials) is sent; the
//! certificate's thumbprint is remembered to name it in the error.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::Error;

/// How the server's certificate is trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// PEM file with one or more CA certificates (config field `ca_file`);
    /// the certificate must chain to one of them and name the URL's host.
    CaFile(PathBuf),
    /// SHA-256 thumbprint of the server's certificate (config field `thumbprint`).
    Thumbprint(Thumbprint),
}

/// The SHA-256 digest of a DER certificate. Parsed from 32 hex byte pairs
/// with or without `:` separators, any case; shown as vSphere shows it
/// (`AB:CD:…`, upper case).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Thumbprint(pub [u8; 32]);

impl Thumbprint {
    /// The thumbprint of a DER-encoded certificate.
    pub fn of_certificate(der: &[u8]) -> Thumbprint {
        let digest = ring::digest::digest(&ring::digest::SHA256, der);
        let mut bytes = [0; 32];
        bytes.copy_from_slice(digest.as_ref());
        Thumbprint(bytes)
    }
}

impl FromStr for Thumbprint {
    type Err = Error;

    /// Errors: [`Error::ThumbprintSyntax`] unless 64 hex digits remain after
    /// removing `:`.
    fn from_str(value: &str) -> Result<Thumbprint, Error> {
        let syntax = || Error::ThumbprintSyntax { value: value.to_owned() };
        let hex: Vec<u8> = value.trim().bytes().filter(|b| *b != b':').collect();
        if hex.len() != 64 {
            return Err(syntax());
        }
        let mut bytes = [0; 32];
        for (byte, pair) in bytes.iter_mut().zip(hex.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| syntax())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| syntax())?;
        }
        Ok(Thumbprint(bytes))
    }
}

impl fmt::Display for Thumbprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{byte:02X}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Thumbprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Thumbprint({self})")
    }
}

/// The rustls configuration for `trust`, and for a thumbprint the verifier
/// that remembers a mismatching certificate.
///
/// Errors: [`Error::CaFile`] when the file cannot be read or holds no
/// certificate.
pub(crate) fn client_config(trust: &Trust) -> Result<(ClientConfig, Option<Arc<PinnedVerifier>>), Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions");
    match trust {
        Trust::CaFile(path) => {
            let roots = read_ca_file(path)?;
            Ok((builder.with_root_certificates(roots).with_no_client_auth(), None))
        }
        Trust::Thumbprint(expected) => {
            let verifier = Arc::new(PinnedVerifier { expected: *expected, seen: Mutex::new(None), provider });
            let config = builder.dangerous().with_custom_certificate_verifier(verifier.clone()).with_no_client_auth();
            Ok((config, Some(verifier)))
        }
    }
}

fn read_ca_file(path: &Path) -> Result<RootCertStore, Error> {
    let fail = |reason: String| Error::CaFile { path: path.to_owned(), reason };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| fail(e.to_string()))? {
        roots.add(cert.map_err(|e| fail(e.to_string()))?).map_err(|e| fail(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(fail("no PEM certificate in it".into()));
    }
    Ok(roots)
}

/// Accepts exactly the certificate whose SHA-256 digest is `expected`.
#[derive(Debug)]
pub(crate) struct PinnedVerifier {
    expected: Thumbprint,
    /// The thumbprint of the last certificate refused.
    seen: Mutex<Option<Thumbprint>>,
    provider: Arc<CryptoProvider>,
}

impl PinnedVerifier {
    /// The expected thumbprint and the one refused since the last call, if any.
    pub(crate) fn take_mismatch(&self) -> Option<(Thumbprint, Thumbprint)> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner()).take();
        seen.map(|seen| (self.expected, seen))
    }
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let actual = Thumbprint::of_certificate(end_entity);
        if actual == self.expected {
            return Ok(ServerCertVerified::assertion());
        }
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(actual);
        Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thumbprints_parse_with_or_without_colons_and_print_as_vsphere_does() {
        let colons = "16:49:6F:E1:78:58:78:A1:5E:50:32:C9:6F:E1:A1:9D:56:3D:EA:2E:27:65:89:C1:B9:AE:B6:CF:0F:2C:EF:E6";
        let parsed: Thumbprint = colons.parse().unwrap();
        let bare: Thumbprint = colons.replace(':', "").to_lowercase().parse().unwrap();
        assert_eq!(parsed, bare);
        assert_eq!(parsed.to_string(), colons);
    }

    #[test]
    fn a_sha1_thumbprint_or_non_hex_is_refused() {
        let sha1 = "16:49:6F:E1:78:58:78:A1:5E:50:32:C9:6F:E1:A1:9D:56:3D:EA:2E";
        assert!(matches!(sha1.parse::<Thumbprint>(), Err(Error::ThumbprintSyntax { .. })));
        assert!("zz".repeat(32).parse::<Thumbprint>().is_err());
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_naming_the_field() {
        let path = std::env::temp_dir().join(format!("vmlet-vsphere-empty-ca-{}.pem", std::process::id()));
        std::fs::write(&path, "not a certificate\n").unwrap();
        let Err(error) = client_config(&Trust::CaFile(path.clone())) else { panic!("an empty CA file was accepted") };
        std::fs::remove_file(&path).ok();
        assert!(error.to_string().contains("`ca_file`"), "{error}");
    }
}
