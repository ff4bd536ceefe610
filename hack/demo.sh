#!/usr/bin/env bash
# THE demo command: vmlet on a real local control plane, serving three simulated
# hypervisor hosts with one VirtualMachine running on them and, as root, a real
# QEMU host that boots a real guest on an isolated network.
#
#   hack/demo.sh            start (or restart) the demo
#   hack/demo.sh --no-qemu  the same without the real guest (or VMLET_DEMO_QEMU=0)
#   hack/demo.sh down       remove the real guest (deletes VirtualMachine and
#                           Service `guest`: vmlet powers the guest off and
#                           undefines its domain), then stop the demo's vmlet.
#                           The control plane, libvirtd and its network keep
#                           running (`hack/cluster.sh down`, `hack/libvirtd.sh
#                           down` stop those)
#
# Hosts host-a, host-b, host-c are libvirt test-driver hosts (test-vms/hosts/*.xml):
# no real guests, but real libvirt API calls. The test driver keeps its VMs in
# vmlet's connection only, so a restarted vmlet finds none and defines them again.
#
# The real guest (as root, unless --no-qemu): host `qemu` is the local libvirtd
# (qemu:///system, started by hack/libvirtd.sh up, which installs nothing itself:
# hack/deps.sh installs libvirt and QEMU first), offering VMs the isolated libvirt
# network vmlet-lan as network `lan` (no route anywhere; reachable only from the
# network namespace vmlet-lan-probe, the tests' probe). VirtualMachine `guest`
# (label app=guest, selected by Service `guest`) boots the tiny test guest
# (test-vms/guest/build.sh, cached in $VMLET_CACHE; the first build downloads
# Debian packages for a few minutes) from a copy in $VMLET_DEMO_GUEST_DIR (default
# /var/lib/vmlet/demo/guest, a place QEMU's user can read). Its domain on
# qemu:///system is <namespace>_guest. Host `qemu` is tainted
# vmlet.io/demo-guest:NoSchedule, so only the guest (which tolerates it) runs
# there; other VMs of the demo stay on the simulated hosts. The script waits until
# the guest's pod is Running with its IP, then shows `kubectl logs`, `kubectl
# exec`, `kubectl get pods -o wide`, and fetches http://<pod IP>:8080/ from inside
# vmlet-lan-probe after starting busybox httpd in the guest. A rerun reuses the
# running guest (vmlet adopts it); nothing sends traffic beyond loopback and that
# network.
#
# The demo's vmlet handles VirtualMachines of namespace $VMLET_DEMO_NAMESPACE
# (default: default; tests use namespaces of their own). State and log:
# $VMLET_CACHE/demo (default ~/.cache/vmlet/demo). Every command has a deadline.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
DEMO=$CACHE/demo
NS=${VMLET_DEMO_NAMESPACE:-default}
PIDFILE=$DEMO/vmlet.pid
LOG=$DEMO/vmlet.log
GUEST_DIR=${VMLET_DEMO_GUEST_DIR:-/var/lib/vmlet/demo/guest}
# How long the guest may take to boot to a pod IP and a guest agent (software
# emulation on a slow machine is the worst case).
GUEST_WAIT=${VMLET_DEMO_GUEST_WAIT:-300}

log() { echo "demo: $*" >&2; }
# kubectl with a deadline, in the demo's namespace.
k() { timeout 60 kubectl -n "$NS" "$@"; }

# Stop the vmlet a previous run started (only that process: pid file + name check).
stop_vmlet() {
  [[ -s $PIDFILE ]] || return 0
  local pid
  pid=$(<"$PIDFILE")
  if [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == vmlet ]]; then
    log "stopping the demo's vmlet (pid $pid); the VMs' objects stay"
    kill -TERM "$pid"
    for _ in $(seq 1 100); do
      [[ -d /proc/$pid ]] || break
      sleep 0.2
    done
    if [[ -d /proc/$pid ]]; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$PIDFILE"
}

vmlet_running() {
  local pid
  [[ -s $PIDFILE ]] && pid=$(<"$PIDFILE") && [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == vmlet ]]
}

# Remove the real guest while the demo's vmlet still runs: deleting the
# VirtualMachine powers the guest off and undefines its domain (deletionPolicy
# Delete). Then the Service and the demo's node `qemu`.
remove_guest() {
  [[ -n ${KUBECONFIG:-} ]] || eval "$(timeout 60 hack/cluster.sh env)"
  if ! timeout 10 kubectl get --raw /readyz >/dev/null 2>&1; then
    log "the control plane does not answer: VirtualMachine guest (if any) left as it is"
    return 0
  fi
  if [[ -n $(k get virtualmachine guest --ignore-not-found -o name) ]]; then
    if vmlet_running; then
      log "deleting VirtualMachine guest: vmlet powers the guest off and undefines its domain ${NS}_guest"
      if ! timeout 150 kubectl -n "$NS" delete virtualmachine guest --wait=true --timeout=120s; then
        log "VirtualMachine guest is not gone within 120 s (vmlet's log: $LOG);"
        log "the domain stays on qemu:///system: virsh -c qemu:///system destroy ${NS}_guest; virsh -c qemu:///system undefine ${NS}_guest"
      fi
    else
      log "the demo's vmlet is not running, so nothing can power the guest off: VirtualMachine guest and"
      log "its domain ${NS}_guest are kept. Start the demo again (hack/demo.sh), then hack/demo.sh down."
      return 0
    fi
  fi
  k delete service guest --ignore-not-found >/dev/null
  timeout 60 kubectl delete node qemu --ignore-not-found >/dev/null
}

NO_QEMU=0
[[ ${VMLET_DEMO_QEMU:-} == 0 ]] && NO_QEMU=1
case ${1:-} in
  down)
    remove_guest
    stop_vmlet
    log "vmlet stopped. The control plane still runs (hack/cluster.sh down stops it);"
    log "so do libvirtd and its network vmlet-lan, if hack/libvirtd.sh up started them (hack/libvirtd.sh down)."
    exit 0
    ;;
  --no-qemu) NO_QEMU=1 ;;
  "") ;;
  *)
    echo "usage: $0 [--no-qemu | down]" >&2
    exit 64
    ;;
esac

# The real guest: as root, unless asked not to.
QEMU=0
if ((NO_QEMU)); then
  log "--no-qemu: simulated hosts only"
elif [[ $(id -u) != 0 ]]; then
  log "not root: simulated hosts only (the real QEMU guest needs root: libvirtd, the guest build, ip netns)"
else
  QEMU=1
fi

mkdir -p "$DEMO"
if ((QEMU)); then
  timeout 2000 hack/deps.sh # also libvirtd, QEMU and what the guest build and network need
else
  timeout 2000 hack/deps.sh build # libvirt-dev and pkg-config, to build vmlet
fi
timeout 2700 hack/cluster.sh up # the first run builds the control plane (~15 min)
eval "$(timeout 60 hack/cluster.sh env)"

log "building vmlet (cargo build, debug: the quickest first build)"
timeout 3600 cargo build --bin vmlet

if ((QEMU)); then
  timeout 300 hack/libvirtd.sh up # qemu:///system, network vmlet-lan, namespace vmlet-lan-probe
  eval "$(timeout 60 hack/libvirtd.sh env)"
  LAN=${VMLET_LIBVIRT_QEMU_NETWORK:?hack/libvirtd.sh up made no test network}
  PROBE=${VMLET_LIBVIRT_QEMU_NETWORK_PROBE:?hack/libvirtd.sh up made no probe namespace}
  log "building the test guest (test-vms/guest/build.sh; cached: the first build downloads Debian packages"
  log "and takes a few minutes, later runs a few seconds)"
  BUILT=$(timeout 1200 test-vms/guest/build.sh | tail -n 1)
  [[ -s $BUILT/vmlinuz && -s $BUILT/initrd.img ]] || { log "test-vms/guest/build.sh printed no guest directory"; exit 1; }
  # kvm where KVM boots the guest's kernel here, else tcg (cached in $BUILT/accelerator).
  ACCELERATOR=$(timeout 120 test-vms/guest/accelerator.sh "$BUILT" | tail -n 1)
  [[ $ACCELERATOR == kvm || $ACCELERATOR == tcg ]] || { log "accelerator.sh answered '$ACCELERATOR'"; exit 1; }
  # Copy only what changed: a running guest of an earlier run booted from these.
  mkdir -p "$GUEST_DIR"
  for f in vmlinuz initrd.img cmdline; do
    cmp -s "$BUILT/$f" "$GUEST_DIR/$f" || cp "$BUILT/$f" "$GUEST_DIR/$f"
  done
  # QEMU runs as libvirt-qemu: every directory on the way must be searchable.
  dir=$GUEST_DIR
  while [[ $dir != / ]]; do
    timeout 10 chmod a+rX "$dir"
    dir=$(dirname "$dir")
  done
  timeout 60 chmod -R a+rX "$GUEST_DIR"
  CMDLINE=$(<"$GUEST_DIR/cmdline")
  log "guest $BUILT copied to $GUEST_DIR (accelerator $ACCELERATOR)"
else
  # A guest of an earlier run would be stranded on a host this vmlet no longer serves.
  if vmlet_running && [[ -n $(k get virtualmachine guest --ignore-not-found -o name 2>/dev/null) ]]; then
    remove_guest
  fi
fi
stop_vmlet

timeout 120 kubectl apply --server-side --force-conflicts -f crds/ >/dev/null
timeout 90 kubectl wait --for=condition=established --timeout=60s crd/virtualmachines.vmlet.io >/dev/null
timeout 300 hack/admission.sh >/dev/null

PKI=$(dirname "$KUBECONFIG")/pki
cat >"$DEMO/vmlet.yaml" <<YAML
# Written by hack/demo.sh: three libvirt test-driver hosts$( ((QEMU)) && echo " and the local libvirtd").
namespace: $NS
trustedNamespaces: [$NS]    # the demo's guest boots a kernel from a host path; tenants use VirtualMachineImages
stateDir: $DEMO/state
kubeletApi:                 # the API server verifies it against the cluster CA
  listen: 127.0.0.1:10250
  tlsCertFile: $PKI/kubelet-serving.crt
  tlsKeyFile: $PKI/kubelet-serving.key
  clientCaFile: $PKI/ca.crt
hosts:
  - name: host-a
    provider: libvirt
    uri: test://$REPO/test-vms/hosts/host-a.xml
    labels: {vmlet.io/demo: "true", topology.kubernetes.io/zone: zone-a}
  - name: host-b
    provider: libvirt
    uri: test://$REPO/test-vms/hosts/host-b.xml
    labels: {vmlet.io/demo: "true", topology.kubernetes.io/zone: zone-b}
  - name: host-c
    provider: libvirt
    uri: test://$REPO/test-vms/hosts/host-c.xml
    labels: {vmlet.io/demo: "true", topology.kubernetes.io/zone: zone-c}
YAML
if ((QEMU)); then
  cat >>"$DEMO/vmlet.yaml" <<YAML
  - name: qemu
    provider: libvirt
    uri: qemu:///system
    labels: {vmlet.io/demo: "true", vmlet.io/demo-qemu: "true"}
    taints:                 # only VMs that tolerate vmlet.io/demo-guest (the guest) run here
      - {key: virtual-kubelet.io/provider, value: vmlet, effect: NoSchedule}
      - {key: vmlet.io/demo-guest, value: "true", effect: NoSchedule}
    accelerator: $ACCELERATOR
    cpuAllocationRatio: 8.0 # 1-cpu guests on a small machine, as on a real VM host
    storageRoots: [$GUEST_DIR]
    networks:
      - {name: lan, network: $LAN}
YAML
fi

log "starting vmlet (log: $LOG)"
{ echo; echo "=== hack/demo.sh $(date -Is)"; } >>"$LOG"
NO_COLOR=1 nohup "$REPO/target/debug/vmlet" run --config "$DEMO/vmlet.yaml" </dev/null >>"$LOG" 2>&1 &
echo $! >"$PIDFILE"

k apply -f examples/vm.yaml
if ! timeout 150 kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Running virtualmachine/web --timeout=120s; then
  log "virtualmachine/web did not reach Running within 120 s"
  k describe virtualmachine/web >&2 || true
  log "last lines of $LOG:"
  tail -n 30 "$LOG" >&2
  exit 1
fi

if ((QEMU)); then
  k apply -f - <<YAML
apiVersion: vmlet.io/v1alpha1
kind: VirtualMachine
metadata:
  name: guest
  labels: {app: guest}
spec:
  replicas: 1
  resources: {cpu: 1, memory: 256Mi}
  shutdownTimeoutSeconds: 5
  kernelBoot:               # the test guest runs from its initramfs: no disk
    kernel: $GUEST_DIR/vmlinuz
    initrd: $GUEST_DIR/initrd.img
    cmdline: "$CMDLINE"
  networks: [{name: lan}]
  nodeSelector: {vmlet.io/demo-qemu: "true"}
  tolerations: [{key: vmlet.io/demo-guest, operator: Exists, effect: NoSchedule}]
---
apiVersion: v1
kind: Service
metadata:
  name: guest
spec:
  selector: {app: guest}
  ports: [{name: http, port: 8080, targetPort: 8080}]
YAML
fi

echo
k get virtualmachines,pods -o wide
echo
timeout 60 kubectl get nodes -l vmlet.io/demo=true -o wide

# --- the real guest ---------------------------------------------------------------

GUEST_POD=""
GUEST_IP=""
FAILED=()

# Wait until VirtualMachine guest's pod is Running with a pod IP (sets GUEST_POD, GUEST_IP).
wait_guest_pod() {
  local deadline=$((SECONDS + GUEST_WAIT)) pod out
  while ((SECONDS < deadline)); do
    pod=$(k get virtualmachine guest -o jsonpath='{.status.podName}' 2>/dev/null || true)
    if [[ -n $pod ]]; then
      out=$(k get pod "$pod" -o jsonpath='{.status.phase} {.status.podIP}' 2>/dev/null || true)
      if [[ $out == "Running "?* ]]; then
        GUEST_POD=$pod
        GUEST_IP=${out#Running }
        return 0
      fi
    fi
    sleep 2
  done
  return 1
}

# Wait until the guest agent answers `kubectl exec` (it starts a few seconds after the kernel).
wait_guest_agent() {
  local deadline=$((SECONDS + GUEST_WAIT))
  until timeout 30 kubectl -n "$NS" exec "$GUEST_POD" -- true >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 2
  done
}

# Show a command as typed, then run it; a failure is reported at the end.
show() {
  local shown=$1
  shift
  echo
  echo "\$ $shown"
  if ! "$@"; then
    log "FAILED: $shown"
    FAILED+=("$shown")
  fi
}

logs_tail() { timeout 30 kubectl -n "$NS" logs "$GUEST_POD" | tail -n 12; }

# GET http://<ip>:8080/ from inside the probe namespace, retried for up to 60 s
# (httpd daemonizes a moment after exec returns); each try has a 5 s deadline.
fetch_guest() {
  local deadline=$((SECONDS + 60)) url="http://$GUEST_IP:8080/"
  while :; do
    if command -v curl >/dev/null; then
      timeout 15 ip netns exec "$PROBE" curl -sS --max-time 5 "$url" && return 0
    else
      timeout 15 ip netns exec "$PROBE" python3 -c \
        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$url', timeout=5).read().decode())" &&
        return 0
    fi
    ((SECONDS < deadline)) || return 1
    sleep 2
  done
}

if ((QEMU)); then
  echo
  log "waiting (up to ${GUEST_WAIT} s) for the guest's pod to run with its IP on network lan ($LAN, accelerator $ACCELERATOR)"
  if ! wait_guest_pod; then
    log "VirtualMachine guest has no Running pod with an IP after ${GUEST_WAIT} s"
    k describe virtualmachine/guest >&2 || true
    log "last lines of $LOG:"
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  if ! wait_guest_agent; then
    log "the guest agent of $GUEST_POD does not answer kubectl exec after ${GUEST_WAIT} s; last lines of $LOG:"
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  fetch_cmd="curl -sS --max-time 5 http://$GUEST_IP:8080/"
  command -v curl >/dev/null || fetch_cmd="python3 -c \"...urlopen('http://$GUEST_IP:8080/', timeout=5)...\""
  echo
  echo "=== VirtualMachine guest: a real QEMU guest on qemu:///system, pod $GUEST_POD, IP $GUEST_IP"
  show "kubectl logs $GUEST_POD | tail -n 12      # its serial console" logs_tail
  show "kubectl exec $GUEST_POD -- uname -a       # through the QEMU guest agent" \
    timeout 30 kubectl -n "$NS" exec "$GUEST_POD" -- uname -a
  show "kubectl get pods -o wide                 # the guest's address is its pod IP" \
    k get pods -o wide
  show "kubectl get endpointslices -l kubernetes.io/service-name=guest   # Service guest selects app=guest" \
    k get endpointslices -l kubernetes.io/service-name=guest
  show "kubectl exec $GUEST_POD -- sh -c 'pidof httpd || httpd -p 8080 -h /www'   # a web server in the guest" \
    timeout 30 kubectl -n "$NS" exec "$GUEST_POD" -- sh -c 'pidof httpd || httpd -p 8080 -h /www'
  show "ip netns exec $PROBE $fetch_cmd   # from the isolated network" fetch_guest
fi

cat <<EOF

The demo runs. In this shell first:   eval "\$(hack/cluster.sh env)"
Then try:
  kubectl scale virtualmachine/web --replicas=0       # stop the VM (its definition stays on its host)
  kubectl scale virtualmachine/web --replicas=1       # start it again, on the same host
  kubectl describe virtualmachine/web                 # status, conditions, events
  kubectl events                                      # what vmlet did, in order
  kubectl get pods -l vmlet.io/vm=web                 # the VM's pod: web-<suffix> (status.podName)
  kubectl delete virtualmachine/web                   # power off and undefine
  kubectl apply -f examples/vm.yaml                   # back again (edit name/cpu/memory for more)
EOF
if ((QEMU)); then
  cat <<EOF
The real guest (VirtualMachine guest on host qemu, pod IP $GUEST_IP on network lan):
  POD=\$(kubectl get vm guest -o jsonpath='{.status.podName}')
  kubectl logs -f \$POD                                # its serial console, live
  kubectl attach -it \$POD                             # type at its live console (one session at a time)
  kubectl exec \$POD -- ip -4 addr show dev eth0       # any command, through the guest agent
  kubectl get pods -o wide                            # IP column: the guest's address
  ip netns exec $PROBE $fetch_cmd
                                                      # the only place that reaches the guest's network
  kubectl scale virtualmachine/guest --replicas=0     # power it off; --replicas=1 boots it again
EOF
else
  cat <<EOF
  kubectl exec \$(kubectl get vm web -o jsonpath='{.status.podName}') -- uname -r
                                                      # test-driver hosts have no guest agent: a clear refusal
                                                      # (as root, hack/demo.sh also boots a real guest)
EOF
fi
cat <<EOF
vmlet's log:   $LOG
VMs are handled in namespace "$NS" (VMLET_DEMO_NAMESPACE to change).
Stop:          hack/demo.sh down      (stops vmlet, after deleting VirtualMachine guest if there is one:
                                       that powers the guest off and undefines its domain; the
                                       control plane keeps running)
               hack/cluster.sh down   (stops the control plane too)
EOF

if ((${#FAILED[@]})); then
  log "these steps failed: ${FAILED[*]}"
  exit 1
fi
