"""The meter of an epoch (or a window of it): data wait, throughput, loss, memory, the samples each source gave, and
the summary over ranks that becomes the epoch's record. The names of its figures are loadout/observe/metrics.py's.

Data wait is host time spent in `next(loader)`: from the end of one step (`stepped`) to the arrival of the next
batch (`waited`). Steps are not synchronized with the device (a sync per step would stall the GPU it measures);
an epoch's elapsed time ends after one device sync in `summary()`, so queued kernels are counted once.

A mid-epoch checkpoint keeps the epoch's counts (epoch_counts.py), so a resumed epoch's record sums and averages its
per-batch figures over the whole epoch as an uninterrupted run's does; its timings (images/s, data wait, first batch,
epoch_s, memory) cover only the part this process ran.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loadout.dist import DistEnv, gather_rows
from loadout.errors import MIB
from loadout.observe.memory import MemorySampler


class SourceTally:
    """The samples each source of a mix gave (dataset=mix): `part_of(indices)` names each index's source by its
    place in `names`. Counted on the host from the batch's indices, so no step waits for the device."""

    def __init__(self, names: Sequence[str], part_of: Callable[[torch.Tensor], np.ndarray]):
        self.names, self.part_of = tuple(names), part_of
        self.counts = np.zeros(len(self.names), dtype=np.int64)

    def add(self, indices: torch.Tensor | None) -> None:
        if indices is not None and len(indices):
            self.counts += np.bincount(self.part_of(indices.numpy()), minlength=len(self.names))

    def clear(self) -> None:
        self.counts[:] = 0

    def figures(self) -> dict[str, int]:
        return {name: int(count) for name, count in zip(self.names, self.counts, strict=True)}


@dataclass
class EpochMeter:
    """Times one epoch (or a window of it). Call `waited` when a batch arrives and `stepped` when its step is
    queued; `restart` after a warm-up drops what came before from the figures. `memory` (a MemorySampler, sampling
    on its own thread) gives the epoch's peak PSS; without it the meter only times. Its fields count what this
    meter saw; `counts()` adds what a resumed epoch did before its checkpoint (`resume_from`)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    memory: MemorySampler | None = None
    sources: SourceTally | None = None  # dataset=mix: the samples each source gave
    start: float = field(default_factory=time.perf_counter)
    data_wait_s: float = 0.0
    first_batch_s: float | None = None
    images: int = 0
    steps: int = 0
    bad_samples: int = 0
    decode_fallbacks: int = 0
    updates: int = 0  # optimizer steps
    skipped_steps: int = 0  # optimizer steps skipped (non-finite gradients)
    lr: float | None = None  # the last optimizer step's
    _loss_sum: torch.Tensor | float = 0.0  # kept on the loss's device: no sync per step
    _grad_norm_sum: torch.Tensor | float = 0.0  # likewise
    _mark: float = 0.0
    _carried: dict = field(default_factory=dict)  # the counts of the epoch before a resume

    def __post_init__(self) -> None:
        self._mark = self.start
        if self.device.type == "cuda":  # the epoch's own peak
            torch.cuda.reset_peak_memory_stats(self.device)

    def waited(self) -> None:
        now = time.perf_counter()
        self.data_wait_s += now - self._mark
        if self.first_batch_s is None:
            self.first_batch_s = now - self.start
        self._mark = now

    def stepped(self, batch_size: int, loss: torch.Tensor | float = 0.0, bad: int = 0, fallbacks: int = 0,
                grad_norm: torch.Tensor | None = None, lr: float | None = None,
                indices: torch.Tensor | None = None, skipped: int = 0) -> None:
        """A batch's step was queued; `grad_norm` and `lr` when the optimizer stepped, `skipped` when it skipped a
        non-finite update; `indices` (on the host): its samples, counted by source for a mix."""
        if self.sources is not None:
            self.sources.add(indices)
        if grad_norm is not None:
            self.updates += 1
            self._grad_norm_sum = self._grad_norm_sum + grad_norm
        if lr is not None:
            self.lr = lr
        self.images += batch_size
        self.steps += 1
        self._loss_sum = self._loss_sum + loss * batch_size
        self.bad_samples += bad
        self.decode_fallbacks += fallbacks
        self.skipped_steps += skipped
        self._mark = time.perf_counter()

    def restart(self) -> None:
        """Start the figures afresh from now (after a warm-up); the first-batch latency is kept."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.start = self._mark = time.perf_counter()
        self.data_wait_s, self.images, self.steps, self._loss_sum = 0.0, 0, 0, 0.0
        self.updates, self._grad_norm_sum, self._carried = 0, 0.0, {}
        self.bad_samples = self.decode_fallbacks = self.skipped_steps = 0
        if self.sources is not None:
            self.sources.clear()

    @property
    def loss_sum(self) -> float:
        """Sum of loss x batch size so far (reading it waits for the device)."""
        return float(self._loss_sum) - self._carried.get("loss_sum", 0.0)

    @property
    def grad_norm_sum(self) -> float:
        """Sum of the optimizer steps' gradient norms so far (reading it waits for the device)."""
        return float(self._grad_norm_sum) - self._carried.get("grad_norm_sum", 0.0)

    def counts(self) -> dict:
        """The epoch's additive figures so far, with those before a resume: what a mid-epoch checkpoint keeps
        (reading them waits for the device)."""
        carried = self._carried
        return {**{key: getattr(self, key) + carried.get(key, 0) for key in COUNTED},
                "loss_sum": float(self._loss_sum), "grad_norm_sum": float(self._grad_norm_sum),
                "lr": self.lr if self.lr is not None else carried.get("lr"),
                "source_samples": self.sources.counts.tolist() if self.sources is not None else []}

    def resume_from(self, counts: dict) -> None:
        """Go on from `counts` (`counts()` at a checkpoint within this epoch). The loss and gradient-norm sums go
        on from the saved ones, adding in the uninterrupted run's order: the same float sums, to the last bit."""
        self._carried = {key: value for key, value in counts.items() if key != "source_samples"}
        self._loss_sum, self._grad_norm_sum = counts["loss_sum"], counts["grad_norm_sum"]
        if self.sources is not None and len(counts["source_samples"]) == len(self.sources.names):
            self.sources.counts += np.asarray(counts["source_samples"], dtype=np.int64)

    def summary(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        gpu = {}
        if self.device.type == "cuda":
            gpu = {"gpu_peak_mb": torch.cuda.max_memory_allocated(self.device) / MIB,
                   "gpu_reserved_mb": torch.cuda.max_memory_reserved(self.device) / MIB}
            util = self.memory.take_gpu_util() if self.memory is not None else None
            if util is not None:
                gpu["gpu_util"] = util / 100
        whole = self.counts()
        return {
            "train_loss": whole["loss_sum"] / max(whole["images"], 1),
            "images_per_s": self.images / elapsed if elapsed > 0 else 0.0,  # this process's part: timed here
            "data_wait_frac": self.data_wait_s / elapsed if elapsed > 0 else 0.0,
            "first_batch_s": self.first_batch_s if self.first_batch_s is not None else float("nan"),
            "epoch_s": elapsed,
            "peak_pss_mb": self.memory.take_peak() / MIB if self.memory is not None else float("nan"),
            "bad_samples": whole["bad_samples"],
            **({"lr": whole["lr"]} if whole["lr"] is not None else {}),
            **({"grad_norm": whole["grad_norm_sum"] / whole["updates"]} if whole["updates"] else {}),
            "decode_fallbacks": whole["decode_fallbacks"],
            "skipped_steps": whole["skipped_steps"],
            "images": whole["images"],
            **({"source_samples": self.sources.figures()} if self.sources is not None else {}),
            **gpu,
        }


COUNTED = ("images", "steps", "updates", "bad_samples", "decode_fallbacks", "skipped_steps")  # EpochMeter.counts()
SUMMED = ("images", "images_per_s", "bad_samples", "decode_fallbacks")  # over ranks: the total
SLOWEST = ("data_wait_frac", "first_batch_s", "epoch_s", "peak_pss_mb", "gpu_peak_mb", "gpu_reserved_mb")  # the max


def reduce_over_ranks(stats: dict, env: DistEnv, device: torch.device) -> dict:
    """An epoch summary over all ranks, from one gather of every rank's figures: sums for counts and throughput
    (the loss weighted by images), the slowest rank for latencies and memory."""
    if not env.distributed:
        return stats
    sources = list(stats.get("source_samples", {}))  # every rank has the same sources, in the same order
    slowest = [key for key in SLOWEST if key in stats]
    row = [stats["train_loss"] * stats["images"], *(stats[key] for key in SUMMED),
           *(stats["source_samples"][name] for name in sources), *(stats[key] for key in slowest)]
    rows = gather_rows(row, device)
    sums, maxima = rows[:, :1 + len(SUMMED) + len(sources)].sum(0).tolist(), rows[:, len(row) - len(slowest):].amax(0)
    loss_sum, *totals = sums
    stats.update(zip(SUMMED, totals[:len(SUMMED)], strict=True))
    stats.update(images=int(stats["images"]), bad_samples=int(stats["bad_samples"]),
                 decode_fallbacks=int(stats["decode_fallbacks"]), train_loss=loss_sum / max(stats["images"], 1))
    if sources:
        stats["source_samples"] = {name: int(total) for name, total in zip(sources, totals[len(SUMMED):], strict=True)}
    stats.update(zip(slowest, maxima.tolist(), strict=True))
    return stats


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
