//! Caps on the exec, attach and port-forward sessions (streams) the kubelet API serves at once: per
//! process and per pod, so that one client (or one pod's users) cannot hold
//! every guest-agent call slot, console and file descriptor of a host. A
//! stream past either cap is refused before its upgrade with
//! `429 Too Many Requests` and a message naming the cap.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Streams served at once by one process unless configured
/// (`kubeletApi.maxStreams`).
pub const DEFAULT_MAX_STREAMS: usize = 256;

/// Streams served at once to one pod unless configured
/// (`kubeletApi.maxStreamsPerPod`).
pub const DEFAULT_MAX_STREAMS_PER_POD: usize = 16;

/// The streams running now, by pod (`namespace`, `name`).
#[derive(Debug)]
pub struct StreamSlots {
    max: usize,
    per_pod: usize,
    running: Mutex<Running>,
}

/// What [`StreamSlots`] counts.
#[derive(Debug, Default)]
struct Running {
    total: usize,
    by_pod: HashMap<(String, String), usize>,
}

/// One running stream's slot; released when dropped.
#[derive(Debug)]
pub struct StreamSlot {
    slots: Arc<StreamSlots>,
    pod: (String, String),
}

impl StreamSlots {
    /// At most `max` streams in all and `per_pod` per pod.
    pub fn new(max: usize, per_pod: usize) -> StreamSlots {
        StreamSlots { max, per_pod, running: Mutex::default() }
    }

    /// A slot for one more stream to pod `namespace/name`. Errors: the
    /// message for a 429 when the process or the pod is at its cap.
    pub fn take(self: &Arc<Self>, namespace: &str, name: &str) -> Result<StreamSlot, String> {
        let mut running = self.running.lock().expect("stream slots poisoned");
        let Running { total, by_pod } = &mut *running;
        let pod = (namespace.to_owned(), name.to_owned());
        let of_pod = by_pod.get(&pod).copied().unwrap_or(0);
        if of_pod >= self.per_pod {
            return Err(format!(
                "pod {namespace}/{name} has {of_pod} exec/attach/port-forward streams open, its limit \
                 (kubeletApi.maxStreamsPerPod); close one and try again"
            ));
        }
        if *total >= self.max {
            return Err(format!(
                "this vmlet serves {total} exec/attach/port-forward streams, its limit (kubeletApi.maxStreams); try again later"
            ));
        }
        *total += 1;
        *by_pod.entry(pod.clone()).or_insert(0) += 1;
        crate::metrics::global().streams_open.inc();
        Ok(StreamSlot { slots: Arc::clone(self), pod })
    }

    /// Streams running now: in all, and to pod `namespace/name`.
    pub fn running(&self, namespace: &str, name: &str) -> (usize, usize) {
        let running = self.running.lock().expect("stream slots poisoned");
        let of_pod = running.by_pod.get(&(namespace.to_owned(), name.to_owned())).copied().unwrap_or(0);
        (running.total, of_pod)
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut running = self.slots.running.lock().expect("stream slots poisoned");
        let Running { total, by_pod } = &mut *running;
        *total -= 1;
        crate::metrics::global().streams_open.dec();
        if let Some(count) = by_pod.get_mut(&self.pod) {
            *count -= 1;
            if *count == 0 {
                by_pod.remove(&self.pod);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_and_the_process_each_get_their_cap_and_dropped_slots_free_it() {
        let slots = Arc::new(StreamSlots::new(3, 2));
        let a1 = slots.take("ns", "a").unwrap();
        let _a2 = slots.take("ns", "a").unwrap();
        let refused = slots.take("ns", "a").unwrap_err();
        assert!(refused.starts_with("pod ns/a has 2 exec/attach/port-forward streams open"), "{refused}");
        let _b1 = slots.take("ns", "b").unwrap();
        let refused = slots.take("other", "c").unwrap_err();
        assert!(refused.starts_with("this vmlet serves 3 exec/attach/port-forward streams"), "{refused}");
        drop(a1);
        assert_eq!(slots.running("ns", "a"), (2, 1));
        let _c1 = slots.take("other", "c").unwrap();
        assert_eq!(slots.running("other", "c"), (3, 1));
    }
}
