# Stands in for NVIDIA's nvcr.io/nvidia/pytorch:<YY.MM>-py3 where it cannot be pulled (make test-container): the
# stand-in base's torch under an NGC-style version (2.14.0a0+<sha>: a source build, no PyPI release of that name),
# numpy at another version than loadout's lock, and a pip constraint file pinning all three, named by PIP_CONSTRAINT,
# as NGC >= 25.03 ships one. loadout's image must build FROM it with TORCH_FROM_BASE=1, and refuse to without.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir numpy==2.3.5 \
 && site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') \
 && sed -i "s/^__version__ = .*/__version__ = '2.14.0a0+ngc1a2b3c'/" "$site/torch/version.py" \
 && sed -i 's/^Version: .*/Version: 2.14.0a0+ngc1a2b3c/' "$site"/torch-*.dist-info/METADATA \
 && mkdir -p /etc/pip \
 && printf 'torch==2.14.0a0+ngc1a2b3c\ntorchvision==%s\nnumpy==2.3.5\n' \
      "$(python3 -c 'import importlib.metadata as m; print(m.version("torchvision"))')" > /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt
