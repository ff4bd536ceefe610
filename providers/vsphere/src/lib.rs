#![warn(missing_docs)]
//! vmlet's vSphere provider, first slice: a vim25 SOAP session with a
//! pinned TLS trust ([`Session`]), the host inventory of a vCenter or ESXi
//! ([`list_hosts`]), the VMs vmlet owns ([`list_vms`]), their power
//! operations ([`power_on`], [`power_off`]), templates and clones
//! ([`list_templates`], [`clone_vm`]), and the [`vmlet_provider::Provider`]
//! of one ESXi host ([`VsphereProvider`] over a shared [`VCenter`]).
//!
//! The SOAP layer is this crate's own, on quick-xml, covering only the calls
//! above (see the README for why not a generated vim25 crate).

mod error;
mod hosts;
mod lifecycle;
mod properties;
mod provider;
mod session;
mod soap;
mod tls;
mod vms;
mod xml;

pub use error::{kind_of_fault, Error};
pub use hosts::{list_hosts, ConnectionState, Host};
pub use lifecycle::{
    clone_vm, destroy_vm, list_templates, reconfigure_size, relocate_vm, shutdown_guest, CloneRequest, Template,
};
pub use provider::{VCenter, VCenterOptions, VsphereProvider, MAX_VM_NAME_CHARS};
pub use session::{Secret, ServiceContent, Session, SessionConfig, VIM_VERSION};
pub use soap::MoRef;
pub use tls::{Thumbprint, Trust};
pub use vms::{list_vms, power_off, power_on, PowerState, Vm, UID_KEY};
