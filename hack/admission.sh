#!/usr/bin/env bash
# Install deploy/admission.yaml (the API server adds vmlet's finalizer to each
# VirtualMachine it creates) and wait until it is in effect.
#
#   hack/admission.sh          uses kubectl and $KUBECONFIG as found
#
# Why the wait: a MutatingAdmissionPolicy needs the schema of the kind it
# mutates, which kube-apiserver loads from its own OpenAPI every 5 s. Until it
# has the VirtualMachine schema (a few seconds after the CRD is established on
# a new cluster), every VirtualMachine create answers 503 ServiceUnavailable
# "Resource kind vmlet.io/v1alpha1, Kind=VirtualMachine not found", whatever
# the policy's failurePolicy (k8s.io/apiserver v0.37, admission/plugin/policy/
# mutating/dispatcher.go returns that error before any patch; the type
# converter polls OpenAPI in patch/typeconverter.go). So this script creates a
# VirtualMachine with --dry-run=server until the answer carries the finalizer:
# then the policy is loaded and the schema known. Nothing is stored.
#
# Environment: VMLET_ADMISSION_WAIT (seconds to wait in all, default 90).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly FINALIZER=virtualmachines.vmlet.io
readonly WAIT=${VMLET_ADMISSION_WAIT:-90}

timeout 60 kubectl apply --server-side --force-conflicts -f deploy/admission.yaml >/dev/null
timeout 90 kubectl wait --for=condition=established --timeout=60s crd/virtualmachines.vmlet.io >/dev/null

probe='{"apiVersion": "vmlet.io/v1alpha1", "kind": "VirtualMachine",
        "metadata": {"name": "vmlet-admission-probe", "namespace": "default"},
        "spec": {"replicas": 0, "resources": {"cpu": 1, "memory": "64Mi"}}}'
deadline=$((SECONDS + WAIT))
while :; do
    if answer=$(timeout 20 kubectl create --dry-run=server -o 'jsonpath={.metadata.finalizers}' -f - \
        <<<"$probe" 2>&1) && [[ $answer == *"$FINALIZER"* ]]; then
        break
    fi
    if ((SECONDS >= deadline)); then
        echo "admission: deploy/admission.yaml not in effect after ${WAIT}s; last answer: ${answer}" >&2
        exit 1
    fi
    sleep 0.5
done
echo "admission: the API server adds $FINALIZER to new VirtualMachines (after $((SECONDS))s)"
