#!/usr/bin/env bash
# Prometheus's promtool, which checks the shipped alert rules and runs their
# unit tests (e2e/tests/monitoring.rs).
exec bash "$(dirname "$0")/install-go-tool.sh" promtool github.com/prometheus/prometheus \
  github.com/prometheus/prometheus/cmd/promtool
