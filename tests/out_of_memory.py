"""A callback the tests install from outside: the model's forward raises torch.OutOfMemoryError on one rank, at one
batch of one epoch, as the CUDA caching allocator does when a batch does not fit. `times` forwards in a row raise
(the retries with smaller micro-batches run forwards too)."""

from __future__ import annotations

import os

import torch


class OutOfMemoryAt:
    def __init__(self, rank: int = 0, epoch: int = 0, batch: int = 1, times: int = 1) -> None:
        self.rank, self.epoch, self.batch, self.times = rank, epoch, batch, times
        self.hooked = False

    def on_train_batch(self, trainer, batch) -> None:
        here = (trainer.progress.epoch, trainer.progress.batch_in_epoch) == (self.epoch, self.batch)
        if self.hooked or not here or int(os.environ.get("RANK", 0)) != self.rank:
            return
        self.hooked = True
        left = [self.times]

        def raise_out_of_memory(module, args) -> None:
            if left[0] > 0 and module.training:
                left[0] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (raised by a test)")

        trainer.step.model.register_forward_pre_hook(raise_out_of_memory)
