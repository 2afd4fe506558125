#!/usr/bin/env bash
# Install the Prometheus server (Debian's `prometheus` package) when it is missing, so the monitoring test that
# scrapes a live trainer with a real Prometheus runs instead of skipping. Safe to call repeatedly; a no-op when
# `prometheus` is already on PATH. Needs root (or sudo) and apt; elsewhere it says so and exits 0 (the test skips).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
    echo "prometheus present: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_prometheus: no apt-get here; install Prometheus yourself (tests/test_monitoring.py skips without it)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "ensure_prometheus: not root and no sudo; the live-Prometheus test will skip" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: the server binary only (no node exporter, no systemd units started in containers).
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Debian's package may start a system service on hosts with systemd; the test runs its own server on a free port.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
echo "prometheus installed: $(prometheus --version 2>&1 | head -n1)"
