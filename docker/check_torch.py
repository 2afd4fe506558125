"""The image's torch after the dependencies are installed: a CUDA build (unless the image is asked for CPU only:
--build-arg CPU_ONLY=1), and torch / torchvision at the lock's versions (constraints.txt, given as the argument), or
with TORCH_FROM_BASE=1 the base's own, in the range loadout supports (requirements.txt). Fails the build in one line
otherwise.

In a CUDA image torchcodec's decoders must load too (data.decode=device): its libraries link against torch's and
its CUDA major's (libcudart/libnvrtc), so a base of another CUDA major than the wheel's fails only at the first
decode=device run, with an OSError. With the lock's torch that fails the build; with TORCH_FROM_BASE=1, whose torch
the lock's torchcodec may not be built for, it is one warning line (every other path runs).

torchcodec is the extra loadout[device-decode] (pyproject.toml), not a dependency: it loads on torch >= 2.11 alone,
and its wheels name no torch, so pip would install it on an older one. Before the install, the Dockerfile asks
`python3 check_torch.py --decode-requirements` for the extra's requirements: none on an older torch (an NGC base's
2.10.0a0), whose image then builds with one warning line."""

from __future__ import annotations

import os
import re
import sys

import torch
import torchvision

DECODE_EXTRA = ("torchcodec>=0.16",)  # loadout[device-decode] in pyproject.toml; the version comes from the lock
DECODE_MIN_TORCH = (2, 11)  # torchcodec >= 0.12 is built against torch's stable ABI as of 2.11


def release(version: str) -> tuple[int, ...]:
    """(2, 8) of '2.8.0a0+5228986c39' (NGC), '2.14.1+cu130' or '2.14.1'."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("a")[0])[:2])


def decode_requirements(torch_version: str) -> tuple[str, ...]:
    """loadout[device-decode]'s requirements where a torch of `torch_version` can load them, else none."""
    return DECODE_EXTRA if release(torch_version) >= DECODE_MIN_TORCH else ()


def main(lock_path: str, requirements_path: str) -> int:
    found = {"torch": torch.__version__, "torchvision": torchvision.__version__}
    if os.environ.get("TORCH_FROM_BASE") == "1":
        with open(requirements_path) as f:
            floor = dict(re.findall(r"^(torch|torchvision)>=(\S+)", f.read(), re.M))
        for name, version in found.items():
            if name in floor and release(version) < release(floor[name]):
                print(f"check_torch: the base's {name} {version} is older than loadout supports ({name}>="
                      f"{floor[name]}): use a newer base", file=sys.stderr)
                return 1
    else:
        with open(lock_path) as f:
            lock = dict(re.findall(r"^(torch|torchvision)==(\S+)", f.read(), re.M))
        for name, version in found.items():
            if name in lock and version.split("+")[0] != lock[name]:
                print(f"check_torch: {name} {version} in the image, the lock has {lock[name]}: build FROM a base with "
                      f"{name}=={lock[name]}, or with --build-arg TORCH_FROM_BASE=1", file=sys.stderr)
                return 1
    if torch.version.cuda is None and os.environ.get("CPU_ONLY") != "1":
        print(f"check_torch: torch {torch.__version__} is a CPU-only build: the image would train GPU profiles on "
              "nothing; use a CUDA base, or --build-arg CPU_ONLY=1 for an image for machines without GPUs",
              file=sys.stderr)
        return 1
    if torch.version.cuda is not None:
        problem = torchcodec_problem()
        if problem and os.environ.get("TORCH_FROM_BASE") == "1":
            print(f"check_torch: warning: {problem}; data.decode=device will not run in this image", file=sys.stderr)
        elif problem:
            print(f"check_torch: {problem}: build FROM a base of the CUDA major torchcodec's wheel is built for, or "
                  "install torchcodec from PyTorch's index for this CUDA", file=sys.stderr)
            return 1
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), torchvision {torchvision.__version__}")
    return 0


def torchcodec_problem() -> str | None:
    """None when torchcodec's image decoders load against this torch; else what failed, in one line."""
    if not decode_requirements(torch.__version__):
        return (f"torch {torch.__version__} is older than data.decode=device needs (torch >= "
                f"{'.'.join(map(str, DECODE_MIN_TORCH))}), so torchcodec (loadout[device-decode]) is not installed")
    try:
        import torchcodec.decoders  # noqa: F401
    except (ImportError, OSError, RuntimeError) as err:  # a CUDA-major mismatch is an OSError from load_library
        text = str(err).strip().splitlines()
        return (f"torchcodec does not load against torch {torch.__version__} (CUDA {torch.version.cuda}): "
                f"{text[0][:300] if text else type(err).__name__}")
    return None


if __name__ == "__main__":
    if sys.argv[1:] == ["--decode-requirements"]:  # a pip requirements file's lines, before the install
        print("\n".join(decode_requirements(torch.__version__)))
        sys.exit(0)
    sys.exit(main(sys.argv[1], sys.argv[2]))
