#!/usr/bin/env bash
# A real Kubernetes control plane on 127.0.0.1 for vmlet's demo and tests.
#
#   hack/cluster.sh build   build etcd + kube-* + kubectl into the cache (idempotent)
#   hack/cluster.sh up      build if needed, generate certs, start all, wait for /readyz
#   hack/cluster.sh down    stop what `up` started, and metrics-server (hack/metrics-server.sh)
#   hack/cluster.sh env     print `export KUBECONFIG=... PATH=...` for a shell to eval
#
# Binaries are built from the k8s.io/kubernetes Go module and go.etcd.io/etcd/server/v3
# into $VMLET_CACHE (default ~/.cache/vmlet), keyed by version, so a second `up`
# takes seconds. Runtime state (certs, etcd data, logs, kubeconfig) lives in
# $VMLET_CLUSTER_DIR (default $VMLET_CACHE/cluster); component logs are in its logs/.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
CACHE=${VMLET_CACHE:-$HOME/.cache/vmlet}
BIN=$CACHE/k8s-$K8S_VERSION-etcd-$ETCD_VERSION/bin
DIR=${VMLET_CLUSTER_DIR:-$CACHE/cluster}
APISERVER_PORT=${APISERVER_PORT:-6443}
ETCD_PORT=${ETCD_PORT:-2379}

log() { echo "cluster: $*" >&2; }

build() {
  local want=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
  local missing=0
  for b in "${want[@]}"; do [[ -x $BIN/$b ]] || missing=1; done
  [[ $missing == 0 ]] && return 0
  local src=$CACHE/src-$K8S_VERSION-$ETCD_VERSION
  mkdir -p "$src" "$BIN"
  log "building control plane $K8S_VERSION + etcd $ETCD_VERSION in $src (first time only; ~15 min on 2 cores)"
  (
    cd "$src"
    export GOFLAGS=-mod=mod GOWORK=off
    [[ -f go.mod ]] || go mod init vmlet.io/cluster >/dev/null 2>&1
    # k8s.io/kubernetes requires its staging modules at v0.0.0 through a ./staging
    # replace that Go ignores in a dependency: pin each to v0.<minor>.<patch>.
    local gomod staging_version=v0.${K8S_VERSION#v1.}
    gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    for m in $(awk '/=> \.\/staging\// {print $1}' "$gomod" | sort -u); do
      go mod edit -replace "$m=$m@$staging_version"
    done
    go mod edit -require "k8s.io/kubernetes@$K8S_VERSION" -require "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    cat > tools.go <<'GO'
//go:build tools

package tools
GO
    local ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    go build -ldflags "$ld" -o "$BIN/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubectl
  )
  # etcd in a module of its own: next to k8s.io/kubernetes, minimal version
  # selection would lift it to the etcd version Kubernetes' client requires.
  local etcd_src=$CACHE/src-etcd-$ETCD_VERSION
  mkdir -p "$etcd_src"
  (
    cd "$etcd_src"
    export GOFLAGS=-mod=mod GOWORK=off
    [[ -f go.mod ]] || go mod init vmlet.io/etcd >/dev/null 2>&1
    go mod edit -require "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    go build -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  )
  log "built into $BIN"
}

certs() {
  local c=$DIR/pki
  [[ -f $c/done && -f $c/metrics-server.crt ]] && return 0
  mkdir -p "$c"
  (
    cd "$c"
    # Each file is made only when missing, so certs added later join an existing CA.
    [[ -f ca.crt ]] || openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout ca.key -out ca.crt -subj "/CN=vmlet-local-ca" 2>/dev/null
    # The front proxy's own CA: the API server's aggregator proves itself to
    # aggregated API servers (metrics-server) with a client cert from it, and
    # they take the user from its X-Remote-* headers only under that cert.
    [[ -f front-proxy-ca.crt ]] || openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout front-proxy-ca.key -out front-proxy-ca.crt -subj "/CN=vmlet-local-front-proxy-ca" 2>/dev/null
    sign() { # name subject [san]: a v3 cert (rustls refuses v1), server+client use; signed by $CA (default ca)
      [[ -f $1.crt ]] && return 0
      local ca=${CA:-ca}
      openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
      {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        if [[ -n ${3:-} ]]; then
          echo "extendedKeyUsage=serverAuth"
          echo "subjectAltName=$3"
        else
          echo "extendedKeyUsage=clientAuth"
        fi
      } > "$1.ext"
      openssl x509 -req -in "$1.csr" -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial -days 3650 -out "$1.crt" -extfile "$1.ext" 2>/dev/null
    }
    sign apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    sign admin "/O=system:masters/CN=admin"
    sign kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
    sign controller-manager "/CN=system:kube-controller-manager"
    sign scheduler "/CN=system:kube-scheduler"
    # vmlet's kubelet API serving cert: the API server verifies kubelets against
    # this CA (--kubelet-certificate-authority).
    sign kubelet-serving "/O=system:nodes/CN=vmlet-kubelet-serving" "IP:127.0.0.1,DNS:localhost"
    CA=front-proxy-ca sign front-proxy-client "/CN=front-proxy-client"
    # metrics-server (hack/metrics-server.sh): its identity towards the API
    # server and the kubelets, and its serving cert under the name the
    # aggregator checks, <service>.<namespace>.svc.
    sign metrics-server "/CN=system:metrics-server"
    sign metrics-server-serving "/CN=metrics-server" "DNS:metrics-server.kube-system.svc,DNS:localhost,IP:127.0.0.1"
    [[ -f sa.key ]] || openssl genrsa -out sa.key 2048 2>/dev/null
    [[ -f sa.pub ]] || openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    touch done
  )
}

# Written to a temporary file and renamed over the old one: `up` runs again
# at every test binary's start while others read these files (hack/run-tests.py
# runs binaries side by side); a truncated file would send their kubectl to
# localhost:8080.
kubeconfig() { # file user
  local c=$DIR/pki
  cat > "$1.tmp.$$" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $c/ca.crt
users:
- name: $2
  user:
    client-certificate: $c/$2.crt
    client-key: $c/$2.key
contexts:
- name: local
  context: {cluster: local, user: $2, namespace: default}
current-context: local
KC
  mv -f "$1.tmp.$$" "$1"
}

start() { # name args...
  local name=$1; shift
  nohup "$BIN/$name" "$@" > "$DIR/logs/$name.log" 2>&1 &
  echo $! > "$DIR/run/$name.pid"
}

running() { [[ -f $DIR/run/$1.pid ]] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; }

up() {
  build
  mkdir -p "$DIR/logs" "$DIR/run" "$DIR/etcd"
  certs
  kubeconfig "$DIR/admin.kubeconfig" admin
  kubeconfig "$DIR/controller-manager.kubeconfig" controller-manager
  kubeconfig "$DIR/scheduler.kubeconfig" scheduler
  local c=$DIR/pki
  running etcd || start etcd --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:0 --quota-backend-bytes 2147483648 --log-level warn
  running kube-apiserver || start kube-apiserver \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
    --endpoint-reconciler-type none \
    --authorization-mode Node,RBAC \
    --client-ca-file "$c/ca.crt" \
    --tls-cert-file "$c/apiserver.crt" --tls-private-key-file "$c/apiserver.key" \
    --kubelet-client-certificate "$c/kubelet-client.crt" --kubelet-client-key "$c/kubelet-client.key" \
    --kubelet-certificate-authority "$c/ca.crt" \
    --service-account-key-file "$c/sa.pub" --service-account-signing-key-file "$c/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-cluster-ip-range 10.0.0.0/24 \
    --requestheader-client-ca-file "$c/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$c/front-proxy-client.crt" --proxy-client-key-file "$c/front-proxy-client.key" \
    --allow-privileged=true --enable-priority-and-fairness=false
  running kube-controller-manager || start kube-controller-manager \
    --kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 0 \
    --service-account-private-key-file "$c/sa.key" --root-ca-file "$c/ca.crt" \
    --cluster-signing-cert-file "$c/ca.crt" --cluster-signing-key-file "$c/ca.key" \
    --use-service-account-credentials=true --leader-elect=false \
    --node-monitor-period 2s --node-monitor-grace-period 20s
  running kube-scheduler || start kube-scheduler \
    --kubeconfig "$DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false
  local deadline=$((SECONDS + 120))
  until "$BIN/kubectl" --kubeconfig "$DIR/admin.kubeconfig" get --raw /readyz >/dev/null 2>&1; do
    if (( SECONDS > deadline )); then
      log "apiserver not ready after 120 s; logs in $DIR/logs"; tail -n 30 "$DIR/logs/kube-apiserver.log" >&2; exit 1
    fi
    sleep 0.5
  done
  # The scheduler and controller-manager need their RBAC bootstrap; wait for the default SA path too.
  log "ready: export KUBECONFIG=$DIR/admin.kubeconfig (logs: $DIR/logs)"
}

down() {
  # metrics-server (hack/metrics-server.sh) first, while the API server can
  # still take its APIService away; its certs and pid file live here too.
  "$(dirname "$0")/metrics-server.sh" down
  # Only what this cluster directory started (pid files): other clusters built
  # from the same cache keep running.
  local pids=()
  for n in kube-scheduler kube-controller-manager kube-apiserver etcd; do
    if running "$n"; then
      pids+=("$(cat "$DIR/run/$n.pid")")
      kill "${pids[-1]}" 2>/dev/null || true
    fi
    rm -f "$DIR/run/$n.pid"
  done
  # 30 s of grace each; what outlives it is killed, so the next `up` finds the
  # ports free (an apiserver still draining once held 6443 into the next CI run).
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid still running 30 s after SIGTERM: sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
  done
  if [[ ${1:-} == --wipe ]]; then rm -rf "$DIR"; fi
}

case ${1:-} in
  build) build ;;
  up) up ;;
  down) shift; down "$@" ;;
  env) echo "export KUBECONFIG=$DIR/admin.kubeconfig PATH=$BIN:\$PATH VMLET_CLUSTER_LOGS=$DIR/logs" ;;
  *) echo "usage: $0 build|up|down [--wipe]|env" >&2; exit 64 ;;
esac
