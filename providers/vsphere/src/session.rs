//! One authenticated vim25 session with a vCenter or ESXi host.
//!
//! Follows the vim25 session model: `RetrieveServiceContent` on the
//! `ServiceInstance` (no session needed) names the managers;
//! `SessionManager.Login` answers with a `vmware_soap_session` cookie that
//! every later call carries; `Logout` ends it. A session that vSphere
//! expired (idle timeout, restart) makes calls fail with `NotAuthenticated`:
//! the session then logs in again, once, and repeats the call.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use reqwest::header::{HeaderValue, CONTENT_TYPE, COOKIE, SET_COOKIE};
use tokio::sync::{watch, Mutex};

use crate::soap::{self, MoRef};
use crate::tls::{self, PinnedVerifier, Trust};
use crate::xml::{escape, Element};
use crate::Error;

/// The vim25 version requested in `SOAPAction` (`urn:vim25/6.5`): every
/// type and property this crate uses exists since vSphere 6.5, and vCenter
/// 7 and 8 still serve it.
pub const VIM_VERSION: &str = "6.5";

/// A secret string (password, session cookie): its `Debug` shows no content.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Where the vCenter is, how its certificate is trusted, and whom to log in as.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The SDK endpoint, `https://host[:port]/sdk` (config field `url`).
    pub url: String,
    /// How the server certificate is trusted; there is no unverified mode.
    pub trust: Trust,
    /// User for `Login`, e.g. `administrator@vsphere.local`.
    pub username: String,
    /// Its password.
    pub password: Secret,
    /// Deadline of each HTTP request, connection included.
    pub request_timeout: Duration,
}

impl SessionConfig {
    /// A config with a 60 s request timeout.
    pub fn new(url: impl Into<String>, trust: Trust, username: impl Into<String>, password: Secret) -> SessionConfig {
        SessionConfig {
            url: url.into(),
            trust,
            username: username.into(),
            password,
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// The parts of the vim25 `ServiceContent` this crate uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceContent {
    /// The inventory's root `Folder`.
    pub root_folder: MoRef,
    /// The `PropertyCollector` that reads properties.
    pub property_collector: MoRef,
    /// The `SessionManager` for `Login` and `Logout`.
    pub session_manager: MoRef,
    /// `about.fullName`, e.g. `VMware vCenter Server 8.0.2 build-…`.
    pub full_name: String,
    /// `about.apiType`: `VirtualCenter` for a vCenter, `HostAgent` for an ESXi host.
    pub api_type: String,
    /// `about.apiVersion`, e.g. `8.0.2.0`.
    pub api_version: String,
}

impl ServiceContent {
    fn from_response(response: &Element) -> Option<ServiceContent> {
        let content = response.child("returnval")?;
        let about = content.child("about")?;
        let moref = |name| content.child(name).and_then(MoRef::from_element);
        Some(ServiceContent {
            root_folder: moref("rootFolder")?,
            property_collector: moref("propertyCollector")?,
            session_manager: moref("sessionManager")?,
            full_name: about.child_text("fullName").unwrap_or_default().to_owned(),
            api_type: about.child_text("apiType").unwrap_or_default().to_owned(),
            api_version: about.child_text("apiVersion").unwrap_or_default().to_owned(),
        })
    }
}

/// A logged-in vim25 session. Calls may run concurrently; a re-login after
/// `NotAuthenticated` happens once for all of them.
pub struct Session {
    config: SessionConfig,
    http: reqwest::Client,
    pinned: Option<Arc<PinnedVerifier>>,
    content: ServiceContent,
    /// `vmware_soap_session=…` while logged in.
    cookie: StdMutex<Option<Secret>>,
    /// Held while logging in, so that concurrent callers log in once.
    login: Mutex<()>,
    /// How many logins succeeded: objects made for a session (a
    /// `PropertyCollector`, its filters) die with it.
    logins: watch::Sender<u64>,
    /// How many tasks this session started and saw end ([`crate::vms`]'s
    /// `wait_for_task`), so that the update cache knows when it must catch up.
    tasks_ended: watch::Sender<u64>,
    /// The vAPI REST session of the same user (`crate::rest`), made on
    /// first use.
    pub(crate) rest: crate::rest::RestSession,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("url", &self.config.url)
            .field("username", &self.config.username)
            .field("api", &self.content.full_name)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Connects to `config.url`, reads the `ServiceContent` and logs in.
    ///
    /// Errors: [`Error::Url`] unless the URL is `https://…`;
    /// [`Error::CaFile`]; [`Error::ThumbprintMismatch`] when the server's
    /// certificate is not the configured one (the handshake is abandoned
    /// before any request, so the credentials are never sent);
    /// [`Error::Transport`] when the server cannot be reached;
    /// [`Error::Fault`] `InvalidLogin` (kind `PermissionDenied`) for refused
    /// credentials.
    pub async fn connect(config: SessionConfig) -> Result<Session, Error> {
        let parsed = reqwest::Url::parse(&config.url)
            .map_err(|_| Error::Url { url: config.url.clone(), reason: "not a URL" })?;
        if parsed.scheme() != "https" {
            return Err(Error::Url {
                url: config.url.clone(),
                reason: "want https:// (vmlet never sends credentials in clear)",
            });
        }
        let (tls, pinned) = tls::client_config(&config.trust)?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .https_only(true)
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            .timeout(config.request_timeout)
            .build()
            .map_err(|source| Error::Transport { operation: "build HTTP client", url: config.url.clone(), source })?;
        let this = MoRef::new("ServiceInstance", "ServiceInstance");
        let body = soap::method("RetrieveServiceContent", &this, "");
        let (response, _) =
            post(&http, &config.url, pinned.as_deref(), "RetrieveServiceContent", body, None, None).await?;
        let content = ServiceContent::from_response(&response).ok_or_else(|| Error::Response {
            operation: "RetrieveServiceContent",
            status: 200,
            reason: "the ServiceContent lacks rootFolder, propertyCollector, sessionManager or about".into(),
        })?;
        let session = Session {
            config,
            http,
            pinned,
            content,
            cookie: StdMutex::new(None),
            login: Mutex::new(()),
            logins: watch::Sender::new(0),
            tasks_ended: watch::Sender::new(0),
            rest: crate::rest::RestSession::default(),
        };
        session.login().await?;
        Ok(session)
    }

    /// The server's `ServiceContent` as read at connect.
    pub fn service_content(&self) -> &ServiceContent {
        &self.content
    }

    /// The configured SDK URL.
    pub fn url(&self) -> &str {
        &self.config.url
    }

    /// The connection settings (the REST side logs in with the same user).
    pub(crate) fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// The HTTP client with the pinned trust, and the verifier that tells a
    /// thumbprint mismatch apart from other transport errors.
    pub(crate) fn http(&self) -> (&reqwest::Client, Option<&PinnedVerifier>) {
        (&self.http, self.pinned.as_deref())
    }

    /// Ends the session (`SessionManager.Logout`). Later calls log in again.
    ///
    /// Errors: [`Error::Transport`], [`Error::Fault`].
    pub async fn logout(&self) -> Result<(), Error> {
        let body = soap::method("Logout", &self.content.session_manager, "");
        let cookie = self.cookie();
        let result = self.post("Logout", body, cookie.as_ref(), None).await;
        *self.cookie.lock().unwrap_or_else(|e| e.into_inner()) = None;
        result.map(|_| ())
    }

    /// Calls `method` on `this` with the argument elements `args` and
    /// returns the `<methodResponse>` element. On `NotAuthenticated` it logs
    /// in again, once, and repeats the call.
    pub(crate) async fn call(&self, method: &'static str, this: &MoRef, args: &str) -> Result<Element, Error> {
        self.call_until(method, this, args, None).await
    }

    /// As [`Session::call`], each HTTP request bounded by `timeout` instead
    /// of [`SessionConfig::request_timeout`] (a `WaitForUpdatesEx` that the
    /// server may hold open for its `maxWaitSeconds`).
    pub(crate) async fn call_until(
        &self,
        method: &'static str,
        this: &MoRef,
        args: &str,
        timeout: Option<Duration>,
    ) -> Result<Element, Error> {
        let body = soap::method(method, this, args);
        let cookie = self.cookie();
        match self.post(method, body.clone(), cookie.as_ref(), timeout).await {
            Err(error) if error.fault() == Some("NotAuthenticated") => {
                tracing::info!(vsphere.url = %self.config.url, method, "session expired (NotAuthenticated): logging in again");
                self.relogin(cookie.as_ref()).await?;
                let cookie = self.cookie();
                self.post(method, body, cookie.as_ref(), timeout).await
            }
            result => result,
        }
    }

    /// How many times this session logged in (1 after connect; one more per
    /// re-login after `NotAuthenticated`), and a receiver told of each next one.
    pub(crate) fn logins(&self) -> watch::Receiver<u64> {
        self.logins.subscribe()
    }

    /// Counts a task of this session that ended (success, fault or deadline).
    pub(crate) fn task_ended(&self) {
        self.tasks_ended.send_modify(|n| *n += 1);
    }

    /// How many tasks of this session ended so far, and a receiver told of
    /// each next one.
    pub(crate) fn tasks_ended(&self) -> watch::Receiver<u64> {
        self.tasks_ended.subscribe()
    }

    /// A guard that counts a task as ended ([`Session::task_ended`]) when
    /// dropped: when its waiter returns, fails or is cancelled.
    pub(crate) fn task_guard(&self) -> TaskGuard<'_> {
        TaskGuard(self)
    }

    fn cookie(&self) -> Option<Secret> {
        self.cookie.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Logs in unless another caller already replaced the `expired` cookie.
    async fn relogin(&self, expired: Option<&Secret>) -> Result<(), Error> {
        let _login = self.login.lock().await;
        if self.cookie().as_ref() != expired {
            return Ok(());
        }
        self.login_locked().await
    }

    async fn login(&self) -> Result<(), Error> {
        let _login = self.login.lock().await;
        self.login_locked().await
    }

    async fn login_locked(&self) -> Result<(), Error> {
        let args = format!(
            "<userName>{}</userName><password>{}</password>",
            escape(&self.config.username),
            escape(self.config.password.expose())
        );
        let body = soap::method("Login", &self.content.session_manager, &args);
        let (_, cookie) = post(&self.http, &self.config.url, self.pinned.as_deref(), "Login", body, None, None).await?;
        let cookie = cookie.ok_or_else(|| Error::Response {
            operation: "Login",
            status: 200,
            reason: "no vmware_soap_session cookie in the answer".into(),
        })?;
        *self.cookie.lock().unwrap_or_else(|e| e.into_inner()) = Some(cookie);
        self.logins.send_modify(|n| *n += 1);
        Ok(())
    }

    async fn post(
        &self,
        operation: &'static str,
        body: String,
        cookie: Option<&Secret>,
        timeout: Option<Duration>,
    ) -> Result<Element, Error> {
        post(&self.http, &self.config.url, self.pinned.as_deref(), operation, body, cookie, timeout)
            .await
            .map(|(element, _)| element)
    }
}

/// Counts a task as ended when dropped ([`Session::task_guard`]).
pub(crate) struct TaskGuard<'a>(&'a Session);

impl Drop for TaskGuard<'_> {
    fn drop(&mut self) {
        self.0.task_ended();
    }
}

/// The error of a request to `url` that got no HTTP answer:
/// [`Error::ThumbprintMismatch`] when `pinned` refused the server's
/// certificate, else [`Error::Transport`].
pub(crate) fn transport_error(
    pinned: Option<&PinnedVerifier>,
    operation: &'static str,
    url: &str,
    source: reqwest::Error,
) -> Error {
    match pinned.and_then(PinnedVerifier::take_mismatch) {
        Some((expected, actual)) => Error::ThumbprintMismatch {
            url: url.to_owned(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        },
        None => Error::Transport { operation, url: url.to_owned(), source: source.without_url() },
    }
}

/// POSTs one method envelope (within `timeout` when given, else the
/// client's); returns the response element and the session cookie the
/// server set, if any.
async fn post(
    http: &reqwest::Client,
    url: &str,
    pinned: Option<&PinnedVerifier>,
    operation: &'static str,
    method: String,
    cookie: Option<&Secret>,
    timeout: Option<Duration>,
) -> Result<(Element, Option<Secret>), Error> {
    let mut request = http
        .post(url)
        .header(CONTENT_TYPE, "text/xml; charset=utf-8")
        .header("SOAPAction", format!("urn:vim25/{VIM_VERSION}"))
        .body(soap::envelope(&method));
    if let Some(timeout) = timeout {
        request = request.timeout(timeout);
    }
    if let Some(cookie) = cookie {
        let mut value = HeaderValue::from_str(cookie.expose()).map_err(|_| Error::Response {
            operation,
            status: 200,
            reason: "the session cookie is not a valid header value".into(),
        })?;
        value.set_sensitive(true);
        request = request.header(COOKIE, value);
    }
    let transport = |source| transport_error(pinned, operation, url, source);
    let response = request.send().await.map_err(transport)?;
    let status = response.status().as_u16();
    let session_cookie = response
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|pair| pair.trim_start().starts_with("vmware_soap_session="))
        .map(|pair| Secret::new(pair.trim()));
    let bytes = response.bytes().await.map_err(transport)?;
    match soap::parse_response(&bytes) {
        Ok(Ok(element)) => match soap::embedded_fault(&element, "NotAuthenticated") {
            Some(message) => Err(Error::Fault { operation, fault: "NotAuthenticated".into(), message }),
            None => Ok((element, session_cookie)),
        },
        Ok(Err(fault)) => Err(Error::Fault { operation, fault: fault.kind, message: fault.message }),
        Err(reason) => {
            let start: String = String::from_utf8_lossy(&bytes).chars().take(200).collect();
            Err(Error::Response { operation, status, reason: format!("not a vim25 envelope ({reason}): {start:?}") })
        }
    }
}
