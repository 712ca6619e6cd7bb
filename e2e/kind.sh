#!/usr/bin/env bash
# End-to-end Kinference on a local kind cluster:
#
#   1. create the kind cluster (kind-config.yaml: control plane + worker)
#   2. build the operator, EPP and simulator images and `kind load` them
#   3. install the Gateway API CRDs (standard v1.6.1) and the Inference
#      Extension InferencePool CRD (v1.6.0): the files in e2e/fixtures/crds/
#   4. install agentgateway (Helm, inference extension enabled) as the
#      Gateway implementation
#   5. install our CRD and the operator (helm install charts/kinference)
#   6. deploy the scenario in e2e/kind/: simulator Pods, a Gateway, an
#      InferencePolicy; wait until the policy is Ready
#   7. send the request of e2e/kind/smoke-request.env through the gateway
#      (port-forward) and check the answer that file expects: status, JSON
#      object and model (and the rule in x-kinference-rule, if the gateway
#      passes it). e2e/tests/real_scenario.rs sends the same request to the
#      same manifests on a real node in CI.
#   8. print `kubectl get inferencepolicy`
#
# Usage:
#   e2e/kind.sh              set up (idempotent: re-running reuses the cluster)
#   e2e/kind.sh --skip-build reuse images already built and loaded
#   e2e/kind.sh --delete     delete the kind cluster
#
# Environment (defaults in brackets):
#   CLUSTER_NAME [kinference]        kind cluster name
#   KIND_NODE_IMAGE []               kindest/node image (kind's default if empty)
#   AGW_VERSION [v1.6.0]             agentgateway Helm chart version
#   AGW_CHARTS [oci://cr.agentgateway.dev/charts]
#   LOCAL_PORT [8080]                local port of the gateway port-forward
#   WAIT_TIMEOUT [300s]              timeout of each wait
#
# Requires docker (or a docker-compatible CLI with BuildKit), kind, kubectl
# (>= 1.27, for -k), helm (>= 3.8, for OCI charts) and curl.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"

CLUSTER_NAME="${CLUSTER_NAME:-kinference}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-}"
AGW_VERSION="${AGW_VERSION:-v1.6.0}"
AGW_CHARTS="${AGW_CHARTS:-oci://cr.agentgateway.dev/charts}"
AGW_NAMESPACE="agentgateway-system"
LOCAL_PORT="${LOCAL_PORT:-8080}"
WAIT_TIMEOUT="${WAIT_TIMEOUT:-300s}"

OPERATOR_NS="kinference-system"
DEMO_NS="kinference-demo"
GATEWAY="inference-gateway"
POLICY="chat"
CTX="kind-${CLUSTER_NAME}"
# SMOKE_PATH, SMOKE_BODY and the expected SMOKE_STATUS, SMOKE_RULE,
# SMOKE_OBJECT, SMOKE_MODEL: shared with e2e/tests/real_scenario.rs.
# shellcheck source=kind/smoke-request.env
source "${SCRIPT_DIR}/kind/smoke-request.env"

OPERATOR_IMAGE="kinference/operator:dev"
EPP_IMAGE="kinference/epp:dev"
SIM_IMAGE="kinference/sim:dev"

PF_PID=""
WORK_DIR=""

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

k() { kubectl --context "${CTX}" "$@"; }

cleanup() {
  if [[ -n "${PF_PID}" ]]; then
    kill "${PF_PID}" 2>/dev/null || true
    wait "${PF_PID}" 2>/dev/null || true
  fi
  if [[ -n "${WORK_DIR}" ]]; then
    rm -rf "${WORK_DIR}"
  fi
}
trap cleanup EXIT

# On a failure after the cluster exists: show what the user needs to debug.
diagnostics() {
  local rc=$?
  [[ ${rc} -eq 0 ]] && return
  printf '\n==> FAILED (exit %s). Diagnostics:\n' "${rc}" >&2
  k get inferencepolicy -A -o wide >&2 || true
  k -n "${DEMO_NS}" describe inferencepolicy "${POLICY}" >&2 || true
  k -n "${DEMO_NS}" get pods,svc,deploy,inferencepool,httproute,gateway -o wide >&2 || true
  k -n "${OPERATOR_NS}" logs deploy/kinference-operator --tail=50 >&2 || true
  k -n "${DEMO_NS}" logs deploy/"${POLICY}"-epp --tail=50 >&2 || true
}

need() {
  local cmd="$1" why="$2"
  command -v "${cmd}" >/dev/null 2>&1 || die "'${cmd}' not found on PATH: ${why}"
}

check_prerequisites() {
  need docker "builds the images (https://docs.docker.com/engine/install/)"
  need kind "creates the cluster (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
  need kubectl "talks to the cluster (https://kubernetes.io/docs/tasks/tools/)"
  need helm "installs agentgateway, v3.8 or newer (https://helm.sh/docs/intro/install/)"
  need curl "sends the test request"
  docker info >/dev/null 2>&1 \
    || die "docker is installed but its daemon is not reachable (is it running? may this user use it?)"
  local helm_version
  helm_version="$(helm version --template '{{.Version}}' 2>/dev/null || true)"
  case "${helm_version}" in
    v3.[0-7].*) die "helm ${helm_version} cannot install OCI charts: need v3.8 or newer" ;;
  esac
}

delete_cluster() {
  need kind "deletes the cluster"
  if grep -qx "${CLUSTER_NAME}" <<<"$(kind get clusters 2>/dev/null)"; then
    log "Deleting kind cluster ${CLUSTER_NAME}"
    kind delete cluster --name "${CLUSTER_NAME}"
  else
    log "No kind cluster named ${CLUSTER_NAME}: nothing to delete"
  fi
}

create_cluster() {
  if grep -qx "${CLUSTER_NAME}" <<<"$(kind get clusters 2>/dev/null)"; then
    log "Reusing kind cluster ${CLUSTER_NAME}"
    return
  fi
  log "Creating kind cluster ${CLUSTER_NAME}"
  local args=(create cluster --name "${CLUSTER_NAME}" --config "${REPO_ROOT}/kind-config.yaml" --wait 120s)
  [[ -n "${KIND_NODE_IMAGE}" ]] && args+=(--image "${KIND_NODE_IMAGE}")
  kind "${args[@]}"
}

build_and_load_images() {
  local spec image dockerfile
  for spec in "${OPERATOR_IMAGE}=Dockerfile.operator" "${EPP_IMAGE}=Dockerfile.epp" "${SIM_IMAGE}=Dockerfile.simulator"; do
    image="${spec%%=*}"
    dockerfile="${spec#*=}"
    log "Building ${image} (${dockerfile}; the first build compiles the workspace, several minutes)"
    DOCKER_BUILDKIT=1 docker build -f "${REPO_ROOT}/${dockerfile}" -t "${image}" "${REPO_ROOT}"
  done
  for image in "${OPERATOR_IMAGE}" "${EPP_IMAGE}" "${SIM_IMAGE}"; do
    log "Loading ${image} into the kind nodes"
    kind load docker-image "${image}" --name "${CLUSTER_NAME}"
  done
}

install_crds() {
  log "Installing Gateway API v1.6.1 (standard) and InferencePool v1.6.0 CRDs (e2e/fixtures/crds/)"
  k apply --server-side -f "${REPO_ROOT}/e2e/fixtures/crds/"
  k wait --for=condition=Established --timeout="${WAIT_TIMEOUT}" \
    crd/gateways.gateway.networking.k8s.io crd/httproutes.gateway.networking.k8s.io \
    crd/inferencepools.inference.networking.k8s.io
}

install_gateway() {
  log "Installing agentgateway ${AGW_VERSION} with the inference extension"
  helm upgrade --install agentgateway-crds "${AGW_CHARTS}/agentgateway-crds" \
    --kube-context "${CTX}" --namespace "${AGW_NAMESPACE}" --create-namespace \
    --version "${AGW_VERSION}" --wait
  helm upgrade --install agentgateway "${AGW_CHARTS}/agentgateway" \
    --kube-context "${CTX}" --namespace "${AGW_NAMESPACE}" \
    --version "${AGW_VERSION}" \
    --set inferenceExtension.enabled=true \
    --wait --timeout "${WAIT_TIMEOUT}"
}

install_operator() {
  log "Installing the CRD and the operator (Helm: charts/kinference, ci/kind-values.yaml)"
  k create namespace "${OPERATOR_NS}" --dry-run=client -o yaml | k apply -f -
  k label namespace "${OPERATOR_NS}" --overwrite pod-security.kubernetes.io/enforce=restricted
  helm upgrade --install kinference "${REPO_ROOT}/charts/kinference" \
    --kube-context "${CTX}" --namespace "${OPERATOR_NS}" \
    --values "${REPO_ROOT}/charts/kinference/ci/kind-values.yaml" \
    --wait --timeout "${WAIT_TIMEOUT}"
  k wait --for=condition=Established --timeout="${WAIT_TIMEOUT}" crd/inferencepolicies.kinference.io
  k -n "${OPERATOR_NS}" rollout status deployment/kinference-operator --timeout="${WAIT_TIMEOUT}"
}

deploy_scenario() {
  log "Deploying the scenario (e2e/kind/: simulator, Gateway, InferencePolicy)"
  k apply -f "${REPO_ROOT}/e2e/kind/"
  k -n "${DEMO_NS}" rollout status deployment/sim --timeout="${WAIT_TIMEOUT}"
  log "Waiting for Gateway ${GATEWAY} to be Programmed"
  k -n "${DEMO_NS}" wait gateway/"${GATEWAY}" --for=condition=Programmed --timeout="${WAIT_TIMEOUT}"
  log "Waiting for InferencePolicy ${POLICY} to be Ready"
  k -n "${DEMO_NS}" wait inferencepolicy/"${POLICY}" --for=condition=Ready --timeout="${WAIT_TIMEOUT}"
}

gateway_service() {
  # Implementations label the Service they provision for a Gateway with the
  # standard gateway-name label; fall back to the Gateway's own name.
  local svc
  svc="$(k -n "${DEMO_NS}" get svc -l "gateway.networking.k8s.io/gateway-name=${GATEWAY}" \
    -o jsonpath='{.items[0].metadata.name}' 2>/dev/null || true)"
  echo "${svc:-${GATEWAY}}"
}

smoke_request() {
  local svc
  svc="$(gateway_service)"
  WORK_DIR="$(mktemp -d)"
  log "Port-forwarding svc/${svc} to localhost:${LOCAL_PORT}"
  k -n "${DEMO_NS}" port-forward "svc/${svc}" "${LOCAL_PORT}:80" >"${WORK_DIR}/port-forward.log" 2>&1 &
  PF_PID=$!
  local _
  for _ in $(seq 1 30); do
    if curl -s -o /dev/null "http://127.0.0.1:${LOCAL_PORT}/" 2>/dev/null; then
      break
    fi
    kill -0 "${PF_PID}" 2>/dev/null || die "port-forward exited: $(cat "${WORK_DIR}/port-forward.log")"
    sleep 1
  done

  log "POST ${SMOKE_PATH} (model ${SMOKE_MODEL}) through the gateway"
  local code=""
  # The route and the EPP connection are programmed asynchronously: retry.
  for _ in $(seq 1 30); do
    code="$(curl -s -o "${WORK_DIR}/body" -D "${WORK_DIR}/headers" -w '%{http_code}' \
      -H 'content-type: application/json' -d "${SMOKE_BODY}" \
      "http://127.0.0.1:${LOCAL_PORT}${SMOKE_PATH}" || true)"
    [[ "${code}" == "${SMOKE_STATUS}" ]] && break
    sleep 2
  done
  echo "HTTP ${code}"
  cat "${WORK_DIR}/headers"
  cat "${WORK_DIR}/body"
  echo
  [[ "${code}" == "${SMOKE_STATUS}" ]] \
    || die "expected HTTP ${SMOKE_STATUS} from the gateway, got ${code:-no answer}"
  local field
  for field in "\"object\":\"${SMOKE_OBJECT}\"" "\"model\":\"${SMOKE_MODEL}\""; do
    grep -qF "${field}" "${WORK_DIR}/body" || die "expected ${field} in the answer"
  done

  local rule server
  rule="$(grep -i '^x-kinference-rule:' "${WORK_DIR}/headers" | tr -d '\r' || true)"
  server="$(grep -i '^x-sim-server:' "${WORK_DIR}/headers" | tr -d '\r' || true)"
  [[ -n "${server}" ]] && echo "served by: ${server#*: }"
  if [[ -n "${rule}" ]]; then
    echo "rule: ${rule#*: }"
    [[ "${rule#*: }" == "${SMOKE_RULE}" ]] \
      || die "expected rule '${SMOKE_RULE}' for a short prompt, got '${rule#*: }'"
  else
    # x-kinference-rule is set on the request towards the model server; the
    # client only sees it if the gateway or the model server echoes it back.
    echo "note: no x-kinference-rule header in the response (not passed through by the gateway)"
  fi
}

main() {
  local skip_build=false
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --delete) delete_cluster; exit 0 ;;
      --skip-build) skip_build=true ;;
      -h|--help) usage; exit 0 ;;
      *) usage >&2; die "unknown argument: $1" ;;
    esac
    shift
  done

  check_prerequisites
  create_cluster
  trap 'diagnostics; cleanup' EXIT
  if [[ "${skip_build}" == false ]]; then
    build_and_load_images
  fi
  install_crds
  install_gateway
  install_operator
  deploy_scenario
  smoke_request

  log "kubectl get inferencepolicy -A"
  k get inferencepolicy -A
  log "Done. Delete the cluster with: e2e/kind.sh --delete"
}

main "$@"
