#!/usr/bin/env python3
"""`make gpu-wheels`: the wheels a lent, offline GPU machine lacks to run `python3 scripts/gpu_check.py` (and so
`python3 -m train` and `pytest -m cuda`) on its preinstalled torch, made here in the git-ignored .gpu-wheels/.

There, gpu_check installs them with no index before anything else (docs/gpu.md). The machine is TARGET with
PREINSTALLED; it lacks CARRIED, whose versions come from the lock (constraints.txt). Binary wheels are downloaded for
the target's Python and platform. antlr4-python3-runtime 4.9.3 exists on PyPI only as a source archive, so its
py3-none-any wheel is built here. torchcodec is the lock's 0.17.0: its PyPI Linux wheel is the CUDA 13 build, and
its libraries target torch's stable ABI as of torch 2.11 (TORCH_TARGET_VERSION 2.11 in its CMakeLists), as 0.16's do,
the release torchcodec's own table lists for torch >= 2.11; the two import the same torch symbols.
A set already complete for these versions is kept, with no network. tests/test_gpu_harness.py proves the set
complete with pip's resolver, offline, against stand-ins of PREINSTALLED.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
STAMP = ".complete"  # the versions of a finished set (JSON); absent while it is being made
LIMIT_MIB = 64  # what a lent machine's working tree may carry, all together
# The lent machine: pip's options for its interpreter and platform.
TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
          "--only-binary=:all:")
# What it has (None: some version, not named), and what it lacks. Every name is on the device notes' list of the
# packages its image ('cuda', for nvidia-h100-x1 and nvidia-h200) holds, "Python packages already there" in
# /work/.library/device/KINDS.md, as read on such a machine on 2026-11-17; the versions are that page's "pip list"
# row (2026-11). Names off that list are CARRIED, not assumed: it has no hydra-core, omegaconf, antlr4, torchdata,
# simplejpeg, torchcodec or zlib-ng.
PREINSTALLED = {"torch": "2.11.0+cu130", "torchvision": "0.26.0", "triton": "3.6.0", "numpy": "2.5.2",
                "pillow": None, "psutil": None, "tqdm": None, "tensorboard": None, "prometheus-client": None,
                "pytest": None, "pyyaml": None, "fsspec": None, "pyarrow": None, "aiohttp": None,
                "nvidia-ml-py": None, "matplotlib": None, "packaging": None, "requests": None, "urllib3": None}
CARRIED = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "torchdata", "simplejpeg", "torchcodec", "zlib-ng")
SOURCE_ONLY = {"antlr4-python3-runtime"}  # no wheel on PyPI: built here (pure Python, py3-none-any)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """name -> version of every `name==version` line of the lock."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", constraints.read_text(), re.MULTILINE)
    return {canonical(name): version for name, version in found}


def wanted() -> dict[str, str]:
    lock = locked_versions()
    missing = [name for name in CARRIED if name not in lock]
    if missing:
        raise SystemExit(f"gpu-wheels: {', '.join(missing)} not pinned in constraints.txt; run `make lock`")
    return {name: lock[name] for name in CARRIED}


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds, canonical: `torchcodec-0.17.0-cp312-...whl` -> torchcodec."""
    return canonical(path.name.split("-")[0])


def complete(folder: Path, versions: dict[str, str]) -> bool:
    stamp = folder / STAMP
    return (stamp.is_file() and json.loads(stamp.read_text()) == versions
            and {wheel_name(w) for w in folder.glob("*.whl")} == set(versions))


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        cause = next((line for line in lines if line.startswith("ERROR: ")), lines[-1]).removeprefix("ERROR: ")
        raise SystemExit(f"gpu-wheels: pip {args[0]} failed ({cause}); it needs PyPI (or your index) reachable")


def make(folder: Path, versions: dict[str, str]) -> None:
    """Download (or build) every carried wheel into a fresh `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pins = [f"{name}=={version}" for name, version in versions.items()]
    binary = [pin for pin in pins if pin.split("==")[0] not in SOURCE_ONLY]
    pip("download", "--quiet", "--no-deps", *TARGET, "--dest", str(folder), *binary)
    for pin in sorted(set(pins) - set(binary)):
        pip("wheel", "--quiet", "--no-deps", "--no-binary", pin.split("==")[0], "--wheel-dir", str(folder), pin)
    (folder / STAMP).write_text(json.dumps(versions) + "\n")


def main() -> int:
    versions = wanted()
    if complete(WHEELS, versions):
        print(f"{WHEELS.relative_to(ROOT)}/ is complete for {' '.join(f'{n}=={v}' for n, v in versions.items())}")
    else:
        make(WHEELS, versions)
    wheels = sorted(WHEELS.glob("*.whl"))
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"  {total:6.2f} MiB  in all ({LIMIT_MIB} MiB may be carried to the lent machine, the checkout included)")
    if total >= LIMIT_MIB:
        print(f"gpu-wheels: {total:.1f} MiB is over the {LIMIT_MIB} MiB a lent machine takes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
