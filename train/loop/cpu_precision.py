"""trainer.precision=auto on a CPU: bf16 or fp32, measured.

A native bf16 flag does not make every model faster in bf16 on a CPU (on an AMD EPYC with avx512_bf16 resnet18
trains faster in bf16, lraspp_mobilenet_v3_large slower: bench/RESULTS.md), so a training run with auto on a CPU
measures both on a copy of its own model before its first step (`RunPrecision.settle`) and keeps bf16 unless fp32 is
clearly faster; fp32 wherever a rank's CPU lacks native bf16. The choice is a part of every checkpoint: a resumed
run keeps a measured one rather than measuring again (fp32 still where a rank lacks native bf16), and so does
trainer.mode=validate on a CPU with native bf16.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import torch

from train.dist import all_reduce_sum
from train.loop.precision import NATIVE_BF16_FLAGS, autocast, native_bf16, resolve

log = logging.getLogger("train.loop.precision")  # the run's precision lines keep one logger name

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



class RunPrecision:
    """A run's resolved precision (`value`), a Stateful part of its checkpoints. trainer.precision=auto, training on
    a CPU for > MEASURE_MIN_STEPS steps, not deterministic: `pending` until `settle`, which every such rank runs (its
    one all-reduce), as `pending` depends on the config alone: neither a rank's own CPU flags nor the checkpoint it
    loaded may leave one rank in a collective the others skip. A checkpoint's measured record is kept for `settle`,
    which takes it in place of a timing. Everywhere else `resolve` decides, as it always has."""

    def __init__(self, setting: str, device: torch.device, *, steps: int, training: bool = True,
                 deterministic: bool = False, flags: set[str] | None = None):
        self.native = native_bf16(flags) if device.type == "cpu" else []
        cpu_auto = setting == "auto" and device.type == "cpu"
        self.pending = cpu_auto and training and steps > MEASURE_MIN_STEPS and not deterministic
        # not pending (validate, smoke, deterministic): a record is adopted on the spot where this CPU runs bf16
        # natively (no collective then; elsewhere fp32 stands)
        self.adoptable = cpu_auto and not self.pending and bool(self.native)
        self.measured = False
        self.record: tuple[str, str] | None = None  # a measured (precision, source) that `settle` takes
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
        return {"precision": str(self.value), "measured": self.measured}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's record where this run would have measured its own (auto on a CPU), if it was measured: an
        unmeasured one (a smoke run's bf16, a record written before the flag) is measured again."""
        saved = state.get("precision")
        if state.get("measured") and saved in ("bf16", "fp32") and (self.pending or self.adoptable):
            self.adopt(saved, "the checkpoint's run")
        elif saved and saved != self.value:
            log.info("precision: %s (the checkpoint was trained in %s)", self.value, saved)

    def adopt(self, value: str, source: str) -> None:
        """`value` (bf16 | fp32) as measured by `source`, in place of a measurement of this run's own: taken now
        where this run does not vote, else kept for `settle` (whose vote still runs: fp32 where a rank lacks
        native bf16)."""
        if self.pending:
            self.record = (value, source)
            return
        self.value, self.measured = value, True
        log.info("precision: %s (trainer.precision=auto: measured by %s; not measured again)", value, source)

    def settle(self, model: torch.nn.Module, shape: tuple[int, ...], channels_last: bool) -> str:
        """bf16 or fp32 for every rank from one all-reduce of [bf16 s, fp32 s, timed, native, 1, over the cap,
        fp32 record, bf16 record]: fp32 where any rank's CPU lacks native bf16; else a measured record (fp32 if any
        rank's is); else bf16 where a rank's warm-up step went over MEASURE_CAP_S; else `choose` on the mean times
        of a forward + backward of a copy of `model` on a random batch of `shape`. Only a rank with native bf16 and
        no record times."""
        if not self.pending:
            return self.value
        start = time.perf_counter()
        timing = bool(self.native) and self.record is None
        times = measure(model, shape, channels_last, cap_s=MEASURE_CAP_S) if timing else {}
        saved = self.record[0] if self.record else None
        bf16, fp32, timed, native, ranks, over, fp32_records, bf16_records = all_reduce_sum(
            [times.get("bf16", 0.0), times.get("fp32", 0.0), float(bool(times)), float(bool(self.native)), 1.0,
             float(timing and not times), float(saved == "fp32"), float(saved == "bf16")], torch.device("cpu"))
        self.pending = False
        flags, where = " or ".join(NATIVE_BF16_FLAGS), ", ".join(self.native)
        if native < ranks:
            self.value, self.measured = "fp32", False
            log.info("precision: fp32 (trainer.precision=auto; no %s on %s)", flags,
                     "this CPU" if not self.native else f"the CPU of {ranks - native:.0f} of {ranks:.0f} ranks")
        elif fp32_records or bf16_records:
            self.value, self.measured = ("fp32" if fp32_records else "bf16"), True
            source = self.record[1] if self.record else "another rank's checkpoint"
            log.info("precision: %s (trainer.precision=auto on a CPU with %s: measured by %s%s; not measured again)",
                     self.value, where, source, f", fp32 on {fp32_records:.0f} of {fp32_records + bf16_records:.0f} "
                     "ranks' records" if fp32_records and bf16_records else "")
        elif over:
            self.value, self.measured = "bf16", False
            log.info("precision: bf16 (trainer.precision=auto on a CPU with %s; not measured against fp32: a warm-up "
                     "forward + backward of %s took over %g s of one thread's CPU on a rank)", where,
                     "x".join(map(str, shape)), MEASURE_CAP_S)
        else:
            bf16, fp32 = bf16 / timed, fp32 / timed
            self.value, self.measured = choose(bf16, fp32), True
            log.info("precision: %s (trainer.precision=auto on a CPU with %s, measured on this model: a forward + "
                     "backward of %s takes %.3f s in bf16, %.3f s in fp32, one thread's CPU s, the faster of two, "
                     "mean over %.0f rank(s); bf16 unless fp32 is >= %.0f %% faster; measuring took %.2f s)",
                     self.value, where, "x".join(map(str, shape)), bf16, fp32, timed, (FP32_MARGIN - 1) * 100,
                     time.perf_counter() - start)
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
