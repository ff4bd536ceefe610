#!/usr/bin/env bash
# A real OpenStack Nova API behind a real Keystone, on 127.0.0.1 only, for
# vmlet's integration tests. See hack/nova/README.md.
#
#   hack/nova.sh up       (re)start Keystone, Placement, Nova and Cinder; wait
#                         until a token can be had, all fake hypervisors are
#                         up and Cinder's volume service is up
#   hack/nova.sh down     stop what `up` started (process groups in pids/)
#   hack/nova.sh status   what runs
#   hack/nova.sh env      sourceable exports (OS_* and VMLET_NOVA_*)
#   hack/nova.sh logs [NAME]  log paths and tails (NAME: nova, keystone, ...)
#   hack/nova.sh venv     only make the venv (if missing); print its path
#
# Settings: VMLET_CACHE (venv parent, default ~/.cache/vmlet), VMLET_NOVA_DIR
# (state and logs, default /tmp/vmlet-nova, wiped on `up`),
# VMLET_KEYSTONE_PORT (35357), VMLET_NOVA_PORT (18774),
# VMLET_PLACEMENT_PORT (18778), VMLET_CINDER_PORT (18776),
# VMLET_NOVA_UP_TIMEOUT (240 s),
# VMLET_NOVA_DEBUG=1 for debug logs.
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)/nova
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
STATE=${VMLET_NOVA_DIR:-/tmp/vmlet-nova}
KEYSTONE_PORT=${VMLET_KEYSTONE_PORT:-35357}
NOVA_PORT=${VMLET_NOVA_PORT:-18774}
PLACEMENT_PORT=${VMLET_PLACEMENT_PORT:-18778}
CINDER_PORT=${VMLET_CINDER_PORT:-18776}
UP_TIMEOUT=${VMLET_NOVA_UP_TIMEOUT:-240}
DEBUG=$([[ ${VMLET_NOVA_DEBUG:-} == 1 ]] && echo true || echo false)

KEYSTONE_URL=http://127.0.0.1:$KEYSTONE_PORT/v3
NOVA_URL=http://127.0.0.1:$NOVA_PORT/v2.1
PLACEMENT_URL=http://127.0.0.1:$PLACEMENT_PORT
CINDER_URL="http://127.0.0.1:$CINDER_PORT/v3/%(project_id)s"
REGION=RegionOne
ADMIN_PASSWORD=vmlet-admin
SERVICE_PASSWORD=vmlet-service
VMLET_PASSWORD=vmlet
HOSTS=nova-a,nova-b,nova-c
ZONES=nova-a=az1,nova-b=az1,nova-c=az2
# What Nova's GlanceFixture and NeutronFixture serve (image1, network_1), and
# the second network hack/nova/vmlet_neutron.py adds (lan2).
IMAGE=155d900f-4e14-4e4c-a73d-069cbf4541e6
NETWORK=3cb9bc59-5699-4588-a4b1-b87f96708bc6
NETWORK_2=c2f1b6a4-6d0e-4d54-9a3e-7b1f0e5d2a42

LOGS=$STATE/logs
PIDS=$STATE/pids
ETC=$STATE/etc
SERVICES=(nova cinder placement keystone)

log() { echo "nova.sh: $*" >&2; }
die() { log "$*"; exit 1; }

venv_dir() {
  local hash
  hash=$(sha256sum "$HACK/constraints.txt" | cut -c1-12)
  echo "$CACHE/nova-venv-$hash"
}
VENV=$(venv_dir)
PY=$VENV/bin/python

# The venv is keyed by the hash of constraints.txt and made once; the marker
# is written last, so an interrupted install is redone from scratch.
ensure_venv() {
  local marker=$VENV/.vmlet-complete started=$SECONDS
  [[ -f $marker ]] && return 0
  log "creating $VENV (pip install, a few minutes; log $CACHE/nova-venv-install.log)"
  mkdir -p "$CACHE"
  rm -rf "$VENV"
  timeout 120 python3 -m venv "$VENV"
  if ! timeout 1200 "$VENV/bin/pip" install --no-input --progress-bar off \
      -c "$HACK/constraints.txt" -r "$HACK/requirements.txt" \
      >"$CACHE/nova-venv-install.log" 2>&1; then
    tail -n 40 "$CACHE/nova-venv-install.log" >&2
    die "pip install failed (log $CACHE/nova-venv-install.log)"
  fi
  date -u +%FT%TZ >"$marker"
  log "venv ready in $((SECONDS - started)) s ($(du -sh "$VENV" | cut -f1))"
}

# pid_ours PIDFILE: the recorded process still runs and was started by this
# script for this state directory (its environment says VMLET_NOVA_DIR=$STATE):
# not a recycled pid, nor the process of another harness on other ports.
pid_ours() {
  local pid
  [[ -f $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF "VMLET_NOVA_DIR=$STATE"
}

# start NAME ENV=... CMD...: run in a new session (its own process group,
# pgid = pid), output to logs/NAME.log, pid to pids/NAME.pid. NICE (default
# 0) is its niceness while `up` waits. The lock (fd 9) is not inherited.
start() {
  local name=$1
  shift
  setsid nice -n "${NICE:-0}" env VMLET_NOVA_DIR="$STATE" "$@" \
    >"$LOGS/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDS/$name.pid"
  # Until setsid/nice/env have exec'd the service, its environment lacks the
  # marker that pid_ours looks for.
  local i
  for i in $(seq 40); do
    pid_ours "$PIDS/$name.pid" && return 0
    kill -0 "$(<"$PIDS/$name.pid")" 2>/dev/null || return 0
    sleep 0.05
  done
}

# Stop the recorded services: SIGTERM to each process group at once, up to
# 10 s for all of them to go, then SIGKILL to what is left.
down() {
  local name pid i names=() pids=()
  [[ -d $PIDS ]] || { log "nothing recorded in $PIDS"; return 0; }
  for name in "${SERVICES[@]}"; do
    if pid_ours "$PIDS/$name.pid"; then
      pid=$(<"$PIDS/$name.pid")
      kill -TERM -- "-$pid" 2>/dev/null || true
      names+=("$name")
      pids+=("$pid")
    fi
    rm -f "$PIDS/$name.pid"
  done
  for i in $(seq 50); do
    for pid in "${pids[@]}"; do
      if kill -0 -- "-$pid" 2>/dev/null; then sleep 0.2; continue 2; fi
    done
    break
  done
  for i in "${!pids[@]}"; do
    if kill -0 -- "-${pids[$i]}" 2>/dev/null; then
      log "${names[$i]} (pgid ${pids[$i]}) still there after 10 s: SIGKILL"
      kill -KILL -- "-${pids[$i]}" 2>/dev/null || true
    fi
    log "${names[$i]} stopped"
  done
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# free_port PORT: stop the listener on 127.0.0.1:PORT if this script started
# it for this state directory but lost its pid file (the directory was wiped
# by an `up` of another checkout); any other listener is left alone.
free_port() {
  local pid i
  port_free "$1" && return 0
  pid=$(ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2)
  [[ -n $pid ]] && { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF "VMLET_NOVA_DIR=$STATE" || return 1
  log "127.0.0.1:$1: stopping pid $pid, left running by an earlier up of $STATE"
  kill -TERM -- "-$(ps -o pgid= "$pid" | tr -d ' ')" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 50); do port_free "$1" && return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  sleep 0.5
  port_free "$1"
}

write_configs() {
  mkdir -p "$ETC/keystone" "$ETC/nova" "$ETC/placement" "$ETC/cinder" "$STATE/keystone" \
    "$STATE/nova/instances" "$STATE/nova/locks" "$STATE/cinder/locks"
  # Password hashing is cheap and token validation is cached in-process:
  # tokens are checked on every Nova and Placement request.
  cat >"$ETC/keystone/keystone.conf" <<EOF
[DEFAULT]
debug = $DEBUG
use_stderr = true
[database]
connection = sqlite:///$STATE/keystone/keystone.sqlite
[token]
provider = fernet
[fernet_tokens]
key_repository = $STATE/keystone/fernet-keys
[fernet_receipts]
key_repository = $STATE/keystone/fernet-keys
[credential]
key_repository = $STATE/keystone/credential-keys
[identity]
password_hash_rounds = 4
[cache]
enabled = true
backend = dogpile.cache.memory
EOF
  # password_auth USER: keystoneauth's password plugin for service user
  # USER in project `service` (the lines every [section] below shares).
  password_auth() {
    cat <<EOF
auth_type = password
auth_url = $KEYSTONE_URL
username = $1
password = $SERVICE_PASSWORD
project_name = service
user_domain_name = Default
project_domain_name = Default
EOF
  }
  authtoken() {
    echo "[keystone_authtoken]"
    echo "www_authenticate_uri = $KEYSTONE_URL"
    password_auth "$1"
    echo "region_name = $REGION"
    echo "interface = public"
  }
  {
    cat <<EOF
[DEFAULT]
debug = $DEBUG
use_stderr = true
[api]
auth_strategy = keystone
[placement_database]
connection = sqlite:///$STATE/placement.sqlite
sync_on_startup = true
EOF
    authtoken placement
  } >"$ETC/placement/placement.conf"
  cp "$VENV/etc/nova/api-paste.ini" "$ETC/nova/api-paste.ini"
  {
    cat <<EOF
[DEFAULT]
debug = $DEBUG
use_stderr = true
host = nova-ctl
my_ip = 127.0.0.1
state_path = $STATE/nova
instances_path = $STATE/nova/instances
compute_driver = vmlet_fake_driver.VmletFakeDriver
transport_url = fake:/
periodic_enable = false
report_interval = 10
service_down_time = 60
[wsgi]
api_paste_config = $ETC/nova/api-paste.ini
[api_database]
connection = sqlite:///$STATE/nova_api.sqlite
[database]
connection = sqlite:///$STATE/nova_cell1.sqlite
[oslo_concurrency]
lock_path = $STATE/nova/locks
[oslo_messaging_notifications]
driver = noop
[placement]
region_name = $REGION
valid_interfaces = public
$(password_auth nova)
[cinder]
os_region_name = $REGION
catalog_info = volumev3::publicURL
# Nova's service token with the user's: Cinder lets only Nova delete the
# attachments of a server (OSSA-2023-003), which it does when the server goes.
[service_user]
send_service_user_token = true
$(password_auth nova)
EOF
    authtoken nova
  } >"$ETC/nova/nova.conf"
  cp "$VENV/etc/cinder/api-paste.ini" "$ETC/cinder/api-paste.ini"
  # One cinder-volume backend, `fake`: Cinder's own FakeLoggingVolumeDriver
  # (shipped in its wheel), which needs no block devices. [nova] is how
  # cinder-volume tells Nova that an attached volume grew.
  {
    cat <<EOF
[DEFAULT]
debug = $DEBUG
use_stderr = true
host = cinder
my_ip = 127.0.0.1
state_path = $STATE/cinder
transport_url = fake:/
auth_strategy = keystone
api_paste_config = $ETC/cinder/api-paste.ini
osapi_volume_listen = 127.0.0.1
osapi_volume_listen_port = $CINDER_PORT
osapi_volume_workers = 1
enabled_backends = fake
scheduler_driver_init_wait_time = 10
[database]
connection = sqlite:///$STATE/cinder.sqlite
[oslo_concurrency]
lock_path = $STATE/cinder/locks
[coordination]
backend_url = file://$STATE/cinder/locks
[oslo_messaging_notifications]
driver = noop
[fake]
volume_driver = cinder.tests.fake_driver.FakeLoggingVolumeDriver
volume_backend_name = fake
[nova]
region_name = $REGION
interface = public
$(password_auth cinder)
EOF
    authtoken cinder
  } >"$ETC/cinder/cinder.conf"
}

# Keystone, the critical path of `up`: keystone-manage fernet_setup,
# credential_setup, db_sync and bootstrap (admin, project admin, region,
# identity endpoints) in one process (keystone_manage.py), while the server
# (started by `up`) imports Keystone and waits for the key repositories; then
# keystone_setup.py (service users, project vmlet, compute and placement
# endpoints). Runs in the background of `up`.
keystone_chain() {
  local i
  timeout 120 "$PY" "$HACK/keystone_manage.py" "$ETC/keystone/keystone.conf" \
    fernet_setup --keystone-user "$(id -un)" --keystone-group "$(id -gn)" -- \
    credential_setup --keystone-user "$(id -un)" --keystone-group "$(id -gn)" -- \
    db_sync -- \
    bootstrap --bootstrap-password "$ADMIN_PASSWORD" \
    --bootstrap-username admin --bootstrap-project-name admin \
    --bootstrap-role-name admin --bootstrap-service-name keystone \
    --bootstrap-region-id "$REGION" \
    --bootstrap-admin-url "$KEYSTONE_URL" --bootstrap-public-url "$KEYSTONE_URL" \
    --bootstrap-internal-url "$KEYSTONE_URL"
  for i in $(seq 240); do
    curl -fsS -m 2 -o /dev/null "$KEYSTONE_URL" 2>/dev/null && break
    pid_ours "$PIDS/keystone.pid" || { echo "keystone exited"; return 1; }
    sleep 0.25
  done
  KEYSTONE_URL=$KEYSTONE_URL OS_PASSWORD=$ADMIN_PASSWORD OS_REGION_NAME=$REGION \
    NOVA_URL=$NOVA_URL PLACEMENT_URL=$PLACEMENT_URL CINDER_URL=$CINDER_URL \
    SERVICE_PASSWORD=$SERVICE_PASSWORD VMLET_PASSWORD=$VMLET_PASSWORD \
    timeout 60 "$PY" "$HACK/keystone_setup.py"
}

print_env() {
  cat <<EOF
export OS_AUTH_URL=$KEYSTONE_URL
export OS_AUTH_TYPE=password
export OS_USERNAME=admin
export OS_PASSWORD=$ADMIN_PASSWORD
export OS_PROJECT_NAME=admin
export OS_USER_DOMAIN_NAME=Default
export OS_PROJECT_DOMAIN_NAME=Default
export OS_REGION_NAME=$REGION
export OS_INTERFACE=public
export OS_IDENTITY_API_VERSION=3
export VMLET_NOVA_URL=$NOVA_URL
export VMLET_CINDER_URL=http://127.0.0.1:$CINDER_PORT/v3
export VMLET_NOVA_IMAGE=$IMAGE
export VMLET_NOVA_NETWORK=$NETWORK
export VMLET_NOVA_NETWORK_2=$NETWORK_2
export VMLET_NOVA_HOSTS=$HOSTS
export VMLET_NOVA_ZONES=$ZONES
export VMLET_NOVA_USER_USERNAME=vmlet
export VMLET_NOVA_USER_PASSWORD=$VMLET_PASSWORD
export VMLET_NOVA_USER_PROJECT_NAME=vmlet
export VMLET_NOVA_LOG_DIR=$LOGS
EOF
}

tail_logs() {
  local f
  for f in "$LOGS"/*.log; do
    [[ -f $f ]] || continue
    echo "==> $f <==" >&2
    tail -n "${1:-25}" "$f" >&2
  done
}

up() {
  local t0=$SECONDS deadline name left
  ensure_venv
  down >/dev/null 2>&1 || true
  for port in "$KEYSTONE_PORT" "$PLACEMENT_PORT" "$NOVA_PORT" "$CINDER_PORT"; do
    free_port "$port" || die "127.0.0.1:$port is taken by something hack/nova.sh did not start"
  done
  rm -rf "$STATE"
  mkdir -p "$LOGS" "$PIDS"
  write_configs
  t0=$SECONDS
  deadline=$((SECONDS + UP_TIMEOUT))
  log "starting; logs in $LOGS"
  # Keystone's chain is the critical path on two cores: Nova and Placement
  # start niced so they take the CPU it leaves (Nova waits by itself for
  # Keystone and Placement); both are reniced to 0 once ready.
  NICE=10 start nova VMLET_NOVA_PORT="$NOVA_PORT" \
    VMLET_KEYSTONE_URL="$KEYSTONE_URL" \
    VMLET_NOVA_SERVICE_PASSWORD="$SERVICE_PASSWORD" VMLET_NOVA_HOSTS="$HOSTS" \
    VMLET_NOVA_ZONES="$ZONES" VMLET_NOVA_START_TIMEOUT="$((UP_TIMEOUT - 10))" \
    "$PY" "$HACK/serve.py"
  NICE=10 start cinder "$PY" "$HACK/cinder_serve.py"
  NICE=10 start placement OS_PLACEMENT_CONFIG_DIR="$ETC/placement" \
    "$PY" "$HACK/wsgi_serve.py" placement placement.wsgi.api:application "$PLACEMENT_PORT" 8
  start keystone OS_KEYSTONE_CONFIG_FILES="$ETC/keystone/keystone.conf" \
    WSGI_SERVE_PRELOAD=keystone.server.wsgi \
    WSGI_SERVE_WAIT_FOR="$STATE/keystone/fernet-keys/0:$STATE/keystone/credential-keys/0" \
    "$PY" "$HACK/wsgi_serve.py" keystone keystone.wsgi.api:application "$KEYSTONE_PORT" 8
  (keystone_chain >"$LOGS/keystone-setup.log" 2>&1) &
  local chain=$!
  local chain_done=
  eval "$(print_env)"
  while :; do
    if [[ -z $chain_done ]] && ! kill -0 "$chain" 2>/dev/null; then
      wait "$chain" || { tail_logs 40; down; die "Keystone setup failed (log $LOGS/keystone-setup.log)"; }
      chain_done=1
      log "keystone ready after $((SECONDS - t0)) s"
    fi
    for name in "${SERVICES[@]}"; do
      pid_ours "$PIDS/$name.pid" || { tail_logs 40; down; die "$name exited (log $LOGS/$name.log)"; }
    done
    left=$((deadline - SECONDS))
    if [[ -n $chain_done && -f $STATE/nova-ready && -f $STATE/cinder-ready ]] && ((left > 0)) &&
      timeout "$((left < 30 ? left : 30))" "$PY" "$HACK/smoke.py" --ready \
        >"$LOGS/ready-check.log" 2>&1; then
      break
    fi
    if ((SECONDS >= deadline)); then
      tail_logs 40
      cat "$LOGS/ready-check.log" >&2 2>/dev/null || true
      kill "$chain" 2>/dev/null || true
      down
      die "not ready within $UP_TIMEOUT s"
    fi
    sleep 1
  done
  cat "$LOGS/ready-check.log" >&2
  for name in nova cinder placement; do
    renice -n 0 -g "$(<"$PIDS/$name.pid")" >/dev/null
  done
  log "ready in $((SECONDS - t0)) s: Keystone $KEYSTONE_URL, Nova $NOVA_URL, Placement $PLACEMENT_URL, Cinder http://127.0.0.1:$CINDER_PORT/v3"
  log "logs: $LOGS/{nova,cinder,keystone,placement,keystone-setup}.log; env: hack/nova.sh env"
}

status() {
  local name any=
  for name in "${SERVICES[@]}"; do
    if pid_ours "$PIDS/$name.pid"; then
      echo "$name: running (pgid $(<"$PIDS/$name.pid"), log $LOGS/$name.log)"
      any=1
    else
      echo "$name: not running"
    fi
  done
  [[ -n $any ]] || return 3
  if [[ -f $STATE/nova-ready ]]; then
    eval "$(print_env)"
    timeout 30 "$PY" "$HACK/smoke.py" --ready || return 1
  fi
}

logs() {
  if [[ -n ${1:-} ]]; then
    tail -n 200 "$LOGS/$1.log"
  else
    ls -l "$LOGS"
    tail_logs 10
  fi
}

# One up/down at a time per state directory.
lock() {
  [[ $STATE == /*/* ]] || die "VMLET_NOVA_DIR=$STATE: want an absolute path below a directory (it is wiped)"
  mkdir -p "$(dirname "$STATE")"
  exec 9>"$STATE.lock"
  flock -w 300 9 || die "another hack/nova.sh holds $STATE.lock"
}

case ${1:-} in
  up) lock; up ;;
  down) lock; down ;;
  status) status ;;
  env) print_env ;;
  logs) logs "${2:-}" ;;
  venv) ensure_venv; echo "$VENV" ;;
  *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
