//! cloud-init data for a VM about to be defined: read from the Secret or
//! ConfigMap keys its `spec.cloudInit` names, in the VM's own namespace (a
//! pod can only ever name objects of its namespace, as with a pod's volumes).
//! The data goes to the provider ([`vmlet_provider::CloudInit`]) and nowhere
//! else: no log, no Event, no status carries it.

use crate::v1alpha1::{CloudInitSpec, DataSource};
use crate::vmpod::PodVm;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{Api, Client};
use vmlet_provider::{CloudInit, VmSpec};

/// Why the data could not be read: what the pod's waiting message says,
/// naming the field and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Missing {
    /// The object or key does not exist.
    #[error("{field}: {what} (namespace {namespace}); create it, or fix {field}")]
    NotFound {
        /// `spec.cloudInit.userData` or `spec.cloudInit.networkData`.
        field: &'static str,
        /// E.g. `Secret web-init has no key user-data`.
        what: String,
        /// The VM's namespace.
        namespace: String,
    },
    /// vmlet may not read it: its identity has no `get` on Secrets or
    /// ConfigMaps of this namespace until an administrator binds
    /// [`READER_ROLE`] there (`deploy/rbac.yaml`).
    #[error(
        "{field}: vmlet may not read {what} in namespace {namespace}; an administrator allows it for this namespace \
         with `kubectl create rolebinding vmlet-cloud-init -n {namespace} --clusterrole={READER_ROLE} \
         --serviceaccount=kube-system:vmlet` (or `--group=system:vmlets` for vmlets installed with `vmlet bootstrap`)"
    )]
    Forbidden {
        /// The field.
        field: &'static str,
        /// The object.
        what: String,
        /// The VM's namespace.
        namespace: String,
    },
    /// Reading it failed (the API server did not answer, or answered an
    /// error other than 403 and 404).
    #[error("{field}: reading {what} (namespace {namespace}) failed: {source}")]
    Kube {
        /// The field.
        field: &'static str,
        /// The object.
        what: String,
        /// The VM's namespace.
        namespace: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// The ClusterRole (`get` on secrets and configmaps) that an administrator
/// binds in each namespace whose VMs may take cloud-init data from its
/// Secrets and ConfigMaps; vmlet's own ClusterRole does not grant it.
pub const READER_ROLE: &str = "vmlet-cloud-init";

impl Missing {
    /// The waiting reason of the VM's pod: `CloudInitDataNotFound`,
    /// `CloudInitDataForbidden` or `CloudInitDataUnreadable`.
    pub fn reason(&self) -> &'static str {
        match self {
            Missing::NotFound { .. } => "CloudInitDataNotFound",
            Missing::Forbidden { .. } => "CloudInitDataForbidden",
            Missing::Kube { .. } => "CloudInitDataUnreadable",
        }
    }
}

/// `vm`'s provider spec with its cloud-init data read in; unchanged when it
/// has none.
pub async fn with_cloud_init(client: &Client, vm: &PodVm) -> Result<VmSpec, Missing> {
    let mut spec = vm.spec.clone();
    let Some(source) = &vm.cloud_init else { return Ok(spec) };
    spec.cloud_init = Some(read(client, &spec, source).await?);
    Ok(spec)
}

async fn read(client: &Client, spec: &VmSpec, source: &CloudInitSpec) -> Result<CloudInit, Missing> {
    let user_data = key(client, &spec.namespace, "spec.cloudInit.userData", &source.user_data).await?;
    let network_config = match &source.network_data {
        Some(network) => Some(key(client, &spec.namespace, "spec.cloudInit.networkData", network).await?),
        None => None,
    };
    Ok(CloudInit {
        instance_id: spec.id.0.clone(),
        hostname: source.hostname.clone().unwrap_or_else(|| spec.name.clone()),
        user_data,
        network_config,
    })
}

/// The bytes of the key `source` names in `namespace`.
async fn key(client: &Client, namespace: &str, field: &'static str, source: &DataSource) -> Result<Vec<u8>, Missing> {
    let not_found = |what: String| Missing::NotFound { field, what, namespace: namespace.to_owned() };
    let failed = |what: String| {
        move |source| match source {
            kube::Error::Api(ref status) if status.code == 403 => {
                Missing::Forbidden { field, what, namespace: namespace.to_owned() }
            }
            source => Missing::Kube { field, what, namespace: namespace.to_owned(), source },
        }
    };
    match (&source.secret_key_ref, &source.config_map_key_ref) {
        (Some(r), _) => {
            let what = format!("Secret {}", r.name);
            let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
            let Some(secret) = secrets.get_opt(&r.name).await.map_err(failed(what.clone()))? else {
                return Err(not_found(format!("{what} does not exist")));
            };
            let bytes = secret.data.as_ref().and_then(|d| d.get(&r.key)).map(|b| b.0.clone());
            let text = secret.string_data.as_ref().and_then(|d| d.get(&r.key)).map(|s| s.clone().into_bytes());
            bytes.or(text).ok_or_else(|| not_found(format!("{what} has no key {}", r.key)))
        }
        (None, Some(r)) => {
            let what = format!("ConfigMap {}", r.name);
            let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
            let Some(map) = maps.get_opt(&r.name).await.map_err(failed(what.clone()))? else {
                return Err(not_found(format!("{what} does not exist")));
            };
            let text = map.data.as_ref().and_then(|d| d.get(&r.key)).map(|s| s.clone().into_bytes());
            let bytes = map.binary_data.as_ref().and_then(|d| d.get(&r.key)).map(|b| b.0.clone());
            text.or(bytes).ok_or_else(|| not_found(format!("{what} has no key {}", r.key)))
        }
        (None, None) => Err(not_found("names neither secretKeyRef nor configMapKeyRef".to_owned())),
    }
}
