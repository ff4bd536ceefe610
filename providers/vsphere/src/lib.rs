#![warn(missing_docs)]
//! vmlet's vSphere provider, first slice: a vim25 SOAP session with a
//! pinned TLS trust ([`Session`]), the host inventory of a vCenter or ESXi
//! ([`list_hosts`]), the VMs vmlet owns ([`list_vms`]) and their power
//! operations ([`power_on`], [`power_off`]).
//!
//! The SOAP layer is this crate's own, on quick-xml, covering only the calls
//! above (see the README for why not a generated vim25 crate).

mod error;
mod hosts;
mod properties;
mod session;
mod soap;
mod tls;
mod vms;
mod xml;

pub use error::{kind_of_fault, Error};
pub use hosts::{list_hosts, ConnectionState, Host};
pub use session::{Secret, ServiceContent, Session, SessionConfig, VIM_VERSION};
pub use soap::MoRef;
pub use tls::{Thumbprint, Trust};
pub use vms::{list_vms, power_off, power_on, PowerState, Vm, UID_KEY};
