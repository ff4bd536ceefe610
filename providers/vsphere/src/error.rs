//! The crate's one error type, and the provider error kind of each failure.
//!
//! | what happened | kind |
//! |---|---|
//! | `url`, `thumbprint` or `ca_file` unusable; certificate not trusted | `Permanent` |
//! | fault `InvalidLogin`, `NoPermission`, `NotAuthenticated` after one re-login | `PermissionDenied` |
//! | fault `ManagedObjectNotFound`, `NotFound`, `FileNotFound` | `NotFound` |
//! | fault `InvalidArgument`, `InvalidRequest`, `InvalidName`, `InvalidProperty`, `InvalidType` | `InvalidInput` |
//! | fault `InvalidState`, `InvalidPowerState`, `TaskInProgress`, `ConcurrentAccess`, `AlreadyExists` | `Conflict` |
//! | fault `HostNotConnected`, `HostCommunication`, `Timedout`, `RequestCanceled`; connect failure, HTTP timeout, HTTP 5xx without a fault, a task past its deadline | `Transient` |
//! | any other fault or an unreadable response | `Permanent` |
//!
//! Messages carry vSphere's own message (a fault's `faultstring` or a task's
//! `localizedMessage`); never a password or a session cookie.

use std::path::PathBuf;
use std::time::Duration;

use vmlet_provider::ErrorKind;

/// A failed vSphere call, or a configuration vmlet cannot connect with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `url` is not an `https://host[:port]/sdk` URL.
    #[error("vSphere `url` {url:?}: {reason}")]
    Url { url: String, reason: &'static str },
    /// `thumbprint` is not 32 hex byte pairs (`AB:CD:…` or `abcd…`).
    #[error("vSphere `thumbprint` {value:?} is not a SHA-256 thumbprint: want 32 hex byte pairs such as AB:CD:…")]
    ThumbprintSyntax { value: String },
    /// `ca_file` cannot be read or holds no PEM certificate.
    #[error("vSphere `ca_file` {path}: {reason}")]
    CaFile { path: PathBuf, reason: String },
    /// The server's certificate is not the one `thumbprint` names; the
    /// connection was closed in the TLS handshake, before any request.
    #[error(
        "vSphere {url}: the server's certificate has SHA-256 thumbprint {actual}, not the configured `thumbprint` \
         {expected}; nothing was sent"
    )]
    ThumbprintMismatch { url: String, expected: String, actual: String },
    /// The request did not get an HTTP response (connect, TLS, timeout).
    #[error("{operation} at {url}: {source}")]
    Transport {
        operation: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server answered, but not with a vim25 envelope this crate reads.
    #[error("{operation}: HTTP {status}: {reason}")]
    Response { operation: &'static str, status: u16, reason: String },
    /// vSphere answered with a fault (`fault` is its vim25 type, e.g.
    /// `InvalidLogin`), either to the call or as the error of its task.
    #[error("{operation}: {fault}: {message}")]
    Fault { operation: &'static str, fault: String, message: String },
    /// A task did not end within its deadline; it may still run in vSphere.
    #[error("{operation}: task {task} still {state} after {waited:?}")]
    TaskTimeout { operation: &'static str, task: String, state: String, waited: Duration },
}

impl Error {
    /// The provider error kind (see the module's table).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Url { .. } | Error::ThumbprintSyntax { .. } | Error::CaFile { .. } => ErrorKind::Permanent,
            Error::ThumbprintMismatch { .. } => ErrorKind::Permanent,
            Error::Transport { source, .. } if source.is_builder() => ErrorKind::Permanent,
            Error::Transport { .. } | Error::TaskTimeout { .. } => ErrorKind::Transient,
            Error::Response { status, .. } if *status >= 500 => ErrorKind::Transient,
            Error::Response { .. } => ErrorKind::Permanent,
            Error::Fault { fault, .. } => kind_of_fault(fault),
        }
    }

    /// The vim25 fault type when vSphere answered with one.
    pub fn fault(&self) -> Option<&str> {
        match self {
            Error::Fault { fault, .. } => Some(fault),
            _ => None,
        }
    }
}

/// The provider error kind of a vim25 fault type (see the module's table).
pub fn kind_of_fault(fault: &str) -> ErrorKind {
    match fault {
        "InvalidLogin" | "NoPermission" | "NotAuthenticated" | "RestrictedByAdministrator" => {
            ErrorKind::PermissionDenied
        }
        "ManagedObjectNotFound" | "NotFound" | "FileNotFound" => ErrorKind::NotFound,
        "InvalidArgument" | "InvalidRequest" | "InvalidName" | "InvalidProperty" | "InvalidType" => {
            ErrorKind::InvalidInput
        }
        "InvalidState" | "InvalidPowerState" | "TaskInProgress" | "ConcurrentAccess" | "AlreadyExists" => {
            ErrorKind::Conflict
        }
        "HostNotConnected" | "HostCommunication" | "Timedout" | "RequestCanceled" => ErrorKind::Transient,
        _ => ErrorKind::Permanent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_map_to_the_kinds_of_the_table() {
        for (fault, kind) in [
            ("InvalidLogin", ErrorKind::PermissionDenied),
            ("NoPermission", ErrorKind::PermissionDenied),
            ("ManagedObjectNotFound", ErrorKind::NotFound),
            ("InvalidArgument", ErrorKind::InvalidInput),
            ("InvalidPowerState", ErrorKind::Conflict),
            ("TaskInProgress", ErrorKind::Conflict),
            ("HostNotConnected", ErrorKind::Transient),
            ("SystemError", ErrorKind::Permanent),
        ] {
            assert_eq!(kind_of_fault(fault), kind, "{fault}");
        }
    }

    #[test]
    fn a_thumbprint_mismatch_names_the_config_field() {
        let error =
            Error::ThumbprintMismatch { url: "https://vc/sdk".into(), expected: "AA".into(), actual: "BB".into() };
        assert!(error.to_string().contains("`thumbprint`"), "{error}");
        assert_eq!(error.kind(), ErrorKind::Permanent);
    }
}
