#!/usr/bin/env bash
# Builds actionlint (the version e2e/tools/actionlint/go.mod names) from the
# Go module proxy, cached under the same Go caches and build lock as every
# other Go build. e2e/tests/workflows.rs checks .github/workflows with it.
# Prints the binary's path on its last line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
LOG_TAG=install-actionlint
# shellcheck source=lib-k8s.sh
source "${here}/lib-k8s.sh"
VERSION="$(sed -n 's#^\t*github.com/rhysd/actionlint \(v[^ ]*\).*#\1#p' "${here}/actionlint/go.mod" | head -n 1)"
dest="${BIN_ROOT}/actionlint-${VERSION}/actionlint"
source_sum="$(cat "${here}/actionlint/go.mod" "${here}/actionlint/go.sum" | sha256sum | cut -c1-12)"
if [[ -x "${dest}" && -f "${dest}.source" && "$(cat "${dest}.source")" == "${source_sum}" ]]; then
  printf '%s\n' "${dest}"
  exit 0
fi
take_build_lock
setup_go_env
log "building actionlint ${VERSION}"
mkdir -p "$(dirname "${dest}")"
(cd "${here}/actionlint" && "${GO}" build -o "${dest}.tmp" github.com/rhysd/actionlint/cmd/actionlint)
mv -f "${dest}.tmp" "${dest}"
printf '%s\n' "${source_sum}" > "${dest}.source"
printf '%s\n' "${dest}"
