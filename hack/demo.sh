#!/usr/bin/env bash
# THE demo command: vmlet serving three simulated hypervisor hosts on a real local
# control plane, with one VirtualMachine running on them.
#
#   hack/demo.sh        start (or restart) the demo
#   hack/demo.sh down   stop the demo's vmlet (the control plane keeps running;
#                       `hack/cluster.sh down` stops that)
#
# Hosts host-a, host-b, host-c are libvirt test-driver hosts (test-vms/hosts/*.xml):
# no real guests, but real libvirt API calls. The test driver keeps its VMs in
# vmlet's connection only, so a restarted vmlet finds none and defines them again.
# The demo's vmlet handles VirtualMachines of namespace $VMLET_DEMO_NAMESPACE
# (default: default). State and log: $VMLET_CACHE/demo (default ~/.cache/vmlet/demo).
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
DEMO=$CACHE/demo
NS=${VMLET_DEMO_NAMESPACE:-default}
PIDFILE=$DEMO/vmlet.pid
LOG=$DEMO/vmlet.log

log() { echo "demo: $*" >&2; }

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
    [[ -d /proc/$pid ]] && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
}

if [[ ${1:-} == down ]]; then
  stop_vmlet
  log "vmlet stopped. The control plane still runs (hack/cluster.sh down stops it)."
  exit 0
elif [[ -n ${1:-} ]]; then
  echo "usage: $0 [down]" >&2
  exit 64
fi

mkdir -p "$DEMO"
hack/deps.sh build # libvirt-dev and pkg-config, to build vmlet
hack/cluster.sh up
eval "$(hack/cluster.sh env)"

log "building vmlet (cargo build, debug: the quickest first build)"
cargo build --bin vmlet
stop_vmlet

kubectl apply --server-side --force-conflicts -f crds/ >/dev/null
kubectl wait --for=condition=established --timeout=60s crd/virtualmachines.vmlet.io >/dev/null

PKI=$(dirname "$KUBECONFIG")/pki
cat >"$DEMO/vmlet.yaml" <<YAML
# Written by hack/demo.sh: three libvirt test-driver hosts.
namespace: $NS
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

log "starting vmlet (log: $LOG)"
{ echo; echo "=== hack/demo.sh $(date -Is)"; } >>"$LOG"
NO_COLOR=1 nohup "$REPO/target/debug/vmlet" run --config "$DEMO/vmlet.yaml" </dev/null >>"$LOG" 2>&1 &
echo $! >"$PIDFILE"

kubectl apply -n "$NS" -f examples/vm.yaml
if ! kubectl wait -n "$NS" --for=jsonpath='{.status.phase}'=Running virtualmachine/web --timeout=120s; then
  log "virtualmachine/web did not reach Running within 120 s"
  kubectl describe -n "$NS" virtualmachine/web >&2 || true
  log "last lines of $LOG:"
  tail -n 30 "$LOG" >&2
  exit 1
fi

echo
kubectl get -n "$NS" virtualmachines,pods -o wide
echo
kubectl get nodes -l vmlet.io/demo=true -o wide
cat <<EOF

The demo runs. In this shell first:   eval "\$(hack/cluster.sh env)"
Then try:
  kubectl scale virtualmachine/web --replicas=0       # stop the VM (its definition stays on its host)
  kubectl scale virtualmachine/web --replicas=1       # start it again, on the same host
  kubectl describe virtualmachine/web                 # status, conditions, events
  kubectl events                                      # what vmlet did, in order
  kubectl get pods -l vmlet.io/vm=web                 # the VM's pod: web-<suffix> (status.podName)
  kubectl exec \$(kubectl get vm web -o jsonpath='{.status.podName}') -- uname -r
                                                      # test-driver hosts have no guest agent: a clear refusal
                                                      # (hack/test.sh boots a real qemu guest for logs/exec/attach)
  kubectl delete virtualmachine/web                   # power off and undefine
  kubectl apply -f examples/vm.yaml                   # back again (edit name/cpu/memory for more)
vmlet's log:   $LOG
VMs are handled in namespace "$NS" (VMLET_DEMO_NAMESPACE to change).
Stop:          hack/demo.sh down      (stops vmlet; the control plane keeps running)
               hack/cluster.sh down   (stops the control plane too)
EOF
