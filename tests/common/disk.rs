//! The test guest's disk and the Jobs that act on it: markers written to and
//! read from the disk's first sector through `kubectl exec`, domain states,
//! Job conditions.

use super::deadline::{output_within, VIRSH};
use super::{qemu_uri, TestEnv};
use futures::FutureExt as _;
use k8s_openapi::api::batch::v1::Job;
use kube::api::Api;
use std::process::Command;
use vmlet::v1alpha1::{OperationPhase, VirtualMachineBackup, VirtualMachineRestore, VirtualMachineRestoreStatus};

/// Write `marker` to the first sector of the guest's disk of `pod`, flushed.
pub async fn write_marker(env: &TestEnv, pod: &str, marker: &str) {
    let script = r#"printf '%s\n' "$1" | dd of=/dev/vda bs=512 count=1 conv=sync,fsync 2>/dev/null && sync"#;
    // The last failed attempt's output, shown if the wait times out (a
    // guest that never answers and a write that fails look alike otherwise).
    let last = std::sync::Mutex::new(String::new());
    let attempts = async {
        env.wait_for(&format!("the guest of {pod} to write {marker}"), || {
            let out = env.kubectl_output(&["exec", pod, "--", "sh", "-c", script, "sh", marker]);
            if !out.status.success() {
                *last.lock().unwrap() = format!(
                    "{}: {}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            async move { out.status.success().then_some(()) }
        })
        .await
    };
    if std::panic::AssertUnwindSafe(attempts).catch_unwind().await.is_err() {
        panic!("the guest of {pod} did not write {marker}; the last kubectl exec said: {}", last.lock().unwrap());
    }
}

/// Write `mib` MiB of random data to the guest's disk of `pod` from its
/// second MiB on (past the marker's sector), flushed.
pub async fn fill_random(env: &TestEnv, pod: &str, mib: u32) {
    let fill = format!("dd if=/dev/urandom of=/dev/vda bs=1M seek=1 count={mib} conv=fsync 2>/dev/null");
    env.wait_for(&format!("the guest of {pod} to fill {mib} MiB of its disk"), || {
        let out = env.kubectl_output(&["exec", pod, "--", "sh", "-c", &fill]);
        async move { out.status.success().then_some(()) }
    })
    .await;
}

/// The first sector of the guest's disk of `pod`, as text.
pub async fn read_marker(env: &TestEnv, pod: &str) -> String {
    env.wait_for(&format!("the guest of {pod} to read its disk"), || {
        let out = env.kubectl_output(&[
            "exec",
            pod,
            "--",
            "sh",
            "-c",
            "dd if=/dev/vda bs=512 count=1 2>/dev/null | head -n 1",
        ]);
        async move { out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()) }
    })
    .await
}

/// Wait until backup `name` has ended (Succeeded or Failed); returns it.
pub async fn wait_backup_ended(env: &TestEnv, name: &str) -> VirtualMachineBackup {
    let backups: Api<VirtualMachineBackup> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for(&format!("VirtualMachineBackup {name} to end"), || {
        let backups = backups.clone();
        async move {
            let backup = backups.get_opt(name).await.ok()??;
            let phase = backup.status.as_ref()?.phase?;
            matches!(phase, OperationPhase::Succeeded | OperationPhase::Failed).then_some(backup)
        }
    })
    .await
}

/// Wait until restore `name` has ended (Succeeded or Failed); returns its
/// status.
pub async fn wait_restore_ended(env: &TestEnv, name: &str) -> VirtualMachineRestoreStatus {
    let restores: Api<VirtualMachineRestore> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for(&format!("VirtualMachineRestore {name} to end"), || {
        let restores = restores.clone();
        async move {
            let status = restores.get_opt(name).await.ok()??.status?;
            matches!(status.phase?, OperationPhase::Succeeded | OperationPhase::Failed).then_some(status)
        }
    })
    .await
}

/// Wait until Job `name` has condition `type_` (`Complete`, `Failed`).
pub async fn wait_job_condition(env: &TestEnv, name: &str, type_: &str) -> Job {
    let jobs: Api<Job> = Api::namespaced(env.client.clone(), &env.ns);
    env.wait_for(&format!("Job {name} condition {type_}"), || {
        let jobs = jobs.clone();
        async move {
            let job = jobs.get_opt(name).await.ok()??;
            let done = job.status.as_ref()?.conditions.as_ref()?.iter().any(|c| c.type_ == type_ && c.status == "True");
            done.then_some(job)
        }
    })
    .await
}

/// The state of VM `vm`'s domain (`virsh domstate`).
pub fn domstate(env: &TestEnv, vm: &str) -> String {
    let out = output_within(
        Command::new("virsh").arg("-c").arg(qemu_uri()).args(["domstate", &format!("{}_{vm}", env.ns)]),
        VIRSH,
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
