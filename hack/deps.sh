#!/usr/bin/env bash
# The one install step shared by .ci/run, hack/demo.sh and hack/test.sh: the Debian
# packages vmlet builds and tests with, checked with dpkg and installed (as root)
# only when missing, plus the toolchains, which it checks but does not install.
#
#   hack/deps.sh          everything hack/test.sh needs (libvirtd, qemu, tmux, ...)
#   hack/deps.sh build    only what building vmlet needs (hack/demo.sh)
#
# Exits 1 with a message naming the packages when something is missing and this
# is not root.
set -euo pipefail

log() { echo "deps: $*" >&2; }

# Building vmlet: the virt crate links libvirt through pkg-config.
BUILD=(libvirt-dev pkg-config openssl)
# Testing: a real libvirtd with QEMU, the guest image build (cpio, kmod), tmux
# for `kubectl attach -it`, for hack/hosts.sh's two hosts in namespaces ip
# (iproute2), unshare and nsenter (util-linux), mount, and genisoimage, with
# which the libvirt provider writes cloud-init seed images; curl, with which the
# service scripts (nova, vsphere, metrics-server) wait for their endpoints. The test networks
# (hack/libvirtd.sh's libvirt network vmlet-lan, hack/hosts.sh's shared guest
# LAN) need dnsmasq-base: libvirt starts dnsmasq for a network's DHCP, and
# hosts.sh runs one itself (only a Recommends of libvirt-daemon-system, so
# --no-install-recommends leaves it out). libvirt 9.0 also applies iptables
# rules when it starts any network, an isolated one too (without the binary
# `virsh net-start` fails: "cannot execute binary /usr/sbin/iptables"); the
# package's iptables-nft works here. It is libvirt-daemon-system's
# `iptables | firewalld` dependency, named so apt never picks firewalld.
TEST=(libvirt-daemon-system libvirt-clients qemu-system-x86 qemu-utils tmux kmod cpio iproute2 procps util-linux mount curl
  genisoimage dnsmasq-base iptables)

case ${1:-test} in
  build) want=("${BUILD[@]}") ;;
  test) want=("${BUILD[@]}" "${TEST[@]}") ;;
  *)
    echo "usage: $0 [build|test]" >&2
    exit 64
    ;;
esac
command -v cc >/dev/null 2>&1 || want+=(gcc libc6-dev)

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]]; then
    log "missing Debian packages: ${missing[*]}"
    log "install them as root: apt-get install ${missing[*]}"
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -q >/dev/null
  timeout 1200 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

for tool in go cargo; do
  command -v "$tool" >/dev/null 2>&1 || { log "$tool not found on PATH (Go and Rust are required)"; exit 1; }
done
