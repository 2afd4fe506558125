"""Evaluation: val_loss and the task's figures over the validation batches, every rank's samples counted once.

The task's sums (train/task/base.py) are added on the device batch after batch and read once, after the last batch;
then one all-reduce adds them over the ranks. Its width comes from the task (`num_counts`), not from the batches, so a
rank that had no readable validation sample still joins that one reduction with zeros, and no collective is spent
learning the width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from loadout.data.loader.batch import Batch
from loadout.dist import all_reduce_sum
from loadout.runtime.buffers import broadcast_from_rank0
from train.task import Task

Predict = Callable[[torch.Tensor, torch.Tensor], Iterator[tuple[Any, torch.Tensor]]]  # TrainStep.predict


class Evaluation:
    """Evaluates `module` (the one that runs: DDP-wrapped under torchrun) through `predict`, the step's forward slice
    by slice, with the `task`'s sums on `device`."""

    def __init__(self, module: torch.nn.Module, predict: Predict, task: Task, device: torch.device):
        self.module, self.predict, self.task, self.device = module, predict, task, device

    def __call__(self, batches: Iterable[Batch]) -> dict:
        """val_loss, the task's figures and val_samples over `batches`, with rank 0's buffers (buffers.py)."""
        self.module.eval()
        broadcast_from_rank0(self.module)
        sums, count = None, 0
        for batch in batches:
            if len(batch):
                batch_sums = self.sums(batch)
                sums, count = (batch_sums if sums is None else sums + batch_sums), count + len(batch)
        sums = [0.0] * (1 + self.task.num_counts()) if sums is None else sums.tolist()  # the loss, the counts
        *totals, count = all_reduce_sum([*sums, count], self.device)
        return {**self.task.evaluation(totals, int(count)), "val_samples": int(count)}

    @torch.no_grad()
    def sums(self, batch: Batch) -> torch.Tensor:
        """The task's evaluation sums over one (non-empty) validation batch, one device tensor."""
        sums = None
        for outputs, targets in self.predict(batch.images, batch.targets):
            part = self.task.eval_sums(outputs, targets)
            sums = part if sums is None else sums + part
        return sums
