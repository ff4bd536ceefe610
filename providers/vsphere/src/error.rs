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
//! | vAPI REST (content library) HTTP 401 or 403 | `PermissionDenied` |
//! | vAPI REST HTTP 404 | `NotFound` |
//! | any other fault or an unreadable response | `Permanent` |
//!
//! Messages carry vSphere's own message (a fault's `faultstring` or a task's
//! `localizedMessage`); never a password or a session cookie.

use std::path::PathBuf;
use std::time::Duration;

use vmlet_provider::ErrorKind;

/// A failed vSphere call, or a configuration vmlet cannot connect with.
/// `operation` fields name the vim25 method (`Login`, `PowerOnVM_Task`, ...).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `url` is not an `https://host[:port]/sdk` URL.
    #[error("vSphere `url` {url:?}: {reason}")]
    Url {
        /// The configured URL.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `thumbprint` is not 32 hex byte pairs (`AB:CD:…` or `abcd…`).
    #[error("vSphere `thumbprint` {value:?} is not a SHA-256 thumbprint: want 32 hex byte pairs such as AB:CD:…")]
    ThumbprintSyntax {
        /// The configured value.
        value: String,
    },
    /// `ca_file` cannot be read or holds no PEM certificate.
    #[error("vSphere `ca_file` {path}: {reason}")]
    CaFile {
        /// The configured path.
        path: PathBuf,
        /// The I/O or PEM error, or that it holds no certificate.
        reason: String,
    },
    /// The server's certificate is not the one `thumbprint` names; the
    /// connection was closed in the TLS handshake, before any request.
    #[error(
        "vSphere {url}: the server's certificate has SHA-256 thumbprint {actual}, not the configured `thumbprint` \
         {expected}; nothing was sent"
    )]
    ThumbprintMismatch {
        /// The configured URL.
        url: String,
        /// The configured thumbprint, `AB:CD:…`.
        expected: String,
        /// The thumbprint of the certificate the server presented, `AB:CD:…`.
        actual: String,
    },
    /// The request did not get an HTTP response (connect, TLS, timeout).
    #[error("{operation} at {url}: {source}")]
    Transport {
        /// The vim25 method.
        operation: &'static str,
        /// The configured URL.
        url: String,
        /// reqwest's error (its own URL removed).
        #[source]
        source: reqwest::Error,
    },
    /// The server answered, but not with a vim25 envelope this crate reads.
    #[error("{operation}: HTTP {status}: {reason}")]
    Response {
        /// The vim25 method.
        operation: &'static str,
        /// The HTTP status.
        status: u16,
        /// What is missing or malformed, with the start of the body.
        reason: String,
    },
    /// vSphere answered with a fault, either to the call or as the error of
    /// its task.
    #[error("{operation}: {fault}: {message}")]
    Fault {
        /// The vim25 method.
        operation: &'static str,
        /// The vim25 fault type, e.g. `InvalidLogin`, `ManagedObjectNotFound`.
        fault: String,
        /// vSphere's message (`faultstring`, or the task's `localizedMessage`).
        message: String,
    },
    /// A task did not end within its deadline; it may still run in vSphere.
    #[error("{operation}: task {task} still {state} after {waited:?}")]
    TaskTimeout {
        /// The vim25 method that started the task.
        operation: &'static str,
        /// The task's reference value, e.g. `task-79`.
        task: String,
        /// Its last `info.state`: `queued` or `running`.
        state: String,
        /// How long the call waited, from the method call on.
        waited: Duration,
    },
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
            Error::Response { status: 401 | 403, .. } => ErrorKind::PermissionDenied,
            Error::Response { status: 404, .. } => ErrorKind::NotFound,
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
