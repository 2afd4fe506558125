"""Which precision the model computes in: one knob, trainer.precision = auto | bf16 | fp16 | fp32.

auto: on CUDA, bf16 autocast without a GradScaler where the GPU runs bf16 natively (Ampere and later: RTX 30xx/40xx,
A100, H100), else fp16 autocast with a GradScaler; on a CPU, bf16 autocast where the CPU has native bf16
(AVX512-BF16 or AMX; elsewhere bf16 is emulated and slower than fp32), else fp32. fp32 on CUDA lets matmuls and
convolutions use TF32.

Only fp16 needs a GradScaler, and its `step` reads the found-inf flag on the host (a sync per optimizer step);
bf16 has fp32's exponent range and needs none, so auto picks bf16 wherever it can.

A native bf16 flag does not make every model faster in bf16 on a CPU (on an AMD EPYC with avx512_bf16 resnet18
trains faster in bf16, lraspp_mobilenet_v3_large slower: bench/RESULTS.md), so a training run with auto on a CPU
measures both on a copy of its own model before its first step (`RunPrecision.settle`) and keeps bf16 unless fp32 is
clearly faster; fp32 wherever a rank's CPU lacks native bf16. The choice is a part of every checkpoint: a resumed
run, or trainer.mode=validate, keeps a measured one rather than measuring again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from pathlib import Path

import torch

from train.dist import all_reduce_sum
from train.errors import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The measurement (a warm-up and two timed steps each way on up to PROBE_BATCH samples, on one thread: under a
# second for resnet18 or lraspp at 64 px) is left out of runs of MEASURE_MIN_STEPS steps or fewer (smoke runs:
# trainer.max_steps, debug=default's 20), where it would be much of the start-up and could not pay for itself.
MEASURE_MIN_STEPS = 20
PROBE_BATCH = 16  # bf16 / fp32 step-time ratios at 16 samples matched those at 32 (resnet18, lraspp)
# A warm-up forward + backward over this many CPU seconds (a big model at 224 px) stops the measurement: it would
# cost tens of seconds at start, and bf16 is kept.
MEASURE_CAP_S = 2.0
# fp32 is taken only when bf16's step takes >= 10 % longer, so noise seldom flips the choice; it still can from one
# run to the next, and a run that must repeat itself (trainer.deterministic=true) is not measured: bf16.
FP32_MARGIN = 1.1
# A step shorter than this is mostly Python and dispatch, whose bf16 / fp32 ratio wanders from one measurement to the
# next: such a model keeps bf16.
MIN_MEASURED_S = 0.005


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
        return setting
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
    """A run's resolved precision (`value`), a Stateful part of its checkpoints. trainer.precision=auto, training on
    a CPU for > MEASURE_MIN_STEPS steps, not deterministic: `pending` until `settle`, which every rank runs, as it
    depends on the config alone (a rank's own CPU flags would leave one in a collective the others skip). A
    checkpoint's measured record replaces the measurement. Everywhere else `resolve` decides, as it always has."""

    def __init__(self, setting: str, device: torch.device, *, steps: int, training: bool = True,
                 deterministic: bool = False, flags: set[str] | None = None):
        self.native = native_bf16(flags) if device.type == "cpu" else []
        cpu_auto = setting == "auto" and device.type == "cpu"
        # training: every rank adopts a record (no collective then); validate: where this CPU runs bf16 natively
        self.adoptable = cpu_auto and (training or bool(self.native))
        self.pending = cpu_auto and training and steps > MEASURE_MIN_STEPS and not deterministic
        self.measured = False
        self.cap_s = MEASURE_CAP_S
        if self.pending:
            self.value = "bf16" if self.native else "fp32"  # until `settle`
        elif cpu_auto and training and deterministic and self.native:
            self.value = "bf16"
            log.info("precision: bf16 (trainer.precision=auto on a CPU with %s; not measured against fp32 under "
                     "trainer.deterministic=true: a timing could pick differently from one run to the next)",
                     ", ".join(self.native))
        else:
            self.value = resolve(setting, device, flags=flags)

    def state_dict(self) -> dict:
        return {"precision": self.value, "measured": self.measured}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's record kept where this run would have measured its own (auto on a CPU), if it was measured
        (settled): an unmeasured one (a smoke run's bf16, a record written before the flag) is measured again."""
        saved = state.get("precision")
        if self.adoptable and state.get("measured") and saved in ("bf16", "fp32"):
            self.adopt(saved, "the checkpoint's run")
        elif saved and saved != self.value:
            log.info("precision: %s (the checkpoint was trained in %s)", self.value, saved)

    def adopt(self, value: str, source: str) -> None:
        """`value` (bf16 | fp32) as measured by `source`, in place of a measurement of this run's own."""
        self.value, self.pending, self.measured = value, False, True
        log.info("precision: %s (trainer.precision=auto: measured by %s; not measured again)", value, source)

    def settle(self, model: torch.nn.Module, shape: tuple[int, ...], channels_last: bool) -> str:
        """bf16 or fp32 for every rank from one all-reduce of [bf16 s, fp32 s, 1, native, over the cap]: fp32 where
        any rank's CPU lacks native bf16 (those do not measure), bf16 where a rank's warm-up step went over
        MEASURE_CAP_S, else `choose` on the per-rank mean times of a forward + backward of a copy of `model` on a
        random batch of `shape`."""
        if not self.pending:
            return self.value
        start = time.perf_counter()
        times = measure(model, shape, channels_last, cap_s=self.cap_s) if self.native else {}
        capped = bool(self.native) and not times
        bf16, fp32, ranks, native, over = all_reduce_sum(
            [times.get("bf16", 0.0), times.get("fp32", 0.0), 1.0, float(bool(self.native)), float(capped)],
            torch.device("cpu"))
        self.pending, self.measured = False, True
        flags = " or ".join(NATIVE_BF16_FLAGS)
        if native < ranks:
            self.value = "fp32"
            log.info("precision: fp32 (trainer.precision=auto; no %s on %s)", flags,
                     "this CPU" if not self.native else f"the CPU of {ranks - native:.0f} of {ranks:.0f} ranks")
        elif over:
            self.value = "bf16"
            log.info("precision: bf16 (trainer.precision=auto on a CPU with %s; not measured against fp32: a warm-up "
                     "forward + backward of %s took over %g s of CPU on a rank)", ", ".join(self.native),
                     "x".join(map(str, shape)), self.cap_s)
        else:
            bf16, fp32 = bf16 / ranks, fp32 / ranks
            self.value = choose(bf16, fp32)
            log.info("precision: %s (trainer.precision=auto on a CPU with %s, measured on this model: a forward + "
                     "backward of %s takes %.3f s in bf16, %.3f s in fp32, one thread's CPU s, the faster of two, "
                     "mean over %.0f rank(s); bf16 unless fp32 is >= %.0f %% faster; measuring took %.2f s)",
                     self.value, ", ".join(self.native), "x".join(map(str, shape)), bf16, fp32, ranks,
                     (FP32_MARGIN - 1) * 100, time.perf_counter() - start)
        return self.value


def choose(bf16: float, fp32: float) -> str:
    """fp32 where its measured step (a rank's mean) is >= 10 % faster than bf16's and long enough to tell."""
    return "fp32" if bf16 >= FP32_MARGIN * fp32 and fp32 >= MIN_MEASURED_S else "bf16"


def measure(model: torch.nn.Module, shape: tuple[int, ...], channels_last: bool, *, warmup: int = 1,
            rounds: int = 2, cap_s: float = MEASURE_CAP_S) -> dict[str, float]:
    """CPU seconds of one training-mode forward + backward of a copy of `model` on a random batch of `shape`, in
    bf16 autocast and in fp32: the fastest of `rounds` each after `warmup`, taken in turn (bf16, fp32, bf16, ...);
    an empty dict as soon as a warm-up step takes over `cap_s`.
    On one thread, timed by its own CPU clock: beside other jobs torch's threads spin waiting for each other, and
    on a loaded 2-core box wall or process time swung the ratio both ways where one thread's stayed put. The
    model's weights, gradients, BatchNorm statistics and the random streams are left as they were."""
    probe = copy.deepcopy(model).train()
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    best = {"bf16": math.inf, "fp32": math.inf}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # dropout draws from the global stream
            for turn in range(warmup + rounds):
                for name in best:
                    start = time.thread_time()
                    with autocast(torch.device("cpu"), name):
                        outputs = probe(images)
                    _total(outputs).backward()
                    probe.zero_grad(set_to_none=True)
                    took = time.thread_time() - start
                    if turn < warmup and took > cap_s:
                        return {}
                    if turn >= warmup:
                        best[name] = min(best[name], took)
    finally:
        torch.set_num_threads(threads)
    return best


def _total(outputs) -> torch.Tensor:
    """One scalar over a model's outputs (a tensor, or a dict / sequence of them: {"out": ...} for segmentation)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float().sum()
    parts = outputs.values() if isinstance(outputs, dict) else outputs
    return sum((_total(part) for part in parts if isinstance(part, torch.Tensor | dict | list | tuple)),
               torch.zeros(()))


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
