#!/usr/bin/env bash
# `ensure_package.sh BINARY PACKAGE`: install Debian's PACKAGE when BINARY is missing, so the tests that use that real
# server run instead of skipping. Safe to call repeatedly; needs root (or sudo) and apt, else it says so and exits 0.
# A package that starts a system service is stopped again: the tests run their own server on a free port.
set -euo pipefail
binary=$1 package=$2

if command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ]; then
    echo "$binary present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_package: no apt-get here; install $package yourself (its tests skip without it)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "ensure_package: not root and no sudo; the tests that need $binary will skip" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$package" >/dev/null
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now "$binary" >/dev/null 2>&1 || true
fi
echo "$package installed"
