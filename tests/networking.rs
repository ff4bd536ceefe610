//! VMs on real networks: real QEMU test guests on the isolated libvirt network
//! `vmlet-lan` of the real libvirtd (`qemu:///system`), which `hack/libvirtd.sh`
//! makes with libvirt's DHCP (dnsmasq), plus the harness's network namespace
//! `vmlet-lan-probe` on the same bridge. Every request to a guest runs inside
//! that namespace (`ip netns exec`) or from another guest; nothing goes to an
//! address outside them.
//!
//! What is checked: the guest's address is its pod's IP and the VM's
//! `status.addresses`; guests reach each other and the probe namespace reaches
//! them by pod IP; a Service selecting VM pods lists exactly the running
//! guests; and no guest reaches anything bound to the host's 127.0.0.1 (etcd,
//! the API server, vmlet's kubelet API, a listener of the test), whichever way
//! it tries.

mod common;

use common::deadline::{kill_and_reap, output_within, KILL_WAIT, VIRSH};
use common::{guest_accelerator, guest_for, guest_vm_spec, qemu_uri, Host, TestEnv};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use serde_json::json;
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// A harness setting exported by `hack/test.sh` (from `hack/libvirtd.sh env`).
fn harness(var: &str) -> String {
    std::env::var(var).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| {
        panic!("{var} is unset: run the tests with hack/test.sh as root, which makes the test network vmlet-lan")
    })
}

/// The libvirt network, the probe namespace and the network's address on the host.
struct Lan {
    network: String,
    probe: String,
    gateway: Ipv4Addr,
}

fn lan() -> Lan {
    Lan {
        network: harness("VMLET_LIBVIRT_QEMU_NETWORK"),
        probe: harness("VMLET_LIBVIRT_QEMU_NETWORK_PROBE"),
        gateway: harness("VMLET_LIBVIRT_QEMU_NETWORK_GATEWAY").parse().expect("a gateway IPv4 address"),
    }
}

/// The qemu:///system host offering `lan` to this test's namespace and a
/// second network to another namespace only.
fn host_with_lan(env: &TestEnv, lan: &Lan, accelerator: &'static str) -> Host<'static> {
    Host { accelerator: Some(accelerator), ..Host::qemu("q") }.with(
        "networks",
        json!([
            {"name": "lan", "network": lan.network, "namespaces": [env.ns]},
            {"name": "team-b-lan", "network": lan.network, "namespaces": ["team-b"]},
        ]),
    )
}

/// `sh -c <script>` in the guest of `pod`, through `kubectl exec`.
fn guest_sh(env: &TestEnv, pod: &str, script: &str) -> Output {
    env.kubectl_output(&["exec", pod, "--", "sh", "-c", script])
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Wait until the guest agent of `pod` answers, then return the IPv4
/// address the guest itself reports on eth0 (`ip -4 -o addr`).
async fn guest_address(env: &TestEnv, pod: &str) -> String {
    env.wait_for(&format!("the guest of {pod} to report an IPv4 address on eth0"), || {
        let out = guest_sh(env, pod, "ip -4 -o addr show dev eth0");
        let text = stdout(&out);
        async move {
            let inet = text.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            Some(inet.split('/').next()?.to_owned())
        }
    })
    .await
}

/// Wait until `pod` reports a pod IP; returns `podIPs`.
async fn pod_ips(env: &TestEnv, pod: &str) -> Vec<String> {
    let pods = env.pods();
    env.wait_for(&format!("pod {pod} to report its IP"), || {
        let pods = pods.clone();
        async move {
            let status = pods.get_opt(pod).await.ok()??.status?;
            status.pod_ip.as_ref()?;
            Some(status.pod_ips?.into_iter().map(|ip| ip.ip).collect())
        }
    })
    .await
}

/// Start `httpd` in the guest of `pod`, serving `/who` = `name`.
async fn serve_who(env: &TestEnv, pod: &str, name: &str) {
    let script = format!("mkdir -p /www && echo {name} > /www/who && httpd -p 8080 -h /www");
    env.wait_for(&format!("httpd in the guest of {pod}"), || {
        let ok = guest_sh(env, pod, &script).status.success();
        async move { ok.then_some(()) }
    })
    .await;
}

/// `GET http://<ip>:8080/who` from inside network namespace `netns`: the body,
/// or `None` when nothing answers within 5 s.
fn probe_who(netns: &str, ip: &str) -> Option<String> {
    let fetch = format!(
        "import urllib.request; print(urllib.request.urlopen('http://{ip}:8080/who', timeout=5).read().decode().strip())"
    );
    let out = output_within(
        Command::new("ip").args(["netns", "exec", netns, "python3", "-c", &fetch]),
        Duration::from_secs(30),
    );
    out.status.success().then(|| stdout(&out).trim().to_owned())
}

/// A TCP listener in network namespace `netns` on `ip:port` that accepts and
/// closes every connection: something a guest may reach, to show that the
/// guest's `nc` does reach what its network allows. Killed when dropped.
struct ProbeListener(Child);

impl ProbeListener {
    fn start(netns: &str, ip: &str, port: u16) -> ProbeListener {
        let listen = format!(
            "import signal, socket\nsignal.alarm(600)\ns = socket.socket()\n\
             s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('{ip}', {port}))\ns.listen(16)\nprint('listening', flush=True)\n\
             while True:\n    s.accept()[0].close()\n"
        );
        // `ip netns exec` execs python, so the child is the listener itself
        // (killed when dropped); its own alarm ends it after 600 s anyway.
        let mut child = Command::new("ip")
            .args(["netns", "exec", netns, "python3", "-c", &listen])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the probe listener");
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("probe listener output");
        assert_eq!(line.trim(), "listening", "the probe listener did not start");
        ProbeListener(child)
    }
}

impl Drop for ProbeListener {
    fn drop(&mut self) {
        kill_and_reap(&mut self.0, KILL_WAIT);
    }
}

/// From the guest of `pod`, try a TCP connection to each `host:port` with a
/// 3 s deadline; returns `(target, connected)` in order.
fn connects_from_guest(env: &TestEnv, pod: &str, targets: &[String]) -> Vec<(String, bool)> {
    let script: String = targets
        .iter()
        .map(|target| {
            let (host, port) = target.rsplit_once(':').unwrap();
            // nc gives up connecting after 3 s (exit 1); a connection that
            // stays open past 8 s (a server waiting for a request) is killed
            // by timeout (exit >= 124), and counts as reached.
            format!(
                "timeout 8 nc -w 3 {host} {port} </dev/null >/dev/null 2>&1; rc=$?; if [ $rc = 0 ] || [ $rc -ge 124 \
                 ]; then echo open {target}; else echo closed {target}; fi; "
            )
        })
        .collect();
    let out = guest_sh(env, pod, &script);
    assert!(
        out.status.success(),
        "the connection probe did not run in the guest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    let results: Vec<(String, bool)> = text
        .lines()
        .filter_map(|line| {
            let (state, target) = line.split_once(' ')?;
            Some((target.to_owned(), state == "open"))
        })
        .collect();
    assert_eq!(results.len(), targets.len(), "one answer per target: {text}");
    results
}

/// `virsh -c qemu:///system dumpxml <domain>`.
fn dumpxml(domain: &str) -> String {
    let out = output_within(Command::new("virsh").args(["-c", &qemu_uri(), "dumpxml", domain]), VIRSH);
    assert!(out.status.success(), "virsh dumpxml {domain}: {}", String::from_utf8_lossy(&out.stderr));
    stdout(&out)
}

/// The addresses the EndpointSlices of Service `service` list as ready.
async fn ready_endpoints(env: &TestEnv, service: &str) -> BTreeSet<String> {
    let slices: Api<EndpointSlice> = Api::namespaced(env.client.clone(), &env.ns);
    let params = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
    let list = slices.list(&params).await.expect("list EndpointSlices");
    list.items
        .iter()
        .flat_map(|slice| slice.endpoints.iter().flatten())
        .filter(|endpoint| endpoint.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
        .flat_map(|endpoint| endpoint.addresses.iter().cloned())
        .collect()
}

async fn wait_endpoints(env: &TestEnv, service: &str, expected: &BTreeSet<String>) {
    env.wait_for(&format!("Service {service}'s EndpointSlices to list exactly {expected:?}"), || async {
        (ready_endpoints(env, service).await == *expected).then_some(())
    })
    .await;
}

/// A VM booting the test guest on network `lan`, labelled `app: shop`.
fn apply_guest(env: &TestEnv, name: &str, guest: &std::path::Path) {
    let mut spec = guest_vm_spec(guest);
    // The guest runs from its initramfs; two guests cannot share one disk.
    spec.as_object_mut().unwrap().remove("image");
    spec["networks"] = json!([{"name": "lan"}]);
    spec["services"] = json!([{"name": "direct"}, {"name": "other"}, {"name": "unasked"}]);
    let mut vm = env.vm_object(name, &spec);
    vm["metadata"]["labels"] = json!({"app": "shop"});
    let out = env.apply(&serde_yaml::to_string(&vm).unwrap());
    assert!(out.status.success(), "apply {name}: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_get_their_own_addresses_as_pod_ips_reach_each_other_and_a_service_but_not_the_hosts_loopback() {
    let lan = lan();
    let mut env = TestEnv::new("net").await;
    let guest = guest_for(&env);
    env.start_vmlet(&[host_with_lan(&env, &lan, guest_accelerator(&guest))]);
    // Both forms: a Service selecting the VMs' pods by label, and a
    // selector-less one the VMs name in spec.services (vmlet keeps its slice).
    // A Service with a selector, or one that did not opt in, gets no slice
    // from vmlet though a VM names it.
    for service in [
        json!({"metadata": {"name": "shop"}, "spec": {"selector": {"app": "shop"}, "ports": [{"port": 80, "targetPort": 8080}]}}),
        json!({"metadata": {"name": "direct", "annotations": {"vmlet.io/virtual-machine-endpoints": "true"}},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}),
        // Selector-less, but it did not opt in: the VMs naming it take nothing over.
        json!({"metadata": {"name": "unasked"}, "spec": {"ports": [{"port": 80}]}}),
        json!({"metadata": {"name": "other"}, "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]}}),
    ] {
        let mut service = service;
        service["apiVersion"] = json!("v1");
        service["kind"] = json!("Service");
        let out = env.apply(&serde_yaml::to_string(&service).unwrap());
        assert!(out.status.success(), "apply Service: {}", String::from_utf8_lossy(&out.stderr));
    }
    apply_guest(&env, "vm-a", &guest);
    apply_guest(&env, "vm-b", &guest);
    env.wait_vm_phase("vm-a", "Running").await;
    env.wait_vm_phase("vm-b", "Running").await;
    let (pod_a, pod_b) = (env.pod_of("vm-a").await, env.pod_of("vm-b").await);

    // Each pod's IP is what its guest took, distinct, in the network's range.
    let (ip_a, ip_b) = (guest_address(&env, &pod_a).await, guest_address(&env, &pod_b).await);
    assert_ne!(ip_a, ip_b);
    for ip in [&ip_a, &ip_b] {
        let ip: Ipv4Addr = ip.parse().unwrap();
        assert_eq!(ip.octets()[..3], lan.gateway.octets()[..3], "{ip} is not on {}", lan.network);
    }
    assert_eq!(pod_ips(&env, &pod_a).await, vec![ip_a.clone()], "pod {pod_a}'s IPs");
    assert_eq!(pod_ips(&env, &pod_b).await, vec![ip_b.clone()], "pod {pod_b}'s IPs");
    let vms = env.vms();
    env.wait_for("vm-a's status.addresses", || async {
        let status = vms.get("vm-a").await.ok()?.status?;
        (status.addresses == vec![ip_a.clone()]).then_some(())
    })
    .await;
    let wide = env.kubectl(&["get", "pods", "-o", "wide"]);
    assert!(wide.lines().any(|l| l.starts_with(&pod_a) && l.contains(&ip_a)), "kubectl get pods -o wide:\n{wide}");
    let xml = dumpxml(&format!("{}_vm-a", env.ns));
    assert!(xml.contains(&format!("<source network='{}'", lan.network)), "{xml}");
    assert!(!xml.contains("type='user'"), "a user-mode NIC: {xml}");

    // Guests serve; the probe namespace and the other guest reach them by pod IP.
    serve_who(&env, &pod_a, "vm-a").await;
    serve_who(&env, &pod_b, "vm-b").await;
    assert_eq!(probe_who(&lan.probe, &ip_a).as_deref(), Some("vm-a"));
    assert_eq!(probe_who(&lan.probe, &ip_b).as_deref(), Some("vm-b"));
    let from_a = guest_sh(&env, &pod_a, &format!("printf 'GET /who HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip_b} 8080"));
    assert!(stdout(&from_a).contains("vm-b"), "vm-a did not reach vm-b's httpd: {}", stdout(&from_a));

    // The Services' EndpointSlices list exactly the running guests.
    let both = BTreeSet::from([ip_a.clone(), ip_b.clone()]);
    wait_endpoints(&env, "shop", &both).await;
    wait_endpoints(&env, "direct", &both).await;
    let slices: Api<EndpointSlice> = Api::namespaced(env.client.clone(), &env.ns);
    let direct = slices.get("direct-vmlet").await.expect("vmlet's slice of Service direct");
    let ports: Vec<_> = direct.ports.iter().flatten().map(|p| (p.name.clone(), p.port)).collect();
    assert_eq!(ports, vec![(Some("http".to_owned()), Some(8080))], "the Service's targetPort");
    assert!(
        slices.get_opt("other-vmlet").await.unwrap().is_none(),
        "vmlet wrote a slice for a Service with a selector"
    );
    assert!(slices.get_opt("unasked-vmlet").await.unwrap().is_none(), "vmlet took over a Service that did not opt in");

    // Nothing on the host's 127.0.0.1 answers a guest: not through the
    // network's gateway, not at QEMU user-mode's 10.0.2.2. A listener in the
    // probe namespace does answer, so the probe can tell.
    let loopback = TcpListener::bind("127.0.0.1:0").unwrap();
    loopback.set_nonblocking(true).unwrap();
    let loopback_port = loopback.local_addr().unwrap().port();
    let probe_port = 20000 + (std::process::id() % 20000) as u16;
    let [a, b, c, _] = lan.gateway.octets();
    let probe_ip = Ipv4Addr::new(a, b, c, 2).to_string(); // hack/libvirtd.sh gives the probe namespace .2
    let _listener = ProbeListener::start(&lan.probe, &probe_ip, probe_port);
    let hosts_ports = [loopback_port, 2379, 6443, env.kubelet_port];
    let mut targets: Vec<String> = hosts_ports.iter().map(|port| format!("{}:{port}", lan.gateway)).collect();
    targets.extend(hosts_ports.iter().map(|port| format!("10.0.2.2:{port}")));
    targets.push(format!("{probe_ip}:{probe_port}"));
    let results = connects_from_guest(&env, &pod_a, &targets);
    let (control, host) = results.split_last().unwrap();
    assert!(control.1, "the guest did not reach the probe namespace's listener: {results:?}");
    let open: Vec<_> = host.iter().filter(|(_, open)| *open).collect();
    assert!(open.is_empty(), "a guest reached the host's loopback services: {open:?}");

    // A hostile guest routes 127.0.0.0/8 to the gateway itself.
    let rerouted = guest_sh(
        &env,
        &pod_a,
        &format!(
            "sysctl -w net.ipv4.conf.all.route_localnet=1 net.ipv4.conf.eth0.route_localnet=1 >/dev/null; \
             ip addr flush dev lo; ip route add 127.0.0.0/8 via {} dev eth0; ip route get 127.0.0.1",
            lan.gateway
        ),
    );
    assert!(
        stdout(&rerouted).contains(&format!("via {}", lan.gateway)),
        "the guest could not route 127.0.0.1 to the host: {} {}",
        stdout(&rerouted),
        String::from_utf8_lossy(&rerouted.stderr)
    );
    let targets: Vec<String> = hosts_ports.iter().map(|port| format!("127.0.0.1:{port}")).collect();
    let open: Vec<_> = connects_from_guest(&env, &pod_a, &targets).into_iter().filter(|(_, open)| *open).collect();
    assert!(open.is_empty(), "a guest routing 127.0.0.0/8 to the host reached: {open:?}");
    match loopback.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the test's listener on the host's 127.0.0.1 got a connection: {other:?}"),
    }

    // A stopped guest leaves the Service.
    env.kubectl(&["scale", "virtualmachine/vm-b", "--replicas=0"]);
    env.wait_vm_phase("vm-b", "Stopped").await;
    wait_endpoints(&env, "shop", &BTreeSet::from([ip_a.clone()])).await;
    wait_endpoints(&env, "direct", &BTreeSet::from([ip_a.clone()])).await;
}

/// Firmware-only QEMU VMs (no guest): the refusals happen before any define.
#[tokio::test]
async fn a_network_the_host_does_not_offer_the_namespace_is_refused_naming_the_field_and_nothing_is_defined() {
    let lan = lan();
    let mut env = TestEnv::new("net-refuse").await;
    env.start_vmlet(&[host_with_lan(&env, &lan, "tcg")]);
    let small = |networks: serde_json::Value| json!({"resources": {"cpu": 1, "memory": "64Mi"}, "networks": networks});
    env.apply_vm("unknown", small(json!([{"name": "lan"}, {"name": "internet"}])));
    env.apply_vm("theirs", small(json!([{"name": "team-b-lan"}])));
    env.apply_vm("default", small(json!([])));
    env.apply_vm("first", small(json!([{"name": "lan", "macAddress": "52:54:00:7e:57:01"}])));
    env.wait_vm_phase("first", "Running").await;
    env.apply_vm("clone", small(json!([{"name": "lan", "macAddress": "52:54:00:7e:57:01"}])));

    let first = format!("{}_first", env.ns);
    let offered = format!("offers namespace {}: lan)", env.ns);
    let refusals = [
        ("unknown", "spec.networks[1].name", "\"internet\"".to_owned(), offered.clone()),
        ("theirs", "spec.networks[0].name", "\"team-b-lan\"".to_owned(), offered),
        ("clone", "spec.networks[0].macAddress", "52:54:00:7e:57:01".to_owned(), format!("domain {first}")),
    ];
    for (vm, field, value, why) in refusals {
        let pods = env.pods();
        let pod = env.pod_of(vm).await;
        let message = env
            .wait_for(&format!("pod {pod} to wait with InvalidSpec"), || {
                let pods = pods.clone();
                let pod = pod.clone();
                async move {
                    let pod: Pod = pods.get(&pod).await.ok()?;
                    let waiting = pod.status?.container_statuses?.first()?.state.clone()?.waiting?;
                    (waiting.reason.as_deref() == Some("InvalidSpec")).then_some(waiting.message.unwrap_or_default())
                }
            })
            .await;
        assert!(message.contains(field), "{vm}: {message}");
        assert!(message.contains(&value), "{vm}: {message}");
        assert!(message.contains(&why), "{vm}: {message}");
    }

    // A VM that names no network gets the host's first one offered to its
    // namespace, and only that.
    env.wait_vm_phase("default", "Running").await;
    let xml = dumpxml(&format!("{}_default", env.ns));
    assert_eq!(xml.matches("<interface ").count(), 1, "{xml}");
    assert!(xml.contains(&format!("<source network='{}'", lan.network)), "{xml}");

    let out = output_within(Command::new("virsh").args(["-c", &qemu_uri(), "list", "--all", "--name"]), VIRSH);
    let mut defined: Vec<String> =
        stdout(&out).lines().filter(|n| n.starts_with(&format!("{}_", env.ns))).map(str::to_owned).collect();
    defined.sort();
    assert_eq!(defined, vec![format!("{}_default", env.ns), first], "a refused VM was defined");
}

/// A guest on a host bridge (`bridge:`) of mig-a, a libvirtd in a network
/// namespace of its own (`hack/hosts.sh`), whose only address is on its
/// migration link (10.237.0.11, where its libvirtd listens, TCP without
/// authentication): the guest's segment is the harness's guest LAN, and
/// nothing of the host answers it, not even when the guest makes the host's
/// addresses on-link itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_on_a_host_bridge_reaches_nothing_of_its_host() {
    let (uri, bridge) = (harness("VMLET_LIBVIRT_MIG_A_URI"), harness("VMLET_MIG_LAN_BRIDGE"));
    let (probe, gateway) = (harness("VMLET_MIG_LAN_PROBE"), harness("VMLET_MIG_LAN_GATEWAY"));
    let host_address = uri.trim_start_matches("qemu+tcp://").split('/').next().unwrap().to_owned();
    let mut env = TestEnv::new("net-bridge").await;
    let guest = guest_for(&env);
    let host = Host { accelerator: Some(guest_accelerator(&guest)), cpu_allocation_ratio: 8.0, ..Host::new("a", uri) }
        .with("networks", json!([{"name": "lan", "bridge": bridge}]));
    env.start_vmlet(&[host]);
    let mut spec = guest_vm_spec(&guest);
    spec.as_object_mut().unwrap().remove("image");
    spec["networks"] = json!([{"name": "lan"}]);
    env.apply_vm("vm", spec);
    env.wait_vm_phase("vm", "Running").await;
    let pod = env.pod_of("vm").await;
    let ip = guest_address(&env, &pod).await;
    assert_eq!(pod_ips(&env, &pod).await, vec![ip.clone()], "the pod's IP, from the guest agent");

    let probe_port = 20000 + (std::process::id() % 20000) as u16;
    let _listener = ProbeListener::start(&probe, &gateway, probe_port);
    let libvirtd = [format!("{host_address}:16509"), "10.237.0.12:16509".to_owned(), "10.237.0.1:16509".to_owned()];
    let mut targets: Vec<String> = libvirtd.to_vec();
    targets.push("10.0.2.2:16509".to_owned());
    targets.push(format!("{gateway}:{probe_port}"));
    let results = connects_from_guest(&env, &pod, &targets);
    let (control, host) = results.split_last().unwrap();
    assert!(control.1, "the guest did not reach the LAN's probe listener: {results:?}");
    let open: Vec<_> = host.iter().filter(|(_, open)| *open).collect();
    assert!(open.is_empty(), "a guest on a bridge reached its host: {open:?}");

    // A hostile guest makes the hosts' link on-link and asks again.
    let rerouted = guest_sh(&env, &pod, "ip route add 10.237.0.0/24 dev eth0; ip route get 10.237.0.11");
    assert!(stdout(&rerouted).contains("dev eth0"), "the guest could not add the route: {}", stdout(&rerouted));
    let open: Vec<_> = connects_from_guest(&env, &pod, &libvirtd).into_iter().filter(|(_, open)| *open).collect();
    assert!(open.is_empty(), "a guest with the hosts' link on-link reached: {open:?}");
}
