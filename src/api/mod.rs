//! The kubelet HTTPS API: one listener per node of this process, node `i`
//! of the config (hosts first, then the clouds' compute hosts) on
//! `kubeletApi.listen`'s port + `i`, as each Node's
//! `daemonEndpoints.kubeletEndpoint.port` says ([`ApiConfig::node_listeners`],
//! [`crate::config::Config::kubelet_port_of`]). A listener answers for its own
//! node only ([`ForNode`]): `/stats/summary` and `/metrics/resource` are that
//! host's figures, `/pods` its pods, a pod of another node is not found, and
//! authorization asks about that node. A process without nodes (controller
//! only) has one listener for `/metrics` and `/healthz`. The listeners share
//! one serving certificate (valid for the node IP, every node's address),
//! the connection and stream caps, and the authorization cache.
//!
//! - TLS ([`tls`]): a serving certificate from files, else a self-signed one
//!   (logged at WARN as such); client certificates verified against a client CA.
//! - Authentication and authorization ([`auth`]) as the kubelet's webhook mode:
//!   client certificate or bearer token (TokenReview), then a
//!   SubjectAccessReview on `nodes/{proxy,log,stats,metrics}`.
//! - Routes ([`routes`]): `/containerLogs` ([`logs`]), `/exec` and `/attach`
//!   ([`exec`], over [`crate::streams`]), `/portForward` ([`portforward`]),
//!   `/stats/summary` and
//!   `/metrics/resource` ([`stats`]), `/pods`, `/healthz`.
//!
//! The core implements [`PodDirectory`] from its node agents and calls [`serve`].

pub mod auth;
pub mod exec;
pub mod logs;
pub mod portforward;
pub mod routes;
pub mod serving_cert;
pub mod slots;
pub mod stats;
pub mod tls;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use vmlet_provider::{ErrorKind, Provider, VmId};

/// What the kubelet API needs from vmlet's node agents.
pub trait PodDirectory: Send + Sync + 'static {
    /// The pod `namespace/name` if it is bound to one of this process's nodes.
    fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry>;
    /// All pods bound to this process's nodes (for /pods and /stats/summary).
    fn pods(&self) -> Vec<PodEntry>;
    /// The one node this directory answers for ([`ForNode`]); `None` when it
    /// spans every node of the process.
    fn node(&self) -> Option<&str> {
        None
    }
}

/// The part of a [`PodDirectory`] on one node: what that node's listener
/// serves. A pod bound to another node of the process is not found here.
pub struct ForNode {
    inner: Arc<dyn PodDirectory>,
    node: String,
}

impl ForNode {
    /// The pods of `inner` bound to node `node`.
    pub fn new(inner: Arc<dyn PodDirectory>, node: &str) -> ForNode {
        ForNode { inner, node: node.to_owned() }
    }
}

impl PodDirectory for ForNode {
    fn lookup(&self, namespace: &str, name: &str) -> Option<PodEntry> {
        self.inner.lookup(namespace, name).filter(|entry| entry.node == self.node)
    }

    fn pods(&self) -> Vec<PodEntry> {
        self.inner.pods().into_iter().filter(|entry| entry.node == self.node).collect()
    }

    fn node(&self) -> Option<&str> {
        Some(&self.node)
    }
}

/// How long the listener pauses after an accept failed (file descriptors or
/// memory exhausted), instead of failing again in a busy loop.
pub const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// One pod on one of this process's nodes.
#[derive(Clone)]
pub struct PodEntry {
    /// The pod as last seen.
    pub pod: Arc<Pod>,
    /// Node (host) name.
    pub node: String,
    /// The host's provider.
    pub provider: Arc<dyn Provider>,
    /// The VM's identity; `None` for pods that are not VMs.
    pub vm: Option<VmId>,
    /// A backup's or restore's pod ([`crate::node::tasks`]): its log is its
    /// progress.
    pub task: bool,
    /// Console history: `0.log`, `1.log`, … one per boot, CRI log format.
    pub log_dir: PathBuf,
}

/// How requests are authorized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum AuthorizationMode {
    /// SubjectAccessReview against the API server (the kubelet's default).
    #[default]
    Webhook,
    /// Every authenticated request is allowed (tests, trusted networks).
    AlwaysAllow,
}

/// Configuration of the kubelet API; embedded as `kubeletApi:` in vmlet's file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiConfig {
    /// Where to listen; default `<nodeIP>:<kubeletPort>` (see [`ApiConfig::resolve`]).
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// PEM serving certificate (chain). With `tlsKeyFile`; when both are
    /// absent a self-signed certificate is made at start (logged at WARN).
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tlsCertFile`.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA bundle that signs accepted client certificates (the API server's
    /// kubelet-client certificate). Absent: client certificates are not accepted.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
    /// Let requests without credentials through as `system:anonymous` (still
    /// authorized). Default false: they get 401.
    #[serde(default)]
    pub anonymous_auth: bool,
    /// `Webhook` (default) or `AlwaysAllow`.
    #[serde(default)]
    pub authorization_mode: AuthorizationMode,
    /// Subject alternative names of the self-signed certificate (IPs or DNS
    /// names); default: the node IP and the node names (see [`ApiConfig::resolve`]).
    #[serde(default)]
    pub serving_cert_sans: Vec<String>,
    /// Connections served at once (TLS handshakes included); one past it is
    /// closed as soon as it is accepted. Default [`DEFAULT_MAX_CONNECTIONS`].
    /// An `exec`/`attach` counts until its stream is upgraded (SPDY,
    /// WebSocket); the upgraded stream is no longer counted here.
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Seconds a connection may take to send a request's headers, counted
    /// from when the server waits for them (so also an idle keep-alive
    /// connection's wait for its next request); then it is closed. Default
    /// [`DEFAULT_HEADER_TIMEOUT`] (30 s). An upgraded stream (exec, attach)
    /// and a response being streamed (`logs -f`) are not bound by it.
    #[serde(default)]
    pub request_header_timeout_seconds: Option<u64>,
    /// `exec`, `attach` and `port-forward` streams (a port-forward session
    /// counts once, whatever it forwards) served at once by this process;
    /// one past it gets 429. Default [`slots::DEFAULT_MAX_STREAMS`] (256).
    #[serde(default)]
    pub max_streams: Option<usize>,
    /// `exec`, `attach` and `port-forward` streams served at once to one
    /// pod; one past it gets 429. Default [`slots::DEFAULT_MAX_STREAMS_PER_POD`] (16).
    #[serde(default)]
    pub max_streams_per_pod: Option<usize>,
}

/// Connections the kubelet API serves at once unless configured
/// ([`ApiConfig::max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How long a connection may take to send request headers unless configured
/// ([`ApiConfig::request_header_timeout_seconds`]).
pub const DEFAULT_HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How often, at most, the listener logs that it closes connections past its limit.
const REFUSAL_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a TLS handshake may take before the connection is closed.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl ApiConfig {
    /// Fill the defaults that depend on the rest of vmlet's config: listen on
    /// `<node_ip>:<kubelet_port>` (the address the API server dials, and no
    /// other: a guest network's address on the host, e.g. a libvirt
    /// network's gateway, does not reach it), and self-signed SANs = the node
    /// IP and names.
    #[must_use]
    pub fn resolve(mut self, node_ip: IpAddr, kubelet_port: u16, node_names: &[String]) -> ApiConfig {
        self.listen.get_or_insert(SocketAddr::new(node_ip, kubelet_port));
        if self.serving_cert_sans.is_empty() {
            self.serving_cert_sans.push(node_ip.to_string());
            self.serving_cert_sans.extend(node_names.iter().cloned());
        }
        self
    }

    /// Where each of `nodes` (in config order) listens: node `i` on the
    /// [`ApiConfig::listen`] address with its port + `i` (port 0 stays 0: the
    /// system picks one per node, for tests that read [`Server::local_addr`]).
    /// Errors: [`ApiError::PortRange`] when a port would pass 65535.
    pub fn node_listeners(&self, nodes: &[String]) -> Result<Vec<(String, SocketAddr)>, ApiError> {
        let base = self.listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 10250)));
        nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let port = match base.port() {
                    0 => Some(0),
                    port => u16::try_from(i).ok().and_then(|i| port.checked_add(i)),
                };
                let port = port.ok_or_else(|| ApiError::PortRange { node: node.clone(), base: base.port() })?;
                Ok((node.clone(), SocketAddr::new(base.ip(), port)))
            })
            .collect()
    }

    /// Check the fields; the error names the field (`kubeletApi.` prefix is the caller's).
    pub fn validate(&self) -> Result<(), (String, String)> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => Err(("tlsKeyFile".into(), "is missing; give it with tlsCertFile, or neither".into())),
            (None, Some(_)) => Err(("tlsCertFile".into(), "is missing; give it with tlsKeyFile, or neither".into())),
            _ if self.max_connections == Some(0) => {
                Err(("maxConnections".into(), "is 0, which serves nothing; leave it out for 1024".into()))
            }
            _ if self.request_header_timeout_seconds == Some(0) => {
                Err(("requestHeaderTimeoutSeconds".into(), "is 0; leave it out for 30".into()))
            }
            _ if self.max_streams == Some(0) => {
                Err(("maxStreams".into(), "is 0, which refuses every exec and attach; leave it out for 256".into()))
            }
            _ if self.max_streams_per_pod == Some(0) => Err((
                "maxStreamsPerPod".into(),
                "is 0, which refuses every exec and attach; leave it out for 16".into(),
            )),
            _ => Ok(()),
        }
    }
}

/// The kubelet API could not start.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Reading a certificate, key or CA file.
    #[error("reading {path}: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The I/O or PEM error.
        #[source]
        source: std::io::Error,
    },
    /// The certificates or key are unusable.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// A node's listener would need a port past 65535 (node `i` listens on
    /// the first node's port + `i`).
    #[error(
        "node {node}: no port left for its kubelet API past {base} (node i listens on port {base} + i); \
         lower kubeletPort or serve fewer nodes in this process"
    )]
    PortRange {
        /// The node without a port.
        node: String,
        /// The first node's port.
        base: u16,
    },
    /// Binding the listener.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Bind the listener, then serve until `shutdown`. See [`Server`].
pub async fn serve(
    config: ApiConfig,
    directory: Arc<dyn PodDirectory>,
    client: kube::Client,
    shutdown: CancellationToken,
) -> Result<(), ApiError> {
    Server::bind(config, directory, client).await?.run(shutdown).await;
    Ok(())
}

/// What the listeners of one process share: the serving certificate, the
/// router (with the authorizer and its cache, and the stream caps) and the
/// connection cap. One router for all listeners: at 500 nodes a router each
/// held about 7 MiB (heaptrack).
struct Shared {
    tls: tokio_rustls::TlsAcceptor,
    router: axum::Router,
    connections: Arc<tokio::sync::Semaphore>,
    header_timeout: std::time::Duration,
}

impl Shared {
    fn new(config: &ApiConfig, client: kube::Client) -> Result<Shared, ApiError> {
        let tls = tls::server_config(config)?;
        let auth = auth::Auth::new(client, config.anonymous_auth, config.authorization_mode);
        let slots = slots::StreamSlots::new(
            config.max_streams.unwrap_or(slots::DEFAULT_MAX_STREAMS),
            config.max_streams_per_pod.unwrap_or(slots::DEFAULT_MAX_STREAMS_PER_POD),
        );
        let max_connections = config.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
        Ok(Shared {
            tls: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            router: routes::router(routes::RouterState::new(Arc::new(auth), Arc::new(slots))),
            connections: Arc::new(tokio::sync::Semaphore::new(max_connections)),
            header_timeout: config
                .request_header_timeout_seconds
                .map_or(DEFAULT_HEADER_TIMEOUT, std::time::Duration::from_secs),
        })
    }

    async fn bind(&self, addr: SocketAddr, directory: Arc<dyn PodDirectory>) -> Result<Server, ApiError> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| ApiError::Bind { addr, source })?;
        Ok(Server {
            listener,
            tls: self.tls.clone(),
            router: self.router.clone(),
            scope: routes::Scope(directory),
            connections: Arc::clone(&self.connections),
            header_timeout: self.header_timeout,
        })
    }
}

/// A bound kubelet API server.
pub struct Server {
    listener: tokio::net::TcpListener,
    tls: tokio_rustls::TlsAcceptor,
    router: axum::Router,
    /// The pods this listener answers for, set on each of its requests.
    scope: routes::Scope,
    /// One permit per connection served ([`ApiConfig::max_connections`]).
    connections: Arc<tokio::sync::Semaphore>,
    header_timeout: std::time::Duration,
}

impl Server {
    /// Build the TLS configuration and bind the listener (port 0 picks a free one).
    /// One listener on [`ApiConfig::listen`] that answers for every node of
    /// `directory` (a process without nodes; tests).
    pub async fn bind(
        config: ApiConfig,
        directory: Arc<dyn PodDirectory>,
        client: kube::Client,
    ) -> Result<Server, ApiError> {
        let addr = config.listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 10250)));
        Shared::new(&config, client)?.bind(addr, directory).await
    }

    /// One listener per node of `nodes` (names in config order), each
    /// answering for its node only ([`ForNode`]), at the addresses of
    /// [`ApiConfig::node_listeners`]; with no nodes, one listener as
    /// [`Server::bind`]. The servers share one certificate, authorizer,
    /// stream caps and connection cap. Errors: as [`Server::bind`], and
    /// [`ApiError::PortRange`].
    pub async fn bind_per_node(
        config: ApiConfig,
        nodes: &[String],
        directory: Arc<dyn PodDirectory>,
        client: kube::Client,
    ) -> Result<Vec<(Option<String>, Server)>, ApiError> {
        let shared = Shared::new(&config, client)?;
        if nodes.is_empty() {
            let addr = config.listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 10250)));
            return Ok(vec![(None, shared.bind(addr, directory).await?)]);
        }
        let mut servers = Vec::with_capacity(nodes.len());
        for (node, addr) in config.node_listeners(nodes)? {
            let scoped = Arc::new(ForNode::new(Arc::clone(&directory), &node));
            servers.push((Some(node), shared.bind(addr, scoped).await?));
        }
        Ok(servers)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Serve connections until `shutdown` (after a failed accept, e.g. out of
    /// file descriptors, the next waits [`ACCEPT_ERROR_PAUSE`]); connections in flight are left to
    /// finish on their own tasks. A connection past
    /// [`ApiConfig::max_connections`] is closed at once (logged at most once
    /// a minute); one that sends no request headers in time is closed
    /// ([`ApiConfig::request_header_timeout_seconds`]).
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!(addr = %self.local_addr(), "kubelet API listening");
        let mut refused_since_log: u64 = 0;
        let mut last_refusal_log: Option<std::time::Instant> = None;
        loop {
            let (tcp, peer) = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors (EMFILE, ENFILE) or
                        // memory: accepting again at once would fail the
                        // same way in a busy loop. Connections in flight
                        // free some meanwhile.
                        tracing::warn!(error = %e, "accepting a kubelet API connection; pausing 100 ms");
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                        }
                    }
                },
            };
            let Ok(permit) = Arc::clone(&self.connections).try_acquire_owned() else {
                drop(tcp);
                refused_since_log += 1;
                if last_refusal_log.is_none_or(|at| at.elapsed() >= REFUSAL_LOG_INTERVAL) {
                    tracing::warn!(%peer, refused = refused_since_log, "kubelet API at its connection limit (kubeletApi.maxConnections); closing new connections");
                    refused_since_log = 0;
                    last_refusal_log = Some(std::time::Instant::now());
                }
                continue;
            };
            // As Go's net/http server does (and the kubelet with it): no
            // Nagle delay. Without it, a small write after another that the
            // peer has not acknowledged yet (a TLS session ticket, then the
            // 101 of an exec's upgrade) waited for the peer's delayed ACK,
            // up to 40 ms per exec.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(%peer, error = %e, "TCP_NODELAY not set");
            }
            let tls = self.tls.clone();
            let router = self.router.clone();
            let scope = self.scope.clone();
            let shutdown = shutdown.clone();
            let header_timeout = self.header_timeout;
            tokio::spawn(async move {
                // Held until the connection (and any stream upgraded from it) ends.
                let _permit = permit;
                let handshake = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(tcp));
                let stream = match handshake.await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
                let identity =
                    stream.get_ref().1.peer_certificates().and_then(|certs| certs.first()).and_then(|leaf| {
                        match tls::identity_from_certificate(leaf) {
                            Ok(user) => Some(user),
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "client certificate without a usable subject");
                                None
                            }
                        }
                    });
                let peer_identity = auth::PeerCertificate(identity);
                let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                    // Both from the connection, never from the request: a
                    // client can set neither.
                    req.extensions_mut().insert(peer_identity.clone());
                    req.extensions_mut().insert(scope.clone());
                    let router = router.clone();
                    async move {
                        use tower::ServiceExt;
                        router.oneshot(req.map(axum::body::Body::new)).await
                    }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .with_upgrades();
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(%peer, error = %e, "kubelet API connection ended");
                        }
                    }
                    _ = shutdown.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
    }
}

/// The HTTP status for a provider error kind ([`crate::failure::handling`]).
pub fn http_status(kind: ErrorKind) -> axum::http::StatusCode {
    axum::http::StatusCode::from_u16(crate::failure::handling(kind).http_status)
        .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_camel_case_and_refuses_unknown_fields() {
        let config: ApiConfig = serde_yaml::from_str(
            "listen: 127.0.0.1:10250\ntlsCertFile: /c\ntlsKeyFile: /k\nclientCaFile: /ca\nanonymousAuth: true\nauthorizationMode: AlwaysAllow",
        )
        .unwrap();
        assert_eq!(config.listen, Some("127.0.0.1:10250".parse().unwrap()));
        assert!(config.anonymous_auth);
        assert_eq!(config.authorization_mode, AuthorizationMode::AlwaysAllow);
        assert!(serde_yaml::from_str::<ApiConfig>("tlsCert: /c").is_err());
    }

    #[test]
    fn defaults_listen_on_the_kubelet_port_with_node_sans() {
        let config = ApiConfig::default().resolve("10.0.0.5".parse().unwrap(), 10251, &["host-a".into()]);
        assert_eq!(config.listen, Some("10.0.0.5:10251".parse().unwrap()), "the node IP only, never every address");
        assert_eq!(config.serving_cert_sans, ["10.0.0.5", "host-a"]);
        assert!(!config.anonymous_auth);
        assert_eq!(config.authorization_mode, AuthorizationMode::Webhook);
    }

    #[test]
    fn connection_limits_of_zero_are_refused_naming_the_field() {
        let config = ApiConfig { max_connections: Some(0), ..ApiConfig::default() };
        assert_eq!(config.validate().unwrap_err().0, "maxConnections");
        let config = ApiConfig { request_header_timeout_seconds: Some(0), ..ApiConfig::default() };
        assert_eq!(config.validate().unwrap_err().0, "requestHeaderTimeoutSeconds");
        let config: ApiConfig = serde_yaml::from_str("maxConnections: 64\nrequestHeaderTimeoutSeconds: 5").unwrap();
        assert_eq!((config.max_connections, config.request_header_timeout_seconds), (Some(64), Some(5)));
        assert!(config.validate().is_ok());
    }

    #[test]
    fn node_i_listens_on_the_first_port_plus_i() {
        let config = ApiConfig::default().resolve("10.0.0.5".parse().unwrap(), 10250, &[]);
        let nodes = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let listeners = config.node_listeners(&nodes).unwrap();
        let ports: Vec<_> = listeners.iter().map(|(node, addr)| (node.as_str(), addr.to_string())).collect();
        assert_eq!(
            ports,
            [("a", "10.0.0.5:10250".into()), ("b", "10.0.0.5:10251".into()), ("c", "10.0.0.5:10252".into())]
        );
        let any = ApiConfig { listen: Some("127.0.0.1:0".parse().unwrap()), ..ApiConfig::default() };
        assert!(any.node_listeners(&nodes).unwrap().iter().all(|(_, addr)| addr.port() == 0), "the system picks each");
        let top = ApiConfig { listen: Some("127.0.0.1:65535".parse().unwrap()), ..ApiConfig::default() };
        let error = top.node_listeners(&nodes).unwrap_err();
        assert!(matches!(&error, ApiError::PortRange { node, base: 65535 } if node == "b"), "{error}");
    }

    #[test]
    fn a_certificate_without_its_key_is_refused() {
        let config = ApiConfig { tls_cert_file: Some("/c".into()), ..ApiConfig::default() };
        assert_eq!(config.validate().unwrap_err().0, "tlsKeyFile");
    }
}
