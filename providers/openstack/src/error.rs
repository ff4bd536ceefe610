//! HTTP and transport failures mapped onto the provider's error kinds.
//!
//! | what happened | kind |
//! |---|---|
//! | 400 | `InvalidInput` |
//! | 401 (after one token renewal and retry) | `PermissionDenied` |
//! | 403 whose message says quota or "exceed"; 413 | `QuotaExceeded` |
//! | other 403 | `PermissionDenied` |
//! | 404 | `NotFound` |
//! | 409 | `Conflict` |
//! | 429, 5xx, connect failure, timeout, TLS failure | `Transient` |
//! | anything else | `Permanent` |
//!
//! Messages carry the service's own message (Nova's `{"<fault>": {"message"}}`,
//! Keystone's `{"error": {"message"}}`, Placement's `{"errors": [{"detail"}]}`)
//! and what to do; never a token or a password (requests carry those in
//! headers and bodies that are never quoted).

use std::error::Error as StdError;

use vmlet_provider::{Error, ErrorKind};

/// Most characters of a response body quoted in a message.
const QUOTED_BODY: usize = 300;

/// The kind of an HTTP error status; `message` is the service's message,
/// read for Nova's quota refusals (403 "Quota exceeded for cores ...").
pub(crate) fn kind_for_status(status: u16, message: &str) -> ErrorKind {
    match status {
        400 => ErrorKind::InvalidInput,
        401 => ErrorKind::PermissionDenied,
        403 => {
            let lower = message.to_ascii_lowercase();
            if lower.contains("quota") || lower.contains("exceed") {
                ErrorKind::QuotaExceeded
            } else {
                ErrorKind::PermissionDenied
            }
        }
        404 => ErrorKind::NotFound,
        409 => ErrorKind::Conflict,
        413 => ErrorKind::QuotaExceeded,
        429 | 500..=599 => ErrorKind::Transient,
        _ => ErrorKind::Permanent,
    }
}

/// The service's own message in an error body, or the start of the body
/// when it has none of the known shapes.
pub(crate) fn message_of_body(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        // Keystone: {"error": {"message": ...}}; Nova: {"badRequest": {"message": ...}}.
        if let Some(object) = value.as_object() {
            for inner in object.values() {
                if let Some(message) = inner.get("message").and_then(|m| m.as_str()) {
                    return message.to_owned();
                }
            }
            // Placement: {"errors": [{"title": ..., "detail": ...}]}.
            if let Some(first) = object.get("errors").and_then(|e| e.as_array()).and_then(|e| e.first()) {
                if let Some(detail) = first.get("detail").and_then(|d| d.as_str()) {
                    return detail.trim().to_owned();
                }
            }
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.chars().count() > QUOTED_BODY {
        format!("{}…", text.chars().take(QUOTED_BODY).collect::<String>())
    } else {
        text.to_owned()
    }
}

/// What the user can do about a failure of this kind from `service`.
fn advice(kind: ErrorKind, service: &str) -> &'static str {
    match (kind, service) {
        (ErrorKind::PermissionDenied, "Keystone") => {
            "check the clouds.yaml credentials (user, password or application credential, domain, project)"
        }
        (ErrorKind::PermissionDenied, _) => {
            "grant vmlet's OpenStack user the admin role (vmlet lists all projects' servers, hypervisors and \
             places servers on hosts)"
        }
        (ErrorKind::QuotaExceeded, _) => "raise the project's quota or free resources, then vmlet retries",
        (ErrorKind::Conflict, _) => "the server is busy with another task; vmlet retries once it settled",
        (ErrorKind::Transient, _) => "vmlet retries",
        _ => "",
    }
}

/// A provider error for an HTTP error status from `service` (`Nova`,
/// `Keystone`, `Placement`, `Glance`) answering `what` (e.g. `POST
/// /servers`).
pub(crate) fn from_status(operation: &'static str, service: &str, what: &str, status: u16, body: &[u8]) -> Error {
    let message = message_of_body(body);
    let kind = kind_for_status(status, &message);
    let advice = advice(kind, service);
    let mut text = format!("{service} answered {what} with HTTP {status}");
    if !message.is_empty() {
        text.push_str(": ");
        text.push_str(&message);
    }
    if !advice.is_empty() {
        text.push_str("; ");
        text.push_str(advice);
    }
    Error::new(operation, kind, text)
}

/// True when `err` or one of its causes is a TLS failure (handshake,
/// certificate): a `rustls::Error`, directly or wrapped in `io::Error`s
/// (hyper's connector nests two; `io::Error::source` skips the wrapped
/// error, so they are opened with `get_ref`).
fn is_tls(err: &(dyn StdError + 'static)) -> bool {
    let mut cause: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cause {
        let mut wrapped: Option<&(dyn StdError + 'static)> = Some(e);
        while let Some(w) = wrapped {
            if w.is::<rustls::Error>() {
                return true;
            }
            wrapped =
                w.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).map(|r| r as &(dyn StdError + 'static));
        }
        cause = e.source();
    }
    false
}

/// The causes of `err`, joined, for a message (reqwest's own Display names
/// only the URL).
fn causes(err: &(dyn StdError + 'static)) -> String {
    let mut parts = Vec::new();
    let mut cause = err.source();
    while let Some(e) = cause {
        parts.push(e.to_string());
        cause = e.source();
    }
    parts.join(": ")
}

/// A provider error for a request to `endpoint` that got no HTTP answer:
/// connection refused, timeout, TLS failure: all `Transient`.
pub(crate) fn from_transport(operation: &'static str, service: &str, endpoint: &str, err: reqwest::Error) -> Error {
    let why = causes(&err);
    let text = if is_tls(&err) {
        format!(
            "TLS with {service} at {endpoint} failed: {why}; trust its CA with clouds.yaml `cacert` (or check the \
             endpoint's certificate and name); vmlet retries"
        )
    } else if err.is_timeout() {
        format!("{service} at {endpoint} did not answer in time; vmlet retries")
    } else if err.is_connect() {
        format!("cannot connect to {service} at {endpoint}: {why}; check that it runs and is reachable; vmlet retries")
    } else if err.is_decode() {
        return Error::new(
            operation,
            ErrorKind::Permanent,
            format!("{service} at {endpoint} sent a body vmlet cannot read: {err} {why}"),
        )
        .with_source(err);
    } else {
        format!("request to {service} at {endpoint} failed: {why}; vmlet retries")
    };
    Error::new(operation, ErrorKind::Transient, text).with_source(err)
}

/// A provider error for a 2xx body that does not have the documented shape.
pub(crate) fn unexpected_body(operation: &'static str, service: &str, what: &str, err: serde_json::Error) -> Error {
    Error::new(
        operation,
        ErrorKind::Permanent,
        format!("{service} answered {what} with a body vmlet cannot read ({err}); is this a supported release?"),
    )
    .with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_kinds() {
        let cases = [
            (400, "Invalid flavorRef provided.", ErrorKind::InvalidInput),
            (401, "The request you have made requires authentication.", ErrorKind::PermissionDenied),
            (
                403,
                "Policy doesn't allow os_compute_api:os-hypervisors:list to be performed.",
                ErrorKind::PermissionDenied,
            ),
            (403, "Quota exceeded for cores: Requested 4, but already used 20 of 20 cores", ErrorKind::QuotaExceeded),
            (403, "Maximum number of ports exceeded", ErrorKind::QuotaExceeded),
            (404, "Instance could not be found.", ErrorKind::NotFound),
            (409, "Cannot 'os-start' instance while it is in vm_state active", ErrorKind::Conflict),
            (413, "", ErrorKind::QuotaExceeded),
            (429, "", ErrorKind::Transient),
            (500, "Unexpected API Error.", ErrorKind::Transient),
            (503, "", ErrorKind::Transient),
            (418, "", ErrorKind::Permanent),
        ];
        for (status, message, kind) in cases {
            assert_eq!(kind_for_status(status, message), kind, "{status} {message}");
        }
    }

    #[test]
    fn messages_are_read_from_each_services_error_shape() {
        let nova = br#"{"forbidden": {"code": 403, "message": "Quota exceeded for instances: Requested 1, but already used 10 of 10 instances"}}"#;
        let err = from_status("create server", "Nova", "POST /servers", 403, nova);
        assert_eq!(err.kind, ErrorKind::QuotaExceeded);
        assert!(err.message.starts_with("Nova answered POST /servers with HTTP 403: Quota exceeded for instances"));
        assert!(err.message.contains("raise the project's quota"), "{}", err.message);

        let keystone = br#"{"error": {"code": 401, "message": "The request you have made requires authentication.", "title": "Unauthorized"}}"#;
        let err = from_status("authenticate", "Keystone", "POST /v3/auth/tokens", 401, keystone);
        assert_eq!(err.kind, ErrorKind::PermissionDenied);
        assert!(err.message.contains("Keystone") && err.message.contains("clouds.yaml credentials"), "{}", err.message);

        let placement = br#"{"errors": [{"status": 404, "title": "Not Found", "detail": "No resource provider with uuid x found\n\n  "}]}"#;
        assert_eq!(message_of_body(placement), "No resource provider with uuid x found");

        let long = vec![b'x'; 1000];
        assert_eq!(message_of_body(&long).chars().count(), QUOTED_BODY + 1);
    }

    #[test]
    fn a_policy_refusal_says_which_role_is_needed() {
        let body = br#"{"forbidden": {"code": 403, "message": "Policy doesn't allow os_compute_api:os-hypervisors:list to be performed."}}"#;
        let err = from_status("list hypervisors", "Nova", "GET /os-hypervisors/detail", 403, body);
        assert_eq!(err.kind, ErrorKind::PermissionDenied);
        assert!(err.message.contains("admin role"), "{}", err.message);
    }
}
