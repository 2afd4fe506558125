# Stands in for NVIDIA's nvcr.io/nvidia/pytorch:<YY.MM>-py3 where it cannot be pulled (make test-container): the
# stand-in base's torch and torchvision versioned as NVIDIA's source builds are (2.14.0a0+<sha>: no PyPI release of
# that name; torchvision asking for that torch), numpy at another version than loadout's lock, and a pip constraint
# file pinning all three at /etc/pip/constraint.txt (NGC >= 25.03 ships one) named by PIP_CONSTRAINT. loadout's
# image must build FROM it with TORCH_FROM_BASE=1, and refuse to without.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir numpy==2.3.5 \
 && site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') \
 && sed -i "s/^__version__ = .*/__version__ = '2.14.0a0+ngc1a2b3c'/" "$site/torch/version.py" \
 && sed -i 's/^Version: .*/Version: 2.14.0a0+ngc1a2b3c/' "$site"/torch-*.dist-info/METADATA \
 && sed -i "s/^__version__ = .*/__version__ = '0.29.0a0+ngc4d5e6f'/" "$site/torchvision/version.py" \
 && sed -i -e 's/^Version: .*/Version: 0.29.0a0+ngc4d5e6f/' \
      -e 's/^Requires-Dist: torch (.*)$/Requires-Dist: torch (>=2.14.0a0)/' "$site"/torchvision-*.dist-info/METADATA \
 && mkdir -p /etc/pip \
 && printf 'torch==2.14.0a0+ngc1a2b3c\ntorchvision==0.29.0a0+ngc4d5e6f\nnumpy==2.3.5\n' > /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt
