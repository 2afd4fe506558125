"""Print pyproject.toml's [project].dependencies, one per line, after checking the base image's torch.

Used by the Dockerfile to install dependencies in a layer of their own, before the source is copied. Fails when
the base image's torch differs from the pin in constraints.txt: pip would otherwise replace it with a fresh
multi-GB CUDA wheel, or the image would train on a torch the tests never saw.
"""

from __future__ import annotations

import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip ships tomli
    from pip._vendor import tomli as tomllib


def main() -> None:
    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open("constraints.txt") as f:
        pin = re.search(r"^torch==(\S+)", f.read(), re.M)
    if pin:
        import torch

        have = torch.__version__.split("+")[0]
        if have != pin.group(1):
            sys.exit(f"base image has torch {have}, constraints.txt pins {pin.group(1)}: pick a matching BASE_IMAGE")
    print("\n".join(deps))


if __name__ == "__main__":
    main()
