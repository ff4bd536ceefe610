#!/usr/bin/env bash
# THE test command: every test of the workspace against a real control plane and
# a real libvirtd.
#
#   hack/test.sh [cargo test args...]     e.g. hack/test.sh --test cluster
#
# Installs missing Debian packages (hack/deps.sh; needs root), starts (or
# reuses) the local control plane (hack/cluster.sh up; the first run builds it,
# ~15 min on 2 cores), libvirtd for qemu:///system with KVM where the machine
# has it (hack/libvirtd.sh up; needs root) and the two libvirt hosts mig-a and
# mig-b in namespaces for the migration and resize tests (hack/hosts.sh up; as
# root only, else those tests skip), the real Nova API behind Keystone for the
# OpenStack provider's tests (hack/nova.sh up: a Python venv cached in
# ~/.cache/vmlet, ~3 min to install once, ~30 s to start), exports
# VMLET_LIBVIRT_QEMU_URI, VMLET_LIBVIRT_MIG_A_URI, VMLET_LIBVIRT_MIG_B_URI, the
# test networks' VMLET_LIBVIRT_QEMU_NETWORK{,_PROBE,_GATEWAY} (the isolated
# libvirt network vmlet-lan on qemu:///system; as root) and
# VMLET_MIG_LAN_{BRIDGE,PROBE,GATEWAY} (the guest LAN of mig-a and mig-b), and
# the harness's OS_* / VMLET_NOVA_* variables, starts metrics-server
# (hack/metrics-server.sh up: built once from its Go module), then runs every test binary of
# the workspace (hack/run-tests.py: those that need libvirtd beside those
# that do not), or `cargo test --workspace --no-fail-fast "$@"` when
# given arguments. All stay running afterwards so
# the next run is fast, except with CI=true, where they are stopped on exit.
# On failure it prints where the logs are and the last lines of each.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD

log() { echo "test.sh: $*" >&2; }

if [[ ${CI:-} == true ]]; then
  # Stop what this run started, whatever happens.
  trap 'log "CI=true: stopping the control plane (metrics-server with it), libvirtd, the two libvirt hosts, the Nova harness and the vSphere simulator"; "$REPO/hack/cluster.sh" down || true; "$REPO/hack/libvirtd.sh" down || true; "$REPO/hack/hosts.sh" down || true; "$REPO/hack/nova.sh" down || true; "$REPO/hack/vsphere.sh" down || true' EXIT
fi

if [[ $(id -u) != 0 ]] && ! virsh -c "$(hack/libvirtd.sh uri)" version >/dev/null 2>&1; then
  log "libvirtd (qemu:///system) is not running and starting it needs root."
  log "Run hack/test.sh as root (CI does), or start libvirtd first (as root: hack/libvirtd.sh up)."
  exit 1
fi

SETUP_START=$SECONDS
hack/deps.sh
if [[ ${CI:-} == true ]]; then
  # A CI run starts from an empty etcd, as on a new machine: objects an older
  # revision made (a ClusterRole deploy/rbac.yaml no longer has, say) would
  # otherwise outlive `kubectl apply` and grant what this revision does not.
  hack/cluster.sh down --wipe
fi
hack/cluster.sh up
eval "$(hack/cluster.sh env)" # KUBECONFIG, PATH (kubectl), VMLET_CLUSTER_LOGS
# metrics.k8s.io for `kubectl top` (tests/cluster.rs): built once (a few
# minutes), then started in seconds. Started here as well as by the test, so
# that no run begins with an APIService whose server is gone (discovery then
# fails for every kubectl and namespace deletion).
hack/metrics-server.sh up
hack/libvirtd.sh up
# VMLET_LIBVIRT_QEMU_URI and, where `up` made it (as root), the test network:
# VMLET_LIBVIRT_QEMU_NETWORK, VMLET_LIBVIRT_QEMU_NETWORK_PROBE, VMLET_LIBVIRT_QEMU_NETWORK_GATEWAY
eval "$(hack/libvirtd.sh env)"
if [[ $(id -u) == 0 ]]; then
  hack/hosts.sh up
  # VMLET_LIBVIRT_MIG_A_URI, VMLET_LIBVIRT_MIG_B_URI,
  # VMLET_MIG_LAN_BRIDGE, VMLET_MIG_LAN_PROBE, VMLET_MIG_LAN_GATEWAY
  eval "$(hack/hosts.sh uris)"
else
  log "not root: the two libvirt hosts (hack/hosts.sh) need root; the migration and resize tests skip"
fi

hack/nova.sh up
eval "$(hack/nova.sh env)" # OS_* (Keystone admin), VMLET_NOVA_IMAGE, VMLET_NOVA_NETWORK, VMLET_NOVA_HOSTS, ...
VSPHERE_START=$SECONDS
hack/vsphere.sh up # builds the simulator once (~1 min), then starts in about a second
eval "$(hack/vsphere.sh env)" # VMLET_VSPHERE_URL, _USERNAME, _PASSWORD, _THUMBPRINT, _CA_FILE, ...
log "vSphere simulator up in $((SECONDS - VSPHERE_START))s"

log "services up in $((SECONDS - SETUP_START))s"

status=0
TESTS_START=$SECONDS
if (($# > 0)); then
  # --no-fail-fast: report every failing test binary, not just the first.
  cargo test --workspace --no-fail-fast "$@" || status=$?
else
  # Every test binary: built once, then run in lanes at the same time, one
  # for those that need no libvirtd and one for those that do
  # (hack/run-tests.py says which and why), then the doc tests.
  RUN_DIR=$REPO/target/test-run
  mkdir -p "$RUN_DIR"
  if cargo test --workspace --no-run --message-format=json-render-diagnostics >"$RUN_DIR/build.json"; then
    log "test build took $((SECONDS - TESTS_START))s"
    hack/run-tests.py "$RUN_DIR/build.json" "$RUN_DIR" || status=$?
    cargo test --workspace --doc || status=$?
  else
    status=$?
  fi
fi
log "cargo test (build and run) took $((SECONDS - TESTS_START))s"

if ((status != 0)); then
  {
    echo
    echo "=================== hack/test.sh: tests FAILED (exit $status) ==================="
    echo "Logs:"
    echo "  control plane components: $VMLET_CLUSTER_LOGS/"
    echo "  each test's vmlet:        $REPO/target/it/<test namespace>/vmlet.log"
    echo "  libvirtd / virtlogd:      /var/log/libvirt/libvirtd.log, /var/log/libvirt/virtlogd.log"
    echo "  hosts mig-a, mig-b:       ${VMLET_HOSTS_DIR:-/var/lib/vmlet/hosts}/<host>/log/ (hack/hosts.sh status)"
    echo "  Nova harness:             ${VMLET_NOVA_LOG_DIR:-/tmp/vmlet-nova/logs}/ (hack/nova.sh logs nova|keystone|placement)"
    for f in "$VMLET_CLUSTER_LOGS"/*.log /var/log/libvirt/libvirtd.log; do
      [[ -f $f ]] || continue
      echo
      echo "--- last 20 lines of $f"
      tail -n 20 "$f"
    done
  } >&2
fi
exit "$status"
