# loadout training image.
#   docker build -t loadout .                                             # official PyTorch CUDA runtime base
#   docker build --build-arg BASE_IMAGE=loadout-base:torch2.14.1 -t loadout .  # any base: python/pip + torch
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3 --build-arg TORCH_FROM_BASE=1 -t loadout .
# BASE_IMAGE must already hold torch/torchvision at the versions of constraints.txt (torch 2.14.1 wheels are
# CUDA 13.0 builds), so no CUDA wheel is downloaded here; or, with TORCH_FROM_BASE=1 (NVIDIA's NGC images, whose
# torch is 2.x.0a0+<sha>), the base's torch/torchvision/CUDA stack is kept and the rest comes from the lock
# (docs/container.md has the NGC tag matrix). The CUDA driver comes from the host through the NVIDIA
# Container Toolkit at run time (see docs/container.md).
# The default base: Ubuntu with torch 2.14.1+cu130 in the system Python 3.12 (cuBLAS 13.1.1.3, cuDNN 9.24.0.43).
# Its digest is not recorded here: no registry is reachable from the machines loadout is built and tested on.
# For a build that never drifts, print it (`docker buildx imagetools inspect <image>`) and build with
# --build-arg BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime@sha256:<digest> (docs/container.md).
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="loadout" \
      org.opencontainers.image.description="PyTorch training template: python -m train <hydra overrides>"

# UID/GID of the user that runs training: match the host user that owns ./outputs (docker-compose.yml passes
# LOADOUT_UID/LOADOUT_GID). --non-unique: the base may already have a user with that id.
ARG UID=1000
ARG GID=1000
# Extra packages for the Jupyter image (docker-compose.yml `jupyter` service); empty for training.
ARG EXTRA_PIP_PACKAGES=""
# 1: an image for machines without GPUs, whose base may carry a CPU-only torch (else the build refuses one).
ARG CPU_ONLY=0
# 1: keep the base's torch / torchvision / CUDA stack whatever its version (NGC), and its own pip constraints.
ARG TORCH_FROM_BASE=0

# PIP_BREAK_SYSTEM_PACKAGES: the 2.14 images keep torch in the system Python (PEP 668 marks it externally managed).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A C compiler and Python's headers: torch.compile's Inductor builds its CPU kernels, and Triton its GPU launchers,
# with them at run time. Unpinned: the base's distribution release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --non-unique --gid "${GID}" app \
 && useradd --non-unique --uid "${UID}" --gid "${GID}" --create-home --shell /bin/bash app

WORKDIR /app

# Dependencies first, in their own layer: rebuilt only when requirements.txt or constraints.txt change, not on
# every source edit. Every version from constraints.txt (the lock CI tests) less what the base brings
# (docker/base_lock.py: its CUDA stack; its torch must be the lock's, checked first, unless TORCH_FROM_BASE=1).
# data.decode=device's extra, loadout[device-decode] (torchcodec), where the base's torch can load it (>= 2.11).
COPY requirements.txt constraints.txt docker/base_lock.py docker/check_torch.py ./
RUN TORCH_FROM_BASE=${TORCH_FROM_BASE} python3 base_lock.py constraints.txt /tmp/constraints.txt \
 && python3 check_torch.py --decode-requirements > /tmp/decode.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/constraints.txt -r requirements.txt -r /tmp/decode.txt \
      ${EXTRA_PIP_PACKAGES} \
 && CPU_ONLY=${CPU_ONLY} TORCH_FROM_BASE=${TORCH_FROM_BASE} python3 check_torch.py constraints.txt requirements.txt \
 && rm /tmp/constraints.txt /tmp/decode.txt base_lock.py check_torch.py

# The source: the library (loadout/, installed) and the template (train/, not installed: the wheel holds the library
# only). `python -m train` runs from /app, so the template and the configs in /app/conf are the ones used; PYTHONPATH
# finds the template from any other folder too (a notebook's kernel in /app/outputs, `docker run -w`).
# README* (pyproject's readme) may not exist yet; pyproject.toml keeps the pattern from matching nothing.
COPY pyproject.toml requirements.txt README* ./
COPY conf/ conf/
COPY loadout/ loadout/
COPY train/ train/
RUN python3 -m pip install --no-cache-dir --no-deps . \
 && rm -rf build ./*.egg-info \
 && mkdir -p /app/data /app/outputs \
 && chown "${UID}:${GID}" /app/outputs
ENV PYTHONPATH="/app${PYTHONPATH:+:${PYTHONPATH}}"

# Mount the dataset read-only at /app/data and a host folder owned by UID:GID at /app/outputs, where Hydra
# writes the run directories (outputs/<date>/<time>/): docker-compose.yml does both.
USER ${UID}:${GID}

# Hydra overrides given to `docker run IMAGE ...` / `docker compose run SERVICE ...` append to this.
ENTRYPOINT ["python3", "-m", "train"]
