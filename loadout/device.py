"""The training device: trainer.device resolved for this rank, why CUDA is unusable when it is, and what the run
runs on (logged once).

A GPU profile (hardware=rtx3060|rtx4080|a100) asks for trainer.device=cuda and fails in one line naming the likely
cause when CUDA is unusable, instead of training ResNet-50 on the CPU. Under torchrun each rank takes
cuda:LOCAL_RANK.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

import torch

from loadout.dist import DistEnv
from loadout.errors import ConfigError

log = logging.getLogger(__name__)

CUDA_SUCCESS, CUDA_ERROR_INSUFFICIENT_DRIVER, CUDA_ERROR_NO_DEVICE = 0, 35, 100


@dataclass(frozen=True)
class CudaFacts:
    """What decides whether CUDA can run: the torch build, CUDA_VISIBLE_DEVICES, the driver as libcuda reports."""

    torch_cuda: str | None  # torch.version.cuda: None for a CPU-only build
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES, None when unset
    driver_cuda: str | None = None  # the newest CUDA the driver supports ("12.4"), None without libcuda
    driver_version: str | None = None  # "550.54.15" (NVML or nvidia-smi)
    init_error: int | None = None  # cuInit's result (0 = success)

    @classmethod
    def of_this_machine(cls) -> CudaFacts:
        driver_cuda, init_error = _libcuda()
        return cls(torch.version.cuda, os.environ.get("CUDA_VISIBLE_DEVICES"), driver_cuda, driver_version(),
                   init_error)


def _libcuda() -> tuple[str | None, int | None]:
    """(driver's CUDA version, cuInit result) through the CUDA driver API; (None, None) without a driver. Called only
    when torch found CUDA unusable, so initialising the driver here cannot disturb forked workers."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != CUDA_SUCCESS:
        return None, None
    return f"{version.value // 1000}.{version.value % 1000 // 10}", lib.cuInit(0)


def driver_version() -> str | None:
    """The NVIDIA driver's version, from NVML (nvidia-ml-py) or nvidia-smi; None where neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, no libnvidia-ml, no GPU: NVML raises its own error types
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def _major_minor(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def why_no_cuda(facts: CudaFacts) -> str:
    """The likely reason torch.cuda.is_available() is False, with the fix, in one sentence."""
    if facts.torch_cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch (or use the "
                "image, whose base carries one)")
    if facts.visible_devices is not None and facts.visible_devices.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides every GPU: unset it or list the GPUs to use"
    if facts.driver_cuda is None:
        return ("no NVIDIA driver found (libcuda.so.1 does not load): install the driver, or start the container "
                "with GPUs (docker run --gpus all, compose's GPU reservation; NVIDIA Container Toolkit)")
    driver = f"driver {facts.driver_version or '(version unknown)'} supports CUDA up to {facts.driver_cuda}"
    if _major_minor(facts.driver_cuda) < _major_minor(facts.torch_cuda):
        likely = "" if _major_minor(facts.driver_cuda)[0] < _major_minor(facts.torch_cuda)[0] else "likely "
        return (f"the NVIDIA driver is {likely}too old for this torch: {driver}, torch {torch.__version__} was built "
                f"for CUDA {facts.torch_cuda}; update the driver or install a torch built for CUDA "
                f"<= {facts.driver_cuda}")
    if facts.init_error == CUDA_ERROR_NO_DEVICE:
        return f"the driver sees no GPU ({driver}): check nvidia-smi, and that the container was given GPUs"
    if facts.init_error == CUDA_ERROR_INSUFFICIENT_DRIVER:
        return f"the NVIDIA driver is too old for this torch ({driver}, torch built for CUDA {facts.torch_cuda})"
    return (f"CUDA failed to initialise ({driver}, cuInit error {facts.init_error}, torch built for CUDA "
            f"{facts.torch_cuda}): nvidia-smi should show the GPU")


def cuda_index(requested: str, env: DistEnv, device_count: int) -> int:
    """The GPU this rank trains on: cuda:LOCAL_RANK for `cuda`, N for `cuda:N` (one process only)."""
    nproc = f"start one process per GPU: torchrun --nproc_per_node={max(device_count, 1)} (compose: NPROC=" \
            f"{max(device_count, 1)})"
    if requested == "cuda":
        if env.local_rank >= device_count:
            raise ConfigError(f"trainer.device=cuda: LOCAL_RANK={env.local_rank} but {device_count} GPU(s) are "
                              f"visible on this node; {nproc}")
        return env.local_rank
    index = int(requested.partition(":")[2])
    if env.local_world_size > 1:
        raise ConfigError(f"trainer.device={requested}: under torchrun every rank would train on GPU {index}; use "
                          f"trainer.device=cuda (each rank takes cuda:LOCAL_RANK) and {nproc}")
    if index >= device_count:
        raise ConfigError(f"trainer.device={requested}: {device_count} GPU(s) are visible (cuda:0 to "
                          f"cuda:{device_count - 1}); pick one of them or unset CUDA_VISIBLE_DEVICES")
    return index


def select_device(requested: str, env: DistEnv) -> torch.device:
    """trainer.device: auto = cuda:LOCAL_RANK when CUDA is usable, else cpu; cuda / cuda:N fail in one line when
    CUDA is unusable or the GPU does not exist."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = why_no_cuda(CudaFacts.of_this_machine())
        raise ConfigError(f"trainer.device={requested}: CUDA is unusable here: {why}. GPU profiles "
                          "(hardware=rtx3060|rtx4080|a100) train on CUDA; without a GPU use hardware=cpu or "
                          "trainer.device=cpu")
    device = torch.device("cuda", cuda_index(requested, env, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def describe(device: torch.device) -> str:
    """One line: what this rank runs on (GPU name, compute capability, memory, driver, torch's CUDA build)."""
    if device.type != "cuda":
        return f"{device} ({torch.get_num_threads()} torch threads), torch {torch.__version__}"
    props = torch.cuda.get_device_properties(device)
    return (f"{device} {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB), "
            f"driver {driver_version() or 'unknown'}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()})")
