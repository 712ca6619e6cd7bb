#!/usr/bin/env bash
# Builds Helm (helm.sh/helm/v4, the version e2e/tools/helm/go.mod names) from
# the Go module proxy, cached under the same Go caches and build lock as every
# other Go build. The chart tests lint, render and install
# charts/kinference with it. Prints the binary's path on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
LOG_TAG=install-helm
# shellcheck source=lib-k8s.sh
source "${here}/lib-k8s.sh"
HELM_VERSION="$(sed -n 's#^\t*helm.sh/helm/v4 \(v[^ ]*\).*#\1#p' "${here}/helm/go.mod" | head -n 1)"
dest="${BIN_ROOT}/helm-${HELM_VERSION}/helm"
source_sum="$(cat "${here}/helm/go.mod" "${here}/helm/go.sum" | sha256sum | cut -c1-12)"
if [[ -x "${dest}" && -f "${dest}.source" && "$(cat "${dest}.source")" == "${source_sum}" ]]; then
  printf '%s\n' "${dest}"
  exit 0
fi
take_build_lock
setup_go_env
log "building helm ${HELM_VERSION}"
mkdir -p "$(dirname "${dest}")"
(cd "${here}/helm" && "${GO}" build -o "${dest}.tmp" \
  -ldflags "-X helm.sh/helm/v4/internal/version.version=${HELM_VERSION}" helm.sh/helm/v4/cmd/helm)
mv -f "${dest}.tmp" "${dest}"
printf '%s\n' "${source_sum}" > "${dest}.source"
printf '%s\n' "${dest}"
