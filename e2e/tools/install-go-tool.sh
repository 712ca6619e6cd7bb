#!/usr/bin/env bash
# Builds one Go command from the Go module proxy, pinned by the module in
# e2e/tools/<name>/ (go.mod, go.sum, and a main.go when the command is ours),
# cached under the same Go caches and build lock as every other Go build.
# Prints the binary's path on its last line.
#
#   install-go-tool.sh <name> <module whose version names the cache slot> <package> [ldflags]
#
# In ldflags, {version} stands for that module's version. $GO_BUILD_TAGS, when
# set, are the build's tags.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
name="$1" module="$2" package="$3" ldflags="${4:-}"
LOG_TAG="install-${name}"
# shellcheck source=lib-k8s.sh
source "${here}/lib-k8s.sh"
src="${here}/${name}"
version="$(sed -n "s#^[[:space:]]*${module} \(v[^ ]*\).*#\1#p" "${src}/go.mod" | head -n 1)"
[[ -n "${version}" ]] || { echo "no ${module} in ${src}/go.mod" >&2; exit 1; }
dest="${BIN_ROOT}/${name}-${version}/${name}"
shopt -s nullglob
sources=("${src}"/go.mod "${src}"/go.sum "${src}"/*.go)
source_sum="$({ cat "${sources[@]}"; [[ -z "${GO_BUILD_TAGS:-}" ]] || echo "tags ${GO_BUILD_TAGS}"; } | sha256sum | cut -c1-12)"
if [[ -x "${dest}" && -f "${dest}.source" && "$(cat "${dest}.source")" == "${source_sum}" ]]; then
  printf '%s\n' "${dest}"
  exit 0
fi
take_build_lock
setup_go_env
log "building ${name} (${module} ${version})"
mkdir -p "$(dirname "${dest}")"
(cd "${src}" && "${GO}" build -o "${dest}.tmp" -tags "${GO_BUILD_TAGS:-}" -ldflags "${ldflags//\{version\}/${version}}" "${package}")
mv -f "${dest}.tmp" "${dest}"
printf '%s\n' "${source_sum}" > "${dest}.source"
printf '%s\n' "${dest}"
