#!/usr/bin/env bash
# Build and cache pinned kube-apiserver and etcd binaries from source.
#
# Both are built with the Go toolchain from modules served by the Go module
# proxy (no prebuilt binary downloads, no docker). Results are cached by
# version under:
#
#   ${KINFERENCE_CACHE:-$HOME/.cache/kinference}/bin/kube-apiserver-<version>/kube-apiserver
#   ${KINFERENCE_CACHE:-$HOME/.cache/kinference}/bin/etcd-<version>/etcd
#
# and a directory holding symlinks to both is printed as the LAST line on
# stdout (all progress output goes to stderr), e.g.
#
#   /root/.cache/kinference/bin/k8s-v1.36.3-etcd-v3.6.16
#
# A second run with a warm cache does no Go work and returns immediately.
# Concurrent callers are serialised with flock, so the build happens once.
# The build steps are in lib-k8s.sh; install-node.sh uses this script to
# build the node components (KINFERENCE_K8S_EXTRA_COMPONENTS).
#
# Environment:
#   KINFERENCE_CACHE         cache root (default $HOME/.cache/kinference)
#   KINFERENCE_K8S_VERSION   override the pinned Kubernetes version
#   KINFERENCE_ETCD_VERSION  override the pinned etcd version
#   KINFERENCE_K8S_EXTRA_COMPONENTS
#                            more commands of k8s.io/kubernetes/cmd to build at
#                            the same version and link into the same directory,
#                            e.g. "kubelet kube-controller-manager kube-scheduler"
#   GO                       go binary (default: `go` on PATH, else /usr/local/go/bin/go)
set -euo pipefail

# The pins (tests/cluster_smoke.rs checks they match cluster.rs).
K8S_VERSION="${KINFERENCE_K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${KINFERENCE_ETCD_VERSION:-v3.6.16}"

LOG_TAG="${LOG_TAG:-install-k8s}"
# shellcheck source=lib-k8s.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib-k8s.sh"
trap 'log "FAILED (exit $?) at line ${LINENO}: ${BASH_COMMAND}"' ERR

read -r -a EXTRA <<<"${KINFERENCE_K8S_EXTRA_COMPONENTS:-}"
for name in "${EXTRA[@]}"; do
  if [[ ! "${name}" =~ ^[a-z][a-z0-9-]*$ ]]; then
    log "bad component name in KINFERENCE_K8S_EXTRA_COMPONENTS: ${name}"
    exit 1
  fi
done
K8S_COMMANDS=(kube-apiserver "${EXTRA[@]}")
COMPONENTS=(etcd "${K8S_COMMANDS[@]}")
COMBINED_DIR="${BIN_ROOT}/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}"

# Fast path: everything is already cached.
if have_components "${COMPONENTS[@]}" && have_links "${COMBINED_DIR}" "${COMPONENTS[@]}"; then
  printf '%s\n' "${COMBINED_DIR}"
  exit 0
fi

take_build_lock
if ! have_components "${COMPONENTS[@]}"; then
  setup_go_env
  TOTAL_START=$(date +%s)
  build_etcd
  build_kubernetes_commands "${K8S_COMMANDS[@]}"
  log "done in $(($(date +%s) - TOTAL_START))s: ${K8S_COMMANDS[*]} ${K8S_VERSION}, etcd ${ETCD_VERSION}"
fi
link_components "${COMBINED_DIR}" "${COMPONENTS[@]}"
printf '%s\n' "${COMBINED_DIR}"
