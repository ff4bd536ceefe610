//! The router: every route behind authentication and authorization, and the
//! small handlers (`/healthz`, `/pods`, `/containerLogs`).

use super::auth::{self, Attributes, Auth, PeerCertificate};
use super::logs;
use super::{exec, portforward, stats, PodDirectory};
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use k8s_openapi::jiff::Timestamp;
use std::sync::Arc;
use std::time::Duration;

/// The router's state: what every listener of a process shares. One router
/// serves all of a process's nodes; which node's pods a request reaches is
/// its listener's [`Scope`], set on the request by the server.
#[derive(Clone)]
pub struct RouterState {
    /// Authentication and authorization.
    pub auth: Arc<Auth>,
    /// CPU counters for rates, keyed by node and VM.
    pub rates: Arc<stats::RateCache>,
    /// The exec and attach streams running, against their caps.
    pub slots: Arc<super::slots::StreamSlots>,
}

impl RouterState {
    /// State over `auth` and the stream caps `slots`.
    pub fn new(auth: Arc<Auth>, slots: Arc<super::slots::StreamSlots>) -> RouterState {
        RouterState { auth, rates: Arc::default(), slots }
    }
}

/// The pods a request may reach: those of the node whose listener it came
/// in on ([`super::ForNode`]), or every node's on the one listener of a
/// process without nodes. The server puts it in the request's extensions
/// from the listener, never from anything the client sent; a request
/// without one is refused with 500 before authentication.
#[derive(Clone)]
pub struct Scope(pub Arc<dyn PodDirectory>);

/// What a handler works with: the process's [`RouterState`] and the pods of
/// the request's [`Scope`].
#[derive(Clone)]
pub struct ApiState {
    /// The pods of the listener's node.
    pub directory: Arc<dyn PodDirectory>,
    /// Authentication and authorization.
    pub auth: Arc<Auth>,
    /// CPU counters for rates.
    pub rates: Arc<stats::RateCache>,
    /// The exec and attach streams running, against their caps.
    pub slots: Arc<super::slots::StreamSlots>,
}

impl FromRequestParts<RouterState> for ApiState {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, shared: &RouterState) -> Result<ApiState, Response> {
        let Some(Scope(directory)) = parts.extensions.get::<Scope>().cloned() else {
            tracing::error!(path = parts.uri.path(), "kubelet API request without its listener's scope; refused");
            return Err(text(StatusCode::INTERNAL_SERVER_ERROR, "this request has no node scope; refused"));
        };
        Ok(ApiState {
            directory,
            auth: Arc::clone(&shared.auth),
            rates: Arc::clone(&shared.rates),
            slots: Arc::clone(&shared.slots),
        })
    }
}

/// A plain-text response.
pub fn text(status: StatusCode, message: impl Into<String>) -> Response {
    let mut message = message.into();
    message.push('\n');
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], message).into_response()
}

/// 501 for a pod whose provider lacks a capability; `what` completes "has no …",
/// e.g. `"serial console to attach to"`.
pub fn lacks(entry: &crate::api::PodEntry, what: &str) -> Response {
    text(
        StatusCode::NOT_IMPLEMENTED,
        format!("the {} provider of host {} has no {what}", entry.provider.kind(), entry.node),
    )
}

/// 403 for a pod on this process's nodes that is not a VirtualMachine's own
/// (see [`crate::identity`]): nothing of any VM is served for it.
pub fn not_a_vm_pod(namespace: &str, pod: &str) -> Response {
    text(
        StatusCode::FORBIDDEN,
        format!(
            "pod {namespace}/{pod} is not a VirtualMachine's pod: its controlling owner must be a VirtualMachine of \
             namespace {namespace} with the UID it names; vmlet serves no console, exec, logs or port forwarding for it"
        ),
    )
}

/// 404 for a pod not on this process's nodes.
pub fn not_found(namespace: &str, pod: &str) -> Response {
    text(StatusCode::NOT_FOUND, format!("pod {namespace}/{pod} does not exist on any node of this vmlet"))
}

/// The kubelet API's routes, for every listener of a process: each request
/// carries its listener's [`Scope`].
pub fn router(state: RouterState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/pods", get(pods))
        .route("/containerLogs/{namespace}/{pod}/{container}", get(container_logs))
        .route("/exec/{namespace}/{pod}/{container}", any(exec::exec))
        .route("/exec/{namespace}/{pod}/{uid}/{container}", any(exec::exec))
        .route("/attach/{namespace}/{pod}/{container}", any(exec::attach))
        .route("/attach/{namespace}/{pod}/{uid}/{container}", any(exec::attach))
        .route("/portForward/{namespace}/{pod}", any(portforward::port_forward))
        .route("/portForward/{namespace}/{pod}/{uid}", any(portforward::port_forward))
        .route("/stats/summary", get(stats::get_summary))
        .route("/metrics/resource", get(stats::get_resource_metrics))
        .route("/metrics", get(metrics))
        .fallback(|| async { text(StatusCode::NOT_FOUND, "not found: this vmlet serves /containerLogs, /exec, /attach, /portForward, /stats/summary, /metrics/resource, /metrics, /pods, /healthz") })
        .layer(middleware::from_fn_with_state(state.clone(), authenticate_and_authorize))
        .layer(middleware::from_fn(count_request))
        .with_state(state)
}

/// Count the request by its matched route and status
/// (`vmlet_kubelet_api_requests_total`, [`crate::metrics`]).
async fn count_request(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<axum::extract::MatchedPath>().map_or("other", |p| p.as_str()).to_owned();
    let response = next.run(req).await;
    let labels = crate::metrics::RequestLabels { route, code: response.status().as_u16() };
    crate::metrics::global().api_requests.get_or_create(&labels).inc();
    response
}

/// `GET /metrics`: vmlet's own metrics ([`crate::metrics`]), the pods by
/// node and phase counted now.
async fn metrics(state: ApiState) -> Response {
    let metrics = crate::metrics::global();
    metrics.pods.clear();
    for entry in state.directory.pods() {
        let phase = entry.pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_else(|| "Unknown".to_owned());
        metrics.pods.get_or_create(&crate::metrics::PodLabels { node: entry.node.clone(), phase }).inc();
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], metrics.encode())
        .into_response()
}

async fn authenticate_and_authorize(state: ApiState, req: Request, next: Next) -> Response {
    let peer = req.extensions().get::<PeerCertificate>().cloned().unwrap_or_default();
    let authorization = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let user = match state.auth.authenticate(&peer, authorization).await {
        Ok(user) => user,
        Err(refusal) => return text(refusal.status, refusal.message),
    };
    let path = req.uri().path();
    // The pod's node; else the node this listener serves (a kubelet asks
    // about its own node for every path); `None` (any node) only on a
    // listener of a process without nodes.
    let node = auth::pod_of_path(path)
        .and_then(|(ns, pod)| state.directory.lookup(ns, pod))
        .map(|e| e.node)
        .or_else(|| state.directory.node().map(str::to_owned));
    let attributes = Attributes {
        verb: auth::verb_for_method(req.method()).to_owned(),
        subresources: auth::subresources_for_path(path),
        node,
    };
    if let Err(refusal) = state.auth.authorize(&user, &attributes).await {
        tracing::debug!(user = %user.name, path, status = %refusal.status, "kubelet API request refused");
        return text(refusal.status, refusal.message);
    }
    next.run(req).await
}

async fn pods(state: ApiState) -> Response {
    let items: Vec<_> = state.directory.pods().into_iter().map(|e| (*e.pod).clone()).collect();
    axum::Json(serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}))
        .into_response()
}

/// How often a follower looks for appended console output.
const FOLLOW_POLL: Duration = Duration::from_millis(250);

/// Bytes of console history read per blocking call (about; one record may go past).
const LOG_CHUNK_BYTES: usize = 32 * 1024;

async fn container_logs(
    state: ApiState,
    Path((namespace, pod, container)): Path<(String, String, String)>,
    Query(query): Query<Vec<(String, String)>>,
) -> Response {
    let opts = match logs::options_from_query(&query, Timestamp::now()) {
        Ok(opts) => opts,
        Err(message) => return text(StatusCode::UNPROCESSABLE_ENTITY, format!("invalid log options: {message}")),
    };
    let Some(entry) = state.directory.lookup(&namespace, &pod) else { return not_found(&namespace, &pod) };
    if entry.task {
        let containers = entry.pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
        if !containers.iter().any(|c| c.name == container) {
            return text(StatusCode::NOT_FOUND, format!("container {container:?} not found in pod {pod:?}"));
        }
    } else if entry.vm.is_none() {
        return not_a_vm_pod(&namespace, &pod);
    } else if container != crate::vmpod::CONTAINER_NAME {
        return text(
            StatusCode::NOT_FOUND,
            format!("container {container:?} not found in pod {pod:?}; a VM pod has one container, \"vm\""),
        );
    }
    if !entry.task && entry.provider.console().is_none() {
        // 400, as the kubelet answers logs it cannot serve: `kubectl logs -f`
        // retries a 5xx for a while, where this is final.
        let mut refusal = lacks(&entry, "serial console, so it keeps no console log");
        *refusal.status_mut() = StatusCode::BAD_REQUEST;
        return refusal;
    }
    let boots = logs::boot_files(&entry.log_dir);
    let file = if opts.previous {
        if boots.len() < 2 {
            return text(
                StatusCode::BAD_REQUEST,
                format!("previous terminated container \"vm\" in pod {pod:?} not found: the VM has no earlier boot"),
            );
        }
        Some(boots[boots.len() - 2].clone())
    } else {
        boots.last().cloned()
    };
    let Some((boot, path)) = file else {
        // No history yet: an empty log, as for a container that wrote nothing.
        return (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], "").into_response();
    };

    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
    let directory = state.directory.clone();
    let pod_uid = entry.pod.metadata.uid.clone();
    let log_dir = entry.log_dir.clone();
    let opts = logs::LogOptions { follow: opts.follow && !opts.previous, ..opts };
    // Reads run on a blocking thread a chunk at a time; waiting (for the
    // client to take a chunk, or for the guest to write more) holds none.
    tokio::spawn(async move {
        let mut cursor = logs::LogCursor::new(&opts);
        loop {
            let (file, read_opts, mut at) = (path.clone(), opts.clone(), cursor.clone());
            let read = tokio::task::spawn_blocking(move || {
                logs::read_chunk(&file, &read_opts, &mut at, LOG_CHUNK_BYTES).map(|read| (read, at))
            });
            let ((chunk, end), at) = match read.await {
                Ok(Ok(read)) => read,
                Ok(Err(e)) => {
                    tracing::debug!(path = %path.display(), error = %e, "reading console history");
                    return;
                }
                Err(_) => return,
            };
            cursor = at;
            if !chunk.is_empty() && tx.send(chunk).await.is_err() {
                return;
            }
            match end {
                logs::ChunkEnd::More => {}
                logs::ChunkEnd::Done => return,
                logs::ChunkEnd::AtEnd => {
                    tokio::time::sleep(FOLLOW_POLL).await;
                    let pod_still_here =
                        directory.lookup(&namespace, &pod).is_some_and(|e| e.pod.metadata.uid == pod_uid);
                    let newer_boot = logs::boot_files(&log_dir).last().is_some_and(|(b, _)| *b > boot);
                    if tx.is_closed() || !pod_still_here || newer_boot {
                        return;
                    }
                }
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (Ok::<_, std::convert::Infallible>(Bytes::from(chunk)), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from_stream(body))
        .expect("a log response builds")
}
