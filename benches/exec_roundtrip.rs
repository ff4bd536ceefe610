//! Exec latency and throughput on a real qemu guest: `cargo bench --bench
//! exec_roundtrip` (run it through hack/test.sh's environment: the control plane
//! and libvirtd must be up and VMLET_LIBVIRT_QEMU_URI set).
//!
//! Prints p50/p95 of
//! - an exec round trip through the API server (kube-rs client → kube-apiserver →
//!   vmlet's kubelet API → guest agent), `true` in the guest, and
//! - the same command as a direct guest-agent call through the libvirt provider,
//!
//! and the stdout throughput of one exec writing VMLET_BENCH_MB (default 1) MiB.
//! Figures only; nothing is asserted about speed.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/exec.rs"]
mod exec;

use common::{Host, TestEnv};
use exec::{exec_via_api, exec_via_api_timed, report};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams};
use std::time::Instant;
use vmlet_provider::{Provider, StreamIo, VmId};

async fn exec_direct(provider: &dyn Provider, id: &VmId, command: &[String]) -> Vec<u8> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    let collector = tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some(chunk) = rx.recv().await {
            out.extend(chunk);
        }
        out
    });
    let io = StreamIo { stdin: None, stdout: Some(tx), stderr: None, tty: false, resize: None };
    let exec = provider.guest_exec().expect("the qemu provider execs");
    let code = exec.exec(id, command, io).await.expect("direct guest exec");
    assert_eq!(code, 0);
    collector.await.unwrap()
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::var("VMLET_BENCH_EXECS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let mib: usize = std::env::var("VMLET_BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let uri = common::qemu_uri();

    let mut env = TestEnv::new("bench-exec").await;
    let guest = common::guest_for(&env);
    env.start_vmlet(&[Host {
        uri: uri.clone(),
        accelerator: Some(common::guest_accelerator(&guest)),
        ..Host::qemu("q")
    }]);
    env.apply_vm("web", common::guest_vm_spec(&guest));
    let vm = env.wait_vm_phase("web", "Running").await;
    let id = VmId(vm.metadata.uid.unwrap());
    // The VM's pod has a generated name (web-xxxxx).
    let pod = env.pod_of("web").await;
    let pods: Api<Pod> = env.pods();
    env.wait_for("the guest agent", || {
        let (pods, pod) = (pods.clone(), pod.clone());
        async move {
            let params = AttachParams::default().stdin(false).stdout(true).stderr(false);
            let mut process = pods.exec(&pod, ["true"], &params).await.ok()?;
            let status = process.take_status()?.await?;
            (status.status.as_deref() == Some("Success")).then_some(())
        }
    })
    .await;

    let accelerator = match common::guest_accelerator(&guest) {
        "kvm" => vmlet_libvirt::AcceleratorSetting::Kvm,
        _ => vmlet_libvirt::AcceleratorSetting::Tcg,
    };
    let provider = vmlet_libvirt::LibvirtProvider::connect_with(&uri, accelerator).await.unwrap();
    let mut via_api = Vec::with_capacity(runs);
    let mut direct = Vec::with_capacity(runs);
    let mut phases = Vec::with_capacity(runs);
    let t = vec!["true".to_owned()];
    for _ in 0..runs {
        let (_, steps) = exec_via_api_timed(&pods, &pod, &["true"]).await;
        via_api.push(steps.closed);
        phases.push(steps);
        let start = Instant::now();
        exec_direct(&provider, &id, &t).await;
        direct.push(start.elapsed());
    }
    println!("exec round trip, `true` in the guest ({runs} runs each):");
    report("  kubectl-style exec via the API server", via_api);
    report("  direct guest-agent call (provider)", direct);
    println!("  where the exec via the API server spends its time (ms from the call, each step's p50):");
    report("    upgrade answered", phases.iter().map(|p| p.upgraded).collect());
    report("    stdout closed", phases.iter().map(|p| p.output).collect());
    report("    status read", phases.iter().map(|p| p.status).collect());
    report("    connection closed", phases.iter().map(|p| p.closed).collect());

    let bytes = mib * 1024 * 1024;
    let command = format!("head -c {bytes} /dev/zero");
    let start = Instant::now();
    let out = exec_via_api(&pods, &pod, &["sh", "-c", &command]).await;
    let elapsed = start.elapsed();
    assert_eq!(out.len(), bytes, "stdout came back whole");
    println!(
        "stdout throughput via the API server: {:.2} MB/s ({mib} MiB in {:.2} s)",
        bytes as f64 / 1e6 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    let start = Instant::now();
    let out = exec_direct(&provider, &id, &["sh".into(), "-c".into(), command]).await;
    let elapsed = start.elapsed();
    println!(
        "stdout throughput, direct guest agent:  {:.2} MB/s ({} bytes in {:.2} s)",
        out.len() as f64 / 1e6 / elapsed.as_secs_f64(),
        out.len(),
        elapsed.as_secs_f64()
    );
}
