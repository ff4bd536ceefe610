//! What libvirt really did, and what survives a vmlet restart, on a real libvirtd
//! (`qemu:///system`, started by `hack/test.sh`): checked with virsh.
//!
//! The guests have no disk: QEMU idles in the firmware, a real and cheap process.
//! It ignores ACPI shutdown, so stops run the TrySoft path: ask, wait
//! `shutdownTimeoutSeconds` (2 s here), destroy.

mod common;

use common::deadline::{output_within, VIRSH};
use common::{guest_accelerator, guest_for, qemu_uri, storage_root, Host, TestEnv};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use std::process::Command;

/// `virsh -c <uri> <args>`: (success, trimmed stdout); panics if it takes
/// longer than [`VIRSH`].
fn virsh(args: &[&str]) -> (bool, String) {
    let out = output_within(Command::new("virsh").arg("-c").arg(qemu_uri()).args(args), VIRSH);
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn domain(env: &TestEnv, vm: &str) -> String {
    format!("{}_{vm}", env.ns)
}

fn domstate(env: &TestEnv, vm: &str) -> String {
    let (ok, state) = virsh(&["domstate", &domain(env, vm)]);
    assert!(ok, "virsh domstate {} failed", domain(env, vm));
    state
}

/// Wait until VM `vm`'s pod `pod` shows one restart and runs, on a new run
/// of its domain (a domain id other than `before`).
async fn wait_restarted_once(env: &TestEnv, pods: &kube::Api<Pod>, pod: &str, vm: &str, before: &str) {
    let name = domain(env, vm);
    env.wait_for(&format!("VM {vm} to be started again"), || {
        let (pods, pod, before, name) = (pods.clone(), pod.to_owned(), before.to_owned(), name.clone());
        async move {
            let container = pods.get(&pod).await.ok()?.status?.container_statuses?.into_iter().next()?;
            let (ok, now) = virsh(&["domid", &name]);
            (container.restart_count == 1 && container.state?.running.is_some() && ok && now != before && now != "-")
                .then_some(())
        }
    })
    .await;
}

fn domuuid(env: &TestEnv, vm: &str) -> Option<String> {
    let (ok, uuid) = virsh(&["domuuid", &domain(env, vm)]);
    ok.then_some(uuid)
}

/// Domain names of this test's namespace defined on the daemon.
fn namespace_domains(env: &TestEnv) -> Vec<String> {
    let (ok, names) = virsh(&["list", "--all", "--name"]);
    assert!(ok);
    let prefix = format!("{}_", env.ns);
    let mut names: Vec<String> = names.lines().filter(|n| n.starts_with(&prefix)).map(str::to_owned).collect();
    names.sort();
    names
}

/// The real daemon's host: as many cpus as this machine (2 in CI), overcommitted
/// so that ten 1-cpu VMs fit, as a real VM host would be.
fn qemu_host() -> [Host<'static>; 1] {
    [Host::qemu("q")]
}

/// The `type` of the domain of VM `vm`: `kvm` or `qemu`.
fn domain_type(env: &TestEnv, vm: &str) -> String {
    let (ok, xml) = virsh(&["dumpxml", &domain(env, vm)]);
    assert!(ok, "virsh dumpxml {} failed", domain(env, vm));
    let start = xml.find("<domain type='").map(|i| i + "<domain type='".len()).expect("a <domain type=...>");
    xml[start..].split('\'').next().unwrap().to_owned()
}

/// The `vmlet.io/accelerator` label of the node of host `suffix`.
async fn accelerator_label(env: &TestEnv, suffix: &str) -> Option<String> {
    let node = env.nodes_api().get(&env.node(suffix)).await.expect("the host's node");
    node.metadata.labels.unwrap_or_default().get("vmlet.io/accelerator").cloned()
}

/// libvirtd's log (written there by hack/libvirtd.sh) from byte `from` on.
fn libvirtd_log_since(from: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(LIBVIRTD_LOG).unwrap_or_else(|e| panic!("{LIBVIRTD_LOG}: {e}"));
    file.seek(SeekFrom::Start(from)).unwrap();
    let mut text = String::new();
    file.read_to_string(&mut text).unwrap();
    text
}

const LIBVIRTD_LOG: &str = "/var/log/libvirt/libvirtd.log";

const SMALL: fn() -> serde_json::Value = || json!({"resources": {"cpu": 1, "memory": "64Mi"}});

#[tokio::test]
async fn stop_keeps_the_domain_start_runs_the_same_one_and_delete_undefines_it() {
    let mut env = TestEnv::new("qlife").await;
    env.start_vmlet(&qemu_host());
    env.apply_vm("web", SMALL());
    let mut retained = SMALL();
    retained["deletionPolicy"] = json!("Retain");
    env.apply_vm("keep", retained);

    env.wait_vm_phase("web", "Running").await;
    env.wait_vm_phase("keep", "Running").await;
    assert_eq!(domstate(&env, "web"), "running");
    let uuid = domuuid(&env, "web").unwrap();
    let status = env.vms().get("web").await.unwrap().status.unwrap();
    assert_eq!(status.provider_id, Some(format!("libvirt://{uuid}")));
    let (_, xml) = virsh(&["dumpxml", &domain(&env, "web")]);
    let uid = env.vms().get("web").await.unwrap().metadata.uid.unwrap();
    assert!(xml.contains(&format!("uid=\"{uid}\"")), "domain metadata lacks the VM's UID:\n{xml}");
    assert!(xml.contains("<memory unit='KiB'>65536</memory>"), "{xml}");

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=0"]);
    env.wait_vm_phase("web", "Stopped").await;
    env.wait_vm_pods_gone("web").await;
    assert_eq!(domstate(&env, "web"), "shut off", "stopped, not undefined");
    assert_eq!(domuuid(&env, "web").as_deref(), Some(uuid.as_str()));

    env.kubectl(&["scale", "virtualmachine/web", "--replicas=1"]);
    env.wait_vm_phase("web", "Running").await;
    assert_eq!(domstate(&env, "web"), "running");
    assert_eq!(domuuid(&env, "web").as_deref(), Some(uuid.as_str()), "the same domain runs again");
    assert_eq!(namespace_domains(&env).len(), 2, "no new domain was defined");

    env.kubectl(&["delete", "virtualmachine/web", "--wait=true", "--timeout=120s"]);
    assert_eq!(domuuid(&env, "web"), None, "deletionPolicy Delete undefines the domain");

    env.kubectl(&["delete", "virtualmachine/keep", "--wait=true", "--timeout=120s"]);
    assert_eq!(domstate(&env, "keep"), "shut off", "deletionPolicy Retain keeps the domain defined");
    let (undefined, _) = virsh(&["undefine", &domain(&env, "keep")]);
    assert!(undefined);
}

#[tokio::test]
async fn a_killed_vmlet_restarts_and_adopts_running_domains_without_touching_them() {
    const VMS: usize = 10;
    let mut env = TestEnv::new("qrestart").await;
    env.start_vmlet(&qemu_host());
    let names: Vec<String> = (0..VMS).map(|i| format!("vm-{i}")).collect();
    for name in &names {
        env.apply_vm(name, SMALL());
    }
    for name in &names {
        env.wait_vm_phase(name, "Running").await;
    }
    // (uuid, domain id): the id changes whenever a domain is started again.
    let before: Vec<(String, String, String)> = names
        .iter()
        .map(|n| {
            let (_, id) = virsh(&["domid", &domain(&env, n)]);
            (n.clone(), domuuid(&env, n).unwrap(), id)
        })
        .collect();
    assert_eq!(namespace_domains(&env).len(), VMS);

    env.kill_vmlet();
    for name in &names {
        assert_eq!(domstate(&env, name), "running", "{name} must outlive vmlet");
    }
    let killed_at = k8s_openapi::jiff::Timestamp::now();
    env.restart_vmlet();

    // Converged: the new process heartbeats, and every pod status was re-read
    // by it (each pod is reconciled on start) and still says Running and Ready.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(env.client.clone(), "kube-node-lease");
    let node = env.node("q");
    env.wait_for("the restarted vmlet to renew its lease", || {
        let leases = leases.clone();
        let node = node.clone();
        async move { (leases.get(&node).await.ok()?.spec?.renew_time?.0 > killed_at).then_some(()) }
    })
    .await;
    let log = env.dir.join("vmlet.log");
    env.wait_for("every pod to be reconciled by the new process", || {
        let log = log.clone();
        let names = names.clone();
        async move {
            let text = std::fs::read_to_string(&log).ok()?;
            let after_restart = text.rsplit("vmlet running").next()?;
            let synced = |n: &String| {
                // The pod of VM `n` is `<n>-<suffix>`.
                after_restart.lines().any(|l| l.contains(&format!("pod.name={n}-")) && l.contains("pod in sync"))
            };
            names.iter().all(synced).then_some(())
        }
    })
    .await;
    for name in &names {
        let vm = env.wait_vm_phase(name, "Running").await;
        assert_eq!(vm.status.unwrap().ready_replicas, 1);
    }

    let after: Vec<(String, String, String)> = names
        .iter()
        .map(|n| {
            let (_, id) = virsh(&["domid", &domain(&env, n)]);
            (n.clone(), domuuid(&env, n).unwrap(), id)
        })
        .collect();
    assert_eq!(before, after, "same domains, same UUIDs, never restarted");
    assert_eq!(namespace_domains(&env).len(), VMS, "no new domains");
    for name in &names {
        assert_eq!(domstate(&env, name), "running");
    }
}

#[tokio::test]
async fn vms_run_under_kvm_where_a_probe_guest_runs_under_it_or_when_asked() {
    // hack/libvirtd.sh makes an existing /dev/kvm usable by QEMU, so libvirtd
    // offers KVM exactly when the machine has /dev/kvm. `auto` takes it only
    // where a kernel runs under it: the host's own kernel (vmlet's probe),
    // as the test guest's kernel does (test-vms/guest/accelerator.sh).
    let dev_kvm = std::path::Path::new("/dev/kvm").exists();
    let host_kernel = std::fs::read_dir("/boot")
        .map(|dir| dir.flatten().any(|e| e.file_name().to_string_lossy().starts_with("vmlinuz")))
        .unwrap_or(false);
    let mut env = TestEnv::new("qkvm").await;
    let runs = dev_kvm && host_kernel && guest_accelerator(&guest_for(&env)) == "kvm";
    env.start_vmlet(&qemu_host());
    env.apply_vm("web", SMALL());
    env.wait_vm_phase("web", "Running").await;
    assert_eq!(domstate(&env, "web"), "running");
    let why = format!("/dev/kvm {dev_kvm}, a /boot kernel {host_kernel}, KVM runs a kernel {runs}");
    assert_eq!(domain_type(&env, "web"), if runs { "kvm" } else { "qemu" }, "{why}");
    assert_eq!(accelerator_label(&env, "q").await.as_deref(), Some(if runs { "kvm" } else { "tcg" }), "{why}");
    if !dev_kvm {
        return;
    }
    // Asked for KVM, a host that offers it gets it, probe or not (a VM
    // without an OS idles in the firmware, which KVM runs here).
    env.kill_vmlet();
    env.start_vmlet(&[Host { accelerator: Some("kvm"), ..Host::qemu("q") }]);
    env.wait_for("the node to say kvm", || async {
        (accelerator_label(&env, "q").await.as_deref() == Some("kvm")).then_some(())
    })
    .await;
    env.apply_vm("db", SMALL());
    env.wait_vm_phase("db", "Running").await;
    assert_eq!(domain_type(&env, "db"), "kvm");
}

#[tokio::test]
async fn accelerator_tcg_emulates_even_where_kvm_is_offered() {
    let mut env = TestEnv::new("qtcg").await;
    env.start_vmlet(&[Host { accelerator: Some("tcg"), ..Host::qemu("q") }]);
    env.apply_vm("web", SMALL());
    env.wait_vm_phase("web", "Running").await;
    assert_eq!(domstate(&env, "web"), "running");
    assert_eq!(domain_type(&env, "web"), "qemu");
    assert_eq!(accelerator_label(&env, "q").await.as_deref(), Some("tcg"));
}

#[tokio::test]
async fn thirty_vms_started_at_once_on_one_host_all_run_within_libvirtds_request_limit() {
    const VMS: usize = 30;
    let log_from = std::fs::metadata(LIBVIRTD_LOG).map(|m| m.len()).unwrap_or_else(|e| panic!("{LIBVIRTD_LOG}: {e}"));
    let mut env = TestEnv::new("qthirty").await;
    env.start_vmlet(&[Host { cpu_allocation_ratio: 32.0, ..Host::qemu("q") }]);
    let names: Vec<String> = (0..VMS).map(|i| format!("vm-{i}")).collect();
    env.apply_vms(&names, SMALL());
    for name in &names {
        env.wait_vm_phase(name, "Running").await;
    }
    assert_eq!(namespace_domains(&env).len(), VMS);
    for name in &names {
        assert_eq!(domstate(&env, name), "running", "{name}");
    }
    // libvirtd serves 5 calls at once per client and warns when one has more.
    let log = libvirtd_log_since(log_from);
    let hits: Vec<&str> = log.lines().filter(|l| l.contains("max requests limit")).collect();
    assert!(hits.is_empty(), "libvirtd saw too many calls in flight:\n{}", hits.join("\n"));
}

#[tokio::test]
async fn vms_deleted_while_their_defines_are_in_flight_leave_no_domain_behind() {
    const VMS: usize = 12;
    let mut env = TestEnv::new("qlate").await;
    env.start_vmlet(&[Host { cpu_allocation_ratio: 16.0, ..Host::qemu("q") }]);
    let names: Vec<String> = (0..VMS).map(|i| format!("vm-{i}")).collect();
    env.apply_vms(&names, SMALL());
    // Delete them all as soon as the first is bound to the host: its agent is
    // defining VMs then, with the rest queued behind libvirt's call limit.
    let pods = env.pods();
    env.wait_for("a VM pod bound to the host", || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&Default::default()).await.ok()?;
            list.items.iter().any(|p: &Pod| p.spec.as_ref().is_some_and(|s| s.node_name.is_some())).then_some(())
        }
    })
    .await;
    env.kubectl(&["delete", "virtualmachines", "--all", "--wait=false"]);

    let vms = env.vms();
    env.wait_for("every VirtualMachine to be gone", || {
        let vms = vms.clone();
        async move { vms.list(&Default::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    env.wait_for("every VM pod to be gone", || {
        let pods = pods.clone();
        async move { pods.list(&Default::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    env.wait_for("no domain of a deleted VirtualMachine on the host", || {
        let left = namespace_domains(&env);
        async move { left.is_empty().then_some(()) }
    })
    .await;
}

/// A raw disk of 1 MiB (sparse) at `path`, in a directory QEMU can enter: the
/// firmware finds nothing to boot on it and idles, as without a disk.
fn blank_disk(path: &std::path::Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::File::create(path).unwrap().set_len(1 << 20).unwrap();
}

/// The reason and message the container of pod `name` waits with, if it waits.
async fn waiting_of(env: &TestEnv, name: &str) -> Option<(String, String)> {
    let status = env.pods().get_opt(name).await.ok()??.status?;
    let waiting = status.container_statuses?.first()?.state.clone()?.waiting?;
    Some((waiting.reason?, waiting.message.unwrap_or_default()))
}

/// A VM whose image lies outside its host's storage roots (here in a directory
/// whose name only starts like the root's) is never defined: its pod waits
/// with reason StorageNotAllowed, naming the field and the roots, one Warning
/// Event says so however often the pod is looked at again, and libvirt has no
/// domain for it. A VM whose image is under the root runs beside it.
#[tokio::test]
async fn a_vm_whose_image_is_outside_the_storage_roots_is_never_defined() {
    let mut env = TestEnv::new("qroots").await;
    let root = storage_root(&env);
    let inside = root.join("inside.raw");
    let outside = std::path::PathBuf::from(format!("{}-evil/outside.raw", root.display()));
    blank_disk(&inside);
    blank_disk(&outside);
    env.start_vmlet(&qemu_host());
    env.apply_vm("inside", json!({"resources": {"cpu": 1, "memory": "64Mi"}, "image": inside}));
    env.apply_vm("outside", json!({"resources": {"cpu": 1, "memory": "64Mi"}, "image": outside}));

    let env_ref = &env;
    let outside_pod = env.pod_of("outside").await;
    let pod_ref = outside_pod.as_str();
    let (reason, message) = env
        .wait_for("the pod of VM outside to wait with reason StorageNotAllowed", || async move {
            waiting_of(env_ref, pod_ref).await.filter(|(reason, _)| reason == "StorageNotAllowed")
        })
        .await;
    assert_eq!(reason, "StorageNotAllowed");
    assert!(
        message.starts_with(&format!("spec.image {:?} is not under a storage root;", outside.display().to_string())),
        "{message}"
    );
    assert!(message.contains(&format!("storage roots [{}]", root.display())), "{message}");
    env.wait_vm_phase("inside", "Running").await;
    assert_eq!(domstate(&env, "inside"), "running");
    let (_, xml) = virsh(&["dumpxml", &domain(&env, "inside")]);
    assert!(xml.contains(&format!("<source file='{}'", inside.display())), "{xml}");

    // Look at the refused pod again (a label change is a pod change) and wait
    // until the agent has been through it once more.
    let log = env.dir.join("vmlet.log");
    let passes = |text: &str| {
        text.lines()
            .filter(|l| {
                l.contains(&format!("pod.name={outside_pod}}}")) && l.contains("storage refusal already reported")
            })
            .count()
    };
    let before = passes(&std::fs::read_to_string(&log).unwrap_or_default());
    env.kubectl(&["label", "pod", &outside_pod, "looked-at=again"]);
    env.wait_for("another pass over the refused pod", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        async move { (passes(&text) > before).then_some(()) }
    })
    .await;

    assert_eq!(domuuid(&env, "outside"), None, "no domain was defined for the refused VM");
    assert_eq!(namespace_domains(&env), vec![domain(&env, "inside")]);
    let vm = env.vms().get("outside").await.unwrap().status.unwrap();
    let ready = vm.conditions.iter().find(|c| c.type_ == "Ready").expect("a Ready condition");
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "StorageNotAllowed"));
    assert_eq!(vm.provider_id, None);
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = kube::Api::namespaced(env.client.clone(), &env.ns);
    let refusals: Vec<_> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("StorageNotAllowed"))
        .collect();
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    let event = &refusals[0];
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(event.regarding.as_ref().and_then(|r| r.name.as_deref()), Some(outside_pod.as_str()));
    assert_eq!(event.note.as_deref(), Some(message.as_str()));
    assert!(event.series.is_none(), "published more than once: {:?}", event.series);

    // The disks go once the VMs are (libvirt restores their ownership at undefine).
    drop(env);
    for dir in [root, outside.parent().unwrap().to_owned()] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The restart policy after `virsh destroy` behind vmlet's back: `Always`
/// (the default) starts the same domain again by itself; `Never` leaves it
/// off, the VM Stopped with reason Destroyed, its pod Failed, its spec as
/// it was.
#[tokio::test]
async fn a_vm_destroyed_behind_vmlet_restarts_under_always_and_stays_off_under_never() {
    let mut env = TestEnv::new("qpolicy").await;
    env.start_vmlet(&qemu_host());
    env.apply_vm("always", SMALL());
    let mut never = SMALL();
    never["restartPolicy"] = json!("Never");
    env.apply_vm("never", never);
    env.wait_vm_phase("always", "Running").await;
    env.wait_vm_phase("never", "Running").await;
    let (always_pod, never_pod) = (env.pod_of("always").await, env.pod_of("never").await);
    let (_, always_id) = virsh(&["domid", &domain(&env, "always")]);
    let uuid = domuuid(&env, "always").unwrap();

    assert!(virsh(&["destroy", &domain(&env, "always")]).0);
    assert!(virsh(&["destroy", &domain(&env, "never")]).0);

    let pods = env.pods();
    wait_restarted_once(&env, &pods, &always_pod, "always", &always_id).await;
    assert_eq!(domuuid(&env, "always").as_deref(), Some(uuid.as_str()), "the same domain");

    let vm = env.wait_vm_phase("never", "Stopped").await;
    assert_eq!(vm.spec.replicas, 1);
    let ready = vm.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.reason, "Destroyed");
    let pod = env.pods().get(&never_pod).await.unwrap().status.unwrap();
    assert_eq!((pod.phase.as_deref(), pod.reason.as_deref()), (Some("Failed"), Some("Destroyed")));
    assert_eq!(domstate(&env, "never"), "shut off");
    assert_eq!(env.pod_of("never").await, never_pod, "not replaced");
}

/// A guest QEMU stops by itself (as on a KVM internal error, which libvirt
/// reports `paused (unknown)`) is a failure, not "Starting": under
/// `restartPolicy: Never` the VM reads `Failed` with
/// `ProviderError=True/Faulted` naming libvirt's reason and the QEMU log's
/// last error line, a Warning Event, the pod still Running (the guest holds
/// the host's memory) and not Ready, nothing destroyed, and once the guest
/// runs again (`virsh resume`) the VM is Running again; under `Always` it is
/// restarted (a new run of the same domain, the pod's restart count 1).
#[tokio::test]
async fn a_guest_the_hypervisor_stopped_for_an_error_is_a_failure_for_its_restart_policy() {
    let mut env = TestEnv::new("qfault").await;
    env.start_vmlet(&qemu_host());
    let mut never = SMALL();
    never["restartPolicy"] = json!("Never");
    env.apply_vm("never", never);
    env.apply_vm("always", SMALL());
    env.wait_vm_phase("never", "Running").await;
    env.wait_vm_phase("always", "Running").await;
    let (never_pod, always_pod) = (env.pod_of("never").await, env.pod_of("always").await);
    let stop = |vm: &str| {
        let name = domain(&env, vm);
        let (ok, out) = virsh(&["qemu-monitor-command", &name, r#"{"execute":"stop"}"#]);
        assert!(ok, "qemu-monitor-command stop: {out}");
    };

    // What QEMU writes to its log on a KVM internal error (the test cannot
    // make this machine's KVM fail), then QEMU's own stop, not libvirt's.
    let name = domain(&env, "never");
    let (_, id_before) = virsh(&["domid", &name]);
    let log = format!("/var/log/libvirt/qemu/{name}.log");
    let mut file = std::fs::OpenOptions::new().append(true).open(&log).expect("the domain's QEMU log");
    std::io::Write::write_all(&mut file, b"KVM internal error. Suberror: 1\nemulation failure\nEAX=00000000\n")
        .unwrap();
    stop("never");
    let (_, reason) = virsh(&["domstate", "--reason", &name]);
    assert_eq!(reason, "paused (unknown)");

    let vm = env.wait_vm_phase("never", "Failed").await;
    let conditions = vm.status.unwrap().conditions;
    let error = conditions.iter().find(|c| c.type_ == "ProviderError").unwrap();
    assert_eq!((error.status.as_str(), error.reason.as_str()), ("True", "Faulted"));
    assert!(
        error.message.contains("paused (unknown)")
            && error.message.contains("the hypervisor's log says: emulation failure"),
        "{}",
        error.message
    );
    let ready = conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "Faulted"));
    let pod_status = env.pods().get(&never_pod).await.unwrap().status.unwrap();
    assert_eq!(pod_status.phase.as_deref(), Some("Running"));
    let selector = format!("involvedObject.name={never_pod},reason=Faulted");
    let events = env.kubectl(&["get", "events", "--field-selector", &selector, "-o", "jsonpath={.items[*].type}"]);
    assert_eq!(events.trim(), "Warning", "one Warning Event");
    assert_eq!(domstate(&env, "never"), "paused", "restartPolicy Never: nothing destroys or resumes it");

    assert!(virsh(&["resume", &name]).0);
    let vm = env.wait_vm_phase("never", "Running").await;
    let error = vm.status.unwrap().conditions.into_iter().find(|c| c.type_ == "ProviderError").unwrap();
    assert_eq!(error.status, "False");
    assert_eq!(virsh(&["domid", &name]).1, id_before, "the same run of the guest");

    // restartPolicy Always: the fault is a failure; the domain runs again.
    let always = domain(&env, "always");
    let (_, always_id) = virsh(&["domid", &always]);
    let uuid = domuuid(&env, "always").unwrap();
    stop("always");
    let pods = env.pods();
    wait_restarted_once(&env, &pods, &always_pod, "always", &always_id).await;
    assert_eq!(domuuid(&env, "always").as_deref(), Some(uuid.as_str()), "the same domain");
    assert_eq!(domstate(&env, "always"), "running");
    let selector = format!("involvedObject.name={always_pod},reason=Faulted");
    let note = env.kubectl(&["get", "events", "--field-selector", &selector, "-o", "jsonpath={.items[0].message}"]);
    assert!(note.contains("restarting it (restartPolicy Always)"), "{note}");
}
