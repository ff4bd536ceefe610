//! vmlet's libvirt provider: the VMs of one libvirt host as persistent domains,
//! driven through the [`virt`] crate.
//!
//! ```no_run
//! # async fn example() -> vmlet_provider::Result<()> {
//! use vmlet_libvirt::LibvirtProvider;
//! use vmlet_provider::Provider;
//!
//! let provider = LibvirtProvider::connect("qemu:///system").await?;
//! let host = provider.host_info().await?;
//! println!("{} CPUs, {} bytes, {}", host.cpus, host.memory_bytes, host.hypervisor);
//! # Ok(())
//! # }
//! ```
//!
//! Supported drivers: QEMU (`qemu:///system`; domains of type `kvm` where the
//! host offers KVM, type `qemu`, software emulation, otherwise: see
//! [`AcceleratorSetting`]) and libvirt's test driver (`test:///<absolute path>.xml`, used by
//! the tests and by development clusters; see `test-vms/hosts/`).
//!
//! QEMU domains are defined for real guests: direct kernel boot when asked, a
//! serial console that virtlogd records from boot in
//! `/var/log/vmlet/console/<domain uuid>.log`, a virtio-serial channel for
//! qemu-guest-agent (`org.qemu.guest_agent.0`), user-mode networking and a
//! balloon that reports guest memory. A VM's hot-plug ceilings (`max_cpus`,
//! `max_memory_bytes`) become `<vcpu current='…'>` and `<memory>` above
//! `<currentMemory>`. On QEMU the provider offers the
//! [`Console`](vmlet_provider::Console) (history and live attach),
//! [`GuestExec`](vmlet_provider::GuestExec) (through the agent),
//! [`Stats`](vmlet_provider::Stats), [`Resize`](vmlet_provider::Resize),
//! [`Migration`](vmlet_provider::Migration) (peer to peer, from this host's
//! libvirtd to the target's) and [`Backup`](vmlet_provider::Backup) (a running
//! VM's disk through libvirt's push-mode backup, an inactive one's and
//! restores, new disks or in place, with `qemu-img` on a local connection)
//! and [`Snapshots`](vmlet_provider::Snapshots) (libvirt's internal snapshots
//! in the qcow2 disk, with memory for a running VM; reverts of a stopped VM's
//! disk with `qemu-img` on a local connection) capabilities; on the test
//! driver `Stats`, `Resize` and `Snapshots` (kept in memory). A VM's
//! cloud-init data
//! ([`VmSpec::cloud_init`](vmlet_provider::VmSpec::cloud_init)) reaches a QEMU
//! guest as a NoCloud seed: an ISO 9660 image labelled `cidata` that vmlet
//! writes with `genisoimage` (on a local connection only) and attaches as a
//! read-only IDE CD-ROM (see [`LibvirtProvider::with_seed_dir`]).
//! `test-vms/guest/build.sh` builds a small guest that has all of this.
//!
//! How vmlet finds its domains, how the connection survives a libvirtd restart
//! and what that means for the test driver: see [`LibvirtProvider`].
//!
//! The provider registers libvirt's default event loop for the process (one
//! thread, `libvirt-events`) before its first connection, and keeps at most
//! four calls in flight per connection, below libvirtd's default
//! `max_client_requests` of 5; the rest wait their turn.

#![warn(missing_docs)]

mod backup;
mod chains;
mod checkpoint;
mod cloud_init;
mod connection;
mod console;
mod domains;
mod error;
mod event_loop;
mod events;
mod exec;
mod host_images;
mod in_flight;
mod jobs;
mod kvm_probe;
mod migration;
mod networks;
mod port_forward;
mod provider;
mod qemu_img;
mod resize;
mod restore;
mod snapshot;
mod stats;
mod volumes;
mod xml;

pub use networks::{Attachment, OfferedNetwork};
pub use provider::{probe_kvm, AcceleratorSetting, LibvirtProvider};
pub use xml::Accelerator;

/// Namespace URI of the `<vmlet:vm uid="…" namespace="…" name="…"/>` element
/// vmlet writes into each of its domains' `<metadata>`; read it with
/// `virsh metadata <domain> --uri https://vmlet.io/xmlns/domain/v1`.
pub const METADATA_NAMESPACE: &str = xml::METADATA_NS;
