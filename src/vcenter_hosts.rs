//! The ESXi hosts of `config.vcenters`, found when vmlet starts: one
//! virtual node and one provider each ([`vmlet::vcenters`]), as
//! [`crate::cloud_hosts`] does for `clouds`.

use anyhow::{anyhow, Context};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vmlet::clouds::SecretKeyRef;
use vmlet::config::HostConfig;
use vmlet::vcenters::{PasswordSource, TrustSource, VCenterHostsConfig};
use vmlet_provider::{ErrorKind, Provider};
use vmlet_vsphere::{NetworkOffer, Secret, SessionConfig, Thumbprint, Trust, VCenter, VCenterOptions, VsphereProvider};

/// How long vmlet waits between attempts to list a vCenter's hosts when it
/// must (hosts chosen by cluster, or all of them).
const LIST_RETRY: Duration = Duration::from_secs(10);

/// The host configs and providers of every vCenter's selected ESXi hosts.
/// A vCenter whose hosts are named is served even when it cannot be listed
/// now (its nodes then report NotReady, saying why); one chosen by cluster
/// or in full is listed until that succeeds or vmlet shuts down (`None`).
///
/// Errors: an unreadable password file or Secret, naming the field; a
/// thumbprint, CA file or URL the vCenter cannot be reached with (kind
/// `Permanent`: a thumbprint mismatch is refused here, at start, naming
/// `vcenters[i].thumbprint`); a host whose node name would be invalid.
pub async fn discover(
    client: &kube::Client,
    vcenters: &[VCenterHostsConfig],
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Vec<(HostConfig, Arc<dyn Provider>)>>> {
    let mut found = Vec::new();
    for (i, entry) in vcenters.iter().enumerate() {
        let password = match entry.password_source() {
            PasswordSource::File(path) => {
                tokio::fs::read(path).await.with_context(|| format!("vcenters[{i}].passwordFile: reading {path}"))?
            }
            PasswordSource::Secret(key) => {
                let key =
                    SecretKeyRef { namespace: key.namespace.clone(), name: key.name.clone(), key: key.key.clone() };
                crate::cloud_hosts::read_secret(client, &key)
                    .await
                    .with_context(|| format!("vcenters[{i}].passwordSecret"))?
            }
        };
        let password = String::from_utf8(password).map_err(|_| anyhow!("vcenters[{i}]: the password is not UTF-8"))?;
        let password = password.strip_suffix('\n').unwrap_or(&password);
        let trust = match entry.trust_source() {
            TrustSource::Thumbprint(value) => {
                Trust::Thumbprint(value.parse::<Thumbprint>().map_err(|e| anyhow!("vcenters[{i}].thumbprint: {e}"))?)
            }
            TrustSource::CaFile(path) => Trust::CaFile(path.into()),
        };
        let session = SessionConfig::new(&entry.url, trust, &entry.username, Secret::new(password));
        let options = VCenterOptions {
            datacenter: Some(entry.datacenter.clone()),
            // What tenants may clone: only what the administrator listed.
            templates: entry.templates.clone(),
            library_items: entry.library_items.clone(),
            folder: entry.folder.clone(),
            resource_pool: entry.resource_pool.clone(),
            datastore: entry.datastore.clone(),
            datastores: entry.datastores.clone(),
            networks: entry
                .networks
                .iter()
                .map(|n| NetworkOffer {
                    name: n.name.clone(),
                    network: n.network.clone(),
                    namespaces: n.namespaces.clone(),
                })
                .collect(),
            ..VCenterOptions::default()
        };
        let vcenter = Arc::new(VCenter::new(&entry.name, session, options));
        let listed = loop {
            match vcenter.hosts().await {
                Ok(list) => break Some(list),
                Err(e) if e.kind() == ErrorKind::Permanent => {
                    let field = match entry.trust_source() {
                        TrustSource::Thumbprint(_) => "thumbprint",
                        TrustSource::CaFile(_) => "caFile",
                    };
                    return Err(anyhow!(
                        "vcenters[{i}] ({}): cannot talk to {} (check url and {field}): {e}",
                        entry.name,
                        entry.url
                    ));
                }
                Err(e) if entry.hosts.is_some() => {
                    warn!(vcenter = %entry.name, error = %e, "cannot list the vCenter's hosts; serving the named ones");
                    break None;
                }
                Err(e) => {
                    warn!(vcenter = %entry.name, error = %e, retry_seconds = LIST_RETRY.as_secs(), "cannot list the vCenter's hosts; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(LIST_RETRY) => {}
                    }
                }
            }
        };
        // Host name → its cluster, if any.
        let mut hosts: BTreeMap<String, Option<String>> = BTreeMap::new();
        match &listed {
            Some(list) => {
                for h in list.iter().filter(|h| entry.selects(&h.name, h.cluster.as_deref())) {
                    hosts.insert(h.name.clone(), h.cluster.clone());
                }
                for missing in
                    entry.hosts.iter().flatten().filter(|h| !hosts.contains_key(*h)).cloned().collect::<Vec<_>>()
                {
                    warn!(vcenter = %entry.name, host = %missing, "vcenters[{i}].hosts names a host datacenter {} does not list; serving it anyway", entry.datacenter);
                    hosts.insert(missing, None);
                }
            }
            None => hosts.extend(entry.hosts.iter().flatten().map(|h| (h.clone(), None))),
        }
        if hosts.is_empty() {
            warn!(vcenter = %entry.name, "no ESXi host of the vCenter matches vcenters[{i}]");
        }
        for (host, cluster) in hosts {
            let config = entry.host_config(i, &host, cluster.as_deref())?;
            info!(vcenter = %entry.name, esxi.host = %host, node.name = %config.name, cluster = cluster.as_deref().unwrap_or(""), "serving an ESXi host");
            let provider = VsphereProvider::new(vcenter.clone(), &host).with_node_name(&config.name);
            found.push((config, Arc::new(provider) as Arc<dyn Provider>));
        }
    }
    Ok(Some(found))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The simulator of `hack/vsphere.sh` (`eval "$(hack/vsphere.sh env)"`),
    /// or `None` with `VMLET_SKIP_VSPHERE=1`.
    fn simulator() -> Option<(String, String, String)> {
        if std::env::var("VMLET_SKIP_VSPHERE").as_deref() == Ok("1") {
            eprintln!("*** SKIPPED: VMLET_SKIP_VSPHERE=1 ***");
            return None;
        }
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| {
                panic!("{name} is unset: run `hack/vsphere.sh up && eval \"$(hack/vsphere.sh env)\"` first, or set VMLET_SKIP_VSPHERE=1")
            })
        };
        Some((var("VMLET_VSPHERE_URL"), var("VMLET_VSPHERE_PASSWORD"), var("VMLET_VSPHERE_THUMBPRINT")))
    }

    /// A client that is never called: the entries read their password from a file.
    fn unused_client() -> kube::Client {
        kube::Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap())).unwrap()
    }

    fn entry(url: &str, password_file: &std::path::Path, thumbprint: &str) -> VCenterHostsConfig {
        serde_yaml::from_str(&format!(
            "{{name: vcsim, url: '{url}', username: vmlet, passwordFile: '{}', thumbprint: '{thumbprint}', \
             datacenter: DC0, clusters: [DC0_C0], templates: [template-c0], nodeNamePrefix: vs-}}",
            password_file.display()
        ))
        .unwrap()
    }

    #[tokio::test]
    async fn a_clusters_hosts_become_nodes_with_zone_and_a_wrong_thumbprint_is_refused_naming_the_field() {
        let Some((url, password, thumbprint)) = simulator() else { return };
        let dir = tempfile::tempdir().unwrap();
        let password_file = dir.path().join("password");
        std::fs::write(&password_file, format!("{password}\n")).unwrap();
        let client = unused_client();
        let shutdown = CancellationToken::new();
        let found = discover(&client, &[entry(&url, &password_file, &thumbprint)], &shutdown).await.unwrap().unwrap();
        let nodes: Vec<(&str, &str, Option<&str>)> = found
            .iter()
            .map(|(h, p)| (h.name.as_str(), p.kind(), h.labels.get("topology.kubernetes.io/zone").map(String::as_str)))
            .collect();
        assert_eq!(
            nodes,
            [
                ("vs-dc0-c0-h0", "vsphere", Some("DC0_C0")),
                ("vs-dc0-c0-h1", "vsphere", Some("DC0_C0")),
                ("vs-dc0-c0-h2", "vsphere", Some("DC0_C0"))
            ]
        );
        let info = found[0].1.host_info().await.expect("host_info");
        assert_eq!((info.cpus, info.memory_bytes), (2, 4_294_430_720));

        let wrong = "00".repeat(32);
        let error = discover(&client, &[entry(&url, &password_file, &wrong)], &shutdown).await.err().expect("refused");
        let error = format!("{error:#}");
        assert!(error.starts_with("vcenters[0] (vcsim): cannot talk to"), "{error}");
        assert!(error.contains("`thumbprint`") && error.contains(&thumbprint), "{error}");
    }
}
