"""Timing the data path as make tune measures it: `repeats` epochs of a training stream through the EpochMeter,
optionally with a training step: steady-state images/s (warm-up excluded; median and spread over the epochs), the
first-batch latency of every epoch, peak PSS of the main process plus workers, peak /dev/shm use and, with a step,
the share of time spent waiting for data. Every figure is loadout/observe/metrics.py's definition."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from loadout.errors import MIB
from loadout.observe.memory import MemorySampler
from loadout.observe.meter import EpochMeter


def progress_bar(total: int, desc: str, show: bool, **kwargs) -> tqdm:
    """A tqdm bar on a terminal only: in a log (stderr not a terminal) a bar's redraws are debris around the table."""
    return tqdm(total=total, desc=desc, disable=not (show and sys.stderr.isatty()), dynamic_ncols=True, **kwargs)


def time_epoch(batches, device: torch.device, warmup: int, limit: int | None, step: Callable | None, bar) -> dict:
    """Iterate one epoch (or `warmup + limit` batches of it) through the EpochMeter; the figures count the batches
    after the warm-up."""
    meter = EpochMeter(device)  # memory is sampled on its own thread, outside the timing
    iterator = iter(batches)
    try:
        for index, batch in enumerate(iterator):
            meter.waited()
            if step is not None and len(batch):
                step(batch)
            meter.stepped(len(batch))
            bar.update(1)
            if index == warmup - 1:
                meter.restart()
            if limit is not None and index + 1 >= warmup + limit:
                break
    finally:
        iterator.close()  # ends this epoch's worker processes unless they are persistent
    summary = meter.summary()
    return {"first_batch_s": summary["first_batch_s"], "images": summary["images"], "elapsed_s": summary["epoch_s"],
            "images_per_s": summary["images_per_s"], "data_stall_frac": summary["data_wait_frac"]}


def spread(samples: list[float]) -> float:
    """(max - min) / median: how much the repetitions disagree."""
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else 0.0


def timed_epochs(pipeline, device: torch.device, sampler: MemorySampler, *, repeats: int, warmup: int,
                 batches: int | None, step: Callable | None, desc: str, show: bool, memory_interval_s: float) -> dict:
    """`repeats` epochs of `pipeline.train` (at most `warmup + batches` batches each), closed afterwards: the
    figures of a tune result. `sampler` was made before the pipeline, so its /dev/shm figure counts the ring."""
    loader = pipeline.train
    per_epoch = min(len(loader), warmup + (batches or len(loader)))
    bar = progress_bar(repeats * per_epoch, desc, show, leave=False)
    epochs = []
    sampler.start(memory_interval_s)
    try:
        for epoch in range(repeats):
            pipeline.set_epoch(epoch)
            epochs.append(time_epoch(loader, device, warmup, batches, step, bar))
    finally:
        sampler.stop()
        bar.close()
        pipeline.close()  # persistent workers end here, before the next job's start
    throughput = [e["images_per_s"] for e in epochs]
    return dict(
        images_per_s=statistics.median(throughput),
        images_per_s_min=min(throughput),
        images_per_s_max=max(throughput),
        images_per_s_spread=spread(throughput),
        images_per_s_samples=throughput,
        first_batch_s=[e["first_batch_s"] for e in epochs],
        peak_pss_mb=sampler.peak_pss / MIB,
        peak_shm_mb=sampler.peak_shm / MIB,
        data_stall_frac=statistics.median(e["data_stall_frac"] for e in epochs) if step is not None else None,
        timed_batches_per_epoch=per_epoch - warmup,
    )
