//! Authentication and authorization, as the kubelet's webhook mode
//! (`pkg/kubelet/server/auth.go`):
//!
//! - a verified client certificate names the user (CN) and groups (O);
//! - else a bearer token is checked with a TokenReview;
//! - else the request is anonymous: `401` unless `anonymousAuth`;
//! - then a SubjectAccessReview on `nodes/<subresource>` with the verb from the
//!   HTTP method decides: `403` with the attributes when denied.
//!
//! Decisions are cached briefly (allowed 5 min, denied 30 s, as the kubelet's
//! webhook caches; token reviews 2 min).

use super::AuthorizationMode;
use axum::http::{Method, StatusCode};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// An authenticated user.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct User {
    /// User name.
    pub name: String,
    /// UID, if the authenticator gave one.
    pub uid: Option<String>,
    /// Groups.
    pub groups: Vec<String>,
    /// Extra attributes.
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    fn anonymous() -> User {
        User {
            name: "system:anonymous".into(),
            uid: None,
            groups: vec!["system:unauthenticated".into()],
            extra: BTreeMap::new(),
        }
    }
}

/// The verified client certificate's user, put in each request's extensions by
/// the connection layer.
#[derive(Clone, Debug, Default)]
pub struct PeerCertificate(pub Option<User>);

/// What a request asks to do, in authorization terms.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attributes {
    /// `get`, `create`, `update`, `patch`, `delete`.
    pub verb: String,
    /// Subresources of `nodes` to try, in order; any allowed one suffices.
    pub subresources: Vec<&'static str>,
    /// The node, for pod-scoped paths; `None` means any node.
    pub node: Option<String>,
}

/// The kubelet's verb for an HTTP method.
pub fn verb_for_method(method: &Method) -> &'static str {
    match *method {
        Method::GET | Method::HEAD => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "",
    }
}

fn is_subpath(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    path == prefix || path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('/'))
}

/// The `nodes` subresources the kubelet checks for `path` (fine-grained
/// authorization: `pods` and `healthz` first, `proxy` as the fallback).
pub fn subresources_for_path(path: &str) -> Vec<&'static str> {
    if is_subpath(path, "/stats") {
        vec!["stats"]
    } else if is_subpath(path, "/metrics") {
        vec!["metrics"]
    } else if is_subpath(path, "/logs") {
        vec!["log"]
    } else if is_subpath(path, "/pods") || is_subpath(path, "/runningpods") {
        vec!["pods", "proxy"]
    } else if is_subpath(path, "/healthz") {
        vec!["healthz", "proxy"]
    } else {
        vec!["proxy"]
    }
}

/// `(namespace, pod)` of a pod-scoped path (`/exec/ns/pod/...`,
/// `/containerLogs/ns/pod/...`, `/attach`, `/portForward`, `/run`).
pub fn pod_of_path(path: &str) -> Option<(&str, &str)> {
    let mut parts = path.trim_start_matches('/').split('/');
    let root = parts.next()?;
    if !matches!(root, "exec" | "attach" | "containerLogs" | "portForward" | "run") {
        return None;
    }
    let namespace = parts.next().filter(|s| !s.is_empty())?;
    let pod = parts.next().filter(|s| !s.is_empty())?;
    Some((namespace, pod))
}

/// A refused request.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 401, 403 or 500.
    pub status: StatusCode,
    /// Why.
    pub message: String,
}

enum Decision {
    Allowed,
    Denied(String),
}

struct Cache<V> {
    entries: Mutex<HashMap<String, (Instant, V)>>,
}

impl<V: Clone> Cache<V> {
    fn new() -> Self {
        Cache { entries: Mutex::new(HashMap::new()) }
    }
    fn get(&self, key: &str) -> Option<V> {
        let entries = self.entries.lock().expect("auth cache");
        entries.get(key).filter(|(until, _)| *until > Instant::now()).map(|(_, v)| v.clone())
    }
    fn put(&self, key: String, value: V, ttl: Duration) {
        let mut entries = self.entries.lock().expect("auth cache");
        if entries.len() > 4096 {
            let now = Instant::now();
            entries.retain(|_, (until, _)| *until > now);
        }
        entries.insert(key, (Instant::now() + ttl, value));
    }
}

/// Authenticates and authorizes requests.
pub struct Auth {
    client: kube::Client,
    anonymous: bool,
    mode: AuthorizationMode,
    tokens: Cache<Option<User>>,
    decisions: Cache<bool>,
}

impl Auth {
    /// Authentication through `client` (TokenReview) and `mode`.
    pub fn new(client: kube::Client, anonymous: bool, mode: AuthorizationMode) -> Auth {
        Auth { client, anonymous, mode, tokens: Cache::new(), decisions: Cache::new() }
    }

    /// Who is asking: the certificate's user, else the bearer token's.
    pub async fn authenticate(&self, peer: &PeerCertificate, authorization: Option<&str>) -> Result<User, Refusal> {
        if let Some(user) = &peer.0 {
            return Ok(user.clone());
        }
        let token = authorization
            .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|t| !t.is_empty());
        if let Some(token) = token {
            return match self.review_token(token).await? {
                Some(user) => Ok(user),
                None => Err(Refusal { status: StatusCode::UNAUTHORIZED, message: "Unauthorized".into() }),
            };
        }
        if self.anonymous {
            return Ok(User::anonymous());
        }
        Err(Refusal { status: StatusCode::UNAUTHORIZED, message: "Unauthorized".into() })
    }

    async fn review_token(&self, token: &str) -> Result<Option<User>, Refusal> {
        if let Some(cached) = self.tokens.get(token) {
            return Ok(cached);
        }
        let review = TokenReview {
            spec: TokenReviewSpec { token: token.to_owned(), audiences: None },
            ..TokenReview::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                // The token itself never reaches the log.
                tracing::warn!(error = %e, "TokenReview failed; does vmlet's role grant tokenreviews create?");
                Refusal { status: StatusCode::INTERNAL_SERVER_ERROR, message: format!("TokenReview: {e}") }
            })?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(info)) => Some(User {
                name: info.username.unwrap_or_default(),
                uid: info.uid,
                groups: info.groups.unwrap_or_default(),
                extra: info.extra.unwrap_or_default(),
            }),
            _ => None,
        };
        let ttl = if user.is_some() { Duration::from_secs(120) } else { Duration::from_secs(10) };
        self.tokens.put(token.to_owned(), user.clone(), ttl);
        Ok(user)
    }

    /// Whether `user` may do `attributes`: `Ok` or a 403 naming them.
    pub async fn authorize(&self, user: &User, attributes: &Attributes) -> Result<(), Refusal> {
        if self.mode == AuthorizationMode::AlwaysAllow {
            return Ok(());
        }
        let mut reasons = Vec::new();
        for subresource in &attributes.subresources {
            match self.review_access(user, attributes, subresource).await? {
                Decision::Allowed => return Ok(()),
                Decision::Denied(reason) if !reason.is_empty() => reasons.push(reason),
                Decision::Denied(_) => {}
            }
        }
        let mut message = format!(
            "Forbidden (user={}, verb={}, resource=nodes, subresource(s)=[{}])",
            user.name,
            attributes.verb,
            attributes.subresources.join(" ")
        );
        if !reasons.is_empty() {
            message.push_str(": ");
            message.push_str(&reasons.join("; "));
        }
        Err(Refusal { status: StatusCode::FORBIDDEN, message })
    }

    async fn review_access(
        &self,
        user: &User,
        attributes: &Attributes,
        subresource: &str,
    ) -> Result<Decision, Refusal> {
        let key = format!("{user:?}|{}|{subresource}|{:?}", attributes.verb, attributes.node);
        if let Some(allowed) = self.decisions.get(&key) {
            return Ok(if allowed { Decision::Allowed } else { Decision::Denied(String::new()) });
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: user.uid.clone(),
                groups: Some(user.groups.clone()),
                extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(attributes.verb.clone()),
                    group: Some(String::new()),
                    version: Some("v1".into()),
                    resource: Some("nodes".into()),
                    subresource: Some(subresource.to_owned()),
                    name: attributes.node.clone(),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let reviewed = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(
                    user = %user.name,
                    error = %e,
                    "SubjectAccessReview failed; does vmlet's role grant subjectaccessreviews create?"
                );
                Refusal {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: format!("Authorization error (user={}): SubjectAccessReview: {e}", user.name),
                }
            })?;
        let status = reviewed.status.unwrap_or_default();
        let ttl = if status.allowed { Duration::from_secs(300) } else { Duration::from_secs(30) };
        self.decisions.put(key, status.allowed, ttl);
        Ok(if status.allowed { Decision::Allowed } else { Decision::Denied(status.reason.unwrap_or_default()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_map_to_the_kubelets_verbs() {
        assert_eq!(verb_for_method(&Method::GET), "get");
        assert_eq!(verb_for_method(&Method::HEAD), "get");
        assert_eq!(verb_for_method(&Method::POST), "create");
        assert_eq!(verb_for_method(&Method::PUT), "update");
        assert_eq!(verb_for_method(&Method::PATCH), "patch");
        assert_eq!(verb_for_method(&Method::DELETE), "delete");
    }

    #[test]
    fn paths_map_to_the_kubelets_subresources() {
        assert_eq!(subresources_for_path("/stats/summary"), ["stats"]);
        assert_eq!(subresources_for_path("/stats"), ["stats"]);
        assert_eq!(subresources_for_path("/metrics/resource"), ["metrics"]);
        assert_eq!(subresources_for_path("/metrics"), ["metrics"]);
        assert_eq!(subresources_for_path("/logs/messages"), ["log"]);
        assert_eq!(subresources_for_path("/pods"), ["pods", "proxy"]);
        assert_eq!(subresources_for_path("/healthz"), ["healthz", "proxy"]);
        for path in ["/exec/ns/p/vm", "/attach/ns/p/vm", "/containerLogs/ns/p/vm", "/portForward/ns/p", "/run/ns/p/vm"]
        {
            assert_eq!(subresources_for_path(path), ["proxy"], "{path}");
        }
        assert_eq!(subresources_for_path("/statsfoo"), ["proxy"], "a prefix is not a subpath");
    }

    #[test]
    fn pod_scoped_paths_name_their_pod() {
        assert_eq!(pod_of_path("/exec/ns/vm-1/vm"), Some(("ns", "vm-1")));
        assert_eq!(pod_of_path("/containerLogs/team-a/web/vm"), Some(("team-a", "web")));
        assert_eq!(pod_of_path("/stats/summary"), None);
        assert_eq!(pod_of_path("/exec/ns"), None);
    }
}
