#!/usr/bin/env bash
# A real vSphere API server (govmomi's simulator, vcsim) on 127.0.0.1 only,
# for vmlet's vSphere tests: vim25 SOAP at https://127.0.0.1:PORT/sdk.
#
#   hack/vsphere.sh build   build the simulator (once; again when hack/vsphere/ changes)
#   hack/vsphere.sh up      start it unless it runs (this build); wait until /sdk answers
#   hack/vsphere.sh down    stop what `up` started (its pid file)
#   hack/vsphere.sh status  whether it runs
#   hack/vsphere.sh env     sourceable exports (VMLET_VSPHERE_*; _PID_FILE names the
#                           simulator's process, which a fault test stops and continues)
#
# Inventory: datacenter DC0, cluster DC0_C0 of hosts DC0_C0_H0..H2, the
# standalone host DC0_H0, templates template-c0 and template-h0, and
# DC0_C0_RP0_VM1 owned by vmlet (extraConfig vmlet.io.uid, see
# hack/vsphere/main.go). TLS with a CA made at each start: ca.pem and the
# server certificate's SHA-256 thumbprint are in the state directory.
#
# Settings: VMLET_CACHE (binary, default ~/.cache/vmlet), VMLET_VSPHERE_DIR
# (state and log, default /tmp/vmlet-vsphere), VMLET_VSPHERE_PORT (18989),
# VMLET_VSPHERE_UP_TIMEOUT (30 s).
set -euo pipefail

SRC=$(cd "$(dirname "$0")" && pwd)/vsphere
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
STATE=${VMLET_VSPHERE_DIR:-/tmp/vmlet-vsphere}
PORT=${VMLET_VSPHERE_PORT:-18989}
UP_TIMEOUT=${VMLET_VSPHERE_UP_TIMEOUT:-30}
GOVMOMI=v0.56.0
BIN_DIR=$CACHE/vcsim-$GOVMOMI
BIN=$BIN_DIR/vmlet-vcsim
USERNAME=vmlet
PASSWORD=vmlet-vsphere
# The UID the harness puts on DC0_C0_RP0_VM1.
OWNED_UID=00000000-0000-4000-8000-000000000001
PIDFILE=$STATE/vcsim.pid
LOG=$STATE/vcsim.log
URL=https://127.0.0.1:$PORT/sdk

log() { echo "vsphere.sh: $*" >&2; }
die() { log "$*"; exit 1; }

source_hash() {
  cat "$SRC/main.go" "$SRC/go.mod" "$SRC/go.sum" | sha256sum | cut -c1-16
}

# The binary is rebuilt only when hack/vsphere/ changed; the hash is written
# last, so an interrupted build is redone.
build() {
  local hash started=$SECONDS
  hash=$(source_hash)
  [[ -x $BIN && -f $BIN_DIR/source-hash && $(<"$BIN_DIR/source-hash") == "$hash" ]] && return 0
  command -v go >/dev/null || die "go is not installed (README: Prerequisites)"
  log "building $BIN (govmomi $GOVMOMI from the Go module proxy; about a minute)"
  mkdir -p "$BIN_DIR"
  rm -f "$BIN_DIR/source-hash"
  (cd "$SRC" && GOFLAGS=-mod=readonly timeout 900 go build -trimpath -o "$BIN.tmp" .) ||
    die "go build failed in $SRC"
  mv "$BIN.tmp" "$BIN"
  echo "$hash" >"$BIN_DIR/source-hash"
  log "built in $((SECONDS - started)) s"
}

# pid_ours: the recorded process runs and is the simulator this script
# started for this state directory (not a recycled pid).
pid_ours() {
  local pid
  [[ -f $PIDFILE ]] || return 1
  pid=$(<"$PIDFILE")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF "VMLET_VSPHERE_DIR=$STATE"
}

# answers: /sdk serves RetrieveServiceContent over TLS verified with ca.pem.
answers() {
  [[ -f $STATE/ca.pem && -f $STATE/thumbprint ]] || return 1
  curl -fsS -m 3 -o /dev/null --cacert "$STATE/ca.pem" -H 'Content-Type: text/xml; charset=utf-8' \
    -H 'SOAPAction: urn:vim25/6.5' --data-binary @- "$URL" 2>/dev/null <<'EOF'
<?xml version="1.0" encoding="UTF-8"?>
<soapenv:Envelope xmlns:soapenv="http://schemas.xmlsoap.org/soap/envelope/"><soapenv:Body><RetrieveServiceContent xmlns="urn:vim25"><_this type="ServiceInstance">ServiceInstance</_this></RetrieveServiceContent></soapenv:Body></soapenv:Envelope>
EOF
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null
}

up() {
  local t0=$SECONDS deadline
  build
  # Reused only while it runs the binary of the current source.
  if pid_ours && answers && [[ $(cat "$STATE/source-hash" 2>/dev/null) == $(<"$BIN_DIR/source-hash") ]]; then
    log "already running (pid $(<"$PIDFILE")): $URL"
    return 0
  fi
  down >/dev/null
  port_free || die "127.0.0.1:$PORT is taken by something hack/vsphere.sh did not start"
  rm -rf "$STATE"
  mkdir -p "$STATE"
  t0=$SECONDS
  setsid env VMLET_VSPHERE_DIR="$STATE" "$BIN" -l "127.0.0.1:$PORT" -username "$USERNAME" \
    -password "$PASSWORD" -state "$STATE" -uid "$OWNED_UID" >"$LOG" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDFILE"
  cp "$BIN_DIR/source-hash" "$STATE/source-hash"
  deadline=$((SECONDS + UP_TIMEOUT))
  until answers; do
    if ! kill -0 "$(<"$PIDFILE")" 2>/dev/null; then
      tail -n 40 "$LOG" >&2
      die "the simulator exited (log $LOG)"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 40 "$LOG" >&2
      down
      die "/sdk did not answer within $UP_TIMEOUT s (log $LOG)"
    fi
    sleep 0.2
  done
  log "ready in $((SECONDS - t0)) s: $URL (thumbprint $(<"$STATE/thumbprint")); log $LOG; env: hack/vsphere.sh env"
}

# SIGTERM to the simulator's process group, SIGKILL after 10 s.
down() {
  local pid i
  if ! pid_ours; then
    rm -f "$PIDFILE"
    log "not running"
    return 0
  fi
  pid=$(<"$PIDFILE")
  kill -TERM -- "-$pid" 2>/dev/null || true
  for i in $(seq 50); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 -- "-$pid" 2>/dev/null; then
    log "pgid $pid still there after 10 s: SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
  log "stopped"
}

status() {
  pid_ours || { echo "vcsim: not running"; return 3; }
  echo "vcsim: running (pid $(<"$PIDFILE"), log $LOG)"
  answers || { echo "vcsim: $URL does not answer"; return 1; }
}

print_env() {
  [[ -f $STATE/thumbprint ]] || die "no $STATE/thumbprint: run hack/vsphere.sh up first"
  cat <<EOF
export VMLET_VSPHERE_URL=$URL
export VMLET_VSPHERE_USERNAME=$USERNAME
export VMLET_VSPHERE_PASSWORD=$PASSWORD
export VMLET_VSPHERE_THUMBPRINT=$(<"$STATE/thumbprint")
export VMLET_VSPHERE_CA_FILE=$STATE/ca.pem
export VMLET_VSPHERE_OWNED_UID=$OWNED_UID
export VMLET_VSPHERE_LOG=$LOG
export VMLET_VSPHERE_PID_FILE=$PIDFILE
EOF
}

# One build/up/down at a time per state directory.
lock() {
  [[ $STATE == /*/* ]] || die "VMLET_VSPHERE_DIR=$STATE: want an absolute path below a directory (it is wiped)"
  mkdir -p "$(dirname "$STATE")"
  exec 9>"$STATE.lock"
  flock -w 300 9 || die "another hack/vsphere.sh holds $STATE.lock"
}

case ${1:-} in
  build) lock; build; echo "$BIN" ;;
  up) lock; up ;;
  down) lock; down ;;
  status) status ;;
  env) print_env ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
