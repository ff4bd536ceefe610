#!/usr/bin/env bash
# metrics-server, built from its Go module, beside the local control plane
# (hack/cluster.sh), so that `kubectl top node` and `kubectl top pod` work on
# vmlet's nodes as on any cluster's.
#
#   hack/metrics-server.sh build   build it into the cache (idempotent)
#   hack/metrics-server.sh up      build if needed, bring the control plane up,
#                                  start it unless it runs, register the API
#                                  (RBAC, Service, APIService), wait until the
#                                  API server reports the APIService Available
#   hack/metrics-server.sh down    stop what `up` started (SIGKILL after 30 s)
#                                  and unregister the API
#   hack/metrics-server.sh env     print `export METRICS_SERVER_LOG=...`
#
# How it is wired, with no pod network and loopback only:
# - The API server's aggregator reaches it through the APIService
#   v1beta1.metrics.k8s.io, whose Service kube-system/metrics-server is an
#   ExternalName `localhost`: the aggregator dials that name at the
#   APIService's port and checks the serving cert (from the cluster CA,
#   pki/metrics-server-serving.*) for metrics-server.kube-system.svc against
#   the APIService's caBundle. It proves itself with the front proxy's client
#   cert (hack/cluster.sh sets the --requestheader-* and --proxy-client-*
#   flags).
# - metrics-server reads the API server and every node's kubelet API as
#   system:metrics-server (pki/metrics-server.*, from the cluster CA), with
#   the rights its upstream manifest grants (get nodes/metrics; get, list and
#   watch nodes and pods) plus those of an aggregated API server (read the
#   authentication ConfigMap, TokenReview and SubjectAccessReview). It dials
#   each Node's InternalIP at its status port (vmlet: one port per node) and
#   checks the kubelet's serving cert against the cluster CA. It leaves the
#   benchmarks' nodes (labelled vmlet.io/bench, vmlet.io/bench-baseline)
#   alone: a scrape of each every 10 s would be part of what they measure.
#
# The binary is cached in $VMLET_CACHE (default ~/.cache/vmlet) keyed by
# version; its pid file, log and kubeconfig are in the cluster directory
# ($VMLET_CLUSTER_DIR, default $VMLET_CACHE/cluster): run/, logs/.
# Settings: METRICS_SERVER_PORT (4443), METRICS_SERVER_UP_TIMEOUT (120 s).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
VERSION=v0.8.0
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
BIN=$CACHE/metrics-server-$VERSION/bin/metrics-server
DIR=${VMLET_CLUSTER_DIR:-$CACHE/cluster}
PORT=${METRICS_SERVER_PORT:-4443}
UP_TIMEOUT=${METRICS_SERVER_UP_TIMEOUT:-120}
PIDFILE=$DIR/run/metrics-server.pid
LOG=$DIR/logs/metrics-server.log
KUBECONFIG_FILE=$DIR/metrics-server.kubeconfig
APISERVICE=v1beta1.metrics.k8s.io

log() { echo "metrics-server.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# kubectl of the control plane, as its admin, each call bounded.
k() { timeout 60 "$KUBECTL" --kubeconfig "$DIR/admin.kubeconfig" "$@"; }

# The binary is written under a temporary name and renamed when complete, so
# an interrupted build is redone.
build() {
  [[ -x $BIN ]] && return 0
  command -v go >/dev/null || die "go is not installed (README: Prerequisites)"
  local src=$CACHE/src-metrics-server-$VERSION started=$SECONDS
  mkdir -p "$src" "$(dirname "$BIN")"
  log "building metrics-server $VERSION from the Go module proxy in $src (first time only; a few minutes)"
  (
    cd "$src"
    export GOFLAGS=-mod=mod GOWORK=off
    [[ -f go.mod ]] || go mod init vmlet.io/metrics-server >/dev/null 2>&1
    go mod edit -require "sigs.k8s.io/metrics-server@$VERSION"
    timeout 1800 go build -trimpath -ldflags "-s -w -X k8s.io/client-go/pkg/version.gitVersion=$VERSION" \
      -o "$BIN.tmp" sigs.k8s.io/metrics-server/cmd/metrics-server
  ) || die "go build failed in $src"
  mv -f "$BIN.tmp" "$BIN"
  log "built $BIN in $((SECONDS - started)) s"
}

running() { [[ -f $PIDFILE ]] && kill -0 "$(<"$PIDFILE")" 2>/dev/null; }

# Its health endpoint over TLS, its serving cert checked against the cluster CA.
answers() {
  curl -fsS -m 3 -o /dev/null --cacert "$DIR/pki/ca.crt" \
    --resolve "metrics-server.kube-system.svc:$PORT:127.0.0.1" \
    "https://metrics-server.kube-system.svc:$PORT/livez" 2>/dev/null
}

kubeconfig() {
  local c=$DIR/pki
  cat > "$KUBECONFIG_FILE.tmp.$$" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:${APISERVER_PORT:-6443}", certificate-authority: "$c/ca.crt"}
users:
- name: metrics-server
  user: {client-certificate: "$c/metrics-server.crt", client-key: "$c/metrics-server.key"}
contexts:
- name: local
  context: {cluster: local, user: metrics-server}
current-context: local
KC
  mv -f "$KUBECONFIG_FILE.tmp.$$" "$KUBECONFIG_FILE"
}

# What metrics-server may do, as user system:metrics-server (its client cert).
rbac() {
  k apply -f - >/dev/null <<'YAML'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:metrics-server"}
rules:
- {apiGroups: [""], resources: [nodes/metrics], verbs: [get]}
- {apiGroups: [""], resources: [nodes, pods], verbs: [get, list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:metrics-server"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:metrics-server"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
# An aggregated API server checks its callers' credentials and rights with
# the API server (TokenReview, SubjectAccessReview) ...
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "metrics-server:system:auth-delegator"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:auth-delegator"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
# ... and reads which CA and names the front proxy proves itself with.
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: metrics-server-auth-reader, namespace: kube-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: extension-apiserver-authentication-reader}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
# Reading metrics.k8s.io comes with the view, edit and admin roles.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: "system:aggregated-metrics-reader"
  labels:
    rbac.authorization.k8s.io/aggregate-to-view: "true"
    rbac.authorization.k8s.io/aggregate-to-edit: "true"
    rbac.authorization.k8s.io/aggregate-to-admin: "true"
rules:
- {apiGroups: [metrics.k8s.io], resources: [nodes, pods], verbs: [get, list, watch]}
YAML
}

# The route from the aggregator to 127.0.0.1:$PORT (see the top of this file).
register() {
  local bundle
  bundle=$(base64 -w0 < "$DIR/pki/ca.crt")
  k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Service
metadata: {name: metrics-server, namespace: kube-system}
spec: {type: ExternalName, externalName: localhost}
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: $APISERVICE}
spec:
  group: metrics.k8s.io
  version: v1beta1
  service: {name: metrics-server, namespace: kube-system, port: $PORT}
  caBundle: $bundle
  groupPriorityMinimum: 100
  versionPriority: 100
YAML
}

available() {
  [[ $(k get apiservice "$APISERVICE" -o 'jsonpath={.status.conditions[?(@.type=="Available")].status}' 2>/dev/null) == True ]]
}

up() {
  build
  # 9>&-: the components it may start must not hold this script's lock.
  "$HERE/cluster.sh" up 9>&-
  eval "$("$HERE/cluster.sh" env)"
  KUBECTL=$(command -v kubectl)
  local started=$SECONDS deadline=$((SECONDS + UP_TIMEOUT))
  # Without the front-proxy flags the aggregator cannot prove itself; an API
  # server started by an older hack/cluster.sh keeps running without them.
  [[ -n $(k -n kube-system get configmap extension-apiserver-authentication \
    -o 'jsonpath={.data.requestheader-client-ca-file}' 2>/dev/null) ]] ||
    die "the API server runs without --requestheader-client-ca-file (started by an older hack/cluster.sh): restart it with hack/cluster.sh down && hack/cluster.sh up"
  kubeconfig
  rbac
  local c=$DIR/pki
  local args=(--bind-address 127.0.0.1 --secure-port "$PORT"
    --tls-cert-file "$c/metrics-server-serving.crt" --tls-private-key-file "$c/metrics-server-serving.key"
    --kubeconfig "$KUBECONFIG_FILE"
    --authentication-kubeconfig "$KUBECONFIG_FILE" --authorization-kubeconfig "$KUBECONFIG_FILE"
    --kubelet-certificate-authority "$c/ca.crt"
    --kubelet-client-certificate "$c/metrics-server.crt" --kubelet-client-key "$c/metrics-server.key"
    --kubelet-preferred-address-types InternalIP --kubelet-use-node-status-port
    --metric-resolution 10s --kubelet-request-timeout 5s
    --node-selector '!vmlet.io/bench,!vmlet.io/bench-baseline')
  # One started with other flags (an older revision of this script) is
  # replaced; the APIService stays, the new one answers in a second.
  if running && [[ $(cat "$DIR/run/metrics-server.args" 2>/dev/null) != "${args[*]}" ]]; then
    log "running with other flags: restarting it"
    stop
  fi
  if ! running; then
    mkdir -p "$DIR/logs" "$DIR/run"
    # setsid: a test's deadline that kills its command's process group leaves
    # this server alone; 9>&-: the lock is not inherited.
    setsid "$BIN" "${args[@]}" </dev/null >"$LOG" 2>&1 9>&- &
    echo $! >"$PIDFILE"
    echo "${args[*]}" >"$DIR/run/metrics-server.args"
    log "started (pid $!), log $LOG"
  fi
  until answers; do
    running || { tail -n 30 "$LOG" >&2; die "metrics-server exited (log $LOG)"; }
    ((SECONDS < deadline)) || { tail -n 30 "$LOG" >&2; die "https://127.0.0.1:$PORT/livez did not answer within $UP_TIMEOUT s (log $LOG)"; }
    sleep 0.5
  done
  register
  until available; do
    if ((SECONDS >= deadline)); then
      k get apiservice "$APISERVICE" -o yaml >&2 || true
      tail -n 30 "$LOG" >&2
      die "APIService $APISERVICE not Available within $UP_TIMEOUT s (log $LOG)"
    fi
    sleep 0.5
  done
  log "ready in $((SECONDS - started)) s: kubectl top node; log $LOG"
}

# The APIService goes first: one whose server is gone makes discovery fail,
# and with it kubectl's resource lists and namespace deletion.
down() {
  eval "$("$HERE/cluster.sh" env)"
  KUBECTL=$(command -v kubectl || true) # none yet on a new machine
  if [[ -n $KUBECTL ]] && k get --raw /readyz >/dev/null 2>&1; then
    k delete apiservice "$APISERVICE" --ignore-not-found >/dev/null || log "could not delete APIService $APISERVICE"
  fi
  stop
}

# SIGTERM to what `up` started, SIGKILL after 30 s.
stop() {
  running || { rm -f "$PIDFILE"; return 0; }
  local pid
  pid=$(<"$PIDFILE")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    log "pid $pid still running 30 s after SIGTERM: sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -f "$PIDFILE"
  log "stopped"
}

# One build/up/down at a time: test binaries call `up` side by side.
lock() {
  mkdir -p "$DIR"
  exec 9>"$DIR/metrics-server.lock"
  flock -w 1900 9 || die "another hack/metrics-server.sh holds $DIR/metrics-server.lock"
}

case ${1:-} in
  build) lock; build ;;
  up) lock; up ;;
  down) lock; down ;;
  env) echo "export METRICS_SERVER_LOG=$LOG METRICS_SERVER_PORT=$PORT" ;;
  *) sed -n '2,14p' "$0" >&2; exit 64 ;;
esac
