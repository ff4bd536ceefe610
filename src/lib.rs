//! vmlet: IaaS virtual machines under Kubernetes.
//!
//! Each hypervisor host registers as a virtual node ([`node`]); each running VM
//! is a pod bound to its host's node, created by the VirtualMachine controller
//! ([`controller`]) from the [`v1alpha1::VirtualMachine`] resource. Backends are
//! reached only through [`vmlet_provider::Provider`]; this crate names none.

pub mod api;
pub mod api_client;
pub mod bootstrap;
pub mod cache;
pub mod clouds;
pub mod conditions;
pub mod config;
pub mod controller;
pub mod election;
pub mod events;
pub mod failure;
pub mod heap;
pub mod identity;
pub mod metrics;
pub mod node;
pub mod pod_index;
pub mod quantity;
pub mod storage;
pub mod streams;
pub mod v1alpha1;
pub mod vcenters;
pub mod vmpod;
pub mod watches;
pub mod written;

#[cfg(test)]
mod testing;
