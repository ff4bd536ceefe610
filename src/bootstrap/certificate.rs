//! What `vmlet bootstrap` reads from an issued certificate: its validity
//! period, whether it belongs to a key, and when to renew it.

use crate::api::tls::{tbs_at_validity, Der};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The validity period of a certificate (RFC 5280 §4.1.2.5), as instants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// `notBefore`.
    pub not_before: SystemTime,
    /// `notAfter`.
    pub not_after: SystemTime,
}

impl Validity {
    /// When to renew: once less than a third of the lifetime is left, i.e. at
    /// two thirds of `notBefore..notAfter`. Deterministic, unlike the
    /// kubelet's 70–90 % with jitter; the systemd timer that runs
    /// `vmlet bootstrap` spreads hosts with its randomized delay instead.
    pub fn renew_at(&self) -> SystemTime {
        let lifetime = self.not_after.duration_since(self.not_before).unwrap_or(Duration::ZERO);
        self.not_before + lifetime * 2 / 3
    }

    /// Whether `now` lies within the period (a certificate the API server accepts).
    pub fn is_valid_at(&self, now: SystemTime) -> bool {
        self.not_before <= now && now < self.not_after
    }
}

/// The facts of one certificate that the renewal decision needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// Its validity period.
    pub validity: Validity,
    /// The contents of its `subjectPublicKeyInfo` SEQUENCE (without tag and length).
    pub public_key: Vec<u8>,
}

/// The first certificate of a PEM text: its validity and public key, or why
/// it is not a certificate this code can read.
pub fn facts_from_pem(pem: &[u8]) -> Result<Facts, &'static str> {
    let der = CertificateDer::pem_slice_iter(pem)
        .next()
        .ok_or("no PEM certificate")?
        .map_err(|_| "malformed PEM certificate")?;
    facts_from_der(&der)
}

/// [`facts_from_pem`] for one DER certificate (RFC 5280 §4.1).
pub fn facts_from_der(der: &[u8]) -> Result<Facts, &'static str> {
    let mut tbs = tbs_at_validity(der)?;
    let mut validity = tbs.sequence()?;
    let not_before = time(validity.element()?)?;
    let not_after = time(validity.element()?)?;
    tbs.element()?; // subject
    let (tag, public_key) = tbs.element()?;
    if tag != 0x30 {
        return Err("subjectPublicKeyInfo is not a SEQUENCE");
    }
    Ok(Facts { validity: Validity { not_before, not_after }, public_key: public_key.to_vec() })
}

/// The contents of a DER `subjectPublicKeyInfo` SEQUENCE (as rcgen's
/// `subject_public_key_info()` returns it, tag and length included).
pub fn public_key_contents(spki: &[u8]) -> Result<Vec<u8>, &'static str> {
    match Der(spki).element()? {
        (0x30, contents) => Ok(contents.to_vec()),
        _ => Err("subjectPublicKeyInfo is not a SEQUENCE"),
    }
}

/// An ASN.1 UTCTime (`YYMMDDHHMMSSZ`, years 1950–2049) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`), the two forms RFC 5280 allows.
fn time((tag, text): (u8, &[u8])) -> Result<SystemTime, &'static str> {
    let text = std::str::from_utf8(text).map_err(|_| "time is not ASCII")?;
    let (year, rest) = match (tag, text.len()) {
        (0x17, 13) => {
            let yy: i64 = number(&text[..2])?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        (0x18, 15) => (number(&text[..4])?, &text[4..]),
        _ => return Err("time is neither UTCTime nor GeneralizedTime in UTC"),
    };
    if !rest.ends_with('Z') {
        return Err("time is not in UTC");
    }
    let [month, day, hour, minute, second] =
        [0, 2, 4, 6, 8].map(|at| rest.get(at..at + 2).map_or(Err("short time"), number::<i64>));
    let (month, day, hour, minute, second) = (month?, day?, hour?, minute?, second?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return Err("time out of range");
    }
    let seconds = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    let seconds = u64::try_from(seconds).map_err(|_| "time before 1970")?;
    Ok(UNIX_EPOCH + Duration::from_secs(seconds))
}

fn number<T: std::str::FromStr>(digits: &str) -> Result<T, &'static str> {
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("time has a non-digit");
    }
    digits.parse().map_err(|_| "time has a non-digit")
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(not_before: (i32, u8, u8), not_after: (i32, u8, u8)) -> (rcgen::KeyPair, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["host-a".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        let pem = params.self_signed(&key).unwrap().pem();
        (key, pem)
    }

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    #[test]
    fn a_certificate_tells_its_validity_period() {
        // 2026-01-01 and 2050-01-01 (UTCTime and GeneralizedTime).
        let (_, pem) = certificate((2026, 1, 1), (2050, 1, 1));
        let facts = facts_from_pem(pem.as_bytes()).unwrap();
        assert_eq!(facts.validity.not_before, at(1_767_225_600));
        assert_eq!(facts.validity.not_after, at(2_524_608_000));
    }

    #[test]
    fn a_certificate_tells_which_key_it_belongs_to() {
        use rcgen::PublicKeyData as _;
        let (key, pem) = certificate((2026, 1, 1), (2027, 1, 1));
        let facts = facts_from_pem(pem.as_bytes()).unwrap();
        assert_eq!(facts.public_key, public_key_contents(&key.subject_public_key_info()).unwrap());
        let other = rcgen::KeyPair::generate().unwrap();
        assert_ne!(facts.public_key, public_key_contents(&other.subject_public_key_info()).unwrap());
    }

    #[test]
    fn renewal_is_due_with_a_third_of_the_lifetime_left() {
        let validity = Validity { not_before: at(0), not_after: at(900) };
        assert_eq!(validity.renew_at(), at(600));
        assert!(validity.is_valid_at(at(0)) && validity.is_valid_at(at(899)));
        assert!(!validity.is_valid_at(at(900)));
    }

    #[test]
    fn garbage_is_no_certificate() {
        assert!(facts_from_pem(b"").is_err());
        assert!(facts_from_pem(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").is_err());
        assert!(facts_from_der(&[0x30, 0x03, 0x30, 0x01]).is_err());
    }

    #[test]
    fn civil_dates_count_days_from_the_epoch() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    }
}
