//! libvirt errors mapped onto the provider's error kinds.

use virt::error::{Error as VirtError, ErrorNumber};
use vmlet_provider::{Error, ErrorKind};

/// The provider error kind for a libvirt error code.
///
/// - `VIR_ERR_NO_DOMAIN` → `NotFound`
/// - access denied, authentication failed → `PermissionDenied`
/// - XML errors, invalid arguments, unsupported configuration → `InvalidInput`
/// - missing driver or operation support → `Unsupported`
/// - system, RPC, connection and timeout errors → `Transient` (libvirtd restarting,
///   socket closed, host busy)
/// - everything else → `Permanent`
pub(crate) fn kind_of(err: &VirtError) -> ErrorKind {
    use ErrorNumber::*;
    match err.code().unwrap_or(InternalError) {
        NoDomain => ErrorKind::NotFound,
        AccessDenied | AuthFailed | AuthCancelled | AuthUnavailable => ErrorKind::PermissionDenied,
        XmlError | XmlDetail | XmlInvalidSchema | InvalidArg | ConfigUnsupported => ErrorKind::InvalidInput,
        NoSupport | OperationUnsupported | ArgumentUnsupported => ErrorKind::Unsupported,
        SystemError | Rpc | NoConnect | InvalidConn | OperationTimeout | AgentUnresponsive | ResourceBusy => {
            ErrorKind::Transient
        }
        _ => ErrorKind::Permanent,
    }
}

/// A provider error for `operation` from a libvirt error, keeping it as source.
pub(crate) fn from_libvirt(operation: &'static str, err: VirtError) -> Error {
    Error::new(operation, kind_of(&err), err.message().to_owned()).with_source(err)
}

/// True when `err` says the domain is already in the state an idempotent
/// operation wanted (start of a running domain, stop of a stopped one).
pub(crate) fn is_operation_invalid(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::OperationInvalid)
}

/// True when `err` says the driver rejected the flags of a call, so a call with
/// fewer flags may succeed.
pub(crate) fn is_unsupported_flags(err: &VirtError) -> bool {
    err.code().is_any(vec![
        ErrorNumber::InvalidArg,
        ErrorNumber::NoSupport,
        ErrorNumber::ArgumentUnsupported,
        ErrorNumber::OperationUnsupported,
    ])
}

/// True when `err` says the domain has no metadata element in the asked namespace.
pub(crate) fn is_no_metadata(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::NoDomainMetadata)
}

/// True when `err` says the domain is gone.
pub(crate) fn is_no_domain(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::NoDomain)
}

/// True when `err` says the host has no storage pool of the asked name.
pub(crate) fn is_no_storage_pool(err: &VirtError) -> bool {
    err.code().is(ErrorNumber::NoStoragePool)
}
