//! The Kubernetes API client vmlet runs with: kube's own stack (base URI,
//! retry of 429/503/504, credentials, extra headers, connect/read/write
//! timeouts, rustls) over a hyper connection pool whose idle connections are
//! bounded.
//!
//! kube's default client keeps every connection it ever opened for 90 s,
//! however many: one vmlet process serving 500 hosts, whose heartbeats and
//! pod syncs come together, held about 700 idle TLS connections to the API
//! server, tens of MiB on both sides. client-go's transport keeps at most 25
//! idle connections per host (`MaxIdleConnsPerHost`, k8s.io/client-go
//! `transport/cache.go`) and closes them after 90 s idle; this client does
//! the same. A burst still opens what it needs; only the idle rest is closed.
//!
//! Its connections set `TCP_NODELAY`, as Go's dialer does for client-go: with
//! Nagle's algorithm a small write that follows another not yet acknowledged
//! (a request's body after its headers, over TLS) waits for the server's
//! delayed ACK, up to 40 ms.

use std::time::Duration;

use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use kube::client::retry::RetryPolicy;
use kube::client::ConfigExt as _;
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};

/// Idle connections kept to the API server (client-go's `MaxIdleConnsPerHost`).
pub const MAX_IDLE_CONNECTIONS: usize = 25;

/// How long an idle connection is kept (client-go's `IdleConnTimeout`).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// A client for `config` (from `KUBECONFIG` or the pod's service account)
/// that keeps at most [`MAX_IDLE_CONNECTIONS`] idle connections, each for at
/// most [`IDLE_TIMEOUT`]. Errors: kube's, when the config's TLS material or
/// credentials cannot be loaded (`kube::Error::{RustlsTls, Auth}`) or an extra
/// header is invalid.
pub fn client(config: Config) -> Result<Client, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false); // the TLS layer above decides the scheme
    http.set_nodelay(true);
    let mut connector = TimeoutConnector::new(config.rustls_https_connector_with_connector(http)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let pool = HyperClient::builder(TokioExecutor::new())
        .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
        .pool_idle_timeout(IDLE_TIMEOUT)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| RetryLayer::new(RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(pool);
    Ok(Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use hyper::body::Incoming;
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;
    use k8s_openapi::api::core::v1::Namespace;
    use kube::Api;
    use tokio::net::TcpListener;
    use tokio::sync::Barrier;

    /// A plain-HTTP stand-in for the API server that answers every GET with
    /// an empty Namespace once `together` requests are in flight at once (so
    /// each holds a connection of its own), counting the connections open.
    async fn server(together: usize) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let open = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(together));
        let counted = Arc::clone(&open);
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let (open, barrier) = (Arc::clone(&counted), Arc::clone(&barrier));
                open.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let answer = hyper::service::service_fn(move |_: Request<Incoming>| {
                        let barrier = Arc::clone(&barrier);
                        async move {
                            barrier.wait().await;
                            let body = r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"n"}}"#;
                            Ok::<_, Infallible>(Response::new(body.to_owned()))
                        }
                    });
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), answer).await;
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (url, open)
    }

    #[tokio::test]
    async fn a_burst_opens_what_it_needs_and_keeps_at_most_the_idle_bound() {
        let burst = 3 * MAX_IDLE_CONNECTIONS;
        let (url, open) = server(burst).await;
        let client = client(Config::new(url.parse().unwrap())).unwrap();
        let namespaces: Api<Namespace> = Api::all(client);
        let answers = futures::future::join_all((0..burst).map(|_| namespaces.get("n"))).await;
        assert!(answers.iter().all(Result::is_ok), "{:?}", answers.iter().find(|a| a.is_err()));
        // All answered together: each request had its own connection.
        assert!(open.load(Ordering::SeqCst) > MAX_IDLE_CONNECTIONS, "{} open", open.load(Ordering::SeqCst));
        // The pool closes what it cannot keep idle.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while open.load(Ordering::SeqCst) > MAX_IDLE_CONNECTIONS {
            assert!(tokio::time::Instant::now() < deadline, "{} connections still open", open.load(Ordering::SeqCst));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(open.load(Ordering::SeqCst), MAX_IDLE_CONNECTIONS, "the idle ones stay for the next requests");
    }
}
