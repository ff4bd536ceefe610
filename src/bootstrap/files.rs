//! The files `vmlet bootstrap` keeps under its output directory, how they
//! are written (temporary file, then rename) and what a rerun makes of them.
//!
//! ```text
//! <out>/kubeconfig                  vmlet's own kubeconfig (client key and certificate inline), 0600
//! <out>/pki/vmlet-client.crt        the client certificate (PEM), 0644
//! <out>/pki/vmlet-client.key        its private key (PKCS#8 PEM, ECDSA P-256), 0600
//! <out>/pki/kubelet-serving.crt     the kubelet API's serving certificate (with --serving)
//! <out>/pki/kubelet-serving.key     its private key, 0600
//! <out>/pki/*.key.next              the key of a request still waiting for its certificate, 0600
//! ```

use super::certificate::{facts_from_pem, public_key_contents, Facts};
use super::request::Credential;
use super::Error;
use rcgen::{KeyPair, PublicKeyData as _};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The paths of one credential (certificate, key, pending key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// The certificate (PEM).
    pub certificate: PathBuf,
    /// Its private key (PEM, mode 0600).
    pub key: PathBuf,
    /// The key of a request in flight (PEM, mode 0600); renamed to `key`
    /// when its certificate arrives.
    pub next_key: PathBuf,
}

impl Paths {
    /// The files of `credential` under the output directory `out`.
    pub fn of(out: &Path, credential: Credential) -> Paths {
        let stem = match credential {
            Credential::Client => "vmlet-client",
            Credential::Serving => "kubelet-serving",
        };
        let pki = out.join("pki");
        Paths {
            certificate: pki.join(format!("{stem}.crt")),
            key: pki.join(format!("{stem}.key")),
            next_key: pki.join(format!("{stem}.key.next")),
        }
    }
}

/// vmlet's kubeconfig under the output directory `out`.
pub fn kubeconfig(out: &Path) -> PathBuf {
    out.join("kubeconfig")
}

/// What is on disk for one credential, as far as the decision needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnDisk {
    /// The current certificate, if it exists, parses and belongs to the
    /// current key.
    pub current: Option<Facts>,
    /// Why there is no usable current certificate (for the log).
    pub unusable: Option<String>,
    /// A pending key exists (a request made before, maybe still waiting).
    pub next_key: bool,
}

/// What to do for one credential.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The certificate is good until `renew_at`: nothing to do.
    Keep {
        /// When a rerun will renew it.
        renew_at: SystemTime,
    },
    /// Request a certificate for the pending key (resume a request made before).
    ResumeWithNextKey {
        /// Why a certificate is needed.
        why: String,
    },
    /// Make a new key, keep it as the pending key, and request a certificate for it.
    RequestWithNewKey {
        /// Why a certificate is needed.
        why: String,
    },
}

/// Decide what to do for one credential at `now`: keep a certificate that
/// belongs to its key and has more than a third of its lifetime left;
/// otherwise resume the pending request, or start one with a new key (a
/// renewal never reuses the current key).
pub fn plan(on_disk: &OnDisk, now: SystemTime) -> Plan {
    let why = match (&on_disk.current, &on_disk.unusable) {
        (Some(facts), _) if now < facts.validity.renew_at() => {
            return Plan::Keep { renew_at: facts.validity.renew_at() };
        }
        (Some(facts), _) if facts.validity.is_valid_at(now) => "less than a third of its lifetime is left".to_owned(),
        (Some(_), _) => "it expired".to_owned(),
        (None, Some(why)) => why.clone(),
        (None, None) => "there is none yet".to_owned(),
    };
    if on_disk.next_key {
        Plan::ResumeWithNextKey { why }
    } else {
        Plan::RequestWithNewKey { why }
    }
}

/// Read what is on disk for `paths`. A missing, unreadable or mismatched
/// certificate is not an error (it is requested again); a pending key that
/// is no key is ([`Error::BadKey`]).
pub fn read(paths: &Paths) -> Result<OnDisk, Error> {
    let next_key = paths.next_key.exists();
    let (current, unusable) = match (read_optional(&paths.certificate)?, read_optional(&paths.key)?) {
        (Some(certificate), Some(key)) => match usable(&certificate, &key) {
            Ok(facts) => (Some(facts), None),
            Err(why) => (None, Some(format!("{}: {why}", paths.certificate.display()))),
        },
        (None, _) => (None, None),
        (Some(_), None) => (None, Some(format!("{} is missing", paths.key.display()))),
    };
    Ok(OnDisk { current, unusable, next_key })
}

fn usable(certificate: &[u8], key: &[u8]) -> Result<Facts, String> {
    let facts = facts_from_pem(certificate)?;
    let key =
        std::str::from_utf8(key).ok().and_then(|pem| KeyPair::from_pem(pem).ok()).ok_or("its key does not parse")?;
    if public_key_contents(&key.subject_public_key_info())? != facts.public_key {
        return Err("it does not belong to its key".to_owned());
    }
    Ok(facts)
}

/// The contents of `path`, `None` when it does not exist.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, Error> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::ReadFile { path: path.to_owned(), source }),
    }
}

/// The key in `path` (PKCS#8 PEM).
pub fn read_key(path: &Path) -> Result<KeyPair, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::ReadFile { path: path.to_owned(), source })?;
    let pem =
        String::from_utf8(bytes).map_err(|_| Error::BadKey { path: path.to_owned(), reason: "not UTF-8".into() })?;
    KeyPair::from_pem(&pem).map_err(|e| Error::BadKey { path: path.to_owned(), reason: e.to_string() })
}

/// Write `contents` to `path` so that readers see the old file or the new
/// one, never a part: a temporary file in the same directory with `mode`,
/// flushed to disk, renamed over `path`; the directory (and its parents)
/// are made when missing.
pub fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> Result<(), Error> {
    let error = |source| Error::WriteFile { path: path.to_owned(), source };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(error)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let temporary = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&temporary)?;
        file.write_all(contents)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(error)
}

/// Make `from` the new `to` (rename), flushing the directory.
pub fn promote(from: &Path, to: &Path) -> Result<(), Error> {
    let error = |source| Error::WriteFile { path: to.to_owned(), source };
    std::fs::rename(from, to).map_err(error)?;
    std::fs::File::open(to.parent().unwrap_or(Path::new("."))).and_then(|dir| dir.sync_all()).map_err(error)
}

#[cfg(test)]
mod tests {
    use super::super::certificate::Validity;
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    fn with_certificate(not_before: u64, not_after: u64, next_key: bool) -> OnDisk {
        let validity = Validity { not_before: at(not_before), not_after: at(not_after) };
        OnDisk { current: Some(Facts { validity, public_key: vec![] }), unusable: None, next_key }
    }

    #[test]
    fn a_fresh_certificate_is_kept_until_two_thirds_of_its_lifetime() {
        assert_eq!(plan(&with_certificate(0, 900, false), at(599)), Plan::Keep { renew_at: at(600) });
    }

    #[test]
    fn a_certificate_with_a_third_left_is_renewed_with_a_new_key() {
        let plan = plan(&with_certificate(0, 900, false), at(600));
        assert!(matches!(plan, Plan::RequestWithNewKey { why } if why.contains("third")));
    }

    #[test]
    fn an_expired_certificate_is_renewed() {
        let plan = plan(&with_certificate(0, 900, false), at(900));
        assert!(matches!(plan, Plan::RequestWithNewKey { why } if why.contains("expired")));
    }

    #[test]
    fn a_pending_key_is_reused_so_a_rerun_resumes_its_request() {
        let nothing = OnDisk { current: None, unusable: None, next_key: true };
        assert!(matches!(plan(&nothing, at(0)), Plan::ResumeWithNextKey { .. }));
        assert!(matches!(plan(&with_certificate(0, 900, true), at(700)), Plan::ResumeWithNextKey { .. }));
    }

    #[test]
    fn a_pending_key_does_not_replace_a_fresh_certificate() {
        assert!(matches!(plan(&with_certificate(0, 900, true), at(10)), Plan::Keep { .. }));
    }

    #[test]
    fn nothing_on_disk_means_a_first_request() {
        let nothing = OnDisk { current: None, unusable: None, next_key: false };
        assert!(matches!(plan(&nothing, at(0)), Plan::RequestWithNewKey { why } if why.contains("none yet")));
    }

    #[test]
    fn a_certificate_of_another_key_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::of(dir.path(), Credential::Client);
        let key = KeyPair::generate().unwrap();
        let other = KeyPair::generate().unwrap();
        let certificate = rcgen::CertificateParams::new(vec!["x".to_owned()]).unwrap().self_signed(&other).unwrap();
        write_atomically(&paths.key, key.serialize_pem().as_bytes(), 0o600).unwrap();
        write_atomically(&paths.certificate, certificate.pem().as_bytes(), 0o644).unwrap();
        let on_disk = read(&paths).unwrap();
        assert!(on_disk.current.is_none());
        assert!(on_disk.unusable.unwrap().contains("does not belong to its key"));
        write_atomically(&paths.key, other.serialize_pem().as_bytes(), 0o600).unwrap();
        assert!(read(&paths).unwrap().current.is_some());
    }

    #[test]
    fn files_are_written_whole_with_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pki/secret.key");
        write_atomically(&path, b"one", 0o600).unwrap();
        write_atomically(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file is left behind");
    }
}
