"""Which precision the model computes in: one knob, trainer.precision = auto | bf16 | fp16 | fp32.

auto: on CUDA, bf16 autocast without a GradScaler where the GPU runs bf16 natively (Ampere and later: RTX 30xx/40xx,
A100, H100), else fp16 autocast with a GradScaler; on a CPU, bf16 autocast where the CPU has native bf16
(AVX512-BF16 or AMX; elsewhere bf16 is emulated and slower than fp32), else fp32. fp32 on CUDA lets matmuls and
convolutions use TF32.

Only fp16 needs a GradScaler, and its `step` reads the found-inf flag on the host (a sync per optimizer step);
bf16 has fp32's exponent range and needs none, so auto picks bf16 wherever it can.
A native bf16 flag does not make every model faster on a CPU (resnet18 trains faster in bf16 here, lraspp slower:
bench/RESULTS.md); a run does not time both before its first step (that cost start-up and ran outside the step's
out-of-memory handling): `make tune` measures it (loadout/tune/cpu_precision.py) and writes the winner into
hardware=local.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from loadout.errors import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def resolve(setting: str, device: torch.device, *, flags: set[str] | None = None,
            cuda_bf16: bool | None = None) -> str:
    """trainer.precision for `device`: auto becomes bf16, fp16 or fp32 (said in one log line); the rest stand.
    `flags` (the CPU's) and `cuda_bf16` (the GPU runs bf16 natively) default to this machine's. fp16 off CUDA fails
    in one line: its GradScaler is CUDA's."""
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError(f"trainer.precision=fp16: fp16 (with its GradScaler) is for CUDA, this run is on {device}; "
                          "use bf16, fp32 or auto")
    if setting != "auto":
        return str(setting)  # a plain str (a StrEnum from the config would not load with weights_only)
    if device.type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        chosen = "bf16" if cuda_bf16 else "fp16"
        log.info("precision: %s (trainer.precision=auto; %s)", chosen,
                 "the GPU runs bf16 natively, no GradScaler" if cuda_bf16 else "no native bf16 before Ampere: "
                 "fp16 with a GradScaler")
        return chosen
    native = native_bf16(flags)
    if native:
        log.info("precision: bf16 (trainer.precision=auto; the CPU has %s)", ", ".join(native))
        return "bf16"
    log.info("precision: fp32 (trainer.precision=auto; no %s on this CPU)", " or ".join(NATIVE_BF16_FLAGS))
    return "fp32"


def native_bf16(flags: set[str] | None = None) -> list[str]:
    """The CPU's native bf16 flags among `flags` (this machine's by default)."""
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


class RunPrecision:
    """The run's resolved precision (`value`: bf16 | fp16 | fp32), a Stateful part of its checkpoints: a resume or
    trainer.mode=validate with auto on a CPU with native bf16 keeps a checkpoint's fp32 (a run that trained in it),
    so one run does not change its precision half-way; elsewhere `resolve` decides and a differing record is said."""

    def __init__(self, setting: str, device: torch.device, *, flags: set[str] | None = None):
        self.value = resolve(setting, device, flags=flags)
        self.adoptable = setting == "auto" and device.type == "cpu" and self.value == "bf16"

    def state_dict(self) -> dict:
        return {"precision": str(self.value)}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("precision")
        if not saved or saved == self.value:
            return
        if self.adoptable and saved == "fp32":
            self.value = "fp32"
            log.info("precision: fp32 (trainer.precision=auto: the checkpoint's run trained in fp32)")
        else:
            log.info("precision: %s (the checkpoint was trained in %s)", self.value, saved)


def autocast(device: torch.device, precision: str):
    """The autocast context for a forward pass in a resolved `precision` (bf16 | fp16 | fp32) on `device`."""
    if precision in DTYPES:
        return torch.autocast(device.type, dtype=DTYPES[precision])
    return contextlib.nullcontext()


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (the one precision whose gradients underflow)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def allow_tf32(device: torch.device) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later; ignored before)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def load_scaler(scaler: torch.amp.GradScaler, state: dict, precision: str) -> None:
    """A GradScaler state from any run: one saved by a disabled scaler (a CPU, bf16 or fp32 run) or loaded into a
    disabled one (this run's `precision` needs none) leaves `scaler` as it starts, with one log line."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)
    elif scaler.is_enabled() or state:
        log.info("trainer.precision=%s: the checkpoint's loss-scaler state does not apply here (it was written %s); "
                 "the scaler starts fresh", precision, "without one" if not state else "by an fp16 run")
