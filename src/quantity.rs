//! Kubernetes resource quantities (`512Mi`, `2Gi`, `1G`, `1500m`) as numbers.
//!
//! Follows `k8s.io/apimachinery/pkg/api/resource` for the suffixes vmlet accepts:
//! binary (`Ki`..`Ei`), decimal (`k`..`E`), milli (`m`, for cpu) and none.

/// A quantity that vmlet cannot read, with the text that was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a quantity vmlet understands: {reason} (write e.g. 512Mi, 2Gi or 1G)")]
pub struct QuantityError {
    /// The text as given.
    pub text: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

fn split(text: &str) -> (&str, &str) {
    let end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    text.split_at(end)
}

fn multiplier(suffix: &str) -> Option<f64> {
    Some(match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        _ => return None,
    })
}

fn parse(text: &str) -> Result<f64, QuantityError> {
    let err = |reason| QuantityError { text: text.to_owned(), reason };
    let (number, suffix) = split(text.trim());
    if number.is_empty() {
        return Err(err("it does not start with a number"));
    }
    let value: f64 = number.parse().map_err(|_| err("its number is malformed"))?;
    let mult = multiplier(suffix).ok_or_else(|| err("its suffix is unknown"))?;
    Ok(value * mult)
}

/// Bytes in a memory quantity, rounded up to a whole byte. Errors: the text is
/// not a quantity or exceeds `u64`.
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    let value = parse(text)?.ceil();
    if !(0.0..=u64::MAX as f64).contains(&value) {
        return Err(QuantityError { text: text.to_owned(), reason: "it is out of range" });
    }
    Ok(value as u64)
}

/// Millicores in a cpu quantity (`2` → 2000, `500m` → 500), rounded up.
pub fn parse_millicores(text: &str) -> Result<u64, QuantityError> {
    Ok((parse(text)? * 1000.0).ceil() as u64)
}

/// The quantity text for a byte count: the largest exact binary suffix
/// (`536870912` → `512Mi`), else plain bytes.
pub fn format_bytes(bytes: u64) -> String {
    const SUFFIXES: [&str; 6] = ["Ei", "Pi", "Ti", "Gi", "Mi", "Ki"];
    for (i, suffix) in SUFFIXES.iter().enumerate() {
        let unit = 1u64 << (10 * (6 - i));
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{}", bytes / unit, suffix);
        }
    }
    bytes.to_string()
}

/// The quantity text for millicores: whole cores when exact (`2000` → `2`),
/// else millicores (`1500` → `1500m`).
pub fn format_millicores(millicores: u64) -> String {
    if millicores.is_multiple_of(1000) {
        (millicores / 1000).to_string()
    } else {
        format!("{millicores}m")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes_give_bytes() {
        assert_eq!(parse_bytes("512Mi").unwrap(), 536_870_912);
        assert_eq!(parse_bytes("2Gi").unwrap(), 2_147_483_648);
        assert_eq!(parse_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("1.5Gi").unwrap(), 1_610_612_736);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
    }

    #[test]
    fn words_are_refused_with_the_text() {
        let err = parse_bytes("lots").unwrap_err();
        assert_eq!(err.text, "lots");
        assert!(err.to_string().contains("512Mi"), "{err}");
        assert!(parse_bytes("12Qi").is_err());
        assert!(parse_bytes("1.2.3Gi").is_err());
    }

    #[test]
    fn cpu_quantities_give_millicores() {
        assert_eq!(parse_millicores("2").unwrap(), 2000);
        assert_eq!(parse_millicores("500m").unwrap(), 500);
        assert_eq!(parse_millicores("0.25").unwrap(), 250);
    }

    #[test]
    fn millicores_format_as_cores_when_whole() {
        assert_eq!(format_millicores(2000), "2");
        assert_eq!(format_millicores(1500), "1500m");
    }

    #[test]
    fn bytes_format_with_the_largest_exact_suffix() {
        assert_eq!(format_bytes(536_870_912), "512Mi");
        assert_eq!(format_bytes(16 * 1024 * 1024 * 1024), "16Gi");
        assert_eq!(format_bytes(1536), "1536");
        assert_eq!(format_bytes(3 * 1024), "3Ki");
    }
}
