#!/usr/bin/env bash
# Build vmlet's tiny test guest from Debian packages only:
#
#   vmlinuz        Debian's cloud kernel (linux-image-cloud-amd64), booted directly
#   initrd.img     busybox-static, the virtio modules the guest needs and those
#                  that read a cloud-init seed CD-ROM (with their dependencies
#                  from modules.dep), Debian's qemu-guest-agent with the shared
#                  libraries and loader it links, and an /init that brings it all
#                  up (busybox acpid powers off on the ACPI power button), reads
#                  a NoCloud seed if one is attached, and keeps a shell on the
#                  serial console
#   disk.qcow2     a small empty qcow2 disk (shows up as /dev/vda)
#   cmdline        the kernel command line to boot with (console=ttyS0 ...)
#   kernel-release `uname -r` of the guest kernel
#   packages.txt   the Debian packages (name version) the guest is made of
#
#   test-vms/guest/build.sh        print the output directory as the last line
#
# Output: ${VMLET_CACHE:-$HOME/.cache/vmlet}/guest-<key>/, where <key> hashes this
# script and the candidate versions of the packages; a rerun with nothing changed
# only checks versions and prints the directory (a few seconds). Needs root (apt).
#
# Boot it under QEMU software emulation (libvirt <domain type='qemu'>) with
# <kernel>vmlinuz</kernel>, <initrd>initrd.img</initrd>, the command line from
# `cmdline`, a pty serial console, a virtio-serial channel named
# org.qemu.guest_agent.0 and a virtio NIC on a network with DHCP (the test
# harness's: libvirt network vmlet-lan from hack/libvirtd.sh, or bridge vmlan0 on
# hack/hosts.sh's hosts). The console then shows
#
#   vmlet-guest: modules loaded
#   vmlet-guest: no cloud-init seed      (or: vmlet-guest: cloud-init seed <instance-id> hostname <name>)
#   vmlet-guest: qemu-ga on /dev/vport1p1
#   vmlet-guest: eth0 10.239.0.123       (or: vmlet-guest: no DHCP lease on eth0 yet; udhcpc keeps trying)
#   vmlet-guest: user-data exited 0      (only with a seed whose user-data is a #! script)
#   vmlet-guest: booted
#
# followed by a root shell (`vmlet-guest# `) that restarts when it exits.
#
# DHCP: busybox udhcpc keeps running (restarted if it exits) and sends the
# guest's hostname. Init waits for the first lease about as long as a single
# 3-try attempt takes (~3 s), then boots on; without a lease udhcpc keeps
# asking, and it renews the lease. Each new address prints `vmlet-guest: eth0
# <ip>` again on the console (a renewal of the same address prints nothing).
# Only the address and, if the server sends one, a default route are set.
#
# For tests on the network, busybox's applets are all linked in /bin, among
# them httpd, nc and wget (the build fails if one of those is missing), and
# /www/index.html holds the guest's hostname: `httpd -p 8080 -h /www` (started
# through the guest agent's guest-exec, or on the console; it daemonizes)
# serves it. Debian 12's busybox 1.35 wget dies of SIGSEGV with -T: bound a
# request with `nc -w <seconds>` (or `timeout`) instead.
#
# cloud-init, in miniature: the guest reads a NoCloud seed
# (https://cloudinit.readthedocs.io/en/latest/reference/datasources/nocloud.html),
# the ISO 9660 file system labelled cidata that vmlet's libvirt provider
# attaches as an IDE CD-ROM. It mounts it read-only at /run/cidata, sets the
# hostname from meta-data's local-hostname, and runs user-data when it is a
# script (starts with #!), once per boot (the guest keeps no state between
# boots), after the network is up. It is no cloud-init: #cloud-config YAML,
# MIME multipart, network-config and vendor-data are not interpreted.
set -euo pipefail

CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
ARCH=amd64
# The drivers the guest loads, in addition to their dependencies: virtio, the
# ACPI power button, and the IDE CD-ROM a cloud-init seed comes on (the PIIX
# IDE controller of QEMU's 'pc' machine, SCSI CD-ROM, ISO 9660).
MODULES=(virtio_pci virtio_console virtio_blk virtio_net virtio_balloon virtio-rng button evdev
  ata_piix sr_mod isofs)
# Packages whose files end up in the guest besides the kernel and busybox: the
# agent and what its binary links (checked below: a missing library fails the build).
AGENT_PACKAGES=(qemu-guest-agent libc6 libglib2.0-0 libnuma1 libudev1 liburing2 libpcre2-8-0
  libffi8 libmount1 libblkid1 libselinux1 zlib1g)
DISK_SIZE=64M

log() { echo "guest-build: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (apt-get download, apt-get install of missing tools)"

# Tools: qemu-img (qemu-utils), cpio, gzip, and xz/zstd for kernels that compress
# their modules; depmod comes from kmod or, failing that, from the downloaded busybox.
ensure_tools() {
  local missing=()
  command -v qemu-img >/dev/null || missing+=(qemu-utils)
  command -v cpio >/dev/null || missing+=(cpio)
  command -v gzip >/dev/null || missing+=(gzip)
  command -v sha256sum >/dev/null || missing+=(coreutils)
  command -v xz >/dev/null || missing+=(xz-utils)   # compressed modules (.ko.xz)
  command -v zstd >/dev/null || missing+=(zstd)     # compressed modules (.ko.zst)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 ||
      { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2; }
  fi
}

# candidate <package>: the version apt would download, empty when unknown.
candidate() {
  apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2; exit }' | grep -v '(none)' || true
}

ensure_tools

# Refresh the package lists once if apt knows nothing yet (fresh container).
if [[ -z $(candidate linux-image-cloud-$ARCH) ]]; then
  log "apt knows no linux-image-cloud-$ARCH; running apt-get update"
  apt-get update -q >&2
fi

# The versioned kernel package behind the metapackage, e.g. linux-image-6.1.0-57-cloud-amd64.
KERNEL_PKG=$(apt-cache depends "linux-image-cloud-$ARCH" 2>/dev/null |
  awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
[[ -n $KERNEL_PKG ]] || die "cannot resolve linux-image-cloud-$ARCH to a kernel package"

PACKAGES=("$KERNEL_PKG" busybox-static "${AGENT_PACKAGES[@]}")
# One apt-cache call for all candidates (each call parses the package lists).
declare -A VERSION=()
while read -r pkg version; do
  VERSION[$pkg]=$version
done < <(apt-cache policy "${PACKAGES[@]}" 2>/dev/null |
  awk '/^[^ ].*:$/ { pkg = substr($0, 1, length($0) - 1) } /^  Candidate:/ { print pkg, $2 }')
manifest=""
for pkg in "${PACKAGES[@]}"; do
  version=${VERSION[$pkg]:-}
  [[ -n $version && $version != "(none)" ]] || die "apt has no candidate for $pkg (apt-get update?)"
  manifest+="$pkg $version"$'\n'
done

KEY=$( { sha256sum <"${BASH_SOURCE[0]}"; printf '%s' "$manifest"; } | sha256sum | cut -c1-16)
OUT=$CACHE/guest-$KEY
if [[ -s $OUT/vmlinuz && -s $OUT/initrd.img && -s $OUT/disk.qcow2 ]]; then
  log "cached: $OUT"
  echo "$OUT"
  exit 0
fi

mkdir -p "$CACHE"
WORK=$(mktemp -d "$CACHE/.guest-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"
log "building $OUT"

# --- download and unpack ---------------------------------------------------------
mkdir -p "$WORK/debs" "$WORK/kernel" "$WORK/busybox" "$WORK/agent" "$WORK/out"
(
  cd "$WORK/debs"
  pkgs=()
  while read -r pkg version; do [[ -n $pkg ]] && pkgs+=("$pkg=$version"); done <<<"$manifest"
  apt-get download -q "${pkgs[@]}" >&2
)
for deb in "$WORK"/debs/*.deb; do
  case $(basename "$deb") in
    linux-image-*) dpkg-deb -x "$deb" "$WORK/kernel" ;;
    busybox-static_*) dpkg-deb -x "$deb" "$WORK/busybox" ;;
    *) dpkg-deb -x "$deb" "$WORK/agent" ;;
  esac
done

RELEASE=$(basename "$(ls -d "$WORK"/kernel/lib/modules/*/)")
[[ -n $RELEASE ]] || die "no modules directory in $KERNEL_PKG"
BUSYBOX=$WORK/busybox/bin/busybox
[[ -x $BUSYBOX ]] || die "busybox-static has no /bin/busybox"

# --- the initramfs tree ------------------------------------------------------------
ROOT=$WORK/root
mkdir -p "$ROOT"/{bin,sbin,dev,proc,sys,run,tmp,etc,root,var/log,usr/share/udhcpc,lib/modules}
ln -s ../run "$ROOT/var/run"
chmod 1777 "$ROOT/tmp"
cp "$BUSYBOX" "$ROOT/bin/busybox"
APPLETS=$("$BUSYBOX" --list)
for applet in $APPLETS; do
  [[ $applet == busybox ]] || ln -sf busybox "$ROOT/bin/$applet"
done
# What /init and the network tests use.
for applet in udhcpc ip httpd nc wget setsid cttyhack acpid findfs; do
  grep -qx "$applet" <<<"$APPLETS" || die "busybox-static ${VERSION[busybox-static]} has no $applet applet"
done

# Modules: depmod over the unpacked tree, then each wanted module after its
# dependencies (modules.dep lists them all, transitively).
MODDIR=$WORK/kernel/lib/modules/$RELEASE
if command -v depmod >/dev/null; then
  depmod -b "$WORK/kernel" "$RELEASE"
else
  "$BUSYBOX" depmod -b "$WORK/kernel" "$RELEASE"
fi
declare -A DEPS=() LOADED=()
while IFS= read -r line; do
  DEPS[${line%%:*}]=${line#*:}
done <"$MODDIR/modules.dep"
ORDER=()
add_module() { # add_module <path relative to the modules dir>
  local path=$1 dep
  [[ -n ${LOADED[$path]:-} ]] && return 0
  LOADED[$path]=1
  for dep in ${DEPS[$path]}; do add_module "$dep"; done
  ORDER+=("$path")
}
declare -A BY_NAME=()
for path in "${!DEPS[@]}"; do
  base=${path##*/}
  base=${base%%.ko*}
  BY_NAME[${base//-/_}]=$path
done
for name in "${MODULES[@]}"; do
  path=${BY_NAME[${name//-/_}]:-}
  if [[ -z $path ]]; then
    grep -q "/${name}.ko" "$MODDIR/modules.builtin" && continue
    die "module $name is neither in $KERNEL_PKG nor built in"
  fi
  add_module "$path"
done
: >"$ROOT/etc/modules"
for path in "${ORDER[@]}"; do
  target=$ROOT/lib/modules/$(basename "${path%%.ko*}").ko
  case $path in
    *.ko.xz) xz -dc "$MODDIR/$path" >"$target" ;;
    *.ko.zst) zstd -qdc "$MODDIR/$path" >"$target" ;;
    *.ko.gz) gzip -dc "$MODDIR/$path" >"$target" ;;
    *) cp "$MODDIR/$path" "$target" ;;
  esac
  echo "/lib/modules/$(basename "$target")" >>"$ROOT/etc/modules"
done
log "modules: $(tr '\n' ' ' <"$ROOT/etc/modules")"

# qemu-ga and the libraries it links, resolved by the packaged loader (what ldd
# does) against the unpacked libraries only; copied to their usual paths.
AGENT=$WORK/agent
LOADER=$AGENT/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
[[ -x $AGENT/usr/sbin/qemu-ga && -f $LOADER ]] || die "qemu-guest-agent or libc6 unpacked incompletely"
LIBPATH=$AGENT/lib/x86_64-linux-gnu:$AGENT/usr/lib/x86_64-linux-gnu
libs=$("$LOADER" --library-path "$LIBPATH" --list "$AGENT/usr/sbin/qemu-ga")
if grep -q 'not found' <<<"$libs"; then
  die "qemu-ga needs libraries none of ${AGENT_PACKAGES[*]} has: $(grep 'not found' <<<"$libs" | tr -s ' \t\n' ' ')"
fi
mkdir -p "$ROOT/usr/sbin" "$ROOT/lib64" "$ROOT/lib/x86_64-linux-gnu" "$ROOT/usr/lib/x86_64-linux-gnu"
cp "$AGENT/usr/sbin/qemu-ga" "$ROOT/usr/sbin/qemu-ga"
while read -r lib; do
  [[ $lib == "$AGENT"/* ]] || continue
  cp -L "$lib" "$ROOT/${lib#"$AGENT"/}"
done < <(awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }' <<<"$libs")
cp -L "$LOADER" "$ROOT/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
ln -sf /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$ROOT/lib64/ld-linux-x86-64.so.2"

cat >"$ROOT/usr/share/udhcpc/default.script" <<'EOF'
#!/bin/sh
# busybox udhcpc hook: configure the leased address, route and resolver. The
# address in use is kept in /run/udhcpc.<interface> (init waits for it); a
# renewal of the same address leaves the interface alone, so connections stay.
state=/run/udhcpc.$interface
case "$1" in
  deconfig)
    ip -4 addr flush dev "$interface"
    ip link set "$interface" up
    rm -f "$state"
    ;;
  bound|renew)
    if [ "$(cat "$state" 2>/dev/null)" != "$ip/${mask:-24}" ]; then
      ip -4 addr flush dev "$interface"
      ip addr add "$ip/${mask:-24}" dev "$interface"
      for r in $router; do ip route add default via "$r" dev "$interface"; break; done
      echo "vmlet-guest: $interface $ip"
      echo "$ip/${mask:-24}" >"$state"
    fi
    : >/etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
    ;;
esac
exit 0
EOF
chmod 755 "$ROOT/usr/share/udhcpc/default.script"

mkdir -p "$ROOT/etc/acpi/PWRF"
cat >"$ROOT/etc/acpi/PWRF/00000080" <<'EOF'
#!/bin/sh
echo "vmlet-guest: ACPI power button: powering off" >/dev/console
sync
poweroff -f
EOF
chmod 755 "$ROOT/etc/acpi/PWRF/00000080"

cat >"$ROOT/init" <<'EOF'
#!/bin/sh
# vmlet test guest: bring up the virtio devices, the guest agent and the network,
# then keep a root shell on the serial console. A minimal NoCloud consumer: with
# a seed (file system labelled cidata) it takes meta-data's local-hostname and
# runs user-data when that is a #! script; it does not interpret #cloud-config
# YAML, MIME multipart, network-config or vendor-data (that takes cloud-init).
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root PS1='vmlet-guest# ' TERM=${TERM:-vt100}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
hostname vmlet-guest
echo vmlet-guest >/etc/hostname
echo "vmlet-guest: init on $(uname -r)"

while read -r module; do
  insmod "$module" || echo "vmlet-guest: insmod $module failed"
done </etc/modules
echo "vmlet-guest: modules loaded"

# cloud-init's NoCloud seed: the file system labelled cidata (or CIDATA), found
# by busybox findfs. No udev: a CD-ROM's medium may need a moment to be read,
# so wait a little while a CD-ROM drive exists; without one, do not wait.
seed=""
i=0
while :; do
  seed=$(findfs LABEL=cidata 2>/dev/null || findfs LABEL=CIDATA 2>/dev/null) && break
  seed=""
  ls -d /sys/class/block/sr* >/dev/null 2>&1 && [ $i -lt 30 ] || break
  sleep 0.1
  i=$((i + 1))
done
# meta <key>: the value of meta-data's top-level `key: value` line, unquoted.
meta() {
  sed -n "s/^$1:[[:space:]]*//p" /run/cidata/meta-data | head -n 1 |
    sed -e 's/[[:space:]]*$//' -e 's/^"\(.*\)"$/\1/' -e "s/^'\(.*\)'$/\1/"
}
cidata=""
if [ -n "$seed" ] && mkdir -p /run/cidata && mount -o ro "$seed" /run/cidata; then
  cidata=/run/cidata
  name=$(meta local-hostname)
  if [ -n "$name" ]; then
    hostname "$name"
    echo "$name" >/etc/hostname
  fi
  echo "vmlet-guest: cloud-init seed $(meta instance-id) hostname $(hostname)"
elif [ -n "$seed" ]; then
  echo "vmlet-guest: cloud-init seed on $seed cannot be mounted"
else
  echo "vmlet-guest: no cloud-init seed"
fi

# The agent's port: no udev, so find the vport whose name is the agent's.
port=""
i=0
while [ -z "$port" ] && [ $i -lt 50 ]; do
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && port=/dev/${p##*/}
  done
  [ -n "$port" ] || { sleep 0.1; i=$((i + 1)); }
done
if [ -n "$port" ]; then
  # Restarted if it exits; its log stays in the guest (/run/qemu-ga.log).
  (while :; do qemu-ga --method=virtio-serial --path="$port" --statedir=/run --logfile=/run/qemu-ga.log; sleep 1; done) &
  echo "vmlet-guest: qemu-ga on $port"
else
  echo "vmlet-guest: no virtio-serial port org.qemu.guest_agent.0; qemu-ga not started"
fi

# The ACPI power button (virsh shutdown) powers the guest off, as a guest OS
# with acpid would: busybox acpid reads the button's input device and runs
# /etc/acpi/PWRF/00000080.
if ls /dev/input/event* >/dev/null 2>&1; then
  acpid -c /etc/acpi -l /run/acpid.log
  echo "vmlet-guest: acpid started"
else
  echo "vmlet-guest: no input devices; the power button is ignored"
fi

# What `httpd -p <port> -h /www` serves: the guest's name.
mkdir -p /www
hostname >/www/index.html

ip link set lo up
if ip link show eth0 >/dev/null 2>&1; then
  # udhcpc in the foreground of a background loop: it asks until it has a lease
  # (3 discovers 1 s apart, then 3 s pause, again), renews it, and is started
  # again if it exits. Its hook prints `vmlet-guest: eth0 <ip>` for each new
  # address and records it in /run/udhcpc.eth0.
  (while :; do
    udhcpc -f -i eth0 -t 3 -T 1 -A 3 -x "hostname:$(hostname)" -s /usr/share/udhcpc/default.script 2>/dev/null
    sleep 1
  done) &
  # Boot on after about as long as a single 3-try attempt took (~3 s).
  i=0
  while [ ! -s /run/udhcpc.eth0 ] && [ $i -lt 35 ]; do
    sleep 0.1
    i=$((i + 1))
  done
  [ -s /run/udhcpc.eth0 ] || echo "vmlet-guest: no DHCP lease on eth0 yet; udhcpc keeps trying"
else
  echo "vmlet-guest: no eth0"
fi

# user-data that is a script runs once, after the network, as cloud-init's
# scripts-user does, from a copy (the seed's files are not executable); its
# output goes to the console and /var/log/cloud-init-output.log.
if [ -n "$cidata" ] && [ "$(head -c 2 "$cidata/user-data" 2>/dev/null)" = "#!" ]; then
  cp "$cidata/user-data" /run/user-data
  chmod 700 /run/user-data
  { /run/user-data </dev/null 2>&1; echo $? >/run/user-data.exit; } | tee -a /var/log/cloud-init-output.log
  echo "vmlet-guest: user-data exited $(cat /run/user-data.exit)"
fi

echo "vmlet-guest: booted"
cd /root
while :; do
  setsid cttyhack sh -l
  echo "vmlet-guest: shell exited; starting another"
done
EOF
chmod 755 "$ROOT/init"

# --- outputs -----------------------------------------------------------------------
(cd "$ROOT" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) | gzip -9n >"$WORK/out/initrd.img"
cp "$WORK/kernel/boot/vmlinuz-$RELEASE" "$WORK/out/vmlinuz"
qemu-img create -q -f qcow2 "$WORK/out/disk.qcow2" "$DISK_SIZE"
echo "$RELEASE" >"$WORK/out/kernel-release"
echo "console=ttyS0" >"$WORK/out/cmdline"
printf '%s' "$manifest" >"$WORK/out/packages.txt"
chmod 644 "$WORK"/out/*
chmod 755 "$WORK/out"

rm -rf "$OUT"
mv "$WORK/out" "$OUT"
log "built $OUT: kernel $RELEASE, initrd $(du -h "$OUT/initrd.img" | cut -f1)"
echo "$OUT"
