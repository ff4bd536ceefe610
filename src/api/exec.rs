//! `/exec/{namespace}/{pod}/{container}` (a command in the guest, through the
//! provider's [`vmlet_provider::GuestExec`]) and `/attach/...` (the live serial
//! console, through [`vmlet_provider::Console`]), over [`crate::streams`].
//!
//! Everything that can be refused is refused before the upgrade, with an HTTP
//! status and a message (404 unknown pod or container, 501 capability missing,
//! 429 past the stream caps of [`super::slots`]);
//! failures after it are reported on the error stream.

use super::routes::{lacks, not_a_vm_pod, not_found, text, ApiState};
use super::{http_status, PodEntry};
use crate::streams::{self, Outcome, StreamOptions};
use axum::body::Body;
use axum::extract::{Path, Query, Request};
use axum::http::StatusCode;
use axum::response::Response;
use std::collections::HashMap;

/// Path parameters of exec and attach, with or without the pod UID segment.
pub type PodPath = HashMap<String, String>;

fn outcome_from_error(e: vmlet_provider::Error) -> Outcome {
    let status = http_status(e.kind);
    Outcome::Failure {
        code: status.as_u16(),
        reason: status.canonical_reason().unwrap_or("Error").replace(' ', ""),
        message: e.to_string(),
    }
}

/// Find the VM pod and check the container; the error is the response to send.
fn vm_pod(state: &ApiState, path: &PodPath) -> Result<(PodEntry, vmlet_provider::VmId), Box<Response>> {
    let (namespace, pod, container) = (
        path.get("namespace").map(String::as_str).unwrap_or(""),
        path.get("pod").map(String::as_str).unwrap_or(""),
        path.get("container").map(String::as_str).unwrap_or(""),
    );
    let entry = state.directory.lookup(namespace, pod).ok_or_else(|| Box::new(not_found(namespace, pod)))?;
    if container != crate::vmpod::CONTAINER_NAME {
        return Err(Box::new(text(
            StatusCode::NOT_FOUND,
            format!(
                "container {container:?} not found in pod {pod:?}; a VM pod has one container, {:?}",
                crate::vmpod::CONTAINER_NAME
            ),
        )));
    }
    let vm = entry.vm.clone().ok_or_else(|| Box::new(not_a_vm_pod(namespace, pod)))?;
    Ok((entry, vm))
}

/// A stream slot for the pod of `path` ([`super::slots`]), held for as long
/// as the stream runs; the error is the 429 response to send.
pub(super) fn take_slot(state: &ApiState, path: &PodPath) -> Result<super::slots::StreamSlot, Box<Response>> {
    let (namespace, pod) =
        (path.get("namespace").map(String::as_str).unwrap_or(""), path.get("pod").map(String::as_str).unwrap_or(""));
    state.slots.take(namespace, pod).map_err(|message| {
        tracing::warn!(pod.namespace = namespace, pod.name = pod, %message, "stream refused");
        Box::new(text(StatusCode::TOO_MANY_REQUESTS, message))
    })
}

/// `GET|POST /exec/...`: `command` (repeated), `stdin`, `stdout`, `stderr`, `tty`.
pub async fn exec(
    state: ApiState,
    Path(path): Path<PodPath>,
    Query(query): Query<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let (entry, vm) = match vm_pod(&state, &path) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    if entry.provider.guest_exec().is_none() {
        return lacks(&entry, "guest agent to run commands in the guest (guest exec)");
    }
    let command: Vec<String> = query.iter().filter(|(k, _)| k == "command").map(|(_, v)| v.clone()).collect();
    if command.is_empty() {
        return text(
            StatusCode::BAD_REQUEST,
            "exec needs a command (query parameter `command`, repeated per argument)",
        );
    }
    let opts = match StreamOptions::from_query(&query) {
        Ok(opts) => opts,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    let slot = match take_slot(&state, &path) {
        Ok(slot) => slot,
        Err(response) => return *response,
    };
    tracing::info!(pod.namespace = %path["namespace"], pod.name = %path["pod"], node.name = %entry.node, ?command, "exec");
    let pod = format!("{}/{}", &path["namespace"], &path["pod"]);
    streams::upgrade(req.map(Body::new), opts, move |io| async move {
        let _slot = slot;
        let Some(guest) = entry.provider.guest_exec() else {
            return Outcome::Failure { code: 501, reason: "NotImplemented".into(), message: "no guest exec".into() };
        };
        match guest.exec(&vm, &command, io).await {
            Ok(0) => Outcome::Success,
            Ok(code) => {
                tracing::debug!(pod = %pod, exit_code = code, "exec: the command exited non-zero");
                Outcome::ExitCode(code)
            }
            Err(e) => {
                // The client sees this too; the log keeps it for whoever
                // reads why a guest "never answered".
                tracing::info!(pod = %pod, error.kind = ?e.kind, error = %e, "exec failed");
                outcome_from_error(e)
            }
        }
    })
    .await
}

/// `GET|POST /attach/...`: the live serial console.
pub async fn attach(
    state: ApiState,
    Path(path): Path<PodPath>,
    Query(query): Query<Vec<(String, String)>>,
    req: Request,
) -> Response {
    let (entry, vm) = match vm_pod(&state, &path) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    if entry.provider.console().is_none() {
        return lacks(&entry, "serial console to attach to");
    }
    let opts = match StreamOptions::from_query(&query) {
        Ok(opts) => opts,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    let slot = match take_slot(&state, &path) {
        Ok(slot) => slot,
        Err(response) => return *response,
    };
    tracing::info!(pod.namespace = %path["namespace"], pod.name = %path["pod"], node.name = %entry.node, "attach");
    streams::upgrade(req.map(Body::new), opts, move |io| async move {
        let _slot = slot;
        let Some(console) = entry.provider.console() else {
            return Outcome::Failure { code: 501, reason: "NotImplemented".into(), message: "no console".into() };
        };
        match console.attach(&vm, io).await {
            Ok(()) => Outcome::Success,
            Err(e) => outcome_from_error(e),
        }
    })
    .await
}
