//! The kubelet API's serving certificate from files, picked up again when
//! the files change (`vmlet bootstrap` renews it while vmlet runs).
//!
//! rustls asks [`ServingCertificate::resolve`] for the certificate at each
//! handshake. At most once per [`RECHECK`] that call compares the files'
//! modification times with those of the pair in use; when either changed it
//! loads the pair and swaps it in if the key belongs to the certificate.
//! Until then, and whenever loading fails (a renewal half written, a
//! mismatched pair), the pair in use stays and the failure is logged once
//! per change.

use super::tls::read_certificates;
use super::ApiError;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How often, at most, the files' modification times are compared.
pub const RECHECK: Duration = Duration::from_secs(60);

/// The pair of files' modification times.
type Stamp = (Option<SystemTime>, Option<SystemTime>);

/// A serving certificate read from `tlsCertFile` and `tlsKeyFile`, reloaded
/// when they change.
#[derive(Debug)]
pub struct ServingCertificate {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    current: Arc<CertifiedKey>,
    /// The stamp of the files last looked at (loaded or refused).
    seen: Stamp,
    checked: Instant,
}

impl ServingCertificate {
    /// Load the pair now; fails naming the file when it cannot be read or
    /// the key does not belong to the certificate.
    pub fn load(cert_file: &Path, key_file: &Path, provider: Arc<CryptoProvider>) -> Result<Self, ApiError> {
        let seen = stamp(cert_file, key_file);
        let current = Arc::new(load_pair(cert_file, key_file, &provider)?);
        Ok(ServingCertificate {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            provider,
            state: Mutex::new(State { current, seen, checked: Instant::now() }),
        })
    }

    /// The pair in use after looking at the files if [`RECHECK`] has passed
    /// since the last look (`now`).
    pub fn current(&self, now: Instant) -> Arc<CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if now.saturating_duration_since(state.checked) >= RECHECK {
            state.checked = now;
            let stamp = stamp(&self.cert_file, &self.key_file);
            if stamp != state.seen {
                state.seen = stamp;
                match load_pair(&self.cert_file, &self.key_file, &self.provider) {
                    Ok(pair) => {
                        tracing::info!(file = %self.cert_file.display(), "kubelet API: serving certificate reloaded");
                        state.current = Arc::new(pair);
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "kubelet API: the serving certificate files changed but do not load; serving the previous one"
                    ),
                }
            }
        }
        state.current.clone()
    }
}

impl ResolvesServerCert for ServingCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current(Instant::now()))
    }
}

fn stamp(cert_file: &Path, key_file: &Path) -> Stamp {
    let modified = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    (modified(cert_file), modified(key_file))
}

fn load_pair(cert_file: &Path, key_file: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, ApiError> {
    let chain = read_certificates(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| ApiError::ReadFile { path: key_file.to_owned(), source: std::io::Error::other(e.to_string()) })?;
    CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| ApiError::Tls(format!("{} and {}: {e}", cert_file.display(), key_file.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap().self_signed(&key).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        cert.der().to_vec()
    }

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// Give the files a modification time that differs from the loaded one,
    /// whatever the file system's timestamp granularity.
    fn touch_later(dir: &Path) {
        let later = SystemTime::now() + Duration::from_secs(5);
        for file in ["tls.crt", "tls.key"] {
            std::fs::File::options().write(true).open(dir.join(file)).unwrap().set_modified(later).unwrap();
        }
    }

    #[test]
    fn a_renewed_certificate_is_served_after_the_recheck_interval() {
        let dir = tempfile::tempdir().unwrap();
        let first = write_pair(dir.path(), "first");
        let serving =
            ServingCertificate::load(&dir.path().join("tls.crt"), &dir.path().join("tls.key"), provider()).unwrap();
        let start = Instant::now();
        let second = write_pair(dir.path(), "second");
        touch_later(dir.path());
        assert_eq!(serving.current(start).cert[0].as_ref(), first, "not before the interval");
        assert_eq!(serving.current(start + RECHECK).cert[0].as_ref(), second);
    }

    #[test]
    fn a_half_written_renewal_keeps_the_previous_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let first = write_pair(dir.path(), "first");
        let serving =
            ServingCertificate::load(&dir.path().join("tls.crt"), &dir.path().join("tls.key"), provider()).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(dir.path().join("tls.key"), other.serialize_pem()).unwrap();
        touch_later(dir.path());
        assert_eq!(serving.current(Instant::now() + RECHECK).cert[0].as_ref(), first);
    }

    #[test]
    fn a_mismatched_pair_is_refused_at_start_naming_the_files() {
        let dir = tempfile::tempdir().unwrap();
        write_pair(dir.path(), "first");
        std::fs::write(dir.path().join("tls.key"), rcgen::KeyPair::generate().unwrap().serialize_pem()).unwrap();
        let error = ServingCertificate::load(&dir.path().join("tls.crt"), &dir.path().join("tls.key"), provider())
            .unwrap_err()
            .to_string();
        assert!(error.contains("tls.crt"), "{error}");
    }
}
