#!/usr/bin/env bash
# actionlint, which checks .github/workflows in e2e/tests/workflows.rs.
exec bash "$(dirname "$0")/install-go-tool.sh" actionlint github.com/rhysd/actionlint \
  github.com/rhysd/actionlint/cmd/actionlint
