"""Per-epoch loader health: images/s, data-wait fraction, first-batch latency, peak RSS of main + workers."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch


def children_rss_bytes() -> dict[int, int]:
    """RSS of each child process (the DataLoader workers), by pid; children that just exited are left out."""
    rss = {}
    for child in psutil.Process().children(recursive=True):
        try:
            rss[child.pid] = child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return rss


def process_tree_rss_mb() -> float:
    """RSS of this process plus its children (the DataLoader workers), in MiB."""
    return (psutil.Process().memory_info().rss + sum(children_rss_bytes().values())) / 2**20


@dataclass
class EpochMeter:
    """Times one epoch. Call `waited` after each batch arrives and `stepped` after each step finishes."""

    rss_every: int = 20
    start: float = field(default_factory=time.perf_counter)
    data_wait_s: float = 0.0
    first_batch_s: float | None = None
    images: int = 0
    steps: int = 0
    bad_samples: int = 0
    peak_rss_mb: float = 0.0
    _loss_sum: torch.Tensor | float = 0.0  # kept on the loss's device: no GPU sync per step
    _mark: float = 0.0

    def __post_init__(self) -> None:
        self._mark = self.start
        self.peak_rss_mb = process_tree_rss_mb()

    def waited(self) -> None:
        now = time.perf_counter()
        self.data_wait_s += now - self._mark
        if self.first_batch_s is None:
            self.first_batch_s = now - self.start
        self._mark = now

    @property
    def loss_sum(self) -> float:
        """Sum of loss x batch size so far (reading it waits for the GPU)."""
        return float(self._loss_sum)

    def stepped(self, batch_size: int, loss: torch.Tensor | float, bad: int = 0) -> None:
        self.images += batch_size
        self.steps += 1
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        self._loss_sum = self._loss_sum + loss * batch_size
        self.bad_samples += bad
        if self.steps % self.rss_every == 1:
            self.peak_rss_mb = max(self.peak_rss_mb, process_tree_rss_mb())
        self._mark = time.perf_counter()

    def summary(self) -> dict:
        elapsed = time.perf_counter() - self.start
        return {
            "train_loss": self.loss_sum / max(self.images, 1),
            "images_per_s": self.images / elapsed if elapsed > 0 else 0.0,
            "data_wait_frac": self.data_wait_s / elapsed if elapsed > 0 else 0.0,
            "first_batch_s": self.first_batch_s if self.first_batch_s is not None else float("nan"),
            "epoch_s": elapsed,
            "peak_rss_mb": max(self.peak_rss_mb, process_tree_rss_mb()),
            "bad_samples": self.bad_samples,
            "images": self.images,
        }


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
