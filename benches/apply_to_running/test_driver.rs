//! What libvirt's test driver itself holds for N running domains.
//!
//! The bench's hosts are `test:///` connections, which keep their domains in
//! the memory of the process that opened them: vmlet's. This measures that
//! share alone, in a bare `virsh -c test:///default` that defines and starts
//! N domains of the shape vmlet defines there (name, UUID, vmlet's identity
//! metadata, memory, one vCPU), so that vmlet's own memory per VM can be read
//! apart from the hypervisor's. On a real host those domains live in
//! libvirtd, not in vmlet.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::process;

/// RSS of the bare process before and after it holds `n` running domains,
/// in MiB; `None` when virsh (or coreutils' `stdbuf`) is missing, fails, or
/// takes longer than `limit` (it is then killed).
pub fn rss_for_domains(n: usize, limit: Duration) -> Option<(f64, f64)> {
    let dir = tempfile::tempdir().ok()?;
    for i in 0..n {
        std::fs::write(dir.path().join(format!("{i}.xml")), domain_xml(i)).ok()?;
    }
    // Line-buffered: virsh's answers must reach the pipe as they are made.
    let mut virsh = Command::new("stdbuf")
        .args(["-oL", "virsh", "-c", "test:///default"])
        .current_dir(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let pid = virsh.id();
    let (lines_tx, lines) = mpsc::channel();
    let stdout = virsh.stdout.take()?;
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut stdin = virsh.stdin.take()?;
    let deadline = std::time::Instant::now() + limit;
    // virsh answers its commands in order: an `echo` marks where it is.
    let reached = |marker: &str, stdin: &mut std::process::ChildStdin| -> Option<()> {
        writeln!(stdin, "echo {marker}").ok()?;
        stdin.flush().ok()?;
        loop {
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            if lines.recv_timeout(left).ok()?.trim_start_matches("virsh # ").trim() == marker {
                return Some(());
            }
        }
    };
    let measured = (|| {
        reached("empty", &mut stdin)?;
        let empty = process::status_mib(pid, "VmRSS")?;
        let mut commands = String::new();
        for i in 0..n {
            commands.push_str(&format!("define {i}.xml\nstart bench_vm-{i}\n"));
        }
        stdin.write_all(commands.as_bytes()).ok()?;
        reached("full", &mut stdin)?;
        Some((empty, process::status_mib(pid, "VmRSS")?))
    })();
    drop(stdin);
    let _ = virsh.kill();
    let _ = virsh.wait();
    measured
}

/// Domain `i` as vmlet defines it on the test driver (see
/// `providers/libvirt/src/xml.rs`): 64 MiB, one vCPU.
fn domain_xml(i: usize) -> String {
    format!(
        "<domain type='test'><name>bench_vm-{i}</name>\
         <uuid>00000000-0000-4000-8000-{i:012x}</uuid>\
         <metadata><vmlet:vm xmlns:vmlet=\"https://vmlet.io/xmlns/domain/v1\" \
         uid=\"10000000-0000-4000-8000-{i:012x}\" namespace=\"bench\" name=\"vm-{i}\"/></metadata>\
         <memory unit='KiB'>65536</memory><currentMemory unit='KiB'>65536</currentMemory>\
         <vcpu placement='static'>1</vcpu><os><type>hvm</type></os></domain>"
    )
}
