"""trainer.precision=auto on a CPU with native bf16, measured by `make tune`: bf16 or fp32 for the model swept.

A native bf16 flag does not make every model faster in bf16 on a CPU (on an AMD EPYC with avx512_bf16 resnet18
trains faster in bf16, lraspp_mobilenet_v3_large slower: bench/RESULTS.md). A training run does not time both itself
(it cost seconds of start-up and a second copy of the model); a with-model sweep does, once, and
tune.autotune=true writes the winner into hardware=local. Running out of memory while measuring is no error: bf16
stands, unmeasured.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import torch

from loadout.runtime.micro_batch import is_out_of_memory
from loadout.runtime.precision import autocast

log = logging.getLogger("loadout.tune")

# The measurement: a warm-up and two timed steps each way on up to PROBE_BATCH samples, on one thread (under a
# second for resnet18 or lraspp at 64 px).
PROBE_BATCH = 16  # bf16 / fp32 step-time ratios at 16 samples matched those at 32 (resnet18, lraspp)
# A warm-up forward + backward over this many CPU seconds (a big model at 224 px) stops the measurement: it would
# cost tens of seconds at start, and bf16 is kept.
MEASURE_CAP_S = 2.0
# fp32 is taken only when bf16's step takes >= 10 % longer, so noise seldom flips the choice.
FP32_MARGIN = 1.1
# A step shorter than this is mostly Python and dispatch, whose bf16 / fp32 ratio wanders from one measurement to the
# next: such a model keeps bf16.
MIN_MEASURED_S = 0.005


def measured(model: torch.nn.Module, shape: tuple[int, ...], channels_last: bool) -> str | None:
    """bf16 or fp32 for `model` on a batch of `shape` (`choose` on `measure`); None where a warm-up step went over
    MEASURE_CAP_S or ran out of memory (then nothing was measured)."""
    try:
        times = measure(model, shape, channels_last)
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        log.info("precision: not measured (out of memory on a batch of %s); bf16 stands", "x".join(map(str, shape)))
        return None
    if not times:
        return None
    chosen = choose(times["bf16"], times["fp32"])
    log.info("precision: %s measured (a forward + backward of %s takes %.3f s in bf16, %.3f s in fp32, one thread's "
             "CPU s; bf16 unless fp32 is >= %.0f %% faster)", chosen, "x".join(map(str, shape)), times["bf16"],
             times["fp32"], (FP32_MARGIN - 1) * 100)
    return chosen


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
