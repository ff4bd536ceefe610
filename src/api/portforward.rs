//! `/portForward/{namespace}/{pod}` and `/portForward/{namespace}/{pod}/{uid}`:
//! `kubectl port-forward` to TCP ports of a VM's guest, through the
//! provider's [`vmlet_provider::PortForward`], over
//! [`crate::streams::portforward`] (SPDY/3.1, SPDY tunnelled in a
//! WebSocket, or WebSocket channels).
//!
//! The request passed authentication and authorization (`nodes/proxy`, as
//! the kubelet asks) in the router; here, as for exec: the pod must be on
//! this node (404), carry the UID the path names if it names one (404), be
//! a VirtualMachine's own pod ([`crate::identity`]; 403 otherwise), its
//! provider must reach guest ports (501), and the stream caps of
//! [`super::slots`] must have room (429). One slot is held for the whole
//! session, however many connections it forwards. Where a connection goes
//! is the provider's to decide from the VM's identity; the request names
//! only ports.

use super::exec::{take_slot, PodPath};
use super::routes::{not_a_vm_pod, not_found, text, ApiState};
use crate::streams::portforward::{self, Dial};
use axum::body::Body;
use axum::extract::{Path, Query, Request};
use axum::http::StatusCode;
use axum::response::Response;
use std::sync::Arc;

/// `GET|POST /portForward/...`: upgrade and forward each connection the
/// client opens to the port it names.
pub async fn port_forward(
    state: ApiState,
    Path(path): Path<PodPath>,
    Query(query): Query<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let (namespace, pod) =
        (path.get("namespace").cloned().unwrap_or_default(), path.get("pod").cloned().unwrap_or_default());
    let Some(entry) = state.directory.lookup(&namespace, &pod) else { return not_found(&namespace, &pod) };
    let uid = entry.pod.metadata.uid.clone().unwrap_or_default();
    if path.get("uid").is_some_and(|asked| *asked != uid) {
        return text(StatusCode::NOT_FOUND, format!("pod {namespace}/{pod} with UID {} not found", path["uid"]));
    }
    let Some(vm) = entry.vm.clone() else { return not_a_vm_pod(&namespace, &pod) };
    if entry.provider.port_forward().is_none() {
        return text(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "the {} provider of host {} cannot reach guest ports, so it forwards none (libvirt's test driver \
                 cannot; a local qemu host reaches guests on its libvirt networks)",
                entry.provider.kind(),
                entry.node
            ),
        );
    }
    let slot = match take_slot(&state, &path) {
        Ok(slot) => slot,
        Err(response) => return *response,
    };
    tracing::info!(pod.namespace = %namespace, pod.name = %pod, node.name = %entry.node, "port-forward");
    let provider = Arc::clone(&entry.provider);
    let dial: Dial = Arc::new(move |port: u16| {
        // The slot lives as long as the session holds this closure.
        let _held = &slot;
        let (provider, vm) = (Arc::clone(&provider), vm.clone());
        let (namespace, pod, uid) = (namespace.clone(), pod.clone(), uid.clone());
        Box::pin(async move {
            let Some(forward) = provider.port_forward() else {
                return Err(format!("error forwarding port {port} to pod {namespace}/{pod}: no port forwarding"));
            };
            forward.connect(&vm, port).await.map_err(|e| {
                tracing::info!(pod.namespace = %namespace, pod.name = %pod, port, error = %e, "port-forward connect failed");
                format!("error forwarding port {port} to pod {namespace}/{pod}, uid {uid}: {e}")
            })
        })
    });
    portforward::upgrade(req.map(Body::new), &query, dial).await
}
