#!/usr/bin/env bash
# Provide the Dockerfile's base image on a machine that cannot pull it, and print the image to build FROM.
#
#   tests/infra/build_base_image.sh            -> prints e.g. "loadout-base:torch2.14.1" on stdout (logs on stderr)
#
# Order: 1. the real base (Dockerfile's ARG BASE_IMAGE default) if already present or pullable within
#           ${PULL_TIMEOUT:-60}s (set SKIP_PULL=1 to skip the attempt);
#        2. the stand-in ${STANDIN_IMAGE:-loadout-base:torch2.14.1} if it already exists (reused, ~0 s);
#        3. otherwise build the stand-in: debootstrap Debian bookworm (minbase + python3), a venv at /opt/venv,
#           torch/torchvision from pip pinned by constraints.txt, the host's CA bundle and the host's pip
#           configuration (local mirrors served by tests/infra/pip_mirror.py on 127.0.0.1), then `docker import`.
#           Needs root, debootstrap and a Debian mirror (${DEBIAN_MIRROR:-http://deb.debian.org/debian}).
# The stand-in stands for pytorch/pytorch's runtime image: python/pip on PATH with torch preinstalled. It has no
# CUDA driver of its own either (the NVIDIA Container Toolkit injects that), so the same Dockerfile works on both.
set -euo pipefail

cd "$(dirname "$0")/../.."
log() { printf '[build_base_image] %s\n' "$*" >&2; }

real_base=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile | head -n1)
torch_version=$(sed -n 's/^torch==//p' constraints.txt)
standin=${STANDIN_IMAGE:-loadout-base:torch${torch_version}}
suite=${DEBIAN_SUITE:-bookworm}  # bookworm's python3.11 matches the cp311 wheels of the local mirrors
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$real_base" >/dev/null 2>&1; then
  log "real base $real_base is present"
  echo "$real_base"
  exit 0
fi
if [[ ${SKIP_PULL:-0} != 1 ]] && timeout "${PULL_TIMEOUT:-60}" docker pull -q "$real_base" >/dev/null 2>&1; then
  log "pulled real base $real_base"
  echo "$real_base"
  exit 0
fi
if docker image inspect "$standin" >/dev/null 2>&1; then
  log "reusing stand-in base $standin (docker rmi it to rebuild)"
  echo "$standin"
  exit 0
fi

[[ $(id -u) -eq 0 ]] || { log "building the stand-in needs root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null || { log "debootstrap missing: run tests/infra/ensure_docker.sh"; exit 1; }

log "real base $real_base unavailable; building stand-in $standin (debootstrap $suite + torch==$torch_version)"
start=$SECONDS
rootfs=$(mktemp -d /var/tmp/loadout-base.XXXXXX)
mirror_pid=""
cleanup() {
  if [[ -n $mirror_pid ]]; then kill "$mirror_pid" 2>/dev/null || true; fi
  # Only plain files live under $rootfs: all mounts were made in a private namespace that is gone by now.
  rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

# .debs are kept between attempts so a failed build does not download them again.
deb_cache=${DEBOOTSTRAP_CACHE:-/var/cache/loadout-debootstrap}
mkdir -p "$deb_cache"
debootstrap --variant=minbase --cache-dir="$deb_cache" \
  --include=python3,python3-venv,ca-certificates,passwd,procps \
  "$suite" "$rootfs" "$mirror" >&2
log "debootstrap done ($((SECONDS - start)) s)"

# The host's CA bundle (it may hold a proxy's CA) and the host's pip configuration, local mirrors rewritten to
# the HTTP mirror below; builds run with --network host so 127.0.0.1 is this machine.
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
port=${PIP_MIRROR_PORT:-38111}
python3 tests/infra/pip_mirror.py --port "$port" --conf-out "$rootfs/etc/pip.conf" &
mirror_pid=$!
for _ in $(seq 1 100); do  # the mirror writes the config once its port is bound
  [[ -s $rootfs/etc/pip.conf ]] && break
  kill -0 "$mirror_pid" 2>/dev/null || { log "pip mirror failed to start (port $port in use? set PIP_MIRROR_PORT)"; exit 1; }
  sleep 0.1
done
[[ -s $rootfs/etc/pip.conf ]] || { log "pip mirror did not start"; exit 1; }
log "pip config in the stand-in:"; sed 's/^/    /' "$rootfs/etc/pip.conf" >&2
cp constraints.txt "$rootfs/tmp/constraints.txt"

# A private mount namespace: /proc and /dev mounts vanish with it, so cleanup never walks into them.
# PIP_* variables are cleared so only the image's /etc/pip.conf counts, exactly as in later docker builds.
# shellcheck disable=SC2016 # the single-quoted script is expanded by the inner sh
env -u PIP_FIND_LINKS -u PIP_CERT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL \
  unshare --mount --propagation private sh -euc '
  root=$1; shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" /bin/sh -euc "$*"
' sh "$rootfs" "
  python3 -m venv /opt/venv
  /opt/venv/bin/pip install --no-cache-dir --progress-bar off -c /tmp/constraints.txt \
    torch==$torch_version \$(sed -n 's/^torchvision==/torchvision==/p' /tmp/constraints.txt)
  /opt/venv/bin/python -c 'import torch, torchvision; print(\"torch\", torch.__version__, \"torchvision\", torchvision.__version__)'
  rm -f /tmp/constraints.txt
  apt-get clean
  rm -rf /var/lib/apt/lists/* /root/.cache
" >&2
log "torch installed ($((SECONDS - start)) s); importing image"

tar --numeric-owner --xattrs -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV VIRTUAL_ENV=/opt/venv' \
  --change 'LABEL org.opencontainers.image.description="loadout stand-in for '"$real_base"' (no CUDA runtime libs beyond the pip wheels)"' \
  --change 'CMD ["python3"]' \
  - "$standin" >/dev/null
log "built $standin in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$standin" | awk '{printf "%.1f GB", $1/1e9}'))"
echo "$standin"
