//! [`PortForward`]: TCP connections from vmlet's machine to a guest's port,
//! at the address the host's libvirt network leased to the guest.
//!
//! Where a connection goes is read from libvirt at every connect
//! ([`crate::domains::leased_addresses`]): only an address libvirt's DHCP
//! server leased to one of the domain's interfaces on a libvirt network.
//! Addresses a guest names itself (guest agent, ARP: what a bridge or
//! macvtap interface reports) are never used, so a guest cannot point
//! forwarding at the host's loopback, the host's other addresses or another
//! machine, and the request names only the port. Loopback, link-local,
//! multicast and unspecified addresses are never used either.
//!
//! Only a local libvirtd (`qemu:///system`): over a remote connection the
//! leased address is on the remote host's network, which vmlet's machine may
//! not reach, or may reach as some other machine.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tracing::instrument;
use vmlet_provider::{Error, ErrorKind, GuestConnection, PortForward, Result, VmId};

use crate::domains::leased_addresses;
use crate::provider::{is_active, is_local_uri, LibvirtProvider};

/// How long one TCP connect to the guest may take before it is given up
/// (`Transient`): a guest that drops SYNs (a firewall, or nothing up yet)
/// must not hold the client for the system's default of minutes.
pub(crate) const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

/// How long reading the leased address from libvirt may take.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(20);

const OP: &str = "connect to guest port";

#[async_trait::async_trait]
impl PortForward for LibvirtProvider {
    /// Connect to `port` at the VM's leased address, trying each address of
    /// the VM in order (IPv4 first as libvirt lists them) until one answers,
    /// within [`CONNECT_DEADLINE`] each. Errors: `NotFound` (no such VM),
    /// `Transient` (not running, no lease yet, refused, no answer),
    /// `Unsupported` (a remote libvirtd, or no interface on a libvirt
    /// network), `InvalidInput` (port 0).
    #[instrument(skip(self), fields(provider = "libvirt", vm.uid = %id))]
    async fn connect(&self, id: &VmId, port: u16) -> Result<Box<dyn GuestConnection>> {
        if port == 0 {
            return Err(Error::new(OP, ErrorKind::InvalidInput, "port 0 is no port to connect to"));
        }
        let uri = self.uri().to_owned();
        if !is_local_uri(&uri) {
            return Err(Error::new(
                OP,
                ErrorKind::Unsupported,
                format!(
                    "this host's libvirtd is reached over a remote connection ({uri}); vmlet reaches a guest's \
                     ports only on a local libvirt host's networks (run vmlet on the host, qemu:///system)"
                ),
            ));
        }
        let vm = id.clone();
        let addresses = self
            .blocking_within(OP, LOOKUP_DEADLINE, move |host, conn| {
                let domain = host.require(conn, OP, &vm)?;
                if !is_active(&domain, OP)? {
                    return Err(Error::new(OP, ErrorKind::Transient, format!("VM {vm} is not running")));
                }
                leased_addresses(&domain)
            })
            .await?;
        connect_first(id, &addresses, port).await
    }
}

/// A connection to `port` at the first of `addresses` that accepts one.
async fn connect_first(id: &VmId, addresses: &[IpAddr], port: u16) -> Result<Box<dyn GuestConnection>> {
    if addresses.is_empty() {
        return Err(Error::new(
            OP,
            ErrorKind::Transient,
            format!(
                "VM {id} has no address leased by its host's libvirt network yet (a guest that is still booting \
                 gets one from DHCP; only interfaces on libvirt networks are reachable for port forwarding)"
            ),
        ));
    }
    let mut failures = Vec::new();
    for address in addresses {
        let target = SocketAddr::new(*address, port);
        match tokio::time::timeout(CONNECT_DEADLINE, tokio::net::TcpStream::connect(target)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(Box::new(stream));
            }
            Ok(Err(e)) => failures.push(format!("{target}: {e}")),
            Err(_) => failures.push(format!("{target}: no answer within {}s", CONNECT_DEADLINE.as_secs())),
        }
    }
    Err(Error::new(OP, ErrorKind::Transient, format!("port {port} of VM {id}: {}", failures.join("; "))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_address_is_a_transient_error_that_says_why() {
        let error = connect_first(&VmId("u-1".to_owned()), &[], 80).await.err().unwrap();
        assert_eq!(error.kind, ErrorKind::Transient);
        assert!(error.to_string().contains("no address leased"), "{error}");
    }

    #[tokio::test]
    async fn a_refused_port_names_the_address_tried() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let addresses = ["127.0.0.1".parse().unwrap()];
        let error = connect_first(&VmId("u-1".to_owned()), &addresses, port).await.err().unwrap();
        assert_eq!(error.kind, ErrorKind::Transient);
        assert!(error.to_string().contains(&format!("127.0.0.1:{port}")), "{error}");
    }
}
