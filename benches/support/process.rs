//! What a process costs, read from procfs: resident memory
//! (`/proc/<pid>/status`) and CPU time (`/proc/<pid>/stat`, proc(5)).

use std::time::{Duration, Instant};

/// Clock ticks per second of the times in `/proc/<pid>/stat` (`USER_HZ`,
/// which Linux's ABI fixes at 100 for user space).
const USER_HZ: f64 = 100.0;

/// Field `field` of `/proc/<pid>/status` (a `kB` figure such as `VmRSS` or
/// `VmHWM`) in MiB; `None` when the process is gone or has no such field.
pub fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let kib: f64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds `pid` has used, user and system (`utime` + `stime`, fields 14
/// and 15 of `/proc/<pid>/stat`); `None` when the process is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing ')'.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // after_name starts at field 3 (state): utime is field 14, stime 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// The pid of the first process whose `/proc/<pid>/comm` is `name` (e.g.
/// `kube-apiserver`), if one runs.
pub fn pid_of(name: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
        (comm.trim_end() == name).then_some(pid)
    })
}

/// CPU use of each of `pids` over the same `window`, as a percentage of one
/// core (`None` for a process that went away).
pub async fn cpu_percent_over(pids: &[u32], window: Duration) -> Vec<Option<f64>> {
    let before: Vec<Option<f64>> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let elapsed = started.elapsed().as_secs_f64();
    pids.iter().zip(before).map(|(pid, before)| Some((cpu_seconds(*pid)? - before?) / elapsed * 100.0)).collect()
}
