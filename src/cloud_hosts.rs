//! The compute hosts of `config.clouds`, found when vmlet starts: one
//! virtual node and one provider each ([`vmlet::clouds`]).

use anyhow::{anyhow, Context};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vmlet::clouds::{CloudHostsConfig, CloudsSource, SecretKeyRef};
use vmlet::config::HostConfig;
use vmlet_provider::Provider;

/// How long vmlet waits between attempts to list a cloud's compute hosts
/// when it must (hosts chosen by zone, or all of them).
const LIST_RETRY: Duration = Duration::from_secs(10);

/// What the cloud says of one compute host: its availability zone and its
/// CPU and memory allocation ratios.
type Found = (Option<String>, (Option<f64>, Option<f64>));

/// The host configs and providers of every cloud's selected compute hosts.
/// A cloud whose hosts are named is served even when it cannot be listed now
/// (its nodes then report NotReady, saying why); one chosen by zone or in
/// full is listed until that succeeds or vmlet shuts down (`None`).
///
/// Errors: a clouds.yaml that cannot be read or parsed, naming the entry and
/// the field; a compute host whose node name would be invalid.
pub async fn discover(
    client: &kube::Client,
    clouds: &[CloudHostsConfig],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Vec<(HostConfig, Arc<dyn Provider>)>>> {
    let mut found = Vec::new();
    for (i, entry) in clouds.iter().enumerate() {
        let bytes = match entry.source() {
            CloudsSource::File(path) => {
                tokio::fs::read(path).await.with_context(|| format!("clouds[{i}].cloudsFile: reading {path}"))?
            }
            CloudsSource::Secret(key) => {
                read_secret(client, key).await.with_context(|| format!("clouds[{i}].cloudsSecret"))?
            }
        };
        let cloud_config = vmlet_openstack::CloudConfig::from_bytes(&bytes, &entry.cloud)
            .map_err(|e| anyhow!("clouds[{i}] ({}): {e}", entry.cloud))?;
        // What tenants may name: only what the administrator listed.
        let options = vmlet_openstack::CloudOptions {
            allowed_images: Some(entry.images.clone()),
            allowed_networks: Some(entry.plain_network_uuids()),
            offered_networks: entry
                .named_networks()
                .map(|n| vmlet_openstack::OfferedNetwork {
                    name: n.name.clone(),
                    uuid: n.uuid.clone(),
                    namespaces: n.namespaces.clone(),
                })
                .collect(),
            ..vmlet_openstack::CloudOptions::default()
        };
        let cloud =
            Arc::new(vmlet_openstack::Cloud::new(cloud_config, options).map_err(|e| anyhow!("clouds[{i}]: {e}"))?);
        let listed = loop {
            match cloud.hypervisors().await {
                Ok(list) => break Some(list),
                Err(e) if entry.hosts.is_some() => {
                    warn!(cloud = %entry.cloud, error = %e, "cannot list the cloud's compute hosts; serving the named ones");
                    break None;
                }
                Err(e) => {
                    warn!(cloud = %entry.cloud, error = %e, retry_seconds = LIST_RETRY.as_secs(), "cannot list the cloud's compute hosts; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(LIST_RETRY) => {}
                    }
                }
            }
        };
        let mut hosts: BTreeMap<String, Found> = BTreeMap::new();
        match &listed {
            Some(list) => {
                for h in list.iter().filter(|h| entry.selects(&h.host, h.availability_zone.as_deref())) {
                    let ratios = (
                        h.vcpu_inventory.as_ref().map(|i| i.allocation_ratio),
                        h.memory_inventory.as_ref().map(|i| i.allocation_ratio),
                    );
                    hosts.insert(h.host.clone(), (h.availability_zone.clone(), ratios));
                }
                let missing: Vec<String> =
                    entry.hosts.iter().flatten().filter(|h| !hosts.contains_key(*h)).cloned().collect();
                for missing in missing {
                    warn!(cloud = %entry.cloud, host = %missing, "clouds[{i}].hosts names a compute host the cloud does not list; serving it anyway");
                    hosts.insert(missing, (None, (None, None)));
                }
            }
            None => hosts.extend(entry.hosts.iter().flatten().map(|h| (h.clone(), (None, (None, None))))),
        }
        if hosts.is_empty() {
            warn!(cloud = %entry.cloud, "no compute host of the cloud matches clouds[{i}]");
        }
        for (host, (zone, ratios)) in hosts {
            let config = entry.host_config(&host, zone.as_deref(), ratios)?;
            info!(cloud = %entry.cloud, compute.host = %host, node.name = %config.name, zone = zone.as_deref().unwrap_or(""), "serving a compute host");
            let provider = vmlet_openstack::OpenStackProvider::new(cloud.clone(), &host).with_node_name(&config.name);
            found.push((config, Arc::new(provider) as Arc<dyn Provider>));
        }
    }
    Ok(Some(found))
}

/// The bytes of one key of a Secret. Errors: the Secret cannot be read, or
/// has no such key (the message names both, never the contents).
pub(crate) async fn read_secret(client: &kube::Client, key: &SecretKeyRef) -> anyhow::Result<Vec<u8>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &key.namespace);
    let secret = secrets
        .get(&key.name)
        .await
        .with_context(|| format!("reading Secret {}/{} (vmlet needs get on it)", key.namespace, key.name))?;
    let data = secret.data.unwrap_or_default();
    let value = data.get(&key.key).ok_or_else(|| {
        let keys: Vec<&String> = data.keys().collect();
        anyhow!("Secret {}/{} has no key {:?} (it has {keys:?})", key.namespace, key.name, key.key)
    })?;
    Ok(value.0.clone())
}
