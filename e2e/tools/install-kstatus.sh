#!/usr/bin/env bash
# Builds cli-utils' kstatus, the library Flux's health checks use, as a small
# command (e2e/tools/kstatus: JSON objects in, "Status<TAB>message" out),
# from the Go module proxy, cached under the same Go caches and build lock as
# every other Go build. Prints the binary's path on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
LOG_TAG=install-kstatus
# shellcheck source=lib-k8s.sh
source "${here}/lib-k8s.sh"
CLI_UTILS_VERSION="$(sed -n 's#^\t*sigs.k8s.io/cli-utils \(v[^ ]*\).*#\1#p' "${here}/kstatus/go.mod" | head -n 1)"
dest="${BIN_ROOT}/kstatus-${CLI_UTILS_VERSION}/kstatus"
source_sum="$(cat "${here}/kstatus/main.go" "${here}/kstatus/go.mod" "${here}/kstatus/go.sum" | sha256sum | cut -c1-12)"
if [[ -x "${dest}" && -f "${dest}.source" && "$(cat "${dest}.source")" == "${source_sum}" ]]; then
  printf '%s\n' "${dest}"
  exit 0
fi
take_build_lock
setup_go_env
log "building kstatus (cli-utils ${CLI_UTILS_VERSION})"
mkdir -p "$(dirname "${dest}")"
(cd "${here}/kstatus" && "${GO}" build -o "${dest}.tmp" .)
mv -f "${dest}.tmp" "${dest}"
printf '%s\n' "${source_sum}" > "${dest}.source"
printf '%s\n' "${dest}"
