//! vmlet's OpenStack provider: the servers of a Nova cloud's compute hosts,
//! through the identity (Keystone v3), compute (Nova, microversion 2.60 to
//! 2.100) and placement REST APIs. It never talks to Kubernetes.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use vmlet_openstack::{Cloud, CloudConfig, CloudOptions, OpenStackProvider};
//! use vmlet_provider::Provider;
//!
//! let config = CloudConfig::from_file("/etc/vmlet/clouds.yaml".as_ref(), "mycloud")?;
//! let cloud = Cloud::connect(config, CloudOptions::default()).await?;
//! for hypervisor in cloud.hypervisors().await?.iter() {
//!     let provider = OpenStackProvider::new(cloud.clone(), &hypervisor.host);
//!     println!("{}: {} vCPUs, {} servers", hypervisor.host, hypervisor.cpus, provider.list().await?.len());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - [`CloudConfig`]: one cloud of a `clouds.yaml` (file or bytes), secrets
//!   redacted in `Debug`.
//! - [`Cloud`]: the session shared by all hosts (token renewal, catalog,
//!   microversion, the shared server listing, [`Cloud::hypervisors`]).
//! - [`OpenStackProvider`]: one per compute host, implementing
//!   [`vmlet_provider::Provider`] with the resize, migration, console and
//!   volume (Cinder) capabilities.
//!
//! vmlet needs the admin role in the cloud (see [`Cloud`]).

#![warn(missing_docs)]

mod auth;
mod compute;
mod config;
mod console;
mod error;
mod hosts;
pub mod mapping;
pub mod microversion;
mod migration;
mod networks;
pub mod options;
mod provider;
mod resize;
mod session;
mod volumes;

pub use config::{CloudConfig, ConfigError, Credentials, Interface, NameOrId, Scope, Secret, Tls, User};
pub use hosts::{HostState, HostStatus, Hypervisor, Inventory};
pub use microversion::Microversion;
pub use networks::OfferedNetwork;
pub use provider::OpenStackProvider;
pub use session::{Cloud, CloudOptions};
