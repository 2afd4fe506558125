#!/usr/bin/env bash
# Make sure a Docker daemon and docker-compose (v1, Debian's) are usable on this machine.
#
# - installs Debian's docker.io, docker-compose and debootstrap with apt-get when missing (needs root);
# - starts `dockerd --iptables=false --bridge=none --storage-driver=overlay2` in the background when no daemon
#   answers, logging to ${DOCKERD_LOG:-/var/log/dockerd.log}, and waits until it does.
# Meant for CI machines and throw-away VMs; on a workstation with Docker already running it only checks.
set -euo pipefail

log() { printf '[ensure_docker] %s\n' "$*" >&2; }

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need_pkgs+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)

if ((${#need_pkgs[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    log "missing ${need_pkgs[*]} and not root: install them (apt-get install ${need_pkgs[*]}) and re-run"
    exit 1
  fi
  log "installing ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  log "docker daemon is up ($(docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null))"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  log "no docker daemon answers and not root: start Docker (or add yourself to the docker group) and re-run"
  exit 1
fi

log "starting dockerd in the background (log: ${DOCKERD_LOG:-/var/log/dockerd.log})"
# iptables/bridge off: CI sandboxes lack the netfilter modules; builds and containers use --network host.
nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 \
  >>"${DOCKERD_LOG:-/var/log/dockerd.log}" 2>&1 &

for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    log "docker daemon is up ($(docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null))"
    exit 0
  fi
  sleep 1
done
log "dockerd did not come up within 60 s; last log lines:"
tail -n 30 "${DOCKERD_LOG:-/var/log/dockerd.log}" >&2 || true
exit 1
