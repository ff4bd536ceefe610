//! `kubectl logs`, `exec` and `attach` through the real API server to vmlet's
//! kubelet API, on a real qemu guest (test-vms/guest) under a real libvirtd, and
//! the clear refusal on a backend without a console or agent.

mod common;

use common::deadline::{self, kill_and_reap, output_within, run_with_stdin, KUBECTL, TMUX};
use common::{guest_accelerator, guest_for, guest_vm_spec, test_driver_uri, Host, TestEnv};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

/// The guest's last boot line.
const BOOTED: &str = "vmlet-guest: booted";

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap().trim().to_owned()
}

/// kubectl with an extra environment (e.g. SPDY instead of WebSocket).
fn kubectl_env(env: &TestEnv, vars: &[(&str, &str)], args: &[&str]) -> Output {
    output_within(env.kubectl_command().envs(vars.iter().copied()).args(args), KUBECTL)
}

/// Have the guest print `line` on its serial console, on a line of its own
/// (whatever the console showed before, e.g. an unanswered prompt).
fn print_on_console(env: &TestEnv, pod: &str, line: &str) {
    env.kubectl(&["exec", pod, "--", "sh", "-c", r#"printf '\n%s\n' "$1" > /dev/console"#, "sh", line]);
}

/// The timestamp of the first line of `stamped` (`kubectl logs --timestamps`)
/// that contains `needle`.
fn stamp_of(stamped: &str, needle: &str) -> Timestamp {
    let line = stamped.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("no {needle:?} in:\n{stamped}"));
    line.split(' ').next().unwrap().parse().unwrap_or_else(|e| panic!("not a timestamp: {line}: {e}"))
}

/// Check that `tail`, the output of `kubectl logs --tail=<n>`, is `n`
/// consecutive lines of `later`, a full read taken after it, ending at or after
/// the last line that contains `marker` (which was in the log before the tail
/// was read). The guest may print more at any time, so the tail need not end
/// at the marker: it is a window of the log that ends at or before the newest
/// line.
fn assert_tail_window(later: &str, tail: &str, n: usize, marker: &str) {
    let log: Vec<&str> = later.lines().collect();
    let tail: Vec<&str> = tail.lines().collect();
    let marker_at = log.iter().rposition(|l| l.contains(marker)).unwrap_or_else(|| panic!("no {marker:?} in the log"));
    assert_eq!(tail.len(), n, "--tail={n} gave {} lines:\n{}", tail.len(), tail.join("\n"));
    let window = log.windows(n).enumerate().any(|(start, lines)| lines == tail.as_slice() && start + n > marker_at);
    assert!(
        window,
        "--tail={n} is not {n} consecutive lines of the log ending at or after {marker:?}\n--- tail:\n{}\n--- log from {n} \
         lines before the marker on:\n{}",
        tail.join("\n"),
        log[marker_at.saturating_sub(n)..].iter().take(50).copied().collect::<Vec<_>>().join("\n")
    );
}

/// A long-running child (`kubectl logs -f`), killed and reaped when dropped,
/// also when the test fails.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if kill_and_reap(&mut self.0, KUBECTL).is_none() {
            eprintln!("pid {} still not reaped {KUBECTL:?} after SIGKILL", self.0.id());
        }
    }
}

/// `tmux <args>`, within [`TMUX`].
fn tmux(args: &[&str]) -> Output {
    output_within(Command::new("tmux").args(args), TMUX)
}

/// A tmux session, killed when dropped (also when the test fails), which ends
/// the command running in it.
struct TmuxSession(String);

impl Drop for TmuxSession {
    fn drop(&mut self) {
        if let Err(timed_out) = deadline::run(Command::new("tmux").args(["kill-session", "-t", &self.0]), TMUX) {
            eprintln!("{timed_out}");
        }
    }
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
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;

    // logs: the boot lines, from the serial console history.
    wait_for_log_line(&env, &pod, BOOTED).await;
    let full = env.kubectl(&["logs", &pod]);
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
                let out = kubectl_env(&env, vars, &["exec", &pod, "--", "uname", "-r"]);
                async move { out.status.success().then_some(out) }
            })
            .await;
        assert_eq!(stdout(&out).trim(), release, "exec with {vars:?}");
        let out = kubectl_env(&env, vars, &["exec", &pod, "--", "sh", "-c", "echo to-stderr >&2; exit 3"]);
        assert_eq!(out.status.code(), Some(3), "exit code with {vars:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("to-stderr"), "{vars:?}");
        assert!(sessions(transport) >= before + 2, "the execs with {vars:?} did not arrive over {transport}");
    }

    // logs --tail: the last lines at the time of the request. The guest (its
    // kernel) may print at any moment, so nothing here assumes it is quiet: the
    // test prints a marker line, waits until the log has it, reads the tails,
    // then the whole log; each tail must be consecutive lines of that later
    // read ending at or after the marker (exactly at it while the guest is
    // quiet).
    let tail_marker = format!("vmlet-tail-{}", env.ns);
    print_on_console(&env, &pod, &tail_marker);
    wait_for_log_line(&env, &pod, &tail_marker).await;
    let tail5 = env.kubectl(&["logs", &pod, "--tail=5"]);
    let tail1 = env.kubectl(&["logs", &pod, "--tail=1"]);
    let later = env.kubectl(&["logs", &pod]);
    assert_tail_window(&later, &tail5, 5, &tail_marker);
    assert_tail_window(&later, &tail1, 1, &tail_marker);

    // logs --timestamps, --limit-bytes.
    let stamped = env.kubectl(&["logs", &pod, "--timestamps", "--tail=3"]);
    for line in stamped.lines() {
        let stamp = line.split(' ').next().unwrap();
        assert!(stamp.parse::<Timestamp>().is_ok(), "not a timestamp: {line}");
    }
    let limited = env.kubectl(&["logs", &pod, "--limit-bytes=10"]);
    assert_eq!(limited.len(), 10, "{limited:?}");

    // logs -f shows a line the guest writes afterwards: once it has shown the
    // history (so it is connected and following), the guest prints a marker.
    let cluster = common::cluster();
    let mut follow =
        KillOnDrop(env.kubectl_command().args(["logs", "-f", &pod]).stdout(Stdio::piped()).spawn().expect("kubectl"));
    let follow_out = follow.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(follow_out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    env.wait_for("`kubectl logs -f` to show the history", || {
        let seen = rx.try_iter().any(|l| l.contains(BOOTED));
        async move { seen.then_some(()) }
    })
    .await;
    let marker = format!("vmlet-follow-{}", env.ns);
    print_on_console(&env, &pod, &marker);
    env.wait_for("`kubectl logs -f` to show the new line", || {
        let seen = rx.try_iter().any(|l| l.contains(&marker));
        async move { seen.then_some(()) }
    })
    .await;
    drop(follow);

    // logs --since=<N>s: records stamped in the last N seconds only; the boot
    // line is left out, a line printed later is in. N is not fixed: a fixed N
    // would race the clock (the later line must still be younger than N when
    // vmlet answers). Each try takes N from the lines' own timestamps and
    // counts only if it tells: the request ended within N of the later line,
    // and the boot line was older than N when it started.
    let boot_time = stamp_of(&env.kubectl(&["logs", &pod, "--timestamps"]), BOOTED);
    env.wait_for("the boot line to be older than 11 s", || {
        let old = Timestamp::now().duration_since(boot_time).as_secs() > 11;
        async move { old.then_some(()) }
    })
    .await;
    let recent = format!("vmlet-recent-{}", env.ns);
    print_on_console(&env, &pod, &recent);
    wait_for_log_line(&env, &pod, &recent).await;
    let recent_time = stamp_of(&env.kubectl(&["logs", &pod, "--timestamps"]), &recent);
    let since = env
        .wait_for("a `kubectl logs --since` that answers within its window", || {
            let asked = Timestamp::now();
            // At least 5 s of room after the later line; the boot line is more
            // than 11 s older than it, so outside.
            let seconds = asked.duration_since(recent_time).as_secs().max(0) + 6;
            let since = env.kubectl(&["logs", &pod, &format!("--since={seconds}s")]);
            let answered = Timestamp::now();
            let tells = answered.duration_since(recent_time).as_secs_f64() <= seconds as f64
                && asked.duration_since(boot_time).as_secs_f64() > seconds as f64;
            async move { tells.then_some(since) }
        })
        .await;
    assert!(since.contains(&recent) && !since.contains(BOOTED), "{since}");

    // attach -it, driven through tmux: type into the serial shell, read the answer.
    // Every tmux call has its deadline; kubectl attach runs until the session
    // is killed (when `session` is dropped, also on failure), and every wait
    // on it is a bounded `wait_for`.
    let session = TmuxSession(format!("vmlet-{}", env.ns));
    let attach = format!(
        "KUBECONFIG={} {} -n {} attach -it {pod}",
        cluster.kubeconfig.display(),
        cluster.bin.join("kubectl").display(),
        env.ns
    );
    let started = tmux(&["new-session", "-d", "-s", &session.0, "-x", "200", "-y", "50", &attach]);
    assert!(started.status.success(), "tmux new-session: {}", String::from_utf8_lossy(&started.stderr));
    let pane = || String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session.0]).stdout).into_owned();
    env.wait_for("kubectl attach to connect", || {
        tmux(&["send-keys", "-t", &session.0, "", "Enter"]);
        let ready = pane().contains("vmlet-guest#");
        async move { ready.then_some(()) }
    })
    .await;
    let typed = tmux(&["send-keys", "-t", &session.0, "echo vmlet-attach-$((6*7))", "Enter"]);
    assert!(typed.status.success(), "tmux send-keys: {}", String::from_utf8_lossy(&typed.stderr));
    env.wait_for("the attached shell to answer", || {
        let answered = pane().contains("vmlet-attach-42");
        async move { answered.then_some(()) }
    })
    .await;
    drop(session);

    // 100 exec and attach cycles leave no task, fd or console lock behind.
    // Each `kubectl attach -i` gets its line, then end of input, and has
    // [`KUBECTL`] to finish.
    let pid = env.vmlet_pid();
    let attach_once = |env: &TestEnv| {
        run_with_stdin(env.kubectl_command().args(["attach", "-i", &pod]), b"true\n", KUBECTL)
            .unwrap_or_else(|timed_out| panic!("{timed_out}"))
    };
    let cycle = |env: &TestEnv| {
        let out = env.kubectl_output(&["exec", &pod, "--", "true"]);
        assert!(out.status.success(), "exec: {}", String::from_utf8_lossy(&out.stderr));
        let out = attach_once(env);
        assert!(out.status.success(), "attach: {}", String::from_utf8_lossy(&out.stderr));
    };
    // The tmux client was killed, not detached: vmlet frees the console once
    // it notices the connection is gone, at a moment the test does not
    // control. Wait for that instead of assuming it. (A client that ends its
    // input, as each cycle's does, is answered only after the console is
    // free, so the cycles need no such wait.)
    env.wait_for("the console to be free again after the tmux client was killed", || {
        let free = attach_once(&env).status.success();
        async move { free.then_some(()) }
    })
    .await;
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
    let pod = env.pod_of("web").await;

    let exec = env.kubectl_output(&["exec", &pod, "--", "uname", "-r"]);
    let stderr = String::from_utf8_lossy(&exec.stderr);
    assert!(!exec.status.success());
    assert!(stderr.contains("agent") || stderr.contains("exec"), "exec error does not say what is missing: {stderr}");
    assert!(stderr.contains("not supported") || stderr.contains("no "), "{stderr}");

    let logs = env.kubectl_output(&["logs", &pod]);
    let stderr = String::from_utf8_lossy(&logs.stderr);
    assert!(!logs.status.success(), "logs of a console-less VM succeeded: {}", stdout(&logs));
    assert!(stderr.contains("console"), "logs error does not name the console: {stderr}");

    let attach = env.kubectl_output(&["attach", &pod]);
    assert!(!attach.status.success());
    assert!(String::from_utf8_lossy(&attach.stderr).contains("console"), "{}", String::from_utf8_lossy(&attach.stderr));
}

#[tokio::test]
async fn attach_sessions_whose_stdin_closes_at_once_all_return_and_a_hung_one_hits_its_deadline() {
    const CYCLES: usize = 500;
    let mut env = TestEnv::new("attach").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.apply_vm("web", guest_vm_spec(&guest));
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    wait_for_log_line(&env, &pod, BOOTED).await;

    // `kubectl attach -i` whose stdin is empty: it closes at once, often
    // before vmlet has the console open. Half over WebSocket (kubectl's
    // default), half over SPDY. Each must return, successfully, within its
    // deadline; one that stayed attached would time out and fail here.
    let attach = |env: &TestEnv, spdy: bool| {
        let mut cmd = env.kubectl_command();
        if spdy {
            cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
        }
        let out = run_with_stdin(cmd.args(["attach", "-i", &pod]), b"", KUBECTL)
            .unwrap_or_else(|timed_out| panic!("{timed_out}"));
        assert!(out.status.success(), "attach (spdy: {spdy}): {}", String::from_utf8_lossy(&out.stderr));
    };
    attach(&env, false); // warm up: connections and worker threads
    attach(&env, true);
    let pid = env.vmlet_pid();
    let (fds, tasks) = (open_fds(pid), threads(pid));
    for i in 0..CYCLES {
        attach(&env, i % 2 == 1);
    }
    env.wait_for("vmlet's fds and threads to settle back", || {
        let settled = open_fds(pid) <= fds + 2 && threads(pid) <= tasks + 2;
        async move { settled.then_some(()) }
    })
    .await;

    // A session that never ends on its own (stdin open, console alive) is a
    // hang the deadline catches: it is killed within its deadline.
    let hang = std::time::Duration::from_secs(5);
    let mut hung = env
        .kubectl_command()
        .args(["attach", "-i", &pod])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl");
    let stdin = hung.stdin.take();
    assert_eq!(deadline::wait_within(&mut hung, hang), None, "an attach with open stdin returned on its own");
    assert!(kill_and_reap(&mut hung, KUBECTL).is_some(), "the hung kubectl was not reaped");
    drop(stdin);
    // Its session ends with the client's connection; then the console is free.
    env.wait_for("the console to be free after the hung client was killed", || {
        let out = run_with_stdin(env.kubectl_command().args(["attach", "-i", &pod]), b"", KUBECTL);
        let free = out.is_ok_and(|out| out.status.success());
        async move { free.then_some(()) }
    })
    .await;
}

/// A tenant whose ServiceAccount may only manage pods (and exec, attach and
/// logs) in its own namespace copies another namespace's VM pod: spec, node,
/// labels and annotations. Through the API (not only kubectl),
/// exec, attach and logs on the copy are refused, nothing of the victim's
/// console reaches it, and deleting it leaves the victim's VM running.
#[tokio::test]
async fn a_tenant_copying_another_namespaces_vm_pod_reaches_nothing_of_that_vm() {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{AttachParams, DeleteParams, LogParams, PostParams};
    use kube::Api;

    let mut env = TestEnv::new("victim").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.apply_vm("web", guest_vm_spec(&guest));
    let vm = env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    wait_for_log_line(&env, &pod, BOOTED).await;
    let domain_uuid = vm.status.as_ref().and_then(|s| s.provider_id.clone()).expect("providerID");

    // The attacker: a namespace of its own and a ServiceAccount limited to it.
    let attacker = format!("{}-attacker", env.ns);
    let rules = serde_json::json!([{"apiGroups": [""], "resources": ["pods", "pods/exec", "pods/log", "pods/attach"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]);
    let common::tenant::Tenant { client: tenant, token, .. } = common::tenant::tenant(&env, &attacker, rules).await;
    let tenant_pods: Api<Pod> = Api::namespaced(tenant.clone(), &attacker);

    // The copy: the victim pod's spec (with its node), labels and annotations.
    // (A copy of its ownerReference too is deleted by the garbage collector
    // within moments, as its owner is not in the copy's namespace; the unit
    // tests of crate::identity cover that case.)
    let victim = env.pods().get(&pod).await.unwrap();
    let mut copy: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "innocent", "namespace": attacker},
        "spec": victim.spec.clone().unwrap(),
    }))
    .unwrap();
    copy.metadata.labels = victim.metadata.labels.clone();
    copy.metadata.annotations = victim.metadata.annotations.clone();
    tenant_pods.create(&PostParams::default(), &copy).await.expect("the tenant may create pods in its namespace");
    let pods = tenant_pods.clone();
    let reason = env.wait_pod_failed(&pods, "innocent").await;
    assert_eq!(reason.as_deref(), Some("NotAVirtualMachine"));

    // exec through the API, as the tenant: refused, no output.
    let exec = tenant_pods
        .exec("innocent", ["cat", "/proc/version"], &AttachParams::default().container("vm").stderr(true))
        .await;
    match exec {
        Err(e) => assert!(e.to_string().contains("403") || e.to_string().contains("Forbidden"), "exec error: {e}"),
        Ok(mut process) => {
            let mut out = String::new();
            if let Some(mut stdout) = process.stdout() {
                use tokio::io::AsyncReadExt;
                let _ = tokio::time::timeout(KUBECTL, stdout.read_to_string(&mut out)).await;
            }
            panic!("exec on the copy was accepted; it printed {out:?}");
        }
    }
    // attach through the API: refused.
    let attach = tenant_pods.attach("innocent", &AttachParams::default().container("vm").stdin(true)).await;
    assert!(attach.is_err(), "attach on the copy was accepted");
    // logs through the API: refused, and nothing of the victim's console.
    let text =
        match tenant_pods.logs("innocent", &LogParams { container: Some("vm".into()), ..Default::default() }).await {
            Ok(text) => text,
            Err(e) => e.to_string(),
        };
    assert!(
        !text.contains(BOOTED) && !text.contains("Linux version"),
        "the victim's console reached the tenant: {text}"
    );
    // kubectl as the tenant says the same.
    let kubectl_logs = output_within(
        Command::new(common::cluster().bin.join("kubectl"))
            .args(["--kubeconfig", "/dev/null", "--server"])
            .arg(kube_server(&env))
            .args(["--certificate-authority"])
            .arg(common::cluster().kubeconfig.parent().unwrap().join("pki/ca.crt"))
            .args(["--token", &token, "-n", &attacker, "logs", "innocent"]),
        KUBECTL,
    );
    assert!(!kubectl_logs.status.success(), "kubectl logs as the tenant succeeded: {}", stdout(&kubectl_logs));
    assert!(!stdout(&kubectl_logs).contains(BOOTED));
    // Nothing of the victim's console was recorded for the copy.
    let copied = walk(&env.dir.join("state")).into_iter().filter(|p| p.to_string_lossy().contains(&attacker)).count();
    assert_eq!(copied, 0, "console history was recorded for the attacker's pod");

    // Deleting the copy changes nothing of the victim's VM.
    tenant_pods.delete("innocent", &DeleteParams::default()).await.expect("the tenant may delete its pod");
    env.wait_for("the copy to be gone", || {
        let pods = pods.clone();
        async move { pods.get_opt("innocent").await.ok()?.is_none().then_some(()) }
    })
    .await;
    let vm = env.wait_vm_phase("web", "Running").await;
    assert_eq!(vm.status.and_then(|s| s.provider_id), Some(domain_uuid), "the same domain runs");
    let pod = env.pods().get(&pod).await.unwrap();
    let container = &pod.status.unwrap().container_statuses.unwrap()[0];
    assert_eq!(container.restart_count, 0, "the victim's VM was not powered off");
    let _ = env.kubectl_output(&["delete", "namespace", &attacker, "--wait=false"]);
}

/// The API server's URL, from the kubeconfig.
fn kube_server(_env: &TestEnv) -> String {
    let kubeconfig = kube::config::Kubeconfig::read_from(&common::cluster().kubeconfig).expect("read kubeconfig");
    kubeconfig.clusters[0].cluster.as_ref().and_then(|c| c.server.clone()).expect("server")
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// `virsh -c qemu:///system <args>`: (success, trimmed stdout).
fn virsh(args: &[&str]) -> (bool, String) {
    let out =
        output_within(Command::new("virsh").arg("-c").arg(common::qemu_uri()).args(args), common::deadline::VIRSH);
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `restartPolicy: OnFailure`, on a real guest: `poweroff` in the guest leaves
/// the VM off (phase Stopped, reason GuestPoweredOff, `spec.replicas` still 1,
/// an Event saying how to start it); a scale to 0 and back to 1 starts it; a
/// `virsh destroy` from the host counts as a failure and the VM is started
/// again by itself; a `virsh shutdown` (ACPI) leaves it off again.
#[tokio::test]
async fn on_failure_leaves_a_guest_that_powered_off_off_and_restarts_a_destroyed_one() {
    let mut env = TestEnv::new("onfailure").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    let mut spec = guest_vm_spec(&guest);
    spec["restartPolicy"] = json!("OnFailure");
    env.apply_vm("web", spec);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    wait_for_log_line(&env, &pod, BOOTED).await;
    let domain = format!("{}_web", env.ns);

    // The guest powers itself off (the exec may end with the guest). Asked
    // again while the VM still runs: right after boot its guest agent may
    // not answer yet (a slow, emulated CI guest), and the exec then fails.
    let vms = env.vms();
    let polls = std::sync::atomic::AtomicU32::new(0);
    let vm = env
        .wait_for("the VM to be Stopped after poweroff in the guest", || {
            let vms = vms.clone();
            // Every 20th poll (about 5 s apart).
            let ask = polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed).is_multiple_of(20);
            let env = &env;
            let pod = pod.clone();
            async move {
                let vm = vms.get("web").await.ok()?;
                if vm.status.as_ref().and_then(|s| s.phase) == Some(vmlet::v1alpha1::VmPhase::Stopped) {
                    return Some(vm);
                }
                if ask {
                    let _ = env.kubectl_output(&["exec", &pod, "--", "poweroff", "-f"]);
                }
                None
            }
        })
        .await;
    assert_eq!(vm.spec.replicas, 1, "vmlet never writes the spec");
    let status = vm.status.unwrap();
    assert_eq!(status.ready_replicas, 0);
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "GuestPoweredOff"));
    assert!(ready.message.contains("kubectl scale vm/web --replicas=0"), "{}", ready.message);
    assert_eq!(virsh(&["domstate", &domain]).1, "shut off", "left off");
    let ended = env.pods().get(&pod).await.unwrap().status.unwrap();
    assert_eq!((ended.phase.as_deref(), ended.reason.as_deref()), (Some("Succeeded"), Some("GuestPoweredOff")));
    let events = env.kubectl(&[
        "get",
        "events",
        "--field-selector",
        "reason=LeftOff",
        "-o",
        "jsonpath={.items[*].message}{.items[*].note}",
    ]);
    assert!(events.contains("--replicas=1"), "no LeftOff event saying how to start it: {events:?}");
    assert_eq!(env.pod_of("web").await, pod, "the ended pod is not replaced");

    // Scale to 0 and back to 1: it runs again.
    env.kubectl(&["scale", "vm/web", "--replicas=0"]);
    env.wait_vm_pods_gone("web").await;
    env.kubectl(&["scale", "vm/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    let pod = env.pod_of("web").await;
    assert_eq!(virsh(&["domstate", &domain]).1, "running");

    // Destroyed from the host: a failure, so OnFailure starts it again.
    let (_, before) = virsh(&["domid", &domain]);
    assert!(virsh(&["destroy", &domain]).0, "virsh destroy {domain}");
    let pods = env.pods();
    let restarted = env
        .wait_for("the destroyed VM to run again", || {
            let pods = pods.clone();
            let pod = pod.clone();
            let before = before.clone();
            let domain = domain.clone();
            async move {
                let status = pods.get(&pod).await.ok()?.status?;
                let container = status.container_statuses?.into_iter().next()?;
                let running = container.state.as_ref()?.running.is_some() && container.restart_count == 1;
                let (ok, now) = virsh(&["domid", &domain]);
                (running && ok && now != before && now != "-").then_some(container)
            }
        })
        .await;
    let last = restarted.last_state.and_then(|s| s.terminated).expect("the destroyed run, as last state");
    assert_eq!(last.reason.as_deref(), Some("PoweredOff"));
    env.wait_vm_phase("web", "Running").await;

    // `virsh shutdown` from the host (ACPI, which the guest honours) is the
    // guest powering itself off too: left off. Asked again while the guest
    // may still be booting (a press before its handler runs is lost).
    let vms = env.vms();
    let polls = std::sync::atomic::AtomicU32::new(0);
    let vm = env
        .wait_for("the VM to be left off after virsh shutdown", || {
            let (vms, domain) = (vms.clone(), domain.clone());
            // Every 20th poll (about 5 s apart).
            let ask = polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed).is_multiple_of(20);
            async move {
                let vm = vms.get("web").await.ok()?;
                let phase = vm.status.as_ref().and_then(|s| s.phase);
                if phase != Some(vmlet::v1alpha1::VmPhase::Stopped) {
                    if ask {
                        let _ = virsh(&["shutdown", &domain]);
                    }
                    return None;
                }
                Some(vm)
            }
        })
        .await;
    assert_eq!(vm.spec.replicas, 1);
    let ready = vm.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.reason, "GuestPoweredOff", "an ACPI shutdown is the guest's own power-off");
    assert_eq!(virsh(&["domstate", &domain]).1, "shut off");
}

/// A guest whose agent hangs delays only its own VM's exec: with two
/// `kubectl exec` into it waiting on its agent (libvirt waits 30 s per agent
/// call), an exec into another VM of the same host answers while both still
/// wait (the host has two agent-call permits, and a VM takes at most one).
#[tokio::test]
async fn a_hung_guest_agent_delays_only_its_own_vms_exec() {
    let mut env = TestEnv::new("agentfair").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[Host { accelerator: Some(guest_accelerator(&guest)), ..Host::qemu("q") }]);
    env.apply_vm("stuck", guest_vm_spec(&guest));
    // A disk of its own: QEMU locks the one it writes.
    std::fs::copy(guest.join("disk.qcow2"), guest.join("fine.qcow2")).unwrap();
    let mut fine_spec = guest_vm_spec(&guest);
    fine_spec["image"] = json!(guest.join("fine.qcow2"));
    env.apply_vm("fine", fine_spec);
    env.wait_vm_phase("stuck", "Running").await;
    env.wait_vm_phase("fine", "Running").await;
    let (stuck, fine) = (env.pod_of("stuck").await, env.pod_of("fine").await);
    wait_for_log_line(&env, &stuck, BOOTED).await;
    wait_for_log_line(&env, &fine, BOOTED).await;

    // Stop the stuck guest's agent, as a hung one.
    let stop_agent = "(sleep 1; killall -STOP qemu-ga) >/dev/null 2>&1 &";
    assert!(env.kubectl_output(&["exec", &stuck, "--", "sh", "-c", stop_agent]).status.success());
    let domain = format!("{}_stuck", env.ns);
    env.wait_for("the stuck guest's agent to stop answering", || {
        let (answered, _) = virsh(&["qemu-agent-command", &domain, r#"{"execute":"guest-ping"}"#, "--timeout", "2"]);
        async move { (!answered).then_some(()) }
    })
    .await;

    // Two execs into it, each waiting on the agent in vmlet.
    let exec_stuck = || {
        KillOnDrop(env.kubectl_command().args(["exec", &stuck, "--", "true"]).stdout(Stdio::null()).spawn().unwrap())
    };
    let mut waiting = [exec_stuck(), exec_stuck()];
    env.wait_for("vmlet to have both execs into the stuck VM", || {
        let log = std::fs::read_to_string(env.dir.join("vmlet.log")).unwrap_or_default();
        let named = format!("pod.name={stuck} ");
        let execs = log.lines().filter(|l| l.contains("api::exec: exec ") && l.contains(&named)).count();
        async move { (execs >= 3).then_some(()) }
    })
    .await;

    let answered = env.kubectl_output(&["exec", &fine, "--", "echo", "fine"]);
    assert_eq!(stdout(&answered).trim(), "fine", "{}", String::from_utf8_lossy(&answered.stderr));
    for exec in &mut waiting {
        assert!(exec.0.try_wait().unwrap().is_none(), "the other VM's exec answered only after a stuck one ended");
    }
}
