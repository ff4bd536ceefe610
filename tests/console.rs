//! `kubectl logs`, `exec` and `attach` through the real API server to vmlet's
//! kubelet API, on a real qemu guest (test-vms/guest) under a real libvirtd, and
//! the clear refusal on a backend without a console or agent.

mod common;

use common::{guest_for, guest_vm_spec, qemu_uri, test_driver_uri, Host, TestEnv};
use serde_json::json;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap().trim().to_owned()
}

/// kubectl with an extra environment (e.g. SPDY instead of WebSocket).
fn kubectl_env(env: &TestEnv, vars: &[(&str, &str)], args: &[&str]) -> Output {
    let cluster = common::cluster();
    Command::new(cluster.bin.join("kubectl"))
        .env("KUBECONFIG", &cluster.kubeconfig)
        .envs(vars.iter().copied())
        .args(["-n", &env.ns])
        .args(args)
        .output()
        .expect("run kubectl")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn wait_for_log_line(env: &TestEnv, pod: &str, needle: &str) {
    env.wait_for(&format!("`kubectl logs {pod}` to show {needle:?}"), || {
        let out = env.kubectl_output(&["logs", pod]);
        let found = out.status.success() && stdout(&out).contains(needle);
        async move { found.then_some(()) }
    })
    .await;
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

#[tokio::test]
async fn logs_exec_and_attach_reach_a_real_guest_through_the_api_server() {
    let mut env = TestEnv::new("console").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { suffix: "q", uri: qemu_uri(), cpu_allocation_ratio: 8.0 }]);
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;

    // logs: the boot lines, from the serial console history.
    wait_for_log_line(&env, "web", "vmlet-guest: booted").await;
    let full = env.kubectl(&["logs", "web"]);
    assert!(full.contains("Linux version"), "kernel boot lines missing:\n{full}");

    // exec, over WebSocket (kubectl's default, passed through by the API server
    // because the Node declares ExtendWebSocketsToKubelet) and over SPDY end to
    // end; vmlet's log names the transport that reached it.
    let release = read(&guest, "kernel-release");
    let sessions = |transport: &str| {
        let log = std::fs::read_to_string(env.dir.join("vmlet.log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("stream session") && l.contains(&format!("stream.transport=\"{transport}\"")))
            .count()
    };
    for (vars, transport) in [(&[][..], "websocket"), (&[("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false")][..], "spdy")] {
        let before = sessions(transport);
        let out = env
            .wait_for("the guest agent to answer exec", || {
                let out = kubectl_env(&env, vars, &["exec", "web", "--", "uname", "-r"]);
                async move { out.status.success().then_some(out) }
            })
            .await;
        assert_eq!(stdout(&out).trim(), release, "exec with {vars:?}");
        let out = kubectl_env(&env, vars, &["exec", "web", "--", "sh", "-c", "echo to-stderr >&2; exit 3"]);
        assert_eq!(out.status.code(), Some(3), "exit code with {vars:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("to-stderr"), "{vars:?}");
        assert!(sessions(transport) >= before + 2, "the execs with {vars:?} did not arrive over {transport}");
    }

    // logs --tail, --timestamps, --limit-bytes.
    let all: Vec<String> = env.kubectl(&["logs", "web"]).lines().map(str::to_owned).collect();
    let tail = env.kubectl(&["logs", "web", "--tail=5"]);
    let tail: Vec<&str> = tail.lines().collect();
    // The guest is quiet between these two reads: the tail is the last 5 lines.
    assert_eq!(tail, all[all.len() - 5..].iter().map(String::as_str).collect::<Vec<_>>());
    let stamped = env.kubectl(&["logs", "web", "--timestamps", "--tail=3"]);
    for line in stamped.lines() {
        let stamp = line.split(' ').next().unwrap();
        assert!(stamp.parse::<k8s_openapi::jiff::Timestamp>().is_ok(), "not a timestamp: {line}");
    }
    let limited = env.kubectl(&["logs", "web", "--limit-bytes=10"]);
    assert_eq!(limited.len(), 10, "{limited:?}");

    // logs -f shows a line the guest writes afterwards.
    let cluster = common::cluster();
    let mut follow = Command::new(cluster.bin.join("kubectl"))
        .env("KUBECONFIG", &cluster.kubeconfig)
        .args(["-n", &env.ns, "logs", "-f", "web"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let marker = format!("vmlet-follow-{}", std::process::id());
    env.kubectl(&["exec", "web", "--", "sh", "-c", &format!("echo {marker} > /dev/console")]);
    let follow_out = follow.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(follow_out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    env.wait_for("`kubectl logs -f` to show the new line", || {
        let seen = rx.try_iter().any(|l| l.contains(&marker));
        async move { seen.then_some(()) }
    })
    .await;
    let _ = follow.kill();
    let _ = follow.wait();

    // logs --since: the boot line is older than 10 s, the marker is not (written
    // again now).
    let boot_time = {
        let stamped = env.kubectl(&["logs", "web", "--timestamps"]);
        let line = stamped.lines().find(|l| l.contains("vmlet-guest: booted")).unwrap().to_owned();
        line.split(' ').next().unwrap().parse::<k8s_openapi::jiff::Timestamp>().unwrap()
    };
    env.wait_for("the boot line to be older than 10 s", || {
        let old = k8s_openapi::jiff::Timestamp::now().duration_since(boot_time).as_secs() > 11;
        async move { old.then_some(()) }
    })
    .await;
    let recent = format!("vmlet-recent-{}", std::process::id());
    env.kubectl(&["exec", "web", "--", "sh", "-c", &format!("echo {recent} > /dev/console")]);
    wait_for_log_line(&env, "web", &recent).await;
    let since = env.kubectl(&["logs", "web", "--since=10s"]);
    assert!(since.contains(&recent) && !since.contains("vmlet-guest: booted"), "{since}");

    // attach -it, driven through tmux: type into the serial shell, read the answer.
    let session = format!("vmlet-{}", env.ns);
    let attach = format!(
        "KUBECONFIG={} {} -n {} attach -it web",
        cluster.kubeconfig.display(),
        cluster.bin.join("kubectl").display(),
        env.ns
    );
    assert!(Command::new("tmux")
        .args(["new-session", "-d", "-s", &session, "-x", "200", "-y", "50", &attach])
        .status()
        .unwrap()
        .success());
    let pane = || {
        String::from_utf8_lossy(
            &Command::new("tmux").args(["capture-pane", "-p", "-t", &session]).output().unwrap().stdout,
        )
        .into_owned()
    };
    env.wait_for("kubectl attach to connect", || {
        let _ = Command::new("tmux").args(["send-keys", "-t", &session, "", "Enter"]).status();
        let ready = pane().contains("vmlet-guest#");
        async move { ready.then_some(()) }
    })
    .await;
    Command::new("tmux").args(["send-keys", "-t", &session, "echo vmlet-attach-$((6*7))", "Enter"]).status().unwrap();
    env.wait_for("the attached shell to answer", || {
        let answered = pane().contains("vmlet-attach-42");
        async move { answered.then_some(()) }
    })
    .await;
    Command::new("tmux").args(["kill-session", "-t", &session]).status().unwrap();

    // 100 exec and attach cycles leave no task, fd or console lock behind.
    let pid = env.vmlet_pid();
    let cycle = |env: &TestEnv| {
        let out = env.kubectl_output(&["exec", "web", "--", "true"]);
        assert!(out.status.success(), "exec: {}", String::from_utf8_lossy(&out.stderr));
        let mut child = Command::new(cluster.bin.join("kubectl"))
            .env("KUBECONFIG", &cluster.kubeconfig)
            .args(["-n", &env.ns, "attach", "-i", "web"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"true\n").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "attach: {}", String::from_utf8_lossy(&out.stderr));
    };
    cycle(&env); // warm up: connections and worker threads
    let (fds, tasks) = (open_fds(pid), threads(pid));
    for _ in 0..100 {
        cycle(&env);
    }
    env.wait_for("vmlet's fds and threads to settle back", || {
        let settled = open_fds(pid) <= fds + 2 && threads(pid) <= tasks + 2;
        async move { settled.then_some(()) }
    })
    .await;
    cycle(&env); // the console is free again
}

#[tokio::test]
async fn a_test_driver_vm_answers_logs_and_exec_with_what_its_backend_lacks() {
    let mut env = TestEnv::new("noconsole").await;
    env.start_vmlet(&[Host::new("a", test_driver_uri("host-a.xml"))]);
    env.apply_vm("web", json!({}));
    env.wait_vm_phase("web", "Running").await;

    let exec = env.kubectl_output(&["exec", "web", "--", "uname", "-r"]);
    let stderr = String::from_utf8_lossy(&exec.stderr);
    assert!(!exec.status.success());
    assert!(stderr.contains("agent") || stderr.contains("exec"), "exec error does not say what is missing: {stderr}");
    assert!(stderr.contains("not supported") || stderr.contains("no "), "{stderr}");

    let logs = env.kubectl_output(&["logs", "web"]);
    let stderr = String::from_utf8_lossy(&logs.stderr);
    assert!(!logs.status.success(), "logs of a console-less VM succeeded: {}", stdout(&logs));
    assert!(stderr.contains("console"), "logs error does not name the console: {stderr}");

    let attach = env.kubectl_output(&["attach", "web"]);
    assert!(!attach.status.success());
    assert!(String::from_utf8_lossy(&attach.stderr).contains("console"), "{}", String::from_utf8_lossy(&attach.stderr));
}
