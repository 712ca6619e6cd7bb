#!/usr/bin/env bash
# containers/image's copy (the library under `skopeo copy` and `podman
# load`; skopeo itself is not on the Go module proxy) as a small command
# (e2e/tools/imagecopy), which the images test copies the archives with.
# Its OpenPGP in Go: the default signature backend is gpgme, through cgo.
export GO_BUILD_TAGS=containers_image_openpgp
exec bash "$(dirname "$0")/install-go-tool.sh" imagecopy github.com/containers/image/v5 .
