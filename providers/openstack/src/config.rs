//! The cloud to talk to, from a standard `clouds.yaml`
//! (<https://docs.openstack.org/openstacksdk/latest/user/config/configuration.html>).
//!
//! ```yaml
//! clouds:
//!   mycloud:
//!     auth:
//!       auth_url: https://keystone.example.com:5000/v3
//!       username: vmlet
//!       password: s3cret
//!       user_domain_name: Default
//!       project_name: vmlet
//!       project_domain_name: Default
//!     region_name: RegionOne
//!     interface: public          # default
//!     cacert: /etc/vmlet/ca.pem  # optional: extra trusted CA (PEM)
//!     verify: true               # default; false turns TLS verification off
//! ```
//!
//! Or, with an application credential (which carries its own scope):
//! `auth: {auth_url, application_credential_id, application_credential_secret}`
//! (or `application_credential_name` plus `username`/`user_id` and the user's
//! domain).
//!
//! Keys this crate does not use (`identity_api_version`, `auth_type`, ...) are
//! ignored; `auth_type`, when present, must agree with the credentials given.
//! Secrets (password, application credential secret) are kept in [`Secret`],
//! whose `Debug` prints `<redacted>`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A secret string (password, application credential secret). Its `Debug` and
/// `Display` print `<redacted>`; only [`Secret::expose`] gives the value, for
/// the Keystone request body.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself. Call only to put it where it is needed (the
    /// Keystone request), never into a log or a message.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Why a `clouds.yaml` could not be used. Each message names the file (or
/// "clouds.yaml bytes") and the field, and says what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("read clouds.yaml {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The YAML does not parse or has the wrong shape.
    #[error("parse {origin}: {source}")]
    Parse {
        /// Where the bytes came from.
        origin: String,
        /// serde_yaml's error (it names line and column, never values).
        #[source]
        source: serde_yaml::Error,
    },
    /// No cloud of that name under `clouds:`.
    #[error("{origin}: no cloud named {name:?} under `clouds:` (it has: {available})")]
    NoSuchCloud {
        /// Where the bytes came from.
        origin: String,
        /// The cloud asked for.
        name: String,
        /// The clouds it has, comma-separated.
        available: String,
    },
    /// A field is missing, contradicts another, or has a value this crate
    /// cannot use.
    #[error("{origin}: clouds.{cloud}.{field}: {problem}")]
    Field {
        /// Where the bytes came from.
        origin: String,
        /// The cloud's name.
        cloud: String,
        /// The field's path below the cloud, e.g. `auth.password`.
        field: &'static str,
        /// What is wrong and what to do.
        problem: String,
    },
}

/// Which endpoint of a service to use from the catalog (`interface`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Interface {
    /// The public endpoint (the default).
    #[default]
    Public,
    /// The internal endpoint.
    Internal,
    /// The admin endpoint.
    Admin,
}

impl Interface {
    /// The catalog's name for it: `public`, `internal`, `admin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Interface::Public => "public",
            Interface::Internal => "internal",
            Interface::Admin => "admin",
        }
    }
}

/// A name or an id (of a domain, a project, a user), as Keystone accepts either.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NameOrId {
    /// By name (unique only within its domain, for projects and users).
    Name(String),
    /// By id.
    Id(String),
}

/// What the token is scoped to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// A project: by id, or by name within a domain.
    Project {
        /// The project.
        project: NameOrId,
        /// The project's domain (needed with a name).
        domain: Option<NameOrId>,
    },
    /// A domain.
    Domain(NameOrId),
    /// The whole deployment (`system_scope: all`).
    System,
    /// No explicit scope: the user's default project, or an application
    /// credential's own project.
    Default,
}

/// The user who authenticates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    /// The user.
    pub user: NameOrId,
    /// The user's domain (needed with a name).
    pub domain: Option<NameOrId>,
}

/// How vmlet proves who it is to Keystone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// `password` method.
    Password {
        /// The user.
        user: User,
        /// The password.
        password: Secret,
        /// The scope asked for.
        scope: Scope,
    },
    /// `application_credential` method; the credential fixes the scope.
    ApplicationCredential {
        /// The credential, by id, or by name (then `user` names its owner).
        credential: NameOrId,
        /// The owner, needed when the credential is named.
        user: Option<User>,
        /// The credential's secret.
        secret: Secret,
    },
}

/// TLS settings for every endpoint of the cloud.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    /// Verify servers' certificates (`verify`, default true).
    pub verify: bool,
    /// PEM bundle trusted besides the system's and Mozilla's roots (`cacert`).
    pub ca_pem: Option<Vec<u8>>,
    /// Where the bundle came from (for messages).
    pub ca_origin: Option<PathBuf>,
}

/// One cloud of a `clouds.yaml`, validated: everything needed to reach its
/// compute API. `Debug` redacts the secrets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudConfig {
    /// The cloud's name under `clouds:`.
    pub name: String,
    /// Keystone's v3 base URL (`auth.auth_url`, with `/v3` appended when it
    /// names no version), without a trailing slash.
    pub auth_url: String,
    /// The credentials.
    pub credentials: Credentials,
    /// `region_name`; `None` takes the catalog's only region for a service.
    pub region: Option<String>,
    /// `interface` (default public).
    pub interface: Interface,
    /// TLS settings.
    pub tls: Tls,
}

#[derive(Deserialize)]
struct CloudsFile {
    #[serde(default)]
    clouds: BTreeMap<String, RawCloud>,
}

#[derive(Deserialize, Default)]
struct RawCloud {
    #[serde(default)]
    auth: RawAuth,
    auth_type: Option<String>,
    region_name: Option<String>,
    interface: Option<String>,
    endpoint_type: Option<String>,
    cacert: Option<String>,
    verify: Option<serde_yaml::Value>,
}

#[derive(Deserialize, Default)]
struct RawAuth {
    auth_url: Option<String>,
    username: Option<String>,
    user_id: Option<String>,
    password: Option<Secret>,
    user_domain_name: Option<String>,
    user_domain_id: Option<String>,
    project_name: Option<String>,
    project_id: Option<String>,
    tenant_name: Option<String>,
    tenant_id: Option<String>,
    project_domain_name: Option<String>,
    project_domain_id: Option<String>,
    domain_name: Option<String>,
    domain_id: Option<String>,
    system_scope: Option<String>,
    application_credential_id: Option<String>,
    application_credential_name: Option<String>,
    application_credential_secret: Option<Secret>,
}

impl CloudConfig {
    /// The cloud `name` of the `clouds.yaml` at `path`. A relative `cacert`
    /// is read relative to the file's directory.
    ///
    /// Errors: [`ConfigError`] naming the file and the field.
    pub fn from_file(path: &Path, name: &str) -> Result<CloudConfig, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&bytes, name, &path.display().to_string(), path.parent())
    }

    /// The cloud `name` of `clouds.yaml` content (e.g. from a Kubernetes
    /// Secret). A `cacert` path must be absolute here.
    ///
    /// Errors: [`ConfigError`] naming the field.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<CloudConfig, ConfigError> {
        Self::parse(bytes, name, "clouds.yaml bytes", None)
    }

    fn parse(bytes: &[u8], name: &str, origin: &str, dir: Option<&Path>) -> Result<CloudConfig, ConfigError> {
        let file: CloudsFile =
            serde_yaml::from_slice(bytes).map_err(|source| ConfigError::Parse { origin: origin.to_owned(), source })?;
        let available = file.clouds.keys().cloned().collect::<Vec<_>>().join(", ");
        let Some(raw) = file.clouds.into_iter().find_map(|(n, c)| (n == name).then_some(c)) else {
            return Err(ConfigError::NoSuchCloud {
                origin: origin.to_owned(),
                name: name.to_owned(),
                available: if available.is_empty() { "none".into() } else { available },
            });
        };
        let field = |field: &'static str, problem: String| ConfigError::Field {
            origin: origin.to_owned(),
            cloud: name.to_owned(),
            field,
            problem,
        };
        let auth_url = raw.auth.auth_url.as_deref().filter(|u| !u.trim().is_empty()).ok_or_else(|| {
            field("auth.auth_url", "missing: give Keystone's URL, e.g. https://keystone:5000/v3".into())
        })?;
        let auth_url = keystone_v3_url(auth_url).map_err(|problem| field("auth.auth_url", problem))?;
        let credentials = credentials(&raw.auth, raw.auth_type.as_deref()).map_err(|(f, p)| field(f, p))?;
        let interface = match raw.interface.as_deref().or(raw.endpoint_type.as_deref()) {
            None | Some("public") | Some("publicURL") => Interface::Public,
            Some("internal") | Some("internalURL") => Interface::Internal,
            Some("admin") | Some("adminURL") => Interface::Admin,
            Some(other) => {
                return Err(field("interface", format!("{other:?} is not one of public, internal, admin")));
            }
        };
        let verify = match raw.verify {
            None | Some(serde_yaml::Value::Null) => true,
            Some(serde_yaml::Value::Bool(b)) => b,
            Some(serde_yaml::Value::String(s)) if matches!(s.as_str(), "true" | "True" | "yes") => true,
            Some(serde_yaml::Value::String(s)) if matches!(s.as_str(), "false" | "False" | "no") => false,
            Some(_) => return Err(field("verify", "must be true or false".into())),
        };
        let (ca_pem, ca_origin) = match raw.cacert.as_deref().filter(|c| !c.is_empty()) {
            None => (None, None),
            Some(cacert) => {
                let mut path = PathBuf::from(cacert);
                if path.is_relative() {
                    match dir {
                        Some(dir) => path = dir.join(path),
                        None => {
                            return Err(field(
                                "cacert",
                                format!("{cacert:?} is relative: give an absolute path to the PEM file"),
                            ))
                        }
                    }
                }
                let pem = std::fs::read(&path)
                    .map_err(|e| field("cacert", format!("cannot read {}: {e}", path.display())))?;
                (Some(pem), Some(path))
            }
        };
        Ok(CloudConfig {
            name: name.to_owned(),
            auth_url,
            credentials,
            region: raw.region_name.filter(|r| !r.is_empty()),
            interface,
            tls: Tls { verify, ca_pem, ca_origin },
        })
    }
}

/// Keystone's v3 base URL from `auth_url`: kept when it ends in `/v3`,
/// `/v3` appended when it names no version; a v2.0 URL is refused.
fn keystone_v3_url(auth_url: &str) -> Result<String, String> {
    let trimmed = auth_url.trim().trim_end_matches('/');
    if !(trimmed.starts_with("http://") || trimmed.starts_with("https://")) {
        return Err(format!("{trimmed:?} is not an http(s) URL"));
    }
    if trimmed.ends_with("/v3") {
        Ok(trimmed.to_owned())
    } else if trimmed.ends_with("/v2.0") {
        Err("Keystone v2.0 is gone: give the v3 URL (ending in /v3)".into())
    } else {
        Ok(format!("{trimmed}/v3"))
    }
}

fn name_or_id(name: &Option<String>, id: &Option<String>) -> Option<NameOrId> {
    match (id.as_deref().filter(|s| !s.is_empty()), name.as_deref().filter(|s| !s.is_empty())) {
        (Some(id), _) => Some(NameOrId::Id(id.to_owned())),
        (None, Some(name)) => Some(NameOrId::Name(name.to_owned())),
        (None, None) => None,
    }
}

type FieldProblem = (&'static str, String);

fn credentials(auth: &RawAuth, auth_type: Option<&str>) -> Result<Credentials, FieldProblem> {
    let app_secret = auth.application_credential_secret.clone().filter(|s| !s.expose().is_empty());
    let wants_app = match auth_type {
        Some("v3applicationcredential") | Some("applicationcredential") => true,
        Some("password") | Some("v3password") => false,
        None => app_secret.is_some(),
        Some(other) => {
            return Err((
                "auth_type",
                format!("{other:?} is not supported: use password (v3password) or v3applicationcredential"),
            ))
        }
    };
    let user_domain = name_or_id(&auth.user_domain_name, &auth.user_domain_id)
        .or_else(|| name_or_id(&auth.domain_name, &auth.domain_id));
    let user = name_or_id(&auth.username, &auth.user_id).map(|user| User { user, domain: user_domain.clone() });
    if wants_app {
        let secret = app_secret.ok_or((
            "auth.application_credential_secret",
            "missing: an application credential needs its secret".to_owned(),
        ))?;
        let credential = name_or_id(&auth.application_credential_name, &auth.application_credential_id).ok_or((
            "auth.application_credential_id",
            "missing: give application_credential_id (or application_credential_name with username)".to_owned(),
        ))?;
        if matches!(credential, NameOrId::Name(_)) {
            let Some(user) = &user else {
                return Err((
                    "auth.username",
                    "missing: a credential named by application_credential_name needs its owner's username \
                     (or user_id)"
                        .to_owned(),
                ));
            };
            if matches!(user.user, NameOrId::Name(_)) && user.domain.is_none() {
                return Err((
                    "auth.user_domain_name",
                    "missing: a user named by username needs user_domain_name or user_domain_id".to_owned(),
                ));
            }
        }
        return Ok(Credentials::ApplicationCredential { credential, user, secret });
    }
    let password = auth
        .password
        .clone()
        .filter(|p| !p.expose().is_empty())
        .ok_or(("auth.password", "missing: give a password, or an application credential".to_owned()))?;
    let user = user.ok_or(("auth.username", "missing: give username (or user_id)".to_owned()))?;
    if matches!(user.user, NameOrId::Name(_)) && user.domain.is_none() {
        return Err((
            "auth.user_domain_name",
            "missing: a user named by username needs user_domain_name or user_domain_id (often Default / default)"
                .to_owned(),
        ));
    }
    let project =
        name_or_id(&auth.project_name, &auth.project_id).or_else(|| name_or_id(&auth.tenant_name, &auth.tenant_id));
    let scope = match (project, auth.system_scope.as_deref()) {
        (Some(project), _) => {
            let domain = name_or_id(&auth.project_domain_name, &auth.project_domain_id)
                .or_else(|| name_or_id(&auth.domain_name, &auth.domain_id));
            if matches!(project, NameOrId::Name(_)) && domain.is_none() {
                return Err((
                    "auth.project_domain_name",
                    "missing: a project named by project_name needs project_domain_name or project_domain_id"
                        .to_owned(),
                ));
            }
            Scope::Project { project, domain }
        }
        (None, Some("all")) => Scope::System,
        (None, Some(other)) => {
            return Err(("auth.system_scope", format!("{other:?}: the only system scope is \"all\"")));
        }
        (None, None) => match name_or_id(&auth.domain_name, &auth.domain_id) {
            Some(domain) => Scope::Domain(domain),
            None => Scope::Default,
        },
    };
    Ok(Credentials::Password { user, password, scope })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWORD_CLOUD: &str = r#"
clouds:
  devstack:
    auth:
      auth_url: http://127.0.0.1:5000
      username: admin
      password: hunter2-very-secret
      user_domain_name: Default
      project_name: admin
      project_domain_id: default
    region_name: RegionOne
    identity_api_version: 3
  other:
    auth:
      auth_url: https://keystone.example/v3/
      application_credential_id: 0123abcd
      application_credential_secret: app-secret-value
    interface: internal
    verify: false
"#;

    #[test]
    fn a_password_cloud_is_parsed_with_v3_appended_and_public_interface() {
        let cloud = CloudConfig::from_bytes(PASSWORD_CLOUD.as_bytes(), "devstack").expect("parses");
        assert_eq!(cloud.auth_url, "http://127.0.0.1:5000/v3");
        assert_eq!(cloud.region.as_deref(), Some("RegionOne"));
        assert_eq!(cloud.interface, Interface::Public);
        assert!(cloud.tls.verify);
        assert_eq!(
            cloud.credentials,
            Credentials::Password {
                user: User { user: NameOrId::Name("admin".into()), domain: Some(NameOrId::Name("Default".into())) },
                password: Secret::new("hunter2-very-secret"),
                scope: Scope::Project {
                    project: NameOrId::Name("admin".into()),
                    domain: Some(NameOrId::Id("default".into()))
                },
            }
        );
    }

    #[test]
    fn an_application_credential_cloud_needs_no_scope() {
        let cloud = CloudConfig::from_bytes(PASSWORD_CLOUD.as_bytes(), "other").expect("parses");
        assert_eq!(cloud.auth_url, "https://keystone.example/v3");
        assert_eq!(cloud.interface, Interface::Internal);
        assert!(!cloud.tls.verify);
        assert_eq!(
            cloud.credentials,
            Credentials::ApplicationCredential {
                credential: NameOrId::Id("0123abcd".into()),
                user: None,
                secret: Secret::new("app-secret-value"),
            }
        );
    }

    #[test]
    fn debug_output_never_shows_a_secret() {
        for name in ["devstack", "other"] {
            let cloud = CloudConfig::from_bytes(PASSWORD_CLOUD.as_bytes(), name).expect("parses");
            let debug = format!("{cloud:?} {cloud:#?}");
            assert!(!debug.contains("hunter2") && !debug.contains("app-secret-value"), "{debug}");
            assert!(debug.contains("<redacted>"), "{debug}");
        }
    }

    #[test]
    fn a_missing_cloud_names_the_ones_there_are() {
        let err = CloudConfig::from_bytes(PASSWORD_CLOUD.as_bytes(), "prod").expect_err("no such cloud");
        assert_eq!(
            err.to_string(),
            "clouds.yaml bytes: no cloud named \"prod\" under `clouds:` (it has: devstack, other)"
        );
    }

    #[test]
    fn missing_fields_are_named() {
        let cases = [
            ("clouds: {c: {auth: {username: u, password: p, user_domain_name: D}}}", "clouds.c.auth.auth_url"),
            ("clouds: {c: {auth: {auth_url: 'http://k/v3', username: u, user_domain_name: D}}}", "clouds.c.auth.password"),
            ("clouds: {c: {auth: {auth_url: 'http://k/v3', username: u, password: p}}}", "clouds.c.auth.user_domain_name"),
            (
                "clouds: {c: {auth: {auth_url: 'http://k/v3', username: u, password: p, user_domain_id: d, project_name: x}}}",
                "clouds.c.auth.project_domain_name",
            ),
            (
                "clouds: {c: {auth: {auth_url: 'http://k/v3', application_credential_name: a, application_credential_secret: s}}}",
                "clouds.c.auth.username",
            ),
            ("clouds: {c: {auth: {auth_url: 'http://k/v2.0', username: u, password: p, user_domain_id: d}}}", "clouds.c.auth.auth_url"),
            ("clouds: {c: {auth: {auth_url: 'http://k/v3', username: u, password: p, user_domain_id: d}, interface: private}}", "clouds.c.interface"),
            ("clouds: {c: {auth: {auth_url: 'http://k/v3', username: u, password: p, user_domain_id: d}, cacert: ca.pem}}", "clouds.c.cacert"),
        ];
        for (yaml, field) in cases {
            let err = CloudConfig::from_bytes(yaml.as_bytes(), "c").expect_err(yaml);
            assert!(err.to_string().contains(&format!("{field}:")), "{yaml}: {err}");
            assert!(!err.to_string().contains("p,"), "{err}");
        }
    }

    #[test]
    fn a_domain_without_project_scopes_to_the_domain_and_system_scope_is_read() {
        let domain = "clouds: {c: {auth: {auth_url: 'http://k', username: u, password: p, domain_name: D}}}";
        let Credentials::Password { scope, user, .. } =
            CloudConfig::from_bytes(domain.as_bytes(), "c").unwrap().credentials
        else {
            panic!("password")
        };
        assert_eq!(scope, Scope::Domain(NameOrId::Name("D".into())));
        assert_eq!(user.domain, Some(NameOrId::Name("D".into())));
        let system = "clouds: {c: {auth: {auth_url: 'http://k', user_id: u1, password: p, system_scope: all}}}";
        let Credentials::Password { scope, .. } = CloudConfig::from_bytes(system.as_bytes(), "c").unwrap().credentials
        else {
            panic!("password")
        };
        assert_eq!(scope, Scope::System);
    }

    #[test]
    fn a_relative_cacert_is_read_next_to_the_file() {
        let dir = std::env::temp_dir().join(format!("vmlet-os-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.pem"), b"-----BEGIN CERTIFICATE-----\n").unwrap();
        let yaml = "clouds: {c: {auth: {auth_url: 'https://k/v3', user_id: u, password: p}, cacert: ca.pem}}";
        std::fs::write(dir.join("clouds.yaml"), yaml).unwrap();
        let cloud = CloudConfig::from_file(&dir.join("clouds.yaml"), "c").expect("parses");
        assert_eq!(cloud.tls.ca_pem.as_deref(), Some(&b"-----BEGIN CERTIFICATE-----\n"[..]));
        assert_eq!(cloud.tls.ca_origin, Some(dir.join("ca.pem")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
