"""Which precision the model computes in: fp16 autocast + GradScaler on CUDA (trainer.amp), bf16 autocast on a CPU
with native bf16 (trainer.cpu_bf16), fp32 otherwise.

trainer.cpu_bf16=auto decides from the CPU's own flags: AVX512-BF16 or AMX run bf16 matrix work natively (faster than
fp32 on ResNets: bench/RESULTS.md), while elsewhere bf16 is emulated and slower than fp32.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def use_cpu_bf16(setting: bool | str, flags: set[str] | None = None) -> bool:
    """trainer.cpu_bf16: true / false as given; auto = on where the CPU has native bf16, said in one log line."""
    if setting != "auto":
        return bool(setting)
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if native:
        log.info("cpu: bf16 autocast on (trainer.cpu_bf16=auto; the CPU has %s)", ", ".join(native))
    else:
        log.info("cpu: fp32 (trainer.cpu_bf16=auto; no %s on this CPU)", " or ".join(NATIVE_BF16_FLAGS))
    return bool(native)


def autocast(device: torch.device, amp: bool, cpu_bf16: bool):
    """The autocast context for a forward pass on `device`."""
    if device.type == "cuda" and amp:
        return torch.autocast("cuda", dtype=torch.float16)
    if device.type == "cpu" and cpu_bf16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
