//! Handing the heap's free pages back to the system after a burst.
//!
//! glibc's malloc returns an arena's memory to the system only from the
//! arena's top: pages freed in its middle stay resident. A burst of work
//! (thousands of VMs created or deleted at once, hundreds of hosts starting)
//! leaves many such pages behind. After 2,000 VMs were created on 500 hosts,
//! `malloc_trim(0)` (called from gdb) gave back 22 of vmlet's 131 MiB of
//! anonymous memory (`RssAnon`); 5 of 74 MiB at 2,000 VMs on 100 hosts, 33
//! MiB at 10,000 VMs. Neither fewer arenas
//! (`MALLOC_ARENA_MAX=2`), a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_`)
//! nor jemalloc did better (see the README's benchmark notes).
//!
//! [`trim_every`] calls glibc's `malloc_trim(0)` (malloc_trim(3)) once per
//! period, so what a burst freed is back with the system within that period.
//! With another C library [`trim`] does nothing.

use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// How often [`trim_every`] trims in vmlet: a walk of glibc's arenas, a few
/// milliseconds of one core with 150 MiB of heap.
pub const TRIM_PERIOD: Duration = Duration::from_secs(30);

/// Trim the heap (see [`trim`]) every `period`, from one `period` after the
/// start, until `shutdown`. Each trim runs on a blocking thread: it holds
/// each arena's lock while it walks it.
pub async fn trim_every(period: Duration, shutdown: CancellationToken) {
    let mut every = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let started = Instant::now();
        let before = anonymous_kib();
        let Ok(released) = tokio::task::spawn_blocking(trim).await else { return };
        if released {
            let after = anonymous_kib();
            debug!(
                rss_anon_before_kib = before,
                rss_anon_after_kib = after,
                took_ms = started.elapsed().as_millis() as u64,
                "returned the heap's free pages to the system"
            );
        }
    }
}

/// Return the free pages of every malloc arena to the system now (glibc's
/// `malloc_trim(0)`); whether any memory was returned. `false` with a C
/// library other than glibc.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointer and works only on glibc's own
        // arenas, each under its lock; any thread may call it at any time.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// This process's anonymous resident memory (`RssAnon` of
/// `/proc/self/status`), in KiB; `None` where it cannot be read.
fn anonymous_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("RssAnon:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of 64 KiB are below glibc's mmap threshold (128 KiB at the
    /// start), so they come from an arena; freeing every other one leaves
    /// free pages between blocks still in use, which only a trim returns.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn free_pages_between_blocks_in_use_are_returned() {
        let mut blocks: Vec<Vec<u8>> = (0..512).map(|i| vec![i as u8; 64 << 10]).collect();
        let mut kept = Vec::new();
        for (i, block) in blocks.drain(..).enumerate() {
            if i % 2 == 0 {
                kept.push(block);
            }
        }
        assert!(trim(), "16 MiB of free 64 KiB blocks between blocks in use: something to return");
        assert_eq!(kept.iter().map(|b| b.len()).sum::<usize>(), 256 * (64 << 10), "the blocks in use are intact");
        assert!(kept.iter().enumerate().all(|(i, b)| b.iter().all(|&x| x == (2 * i) as u8)));
    }

    #[test]
    fn this_process_has_anonymous_memory() {
        assert!(anonymous_kib().is_some_and(|kib| kib > 0));
    }

    #[tokio::test]
    async fn the_trim_loop_ends_at_shutdown() {
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(trim_every(Duration::from_secs(3600), shutdown.clone()));
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), running).await.expect("it ends at shutdown").unwrap();
    }
}
