#!/usr/bin/env bash
# Install the Prometheus server (Debian's `prometheus`) when it is missing, so the monitoring test that scrapes a live
# trainer with a real Prometheus runs instead of skipping (.ci/ensure_package.sh does the work).
set -euo pipefail
exec bash "$(dirname "$0")/../../.ci/ensure_package.sh" prometheus prometheus
