#!/usr/bin/env bash
# Install nginx (Debian's nginx-light) when it is missing, so tests/test_shards.py serves shards over HTTP from a real
# web server instead of skipping. Safe to call repeatedly; needs root (or sudo) and apt, else it says so and exits 0.
set -euo pipefail

if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
    echo "nginx present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_nginx: no apt-get here; install nginx yourself (the HTTP shard tests skip without it)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "ensure_nginx: not root and no sudo; the HTTP shard tests will skip" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
# the package may start a system service on hosts with systemd; the tests run their own server on a free port
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true
fi
echo "nginx installed"
