#![warn(missing_docs)]
//! vmlet's vSphere provider, first slice: a vim25 SOAP session with a
//! pinned TLS trust ([`Session`]), the host inventory of a vCenter or ESXi
//! ([`list_hosts`]), the VMs vmlet owns ([`list_vms`]), their power
//! operations ([`power_on`], [`power_off`]), templates and clones
//! ([`list_templates`], [`clone_vm`]), snapshots ([`snapshots_of`],
//! [`create_snapshot`], [`revert_to_snapshot`], [`remove_snapshot`],
//! [`clone_snapshot_to_template`]), and the [`vmlet_provider::Provider`]
//! of one ESXi host ([`VsphereProvider`] over a shared [`VCenter`]).
//!
//! Status by push: each [`VCenter`] follows its VMs with one
//! `PropertyCollector` filter and `WaitForUpdatesEx` (`updates` module) and
//! its providers read VMs from that cache ([`VCenter::pushed_vms`]), reading
//! directly ([`list_vms`]) only while the cache is not current.
//!
//! The SOAP layer is this crate's own, on quick-xml, covering only the calls
//! above (see the README for why not a generated vim25 crate).

mod error;
mod hosts;
mod library;
mod lifecycle;
mod placement;
mod properties;
mod provider;
mod rest;
mod session;
mod snapshots;
mod soap;
mod tls;
mod updates;
mod vms;
mod xml;

pub use error::{kind_of_fault, Error};
pub use hosts::{list_hosts, ConnectionState, Host};
pub use library::{deploy_library_item, find_library_item, mark_as_template, LibraryDeploy, LibraryItem};
pub use lifecycle::{
    clone_vm, destroy_vm, list_templates, reconfigure_hardware, reconfigure_live, reconfigure_size, record_next_start,
    relocate_vm, shutdown_guest, CloneRequest, Hardware, NicBacking, NicNetwork, Template,
};
pub use placement::{
    read_datacenter, read_location, read_portgroup, read_template, Datacenter, Named, Nic, Pool, PortgroupPort,
    TemplateFacts, VmLocation,
};
pub use provider::{NetworkOffer, VCenter, VCenterOptions, VsphereProvider, MAX_VM_NAME_CHARS};
pub use session::{Secret, ServiceContent, Session, SessionConfig, VIM_VERSION};
pub use snapshots::{
    clone_snapshot_to_template, create_snapshot, remove_snapshot, revert_to_snapshot, snapshots_of, CreateSnapshot,
    Snapshot, SnapshotClone,
};
pub use soap::MoRef;
pub use tls::{Thumbprint, Trust};
pub use vms::{
    list_vms, power_off, power_on, PowerState, Sizing, Vm, MAX_CPUS_KEY, MAX_MEMORY_KEY, NEXT_CPUS_KEY,
    NEXT_MEMORY_KEY, UID_KEY,
};
