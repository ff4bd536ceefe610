//! Keystone v3 tokens and the service catalog that comes with them
//! (<https://docs.openstack.org/api-ref/identity/v3/#password-authentication-with-scoped-authorization>,
//! `POST /v3/auth/tokens`).
//!
//! The request body is built from [`Credentials`]; the answer carries the
//! token in the `X-Subject-Token` header and, in its body, `issued_at`,
//! `expires_at` and the catalog. A token is renewed when less than
//! [`renewal_margin`] of its lifetime remains.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{Credentials, Interface, NameOrId, Scope, User};

/// The JSON body of `POST /v3/auth/tokens` for these credentials. It holds
/// the secret: never log it.
pub(crate) fn auth_body(credentials: &Credentials) -> Value {
    fn named(v: &NameOrId) -> Value {
        match v {
            NameOrId::Name(name) => json!({ "name": name }),
            NameOrId::Id(id) => json!({ "id": id }),
        }
    }
    fn user_json(user: &User) -> Value {
        let mut out = named(&user.user);
        if let (Some(domain), NameOrId::Name(_)) = (&user.domain, &user.user) {
            out["domain"] = named(domain);
        }
        out
    }
    match credentials {
        Credentials::Password { user, password, scope } => {
            let mut user = user_json(user);
            user["password"] = Value::String(password.expose().to_owned());
            let mut auth = json!({ "identity": { "methods": ["password"], "password": { "user": user } } });
            match scope {
                Scope::Project { project, domain } => {
                    let mut project_json = named(project);
                    if let (Some(domain), NameOrId::Name(_)) = (domain, project) {
                        project_json["domain"] = named(domain);
                    }
                    auth["scope"] = json!({ "project": project_json });
                }
                Scope::Domain(domain) => auth["scope"] = json!({ "domain": named(domain) }),
                Scope::System => auth["scope"] = json!({ "system": { "all": true } }),
                Scope::Default => {}
            }
            json!({ "auth": auth })
        }
        Credentials::ApplicationCredential { credential, user, secret } => {
            let mut app = named(credential);
            app["secret"] = Value::String(secret.expose().to_owned());
            if let (Some(user), NameOrId::Name(_)) = (user, credential) {
                app["user"] = user_json(user);
            }
            json!({ "auth": { "identity": { "methods": ["application_credential"], "application_credential": app } } })
        }
    }
}

/// The body of Keystone's token answer (the parts vmlet reads).
#[derive(Debug, Deserialize)]
pub(crate) struct TokenBody {
    pub(crate) token: TokenInfo,
}

/// A token's metadata and catalog.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenInfo {
    /// RFC 3339, e.g. `2026-12-02T04:38:00.000000Z`.
    pub(crate) expires_at: String,
    /// RFC 3339.
    pub(crate) issued_at: String,
    #[serde(default)]
    pub(crate) catalog: Vec<CatalogEntry>,
    /// The project the token is scoped to (absent for domain or system
    /// scope).
    #[serde(default)]
    pub(crate) project: Option<ProjectRef>,
}

/// A token's project.
#[derive(Debug, Deserialize)]
pub(crate) struct ProjectRef {
    pub(crate) id: String,
}

/// One service of the catalog.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CatalogEntry {
    #[serde(rename = "type")]
    pub(crate) service_type: String,
    #[serde(default)]
    pub(crate) endpoints: Vec<CatalogEndpoint>,
}

/// One endpoint of a service.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CatalogEndpoint {
    pub(crate) interface: String,
    #[serde(default)]
    pub(crate) region_id: Option<String>,
    #[serde(default)]
    pub(crate) region: Option<String>,
    pub(crate) url: String,
}

impl TokenInfo {
    /// The token's lifetime (`expires_at - issued_at`, both Keystone's clock,
    /// so local clock skew does not matter). `None` when a time does not parse.
    pub(crate) fn lifetime(&self) -> Option<Duration> {
        let issued: jiff::Timestamp = self.issued_at.parse().ok()?;
        let expires: jiff::Timestamp = self.expires_at.parse().ok()?;
        let seconds = expires.as_millisecond().checked_sub(issued.as_millisecond())?;
        u64::try_from(seconds).ok().map(Duration::from_millis)
    }
}

/// How long before expiry a token of this lifetime is renewed: the larger of
/// 5 minutes and a tenth of its lifetime, but at most half of it (so that a
/// short-lived token is not renewed on every call).
pub(crate) fn renewal_margin(lifetime: Duration) -> Duration {
    Duration::from_secs(300).max(lifetime / 10).min(lifetime / 2)
}

/// Why the catalog has no usable endpoint.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NoEndpoint(pub(crate) String);

/// The URL (without trailing slash) of the `service_type` endpoint for
/// `interface` in `region` (any region when `None`, as long as the service
/// has only one). `Ok(None)` when the catalog has no such service at all (for
/// optional services); `Err` names what was missing when the service is
/// there but the region or interface is not.
pub(crate) fn endpoint(
    catalog: &[CatalogEntry],
    service_type: &str,
    region: Option<&str>,
    interface: Interface,
) -> Result<Option<String>, NoEndpoint> {
    let Some(service) = catalog.iter().find(|s| s.service_type == service_type) else {
        return Ok(None);
    };
    let region_of = |e: &CatalogEndpoint| e.region_id.clone().or_else(|| e.region.clone()).unwrap_or_default();
    let with_interface: Vec<&CatalogEndpoint> =
        service.endpoints.iter().filter(|e| e.interface == interface.as_str()).collect();
    let candidates: Vec<&CatalogEndpoint> = match region {
        Some(region) => with_interface.iter().copied().filter(|e| region_of(e) == region).collect(),
        None => with_interface.clone(),
    };
    let mut regions: Vec<String> = service.endpoints.iter().map(region_of).collect();
    regions.sort();
    regions.dedup();
    match candidates.as_slice() {
        [one] => Ok(Some(one.url.trim_end_matches('/').to_owned())),
        [] if with_interface.is_empty() => {
            let mut interfaces: Vec<&str> = service.endpoints.iter().map(|e| e.interface.as_str()).collect();
            interfaces.sort();
            interfaces.dedup();
            Err(NoEndpoint(format!(
                "the catalog's {service_type} service has no {} endpoint (it has: {}); set clouds.yaml `interface`",
                interface.as_str(),
                interfaces.join(", ")
            )))
        }
        [] => Err(NoEndpoint(format!(
            "the catalog's {service_type} service has no {} endpoint in region {:?} (regions: {}); set clouds.yaml \
             `region_name`",
            interface.as_str(),
            region.unwrap_or_default(),
            regions.join(", ")
        ))),
        [first, ..] => {
            if region.is_none() {
                // Several regions: the user must choose.
                if candidates.iter().any(|e| region_of(e) != region_of(first)) {
                    return Err(NoEndpoint(format!(
                        "the catalog's {service_type} service has {} endpoints in several regions ({}); set \
                         clouds.yaml `region_name`",
                        interface.as_str(),
                        regions.join(", ")
                    )));
                }
            }
            Ok(Some(first.url.trim_end_matches('/').to_owned()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn catalog() -> Vec<CatalogEntry> {
        serde_json::from_value(json!([
            {"type": "compute", "endpoints": [
                {"interface": "public", "region_id": "RegionOne", "region": "RegionOne", "url": "http://nova-1/v2.1/"},
                {"interface": "internal", "region_id": "RegionOne", "url": "http://nova-1-int/v2.1"},
                {"interface": "public", "region_id": "RegionTwo", "url": "http://nova-2/v2.1"}
            ]},
            {"type": "placement", "endpoints": [
                {"interface": "public", "region_id": "RegionOne", "url": "http://placement"}
            ]}
        ]))
        .unwrap()
    }

    #[test]
    fn the_endpoint_for_region_and_interface_is_found() {
        let c = catalog();
        assert_eq!(
            endpoint(&c, "compute", Some("RegionOne"), Interface::Public),
            Ok(Some("http://nova-1/v2.1".into()))
        );
        assert_eq!(
            endpoint(&c, "compute", Some("RegionOne"), Interface::Internal),
            Ok(Some("http://nova-1-int/v2.1".into()))
        );
        assert_eq!(endpoint(&c, "placement", None, Interface::Public), Ok(Some("http://placement".into())));
        assert_eq!(endpoint(&c, "image", None, Interface::Public), Ok(None));
    }

    #[test]
    fn a_missing_region_or_interface_is_named() {
        let c = catalog();
        let NoEndpoint(why) = endpoint(&c, "compute", Some("RegionThree"), Interface::Public).unwrap_err();
        assert!(why.contains("RegionThree") && why.contains("RegionOne, RegionTwo") && why.contains("region_name"));
        let NoEndpoint(why) = endpoint(&c, "compute", None, Interface::Public).unwrap_err();
        assert!(why.contains("several regions") && why.contains("region_name"), "{why}");
        let NoEndpoint(why) = endpoint(&c, "placement", None, Interface::Admin).unwrap_err();
        assert!(why.contains("no admin endpoint") && why.contains("public"), "{why}");
    }

    #[test]
    fn password_body_carries_user_domain_and_project_scope() {
        let creds = Credentials::Password {
            user: User { user: NameOrId::Name("vmlet".into()), domain: Some(NameOrId::Id("default".into())) },
            password: Secret::new("pw"),
            scope: Scope::Project { project: NameOrId::Name("ops".into()), domain: Some(NameOrId::Name("D".into())) },
        };
        assert_eq!(
            auth_body(&creds),
            json!({"auth": {
                "identity": {"methods": ["password"], "password": {"user": {"name": "vmlet", "domain": {"id": "default"}, "password": "pw"}}},
                "scope": {"project": {"name": "ops", "domain": {"name": "D"}}}
            }})
        );
        let by_id = Credentials::Password {
            user: User { user: NameOrId::Id("u1".into()), domain: None },
            password: Secret::new("pw"),
            scope: Scope::System,
        };
        assert_eq!(
            auth_body(&by_id),
            json!({"auth": {
                "identity": {"methods": ["password"], "password": {"user": {"id": "u1", "password": "pw"}}},
                "scope": {"system": {"all": true}}
            }})
        );
    }

    #[test]
    fn application_credential_body_has_no_scope() {
        let creds = Credentials::ApplicationCredential {
            credential: NameOrId::Name("vmlet-ac".into()),
            user: Some(User { user: NameOrId::Name("vmlet".into()), domain: Some(NameOrId::Name("Default".into())) }),
            secret: Secret::new("s"),
        };
        assert_eq!(
            auth_body(&creds),
            json!({"auth": {"identity": {"methods": ["application_credential"], "application_credential": {
                "name": "vmlet-ac", "secret": "s", "user": {"name": "vmlet", "domain": {"name": "Default"}}
            }}}})
        );
    }

    #[test]
    fn lifetime_comes_from_keystones_own_times_and_renewal_starts_early_enough() {
        let info = TokenInfo {
            issued_at: "2026-12-02T03:38:00.000000Z".into(),
            expires_at: "2026-12-02T04:38:00.000000Z".into(),
            catalog: vec![],
            project: None,
        };
        assert_eq!(info.lifetime(), Some(Duration::from_secs(3600)));
        // One hour: 6 minutes (a tenth); a day: 2.4 hours; 10 minutes: 5 (half); 2 minutes: 1.
        assert_eq!(renewal_margin(Duration::from_secs(3600)), Duration::from_secs(360));
        assert_eq!(renewal_margin(Duration::from_secs(86400)), Duration::from_secs(8640));
        assert_eq!(renewal_margin(Duration::from_secs(600)), Duration::from_secs(300));
        assert_eq!(renewal_margin(Duration::from_secs(120)), Duration::from_secs(60));
    }
}
