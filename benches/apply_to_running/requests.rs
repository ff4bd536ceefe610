//! API requests a run cost: `apiserver_request_total` from the API server's
//! `/metrics`, read before and after, counted per object (a VM or a baseline
//! pod). Everything that talks to the API server meanwhile counts (vmlet or the
//! bench's own status writes, kube-scheduler, kube-controller-manager), which
//! is the point: it is what one object costs the control plane.

use kube::Client;
use std::collections::BTreeMap;

/// `(verb, resource[/subresource])` → requests served so far.
#[derive(Clone, Debug, Default)]
pub struct Requests(BTreeMap<(String, String), f64>);

impl Requests {
    /// The API server's counters now; empty (and a note on stderr) when
    /// `/metrics` cannot be read.
    pub async fn read(client: &Client) -> Requests {
        let request = axum::http::Request::get("/metrics").body(Vec::new()).expect("a GET request");
        match client.request_text(request).await {
            Ok(text) => Requests::parse(&text),
            Err(e) => {
                eprintln!("requests: reading /metrics: {e}");
                Requests::default()
            }
        }
    }

    /// Sum `apiserver_request_total` by verb and resource from the Prometheus
    /// text format; watches are left out (one long request, not a cost per
    /// object).
    fn parse(text: &str) -> Requests {
        let mut counts = BTreeMap::new();
        for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
            let Some((labels, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            let label = |name: &str| {
                let key = format!("{name}=\"");
                labels.split_once(&key).and_then(|(_, rest)| rest.split_once('"')).map(|(v, _)| v.to_owned())
            };
            let (Some(verb), Some(resource)) = (label("verb"), label("resource")) else { continue };
            if verb == "WATCH" {
                continue;
            }
            let resource = match label("subresource").filter(|s| !s.is_empty()) {
                Some(sub) => format!("{resource}/{sub}"),
                None => resource,
            };
            *counts.entry((verb, resource)).or_insert(0.0) += value;
        }
        Requests(counts)
    }

    /// What was served between `before` and `self`.
    pub fn since(&self, before: &Requests) -> Requests {
        Requests(self.0.iter().map(|(key, now)| (key.clone(), now - before.0.get(key).unwrap_or(&0.0))).collect())
    }

    /// Requests in all.
    pub fn total(&self) -> f64 {
        self.0.values().sum()
    }

    /// Print these requests per object under `label` (e.g. "API requests/object"):
    /// the total and each kind that cost at least 0.05 requests per object,
    /// most first.
    pub fn print_per_object(&self, label: &str, objects: usize) {
        if self.0.is_empty() || objects == 0 {
            return;
        }
        let per_object = |n: f64| n / objects as f64;
        let mut rows: Vec<(String, f64)> = self
            .0
            .iter()
            .map(|((verb, resource), n)| (format!("{verb} {resource}"), per_object(*n)))
            .filter(|(_, n)| *n >= 0.05)
            .collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        let listed = rows.iter().map(|(kind, n)| format!("{kind} {n:.2}")).collect::<Vec<_>>().join(", ");
        println!("  {:<22} {:.1} ({listed})", format!("{label}:"), per_object(self.total()));
    }
}
