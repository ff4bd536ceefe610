#!/usr/bin/env bash
# Which accelerator boots the test guest on this machine: prints `kvm` or `tcg`.
#
#   test-vms/guest/accelerator.sh <guest dir>     (the directory build.sh printed)
#
# `kvm` when /dev/kvm exists and QEMU under KVM runs the guest's kernel to its
# first line ("Linux version") within $VMLET_KVM_PROBE_SECONDS (default 20);
# `tcg` otherwise. Some machines offer KVM that runs firmware but not a Linux
# kernel: on nested virtualization seen here, SeaBIOS and the kernel's
# decompressor ran, then the kernel stopped without a line, at 100% CPU. There,
# guests without an OS still run as KVM domains, and real guests must use TCG.
# The answer is cached in <guest dir>/accelerator (delete it to probe again);
# the reason goes to stderr. Needs qemu-system-x86 (and root for /dev/kvm).
set -euo pipefail

log() { echo "accelerator: $*" >&2; }

GUEST=${1:?usage: $0 <guest dir>}
CACHED=$GUEST/accelerator
WAIT=${VMLET_KVM_PROBE_SECONDS:-20}

if [[ -s $CACHED ]]; then
  cat "$CACHED"
  exit 0
fi

answer() {
  echo "$1" >"$CACHED"
  echo "$1"
}

if [[ ! -c /dev/kvm ]]; then
  log "no /dev/kvm: tcg"
  answer tcg
  exit 0
fi

console=$(mktemp)
trap 'rm -f "$console"' EXIT
# -no-reboot, no disk, no network: the kernel's first lines are all we need.
timeout "$((WAIT + 5))" qemu-system-x86_64 -accel kvm -m 256 -display none -no-reboot -nodefaults \
  -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initrd.img" -append "console=ttyS0" \
  -serial "file:$console" >/dev/null 2>&1 &
qemu=$!
booted=0
for _ in $(seq 1 $((WAIT * 4))); do
  if grep -q "Linux version" "$console" 2>/dev/null; then
    booted=1
    break
  fi
  kill -0 "$qemu" 2>/dev/null || break
  sleep 0.25
done
kill "$qemu" 2>/dev/null || true
wait "$qemu" 2>/dev/null || true

if ((booted)); then
  log "the guest kernel boots under KVM: kvm"
  answer kvm
else
  log "the guest kernel did not print its first line under KVM within ${WAIT}s (KVM here runs firmware only): tcg"
  answer tcg
fi
