//! Shared by the tests against the real Nova harness (`hack/nova.sh` of the
//! nova-harness branch: Keystone, Placement and Nova with fake computes
//! nova-a, nova-b, nova-c on 127.0.0.1).
//!
//! The cloud comes from `VMLET_NOVA_CLOUDS_YAML` (a clouds.yaml path; cloud
//! `VMLET_NOVA_CLOUD`, default the file's only one) or from the `OS_*`
//! variables that `hack/nova.sh env` prints. Without either a test fails,
//! saying how to start the harness, unless `VMLET_SKIP_NOVA=1`.

#![allow(dead_code)] // not every test binary uses every helper

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vmlet_openstack::{Cloud, CloudConfig, CloudOptions, OpenStackProvider};
use vmlet_provider::{PowerState, Provider, VmId, VmSpec, VmStatus};

pub const MIB: u64 = 1024 * 1024;

/// The harness as the tests see it.
pub struct Harness {
    /// clouds.yaml content naming cloud [`CLOUD`].
    pub clouds_yaml: String,
    pub cloud_name: String,
    /// The compute hosts, in order (`VMLET_NOVA_HOSTS`).
    pub hosts: Vec<String>,
    /// An image id the cloud serves (`VMLET_NOVA_IMAGE`).
    pub image: String,
    /// A network UUID the cloud serves (`VMLET_NOVA_NETWORK`).
    pub network: String,
    /// A second network (`VMLET_NOVA_NETWORK_2`, the harness's `lan2`,
    /// 10.42.0.0/24), when the harness has one.
    pub network_2: Option<String>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn required(name: &str) -> String {
    var(name).unwrap_or_else(|| {
        panic!("{name} is unset: start the harness with `hack/nova.sh up` and `eval \"$(hack/nova.sh env)\"`")
    })
}

/// The harness, or `None` (after saying so loudly) with `VMLET_SKIP_NOVA=1`.
/// Panics with how to start the harness when it is not configured.
pub fn harness(test: &str) -> Option<Harness> {
    if var("VMLET_SKIP_NOVA").as_deref() == Some("1") {
        eprintln!("\n*** SKIPPED {test}: VMLET_SKIP_NOVA=1 ***\n");
        return None;
    }
    let (clouds_yaml, cloud_name) = match var("VMLET_NOVA_CLOUDS_YAML") {
        Some(path) => {
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("VMLET_NOVA_CLOUDS_YAML {path}: {e}"));
            (text, var("VMLET_NOVA_CLOUD").unwrap_or_else(|| "vmlet-test".into()))
        }
        None => {
            if var("OS_AUTH_URL").is_none() {
                panic!(
                    "no Nova to test against: neither VMLET_NOVA_CLOUDS_YAML nor OS_AUTH_URL is set. Start the \
                     harness (nova-harness branch): `hack/nova.sh up && eval \"$(hack/nova.sh env)\"`, then run \
                     the tests again; or set VMLET_SKIP_NOVA=1 to skip them knowingly"
                );
            }
            (clouds_yaml_from_os_env(), "vmlet-test".to_owned())
        }
    };
    let hosts: Vec<String> = required("VMLET_NOVA_HOSTS").split(',').map(str::to_owned).collect();
    assert!(hosts.len() >= 2, "VMLET_NOVA_HOSTS needs at least two hosts: {hosts:?}");
    Some(Harness {
        clouds_yaml,
        cloud_name,
        hosts,
        image: required("VMLET_NOVA_IMAGE"),
        network: required("VMLET_NOVA_NETWORK"),
        network_2: var("VMLET_NOVA_NETWORK_2"),
    })
}

/// A clouds.yaml for the `OS_*` environment (password auth, project scope).
pub fn clouds_yaml_from_os_env() -> String {
    let os = |name: &str| required(name);
    format!(
        "clouds:\n  vmlet-test:\n    auth:\n      auth_url: {}\n      username: {}\n      password: {}\n      \
         user_domain_name: {}\n      project_name: {}\n      project_domain_name: {}\n    region_name: {}\n    \
         interface: {}\n",
        os("OS_AUTH_URL"),
        os("OS_USERNAME"),
        serde_json_string(&os("OS_PASSWORD")),
        var("OS_USER_DOMAIN_NAME").unwrap_or_else(|| "Default".into()),
        os("OS_PROJECT_NAME"),
        var("OS_PROJECT_DOMAIN_NAME").unwrap_or_else(|| "Default".into()),
        var("OS_REGION_NAME").unwrap_or_else(|| "RegionOne".into()),
        var("OS_INTERFACE").unwrap_or_else(|| "public".into()),
    )
}

/// A YAML-safe quoted string (JSON strings are YAML).
fn serde_json_string(s: &str) -> String {
    format!("{s:?}")
}

/// Options for tests: short polls.
pub fn test_options() -> CloudOptions {
    CloudOptions {
        poll_interval: Duration::from_millis(300),
        listing_ttl: Duration::from_millis(500),
        build_timeout: Duration::from_secs(120),
        task_timeout: Duration::from_secs(120),
        ..CloudOptions::default()
    }
}

impl Harness {
    pub fn config(&self) -> CloudConfig {
        CloudConfig::from_bytes(self.clouds_yaml.as_bytes(), &self.cloud_name).expect("harness clouds.yaml")
    }

    /// A new session, as a restarted vmlet would make.
    pub async fn cloud(&self) -> Arc<Cloud> {
        Cloud::connect(self.config(), test_options()).await.expect("connect to the harness cloud")
    }

    /// One provider per host of `cloud`.
    pub fn providers(&self, cloud: &Arc<Cloud>) -> Vec<OpenStackProvider> {
        self.hosts.iter().map(|h| OpenStackProvider::new(cloud.clone(), h)).collect()
    }

    /// A spec unique to this run in `namespace`: 1 vCPU, 256 MiB, the
    /// harness image and network.
    pub fn spec(&self, namespace: &str, what: &str) -> VmSpec {
        let (id, nanos) = unique_uid();
        let mut spec = VmSpec {
            id,
            namespace: namespace.into(),
            name: format!("{what}-{}-{}", std::process::id(), nanos % 1_000_000_000),
            cpus: 1,
            memory_bytes: 256 * MIB,
            max_cpus: None,
            max_memory_bytes: None,
            image: Some(self.image.clone()),
            image_backing_chain: None,
            kernel_boot: None,
            options: Default::default(),
            cloud_init: None,
            disks: vec![],
            networks: vec![],
        };
        spec.options.insert("networks".into(), self.network.clone());
        spec
    }
}

/// A UUID-shaped uid unique to this run, and the nanoseconds it came from.
pub fn unique_uid() -> (VmId, u128) {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos();
    let uid = uuid_from(nanos ^ ((std::process::id() as u128) << 96));
    (VmId(uid), nanos)
}

fn uuid_from(n: u128) -> String {
    let hex = format!("{n:032x}");
    format!("{}-{}-4{}-8{}-{}", &hex[0..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..32])
}

/// Remove what an earlier run left in `namespace` on any host.
pub async fn remove_leftovers(providers: &[OpenStackProvider], namespace: &str) {
    let prefix = format!("{namespace}_");
    for provider in providers {
        for vm in provider.list().await.expect("list") {
            if vm.backend_name.starts_with(&prefix) {
                eprintln!("removing leftover {} ({}) on {}", vm.backend_name, vm.backend_id, provider.host());
                remove(provider, &vm.id).await;
            }
        }
    }
}

/// Stop and delete a VM (test cleanup).
pub async fn remove(provider: &OpenStackProvider, id: &VmId) {
    if let Err(e) = provider.destroy(id).await {
        eprintln!("cleanup destroy {id}: {e}");
    }
    provider.undefine(id).await.unwrap_or_else(|e| panic!("cleanup undefine {id}: {e}"));
}

/// Call `probe` until it returns `Ok`, at most `deadline`; panics with the
/// last `Err` description then.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(last) if start.elapsed() >= deadline => {
                panic!("{what}: not within {} s; last: {last}", deadline.as_secs())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// Wait until `get` reports `power` for the VM on `provider`'s host.
pub async fn wait_power(provider: &OpenStackProvider, id: &VmId, power: PowerState) -> VmStatus {
    wait_for(&format!("{id} {power:?} on {}", provider.host()), Duration::from_secs(120), || async {
        match provider.get(id).await.map_err(|e| e.to_string())? {
            Some(status) if status.power == power => Ok(status),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// How many servers of the whole cloud (every host) carry `id`.
pub async fn count_everywhere(providers: &[OpenStackProvider], id: &VmId) -> usize {
    let mut n = 0;
    for provider in providers {
        n += provider.list().await.expect("list").iter().filter(|s| &s.id == id).count();
    }
    n
}

/// A Keystone token of the harness's admin (`OS_*`), the admin's user id
/// and the token's project id.
async fn admin_token(http: &reqwest::Client) -> (String, String, String) {
    let os = |name: &str| required(name);
    let auth = serde_json::json!({"auth": {
        "identity": {"methods": ["password"], "password": {"user": {
            "name": os("OS_USERNAME"), "domain": {"name": var("OS_USER_DOMAIN_NAME").unwrap_or_else(|| "Default".into())},
            "password": os("OS_PASSWORD")}}},
        "scope": {"project": {"name": os("OS_PROJECT_NAME"),
            "domain": {"name": var("OS_PROJECT_DOMAIN_NAME").unwrap_or_else(|| "Default".into())}}}
    }});
    let response = http.post(format!("{}/auth/tokens", os("OS_AUTH_URL"))).json(&auth).send().await.expect("token");
    assert!(response.status().is_success(), "token: {}", response.status());
    let token = response.headers()["X-Subject-Token"].to_str().expect("token header").to_owned();
    let body: serde_json::Value = response.json().await.expect("token body");
    let user = body["token"]["user"]["id"].as_str().expect("the token's user id").to_owned();
    let project = body["token"]["project"]["id"].as_str().expect("the token's project id").to_owned();
    (token, user, project)
}

/// Create an application credential `name` for the harness's admin, in its
/// project (as a user does with `openstack application credential create`):
/// its id and secret.
pub async fn create_application_credential(name: &str) -> (String, String) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    let (token, user, _) = admin_token(&http).await;
    let response = http
        .post(format!("{}/users/{user}/application_credentials", required("OS_AUTH_URL")))
        .header("X-Auth-Token", token)
        .json(&serde_json::json!({"application_credential": {"name": name}}))
        .send()
        .await
        .expect("create application credential");
    assert!(response.status().is_success(), "create application credential: {}", response.status());
    let body: serde_json::Value = response.json().await.expect("application credential body");
    let credential = &body["application_credential"];
    (credential["id"].as_str().expect("id").to_owned(), credential["secret"].as_str().expect("secret").to_owned())
}

/// Post a server action to Nova as the harness's admin, behind the
/// provider's back (e.g. `os-resetState` to make a server look crashed).
/// Uses the `OS_*` variables of `hack/nova.sh env` and `VMLET_NOVA_URL`.
pub async fn nova_action_behind_vmlet(server_id: &str, body: serde_json::Value) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    let (token, _, _) = admin_token(&http).await;
    let response = http
        .post(format!("{}/servers/{server_id}/action", required("VMLET_NOVA_URL")))
        .header("X-Auth-Token", token)
        .header("OpenStack-API-Version", "compute 2.60")
        .json(&body)
        .send()
        .await
        .expect("action");
    assert!(response.status().is_success(), "{body}: {}", response.status());
}

/// `ensure_defined`, retried on `Transient` errors as vmlet's node agent
/// retries (the harness's Placement, on sqlite, sometimes fails a
/// scheduling with "database is locked", which Nova reports as no valid host).
pub async fn define(provider: &OpenStackProvider, spec: &VmSpec) -> VmStatus {
    let mut attempt = 1;
    loop {
        match provider.ensure_defined(spec).await {
            Ok(status) => return status,
            Err(e) if e.is_transient() && attempt < 3 => {
                eprintln!("define {} on {} (attempt {attempt}): {e}; retrying", spec.backend_name(), provider.host());
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => panic!("define {} on {}: {e}", spec.backend_name(), provider.host()),
        }
    }
}

/// One call to Cinder as the harness's admin, behind the provider's back
/// (`VMLET_CINDER_URL`, e.g. `http://127.0.0.1:18776/v3`): `path` below the
/// project's root (`/volumes/<id>`), microversion 3.42. The HTTP status and
/// the JSON body (`Null` when empty).
pub async fn cinder_behind_vmlet(
    method: reqwest::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    let (token, _, project) = admin_token(&http).await;
    let url = format!("{}/{project}{path}", required("VMLET_CINDER_URL"));
    let mut request =
        http.request(method, &url).header("X-Auth-Token", token).header("OpenStack-API-Version", "volume 3.42");
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status().as_u16();
    let text = response.text().await.expect("Cinder's answer");
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
}
