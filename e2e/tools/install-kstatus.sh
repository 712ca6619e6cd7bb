#!/usr/bin/env bash
# cli-utils' kstatus, the library Flux's health checks use, as a small command
# (e2e/tools/kstatus: JSON objects in, "Status<TAB>message" out).
exec bash "$(dirname "$0")/install-go-tool.sh" kstatus sigs.k8s.io/cli-utils .
