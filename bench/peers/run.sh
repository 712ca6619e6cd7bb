#!/usr/bin/env bash
# Side by side with the reference EPPs, in one command:
#
#   bench/peers/run.sh [smoke|full] [more arguments for the bench]
#
# Builds (once, cached) the pinned peers (bench/peers/install.sh), the
# API server (e2e/tools/install-k8s.sh), Envoy (crates/testbed/envoy/install.sh)
# and our release EPP, then runs `cargo bench -p kinference-e2e --bench peers`:
# an API server with the InferencePool and simulated Pods, each EPP in turn
# behind its own Envoy, the workloads, markdown tables on stdout (progress on
# stderr), everything torn down at the end.
#
# smoke: a few requests per EPP and workload (CI: fails on any error or an EPP
# that did not run), with debug builds of our EPP and the bench, which share
# the test run's compiled dependencies. full: the figures (about 15 minutes on
# 2 cores), everything of ours in release.
# Extra arguments go to the bench, e.g. `--only direct,kinference-queue,gie-queue`
# or `--workloads chat`; see `e2e/benches/peers.rs`.
set -euo pipefail

mode="${1:-full}"
shift || true
case "${mode}" in
  smoke | full) ;;
  *) echo "usage: $0 [smoke|full] [bench arguments]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "${root}"
log() { printf '[peers] %s\n' "$*" >&2; }

last_line() { tail -n 1; }

# smoke (CI): the two peer EPPs; full: everything, the peer simulator,
# inference-perf and vLLM's publisher (precise mode with bound publishers) included.
if [[ "${mode}" == smoke ]]; then peers=(gie-epp llmd-epp); else peers=(gie-epp llmd-epp llmd-sim inference-perf vllm-publisher); fi
log "peers: bench/peers/install.sh ${peers[*]}"
peers_dir="$(bash bench/peers/install.sh "${peers[@]}" | last_line)"
log "kube-apiserver and etcd: e2e/tools/install-k8s.sh"
k8s_dir="${KINFERENCE_K8S_BIN_DIR:-$(bash e2e/tools/install-k8s.sh | last_line)}"
log "Envoy: crates/testbed/envoy/install.sh"
bash crates/testbed/envoy/install.sh >/dev/null

target_dir="${CARGO_TARGET_DIR:-${root}/target}"
if [[ "${mode}" == smoke ]]; then
  profile=(); bench=(test); epp_bin="${target_dir}/debug/kinference-epp"
else
  profile=(--release); bench=(bench); epp_bin="${target_dir}/release/kinference-epp"
fi
log "our EPP: cargo build ${profile[*]} -p kinference-epp"
cargo build "${profile[@]}" --locked -p kinference-epp

KINFERENCE_K8S_BIN_DIR="${k8s_dir}" \
  cargo "${bench[@]}" --locked -p kinference-e2e --bench peers -- \
  --mode "${mode}" \
  --epp-bin "${epp_bin}" \
  --peers-dir "${peers_dir}" \
  "$@"
