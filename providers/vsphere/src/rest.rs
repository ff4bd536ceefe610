//! The vAPI REST side of a vCenter, for what vim25 SOAP lacks (content
//! library items): JSON over the same HTTPS endpoint and pinned trust as
//! the [`Session`], under `/rest` (served by vCenter 6.5 to 8 and by
//! govmomi's simulator; vCenter 7+ also serves it under `/api`).
//!
//! Follows the vAPI REST session model: `POST /rest/com/vmware/cis/session`
//! with HTTP basic authentication answers `{"value": "<session id>"}`, which
//! later requests carry in the `vmware-api-session-id` header. A session
//! that expired makes a request fail with 401; it then logs in again, once,
//! and repeats the request. Answers wrap their result in `{"value": …}`;
//! errors are `{"type": "com.vmware.vapi.std.errors.<kind>", "value":
//! {"messages": [{"default_message": …}]}}`.

use std::sync::Mutex as StdMutex;
use std::time::Duration;

use reqwest::header::{HeaderValue, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::session::{transport_error, Secret, Session};
use crate::tls::PinnedVerifier;
use crate::Error;

/// The REST session id of a [`Session`] (`None` until the first request).
#[derive(Default)]
pub(crate) struct RestSession {
    id: StdMutex<Option<Secret>>,
}

impl std::fmt::Debug for RestSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RestSession(<redacted>)")
    }
}

/// The header that carries the session id.
const SESSION_HEADER: &str = "vmware-api-session-id";

impl Session {
    /// `method` of `path` (below `/rest`, with its query) with the JSON
    /// `body`, as the session's user, within `timeout` (`None`:
    /// [`crate::SessionConfig::request_timeout`]); returns the answer's
    /// `value` (`Null` when it has none). Logs in on first use and once
    /// more on a 401.
    ///
    /// Errors: [`Error::Transport`] (or [`Error::ThumbprintMismatch`]);
    /// [`Error::Response`] with the HTTP status and the vAPI error type and
    /// messages for any other status than 2xx (401 and 403: kind
    /// `PermissionDenied`; 404: `NotFound`).
    pub(crate) async fn rest(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<Value, Error> {
        let id = match self.rest_id() {
            Some(id) => id,
            None => self.rest_login(None).await?,
        };
        match self.rest_once(operation, method.clone(), path, body, timeout, &id).await {
            Err(Error::Response { status: 401, .. }) => {
                tracing::info!(vsphere.url = %self.url(), operation, "REST session expired (401): logging in again");
                let id = self.rest_login(Some(&id)).await?;
                self.rest_once(operation, method, path, body, timeout, &id).await
            }
            result => result,
        }
    }

    fn rest_id(&self) -> Option<Secret> {
        self.rest.id.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Logs in unless another caller already replaced the `expired` id.
    async fn rest_login(&self, expired: Option<&Secret>) -> Result<Secret, Error> {
        if let Some(current) = self.rest_id().filter(|current| Some(current) != expired) {
            return Ok(current);
        }
        const OPERATION: &str = "REST login";
        let config = self.config();
        let (http, pinned) = self.http();
        let url = rest_url(&config.url, "/com/vmware/cis/session")?;
        let request = http.post(&url).basic_auth(&config.username, Some(config.password.expose()));
        let value = send(request, OPERATION, &url, pinned).await?;
        let id = value.as_str().map(Secret::new).ok_or_else(|| Error::Response {
            operation: OPERATION,
            status: 200,
            reason: "the answer holds no session id".into(),
        })?;
        *self.rest.id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id.clone());
        Ok(id)
    }

    async fn rest_once(
        &self,
        operation: &'static str,
        method: Method,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
        id: &Secret,
    ) -> Result<Value, Error> {
        let (http, pinned) = self.http();
        let url = rest_url(&self.config().url, path)?;
        let mut header = HeaderValue::from_str(id.expose()).map_err(|_| Error::Response {
            operation,
            status: 200,
            reason: "the REST session id is not a valid header value".into(),
        })?;
        header.set_sensitive(true);
        let mut request = http.request(method, &url).header(SESSION_HEADER, header);
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        if let Some(body) = body {
            request = request.header(CONTENT_TYPE, "application/json").body(body.to_string());
        }
        send(request, operation, &url, pinned).await
    }
}

/// The REST URL of `path` on the server of the SDK URL `sdk`
/// (`https://vc/sdk` → `https://vc/rest<path>`).
fn rest_url(sdk: &str, path: &str) -> Result<String, Error> {
    let mut url = reqwest::Url::parse(sdk).map_err(|_| Error::Url { url: sdk.to_owned(), reason: "not a URL" })?;
    url.set_path("");
    url.set_query(None);
    Ok(format!("{}rest{path}", url.as_str()))
}

/// Sends `request`; the answer's `value` on 2xx, else the vAPI error.
async fn send(
    request: reqwest::RequestBuilder,
    operation: &'static str,
    url: &str,
    pinned: Option<&PinnedVerifier>,
) -> Result<Value, Error> {
    let transport = |source| transport_error(pinned, operation, url, source);
    let response = request.send().await.map_err(transport)?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(transport)?;
    let json: Option<Value> = serde_json::from_slice(&bytes).ok();
    if status.is_success() {
        return Ok(json.and_then(|mut v| v.get_mut("value").map(Value::take)).unwrap_or(Value::Null));
    }
    Err(Error::Response { operation, status: status.as_u16(), reason: vapi_error(status, json.as_ref(), &bytes) })
}

/// What a vAPI error answer says: its type and messages, else the start
/// of the body.
fn vapi_error(status: StatusCode, json: Option<&Value>, body: &[u8]) -> String {
    let Some(json) = json else {
        let start: String = String::from_utf8_lossy(body).chars().take(200).collect();
        return format!("{status}: {start:?}");
    };
    let kind = json.get("type").and_then(Value::as_str).unwrap_or("unknown error");
    let messages: Vec<&str> = json
        .pointer("/value/messages")
        .and_then(Value::as_array)
        .map(|m| m.iter().filter_map(|m| m.get("default_message").and_then(Value::as_str)).collect())
        .unwrap_or_default();
    if messages.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}: {}", messages.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rest_root_replaces_the_sdk_path() {
        assert_eq!(
            rest_url("https://vc.example.com:8443/sdk", "/com/vmware/cis/session").unwrap(),
            "https://vc.example.com:8443/rest/com/vmware/cis/session"
        );
    }

    #[test]
    fn a_vapi_error_says_its_type_and_messages() {
        let body = br#"{"type":"com.vmware.vapi.std.errors.not_found","value":{"messages":[{"id":"x","default_message":"Item abc not found."}]}}"#;
        let json: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(
            vapi_error(StatusCode::NOT_FOUND, Some(&json), body),
            "com.vmware.vapi.std.errors.not_found: Item abc not found."
        );
        assert_eq!(vapi_error(StatusCode::BAD_GATEWAY, None, b"<html>"), "502 Bad Gateway: \"<html>\"");
    }
}
