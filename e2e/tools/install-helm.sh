#!/usr/bin/env bash
# Helm v4, which lints, renders and installs charts/kinference in the tests.
exec bash "$(dirname "$0")/install-go-tool.sh" helm helm.sh/helm/v4 helm.sh/helm/v4/cmd/helm \
  '-X helm.sh/helm/v4/internal/version.version={version}'
