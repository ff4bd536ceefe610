//! Provider errors with a kind the core maps to retries, HTTP codes and pod phases.

use std::error::Error as StdError;

/// What kind of failure a provider error is; the core decides from this alone
/// whether to retry (`Transient`), surface a user error (`InvalidInput`), or give up
/// until something changes (`Permanent`). Follows virtual-kubelet's `errdefs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The VM (or another named object) does not exist on the host.
    NotFound,
    /// The request cannot be expressed for this backend; the user must change it.
    InvalidInput,
    /// The backend lacks this capability (e.g. no console on libvirt's test driver).
    Unsupported,
    /// Worth retrying: connection lost, timeout, backend busy.
    Transient,
    /// The VM is busy with another operation or in a state that forbids this
    /// one for now (libvirt `OPERATION_INVALID` mid-transition, Nova's 409
    /// while a task runs); retrying once it settled may succeed.
    Conflict,
    /// The back end refused vmlet's credentials the right to do this (Nova
    /// 403, libvirt `AUTH_FAILED`/`ACCESS_DENIED`): an administrator must
    /// grant it.
    PermissionDenied,
    /// The back end's quota or capacity for the project is used up (Nova 403
    /// "Quota exceeded", 413): retrying after something else was freed may
    /// succeed.
    QuotaExceeded,
    /// Retrying the same request will not help until something else changes.
    Permanent,
}

/// A failed provider operation: the operation's name, a kind, a message for users
/// and the backend's own error as source.
#[derive(Debug, thiserror::Error)]
#[error("{operation}: {message}")]
pub struct Error {
    /// The operation that failed, e.g. `define domain`.
    pub operation: &'static str,
    /// The failure's kind.
    pub kind: ErrorKind,
    /// What happened and, where the user can act, what to do.
    pub message: String,
    /// The backend's error.
    #[source]
    pub source: Option<Box<dyn StdError + Send + Sync>>,
}

impl Error {
    /// A new error without a backend source.
    pub fn new(operation: &'static str, kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { operation, kind, message: message.into(), source: None }
    }

    /// Attach the backend's error as source.
    #[must_use]
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// True when retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        self.kind == ErrorKind::Transient
    }
}

/// Result of a provider operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
