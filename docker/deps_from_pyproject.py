"""Print pyproject.toml's [project].dependencies, one per line, and write the lock the image installs them under.

Used by the Dockerfile to install dependencies in a layer of their own, before the source is copied. The base image
brings torch with its CUDA stack (nvidia-*, cuda-*, triton); the image keeps those and takes every other pin from
constraints.txt (the lock), written to the path given as the first argument. Fails when the base image's torch
differs from the lock's: pip would otherwise replace it with a fresh multi-GB CUDA wheel, or the image would train
on a torch the tests never saw.
"""

from __future__ import annotations

import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip ships tomli
    from pip._vendor import tomli as tomllib

BASE_STACK = re.compile(r"^(nvidia-(?!ml-py)|cuda-|triton==)")  # the base's CUDA libraries (nvidia-ml-py is ours)


def main() -> None:
    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open("constraints.txt") as f:
        lock = f.read()
    pin = re.search(r"^torch==(\S+)", lock, re.M)
    if pin:
        import torch

        have = torch.__version__.split("+")[0]
        if have != pin.group(1):
            sys.exit(f"base image has torch {have}, constraints.txt pins {pin.group(1)}: pick a matching BASE_IMAGE")
    pins = [line for line in lock.splitlines() if re.match(r"^[A-Za-z0-9]", line) and not BASE_STACK.match(line)]
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(pins) + "\n")
    print("\n".join(deps))


if __name__ == "__main__":
    main()
