"""Write the lock the image installs its dependencies under: constraints.txt less what the base image brings.

The base brings torch with its CUDA stack (nvidia-*, cuda-*, triton): those pins are dropped, and the base's torch
must be the lock's (else pip would replace it with a fresh multi-GB CUDA wheel, or the image would train on a torch
the tests never saw): one line, before anything is installed. With TORCH_FROM_BASE=1 (NVIDIA's NGC images, whose
torch is `2.x.0a0+<sha>`) the base's torch and torchvision are kept whatever their version, and every package the
base's own pip constraint files pin (/etc/pip/constraint.txt, which NGC ships since 25.03, and $PIP_CONSTRAINT) is
left to them.

    python3 base_lock.py constraints.txt /tmp/constraints.txt
"""

from __future__ import annotations

import os
import re
import sys

BASE_STACK = re.compile(r"^(nvidia-(?!ml-py)|cuda-|triton==)")  # the base's CUDA libraries (nvidia-ml-py is ours)
TORCH = re.compile(r"^(torch|torchvision)==")
NGC_CONSTRAINT = "/etc/pip/constraint.txt"
NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_by(path: str) -> set[str]:
    """The package names a pip constraint file pins."""
    with open(path) as f:
        return {canonical(m[1]) for line in f if (m := NAME.match(line.strip()))}


def main(lock_path: str, out_path: str) -> None:
    with open(lock_path) as f:
        pins = [line for line in f.read().splitlines() if NAME.match(line)]
    keep_base = os.environ.get("TORCH_FROM_BASE") == "1"
    import torch

    have = torch.__version__
    wanted = next((line.split("==", 1)[1] for line in pins if line.startswith("torch==")), None)
    if not keep_base and wanted and have.split("+")[0] != wanted:
        sys.exit(f"base image has torch {have}, constraints.txt pins {wanted}: pick a matching BASE_IMAGE, or build "
                 "with --build-arg TORCH_FROM_BASE=1 to keep the base's torch (NVIDIA's NGC images)")
    base_pins: set[str] = set()
    if keep_base:
        files = {NGC_CONSTRAINT, *os.environ.get("PIP_CONSTRAINT", "").split()}
        base_pins = set().union(*(pinned_by(path) for path in files if os.path.isfile(path)))
    kept = [line for line in pins if not BASE_STACK.match(line) and not (keep_base and TORCH.match(line))
            and canonical(NAME.match(line)[1]) not in base_pins]
    with open(out_path, "w") as f:
        f.write("\n".join(kept) + "\n")
    left = sorted(base_pins & {canonical(NAME.match(line)[1]) for line in pins})
    print(f"torch {have} from the base; {len(kept)} pins from constraints.txt"
          + (f", {len(left)} left to the base's constraint file ({', '.join(left)})" if left else ""))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
