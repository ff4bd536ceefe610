//! Nova's compute API, typed: the calls vmlet makes and the fields it reads
//! (<https://docs.openstack.org/api-ref/compute/>). All at the negotiated
//! microversion (≥ 2.60) unless a call says otherwise.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use reqwest::Method;
use serde::Deserialize;
use serde_json::{json, Value};
use vmlet_provider::{Error, ErrorKind, Result};

use crate::mapping::UID_KEY;
use crate::microversion::IMAGE_PROXY;
use crate::session::{Call, Cloud, Service};

/// Servers asked for per page (Nova's default `osapi_max_limit`).
const PAGE: usize = 1000;

/// A server as `GET /servers/detail` and `GET /servers/{id}` show it
/// (admin view: the `OS-EXT-*` attributes need the admin role).
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Server {
    pub(crate) id: String,
    #[serde(default)]
    pub(crate) name: String,
    /// ACTIVE, BUILD, SHUTOFF, VERIFY_RESIZE, MIGRATING, ERROR, ...
    #[serde(default)]
    pub(crate) status: String,
    #[serde(rename = "OS-EXT-STS:task_state", default)]
    pub(crate) task_state: Option<String>,
    /// 0 NOSTATE, 1 RUNNING, 3 PAUSED, 4 SHUTDOWN, 6 CRASHED, 7 SUSPENDED.
    #[serde(rename = "OS-EXT-STS:power_state", default)]
    pub(crate) power_state: Option<i64>,
    /// The compute service host (the hypervisor's `service.host`).
    #[serde(rename = "OS-EXT-SRV-ATTR:host", default)]
    pub(crate) host: Option<String>,
    #[serde(default)]
    pub(crate) metadata: BTreeMap<String, String>,
    /// The embedded flavor (2.47+).
    #[serde(default)]
    pub(crate) flavor: ServerFlavor,
    /// Network name → addresses, in Nova's order: the server's ports in
    /// the order they were asked for (a JSON object, read in order).
    #[serde(default, deserialize_with = "in_order")]
    pub(crate) addresses: Vec<(String, Vec<Address>)>,
    #[serde(default)]
    pub(crate) fault: Option<Fault>,
    #[serde(rename = "OS-SRV-USG:launched_at", default)]
    pub(crate) launched_at: Option<String>,
    /// The project that owns the server.
    #[serde(default)]
    pub(crate) tenant_id: Option<String>,
}

/// The flavor a server has (embedded since 2.47: sizes, no id).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub(crate) struct ServerFlavor {
    #[serde(default)]
    pub(crate) original_name: String,
    #[serde(default)]
    pub(crate) vcpus: u32,
    /// MiB.
    #[serde(default)]
    pub(crate) ram: u64,
    /// GiB.
    #[serde(default)]
    pub(crate) disk: u64,
}

/// One address of a server.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Address {
    pub(crate) addr: String,
    /// `fixed` (the port's own address) or `floating` (a NAT address of a
    /// router in front of it); absent in old clouds' answers.
    #[serde(rename = "OS-EXT-IPS:type", default)]
    pub(crate) kind: Option<String>,
}

/// A JSON object's entries in the order they come (`BTreeMap` would sort
/// them by network name and lose the port order).
fn in_order<'de, D>(deserializer: D) -> std::result::Result<Vec<(String, Vec<Address>)>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct InOrder;
    impl<'de> serde::de::Visitor<'de> for InOrder {
        type Value = Vec<(String, Vec<Address>)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of network name to addresses")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            let mut entries = Vec::new();
            while let Some(entry) = map.next_entry()? {
                entries.push(entry);
            }
            Ok(entries)
        }
        fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<Self::Value, E> {
            Ok(Vec::new())
        }
    }
    deserializer.deserialize_any(InOrder)
}

/// Why a server is in ERROR.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Fault {
    #[serde(default)]
    pub(crate) message: String,
}

/// A flavor (`GET /flavors/detail`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub(crate) struct Flavor {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) vcpus: u32,
    /// MiB.
    pub(crate) ram: u64,
    /// GiB.
    #[serde(default)]
    pub(crate) disk: u64,
    #[serde(rename = "OS-FLV-DISABLED:disabled", default)]
    pub(crate) disabled: bool,
}

/// An entry of `GET /servers/{id}/os-instance-actions`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct InstanceAction {
    pub(crate) action: String,
    #[serde(default)]
    pub(crate) request_id: String,
    #[serde(default)]
    pub(crate) start_time: String,
}

/// An in-progress migration of a server (`GET /servers/{id}/migrations`,
/// 2.23+; live migrations only).
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ServerMigration {
    pub(crate) id: u64,
    #[serde(default)]
    pub(crate) memory_total_bytes: Option<u64>,
    #[serde(default)]
    pub(crate) memory_processed_bytes: Option<u64>,
    #[serde(default)]
    pub(crate) memory_remaining_bytes: Option<u64>,
    #[serde(default)]
    pub(crate) disk_total_bytes: Option<u64>,
    #[serde(default)]
    pub(crate) disk_processed_bytes: Option<u64>,
    #[serde(default)]
    pub(crate) disk_remaining_bytes: Option<u64>,
}

/// A migration record (`GET /os-migrations`, 2.59+ filters by server).
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct MigrationRecord {
    #[serde(default)]
    pub(crate) id: u64,
    #[serde(default)]
    pub(crate) status: String,
    #[serde(default)]
    pub(crate) migration_type: String,
    #[serde(default)]
    pub(crate) dest_compute: Option<String>,
}

#[derive(Deserialize)]
struct Link {
    rel: String,
    href: String,
}

/// The `marker` of a collection's `next` link, if it has one.
fn next_marker(links: &[Link]) -> Option<String> {
    let next = links.iter().find(|l| l.rel == "next")?;
    let url = reqwest::Url::parse(&next.href).ok()?;
    let marker = url.query_pairs().find(|(k, _)| k == "marker").map(|(_, v)| v.into_owned());
    marker
}

impl Cloud {
    /// Every server of every project that carries vmlet's identity
    /// (`GET /servers/detail?all_tenants=1`, followed page by page).
    pub(crate) async fn list_vmlet_servers(&self) -> Result<Vec<Server>> {
        const OP: &str = "list servers";
        #[derive(Deserialize)]
        struct Page {
            servers: Vec<Server>,
            #[serde(default)]
            servers_links: Vec<Link>,
        }
        let started = Instant::now();
        let project = self.project_id().await?;
        let mine = |s: &Server| project.is_none() || s.tenant_id.is_none() || s.tenant_id == project;
        let mut out = Vec::new();
        let mut marker: Option<String> = None;
        let mut pages = 0;
        loop {
            let mut call = Call::get("/servers/detail").query("all_tenants", "1").query("limit", PAGE.to_string());
            if let Some(project) = &project {
                // Only vmlet's own project: a server another project tags
                // with a VM's UID is never adopted, stopped or deleted.
                call = call.query("project_id", project.clone());
            }
            if let Some(marker) = &marker {
                call = call.query("marker", marker.clone());
            }
            let page: Page = self.json(OP, &call).await?;
            pages += 1;
            let last = page.servers.last().map(|s| s.id.clone());
            let count = page.servers.len();
            // A cell that does not answer shows its servers as bare records
            // (status UNKNOWN, no metadata, 2.69+): the listing is
            // incomplete, and "not found" would not be true.
            if let Some(bare) = page.servers.iter().find(|s| s.status == "UNKNOWN" && s.metadata.is_empty()) {
                return Err(Error::new(
                    OP,
                    ErrorKind::Transient,
                    format!("server {} is listed as UNKNOWN (a cell of the cloud does not answer); the listing is incomplete", bare.id),
                ));
            }
            out.extend(page.servers.into_iter().filter(|s| s.metadata.contains_key(UID_KEY) && mine(s)));
            marker = match next_marker(&page.servers_links).or(if count >= PAGE { last } else { None }) {
                Some(next) if Some(&next) != marker.as_ref() => Some(next),
                _ => break,
            };
        }
        tracing::debug!(
            servers = out.len(),
            pages,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "listed servers"
        );
        Ok(out)
    }

    /// `GET /servers/{id}`; `None` when Nova has no such server (404), or
    /// when it belongs to a project other than vmlet's (never vmlet's).
    pub(crate) async fn server(&self, id: &str) -> Result<Option<Server>> {
        #[derive(Deserialize)]
        struct One {
            server: Server,
        }
        match self.json::<One>("show server", &Call::get(format!("/servers/{id}"))).await {
            Ok(one) => {
                let project = self.project_id().await?;
                let foreign = project.is_some() && one.server.tenant_id.is_some() && one.server.tenant_id != project;
                Ok((!foreign).then_some(one.server))
            }
            Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /servers` with `body` (`{"server": {...}}`); the new server's id.
    pub(crate) async fn create_server(&self, body: Value) -> Result<String> {
        const OP: &str = "create server";
        #[derive(Deserialize)]
        struct Created {
            server: CreatedServer,
        }
        #[derive(Deserialize)]
        struct CreatedServer {
            id: String,
        }
        let created: Created = self.json(OP, &Call::post("/servers", body)).await?;
        self.invalidate_listing();
        Ok(created.server.id)
    }

    /// `POST /servers/{id}/action` with `body` (`{"os-start": null}`, ...).
    pub(crate) async fn server_action(&self, operation: &'static str, id: &str, body: Value) -> Result<()> {
        let result = self.send(operation, &Call::post(format!("/servers/{id}/action"), body)).await;
        self.invalidate_listing();
        result.map(|_| ())
    }

    /// `PUT /servers/{id}/metadata/{key}`.
    pub(crate) async fn set_server_metadata(&self, id: &str, key: &str, value: &str) -> Result<()> {
        let call = Call::new(Service::Compute, Method::PUT, format!("/servers/{id}/metadata/{key}"))
            .body(json!({ "meta": { key: value } }));
        let result = self.send("set server metadata", &call).await;
        self.invalidate_listing();
        result.map(|_| ())
    }

    /// `DELETE /servers/{id}/metadata/{key}`; a missing key is success.
    pub(crate) async fn delete_server_metadata(&self, id: &str, key: &str) -> Result<()> {
        let call = Call::new(Service::Compute, Method::DELETE, format!("/servers/{id}/metadata/{key}"));
        let result = self.send("delete server metadata", &call).await;
        self.invalidate_listing();
        match result {
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// `DELETE /servers/{id}`; `false` when it was gone already (404).
    pub(crate) async fn delete_server(&self, id: &str) -> Result<bool> {
        let call = Call::new(Service::Compute, Method::DELETE, format!("/servers/{id}"));
        let result = self.send("delete server", &call).await;
        self.invalidate_listing();
        match result {
            Ok(_) => Ok(true),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// All flavors the token's project may use, enabled ones only
    /// (`GET /flavors/detail?is_public=None`, which shows an admin the
    /// private ones too), cached for [`crate::CloudOptions::flavor_ttl`]
    /// unless `fresh`.
    pub(crate) async fn flavors(&self, fresh: bool) -> Result<Arc<Vec<Flavor>>> {
        const OP: &str = "list flavors";
        #[derive(Deserialize)]
        struct Page {
            flavors: Vec<Flavor>,
            #[serde(default)]
            flavors_links: Vec<Link>,
        }
        let mut guard = self.flavors.lock().await;
        if let Some((fetched, flavors)) = guard.as_ref() {
            if !fresh && fetched.elapsed() < self.options.flavor_ttl {
                return Ok(flavors.clone());
            }
        }
        let mut out = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            // Public flavors only: a project's private flavor is not vmlet's
            // to hand to tenants.
            let mut call = Call::get("/flavors/detail").query("is_public", "true");
            if let Some(marker) = &marker {
                call = call.query("marker", marker.clone());
            }
            let page: Page = self.json(OP, &call).await?;
            out.extend(page.flavors.into_iter().filter(|f| !f.disabled));
            marker = match next_marker(&page.flavors_links) {
                Some(next) if Some(&next) != marker.as_ref() => Some(next),
                _ => break,
            };
        }
        let flavors = Arc::new(out);
        *guard = Some((Instant::now(), flavors.clone()));
        Ok(flavors)
    }

    /// `POST /servers/{id}/action {"os-getConsoleOutput": {"length": null}}`:
    /// the whole console log Nova keeps (the hypervisor's, often only its
    /// last part).
    pub(crate) async fn console_log(&self, id: &str) -> Result<String> {
        #[derive(Deserialize)]
        struct Output {
            output: String,
        }
        let call = Call::post(format!("/servers/{id}/action"), json!({ "os-getConsoleOutput": { "length": null } }));
        Ok(self.json::<Output>("get console output", &call).await?.output)
    }

    /// `GET /servers/{id}/os-instance-actions`: what was done to the server.
    pub(crate) async fn instance_actions(&self, id: &str) -> Result<Vec<InstanceAction>> {
        #[derive(Deserialize)]
        struct Actions {
            #[serde(rename = "instanceActions")]
            actions: Vec<InstanceAction>,
        }
        let call = Call::get(format!("/servers/{id}/os-instance-actions"));
        Ok(self.json::<Actions>("list instance actions", &call).await?.actions)
    }

    /// `GET /servers/{id}/migrations`: its live migrations in progress.
    pub(crate) async fn server_migrations(&self, id: &str) -> Result<Vec<ServerMigration>> {
        #[derive(Deserialize)]
        struct Migrations {
            migrations: Vec<ServerMigration>,
        }
        let call = Call::get(format!("/servers/{id}/migrations"));
        Ok(self.json::<Migrations>("list server migrations", &call).await?.migrations)
    }

    /// `DELETE /servers/{id}/migrations/{migration}` (2.24+): abort a
    /// running live migration; the server stays on its source.
    pub(crate) async fn abort_migration(&self, id: &str, migration: u64) -> Result<()> {
        let call = Call::new(Service::Compute, Method::DELETE, format!("/servers/{id}/migrations/{migration}"));
        self.send("abort live migration", &call).await.map(|_| ())
    }

    /// `GET /os-migrations?instance_uuid={id}` (2.59+): the server's
    /// migrations, newest first.
    pub(crate) async fn migration_records(&self, id: &str) -> Result<Vec<MigrationRecord>> {
        #[derive(Deserialize)]
        struct Migrations {
            migrations: Vec<MigrationRecord>,
        }
        let call = Call::get("/os-migrations").query("instance_uuid", id);
        let mut records = self.json::<Migrations>("list migrations", &call).await?.migrations;
        records.sort_by_key(|m| std::cmp::Reverse(m.id));
        Ok(records)
    }

    /// The id of the image `reference` names: itself when it is a UUID,
    /// else the one image of that name, from Glance (`GET /v2/images?name=`)
    /// when the catalog has it, otherwise from Nova's image proxy
    /// (`GET /images?name=`, microversion 2.35).
    ///
    /// Errors: `InvalidInput` when no image or several have that name.
    pub(crate) async fn resolve_image(&self, reference: &str) -> Result<String> {
        const OP: &str = "find image";
        if uuid::Uuid::parse_str(reference).is_ok() {
            return Ok(reference.to_owned());
        }
        #[derive(Deserialize)]
        struct Images {
            images: Vec<Image>,
        }
        #[derive(Deserialize)]
        struct Image {
            id: String,
            #[serde(default)]
            name: Option<String>,
        }
        let call = if self.has_service(Service::Image).await? {
            Call::new(Service::Image, Method::GET, "/images").query("name", reference)
        } else {
            Call::get("/images").query("name", reference).at_most(IMAGE_PROXY)
        };
        // Exact names only: a service that ignores the filter (the image
        // proxy of Nova's test fixtures does) must not pass for a match.
        let images: Vec<Image> = self
            .json::<Images>(OP, &call)
            .await?
            .images
            .into_iter()
            .filter(|image| image.name.as_deref() == Some(reference))
            .collect();
        match images.as_slice() {
            [one] => Ok(one.id.clone()),
            [] => Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!(
                    "spec.image: no image named {reference:?} in the cloud's image service; give an image id or name"
                ),
            )),
            several => Err(Error::new(
                OP,
                ErrorKind::InvalidInput,
                format!("spec.image: {} images are named {reference:?}; give the image id instead", several.len()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_link_gives_the_marker() {
        let links: Vec<Link> = serde_json::from_value(json!([
            {"rel": "next", "href": "http://nova/v2.1/servers/detail?all_tenants=1&limit=1000&marker=abc-123"}
        ]))
        .unwrap();
        assert_eq!(next_marker(&links).as_deref(), Some("abc-123"));
        assert_eq!(next_marker(&[]), None);
    }

    #[test]
    fn a_server_reads_its_admin_attributes_and_embedded_flavor() {
        let server: Server = serde_json::from_value(json!({
            "id": "s1", "name": "ns_vm", "status": "ACTIVE",
            "OS-EXT-STS:vm_state": "active", "OS-EXT-STS:task_state": null, "OS-EXT-STS:power_state": 1,
            "OS-EXT-SRV-ATTR:host": "nova-a", "OS-EXT-AZ:availability_zone": "nova",
            "metadata": {"vmlet.io:uid": "u1"},
            "flavor": {"original_name": "m1.small", "vcpus": 1, "ram": 2048, "disk": 20, "ephemeral": 0, "swap": 0, "extra_specs": {}},
            "addresses": {"private": [{"addr": "192.168.1.5", "version": 4, "OS-EXT-IPS:type": "fixed"}]},
        }))
        .unwrap();
        assert_eq!(server.host.as_deref(), Some("nova-a"));
        assert_eq!(server.flavor, ServerFlavor { original_name: "m1.small".into(), vcpus: 1, ram: 2048, disk: 20 });
        assert_eq!(server.addresses[0].0, "private");
        assert_eq!(server.addresses[0].1[0].addr, "192.168.1.5");
        assert_eq!(server.addresses[0].1[0].kind.as_deref(), Some("fixed"));
    }

    #[test]
    fn addresses_keep_nova_s_port_order_not_the_names_order() {
        let server: Server = serde_json::from_str(
            r#"{"id": "s1", "addresses": {"zeta": [{"addr": "10.0.0.2"}], "alpha": [{"addr": "10.0.1.2"}]}}"#,
        )
        .unwrap();
        let names: Vec<&str> = server.addresses.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["zeta", "alpha"]);
        let none: Server = serde_json::from_str(r#"{"id": "s1", "addresses": null}"#).unwrap();
        assert!(none.addresses.is_empty());
    }
}
