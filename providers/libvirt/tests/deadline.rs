//! The deadline helper's own tests (tests/support/deadline.rs): only `sleep`,
//! `sh` and `cat`, no cluster and no libvirtd. A test binary of its own, so they
//! run once rather than in every binary that includes the helper.

#[path = "../../../tests/support/deadline.rs"]
mod deadline;

use deadline::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn deadline_kills_a_hung_command_and_names_it() {
    let err = run(Command::new("sleep").arg("30"), Duration::from_secs(1)).expect_err("sleep 30 must time out");
    assert_eq!(err.command, "sleep 30");
    assert!(err.exited.is_none(), "{err}");
    let text = err.to_string();
    assert!(text.starts_with("`sleep 30` did not finish within its 1s deadline: killed after "), "{text}");
    assert!(text.contains("--- stdout so far (0 bytes)") && text.contains("--- stderr so far (0 bytes)"), "{text}");
}

#[test]
fn deadline_message_shows_the_command_line_time_and_output_so_far() {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo it's up; sleep 30"]).env("VMLET_PROBE", "a b");
    let command = command_line(&cmd);
    assert_eq!(command, r"VMLET_PROBE='a b' sh -c 'echo it'\''s up; sleep 30'");
    let timed_out = TimedOut {
        command,
        deadline: Duration::from_secs(60),
        elapsed: Duration::from_millis(60_012),
        exited: None,
        stdout: b"it's up\n".to_vec(),
        stderr: vec![b'e'; SHOWN + 5],
    };
    let text = timed_out.to_string();
    let head = r"`VMLET_PROBE='a b' sh -c 'echo it'\''s up; sleep 30'` did not finish within its 60s deadline: killed after 60.0s";
    assert!(text.starts_with(head), "{text}");
    assert!(
        text.contains("\n--- stdout so far (8 bytes):\nit's up\n\n--- stderr so far (last 16384 of 16389 bytes):\neee")
    );
}

#[test]
fn deadline_returns_output_and_exit_code() {
    let out = output_within(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]), KUBECTL);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!((out.stdout.as_slice(), out.stderr.as_slice()), (&b"out\n"[..], &b"err\n"[..]));
}

#[test]
fn deadline_feeds_stdin_and_drains_large_output_without_deadlock() {
    // 1 MiB on stdout and on stderr, far beyond a pipe's buffer.
    let script = "head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2";
    let out = output_within(Command::new("sh").args(["-c", script]), KUBECTL);
    assert!(out.status.success());
    assert_eq!((out.stdout.len(), out.stderr.len()), (1 << 20, 1 << 20));

    let input = vec![b'x'; 1 << 20];
    let out = run_with_stdin(&mut Command::new("cat"), &input, KUBECTL).unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success());
    assert_eq!(out.stdout, input);
}

#[test]
fn deadline_reaps_a_killed_child() {
    let mut child = Command::new("sleep").arg("30").spawn().expect("spawn sleep");
    let status = kill_and_reap(&mut child, KILL_WAIT).expect("reaped");
    assert!(!status.success());
}
