"""The training batches of every epoch from one long-lived loader iterator, so workers never idle at an epoch end.

A stock loader starts each epoch by handing the workers new indices and waiting for a whole batch: the first
batch of every epoch is slow, however persistent the workers. Here one batch sampler spans all epochs (as timm's
MultiEpochsDataLoader does), so while the loop finishes epoch e and runs validation the workers already decode
epoch e+1. Each index travels with its epoch, `(epoch, index)`: the inner sampler's `set_epoch` (DistributedSampler)
runs in the main process as that epoch's indices are drawn, and the worker-side dataset sees the right epoch for
every sample even while the main process is still in the previous one (a shared "current epoch" value would be
wrong for exactly the samples prefetched across the boundary). The position the loop has consumed is the state:
resuming at (epoch, batch) draws the same order and, with per-sample seeding (resumable.py), the same pixels.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from train.data.loader import build_sampler, checked_loader_kwargs
from train.data.resumable import EpochSeededDataset
from train.data.workers import collate_skipping_bad, loader_seed
from train.dist import DistEnv


class EpochBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of (epoch, index) for epochs `start_epoch`..`epochs - 1`, skipping the first `start_batch` batches
    of the first; a batch never spans two epochs and `drop_last` applies per epoch."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, epochs: int):
        self.sampler, self.batch_size, self.drop_last, self.epochs = sampler, batch_size, drop_last, epochs
        self.start_epoch = self.start_batch = 0

    def batches_per_epoch(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def __len__(self) -> int:
        return max(self.epochs - self.start_epoch, 0) * self.batches_per_epoch() - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for epoch in range(self.start_epoch, self.epochs):
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            skip = self.start_batch if epoch == self.start_epoch else 0
            for batch in itertools.islice(BatchSampler(self.sampler, self.batch_size, self.drop_last), skip, None):
                yield [(epoch, index) for index in batch]


class TrainStream:
    """The training loader as the loop sees it: `len` = batches per epoch, iterating yields the rest of the
    current epoch (on the device), `state_dict`/`load_state_dict` = the (epoch, batch) position consumed.

    `open_batches(loader)` turns the loader into device batches (the DevicePrefetcher); it wraps the whole
    multi-epoch iterator, so its one-batch-ahead copy also crosses epoch boundaries. The position counts the
    batches handed to the loop, never the ones in flight, so a checkpoint taken mid-epoch resumes exactly.
    """

    def __init__(self, loader: Iterable, batches: EpochBatchSampler, open_batches: Callable[[Iterable], Iterable]):
        self.loader, self.batches, self.open_batches = loader, batches, open_batches
        self.epoch = self.batch = 0
        self._iter: Iterator | None = None

    def __len__(self) -> int:
        return self.batches.batches_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch unless the stream is already in it (e.g. resumed mid-epoch)."""
        if epoch != self.epoch:
            self.seek(epoch, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.seek(int(state["epoch"]), int(state["batch"]))

    def seek(self, epoch: int, batch: int) -> None:
        """Continue from batch `batch` of `epoch`; the workers' prefetched batches are dropped."""
        if (epoch, batch) == (self.epoch, self.batch):
            return
        self.close()
        self.epoch, self.batch = epoch, batch

    def close(self) -> None:
        if self._iter is not None and hasattr(self._iter, "close"):
            self._iter.close()
        self._iter = None

    def __iter__(self) -> Iterator:
        per_epoch = len(self)
        epoch = self.epoch
        if per_epoch == 0 or epoch >= self.batches.epochs:
            return
        if self._iter is None:
            self.batches.start_epoch, self.batches.start_batch = self.epoch, self.batch
            self._iter = iter(self.open_batches(self.loader))
        while self.epoch == epoch:
            try:
                batch = next(self._iter)
            except BaseException:
                self._iter = None  # a failed iterator is finished; the next pass restarts from the position
                raise
            self.batch += 1
            if self.batch == per_epoch:
                self.epoch, self.batch = epoch + 1, 0
            yield batch


def build_train_stream(dataset: Dataset, data_cfg, env: DistEnv, device: torch.device, *, seed: int, epochs: int,
                       open_batches: Callable[[Iterable], Iterable], record_indices: bool = False) -> TrainStream:
    """The training stream from data.*: every DataLoader knob as for any loader, one batch sampler over all
    `epochs`, each sample's augmentation drawn from (seed, epoch, index) (resumable.py)."""
    kwargs = checked_loader_kwargs(data_cfg, env, device)
    del kwargs["batch_size"]  # the batch sampler batches
    sampler = build_sampler(dataset, data_cfg, env, train=True, seed=seed)
    batches = EpochBatchSampler(sampler, data_cfg.batch_size, data_cfg.drop_last, epochs)
    loader = DataLoader(EpochSeededDataset(dataset, seed, with_index=record_indices), batch_sampler=batches,
                        collate_fn=collate_skipping_bad, generator=torch.Generator().manual_seed(
                            loader_seed(seed, env.rank)), **kwargs)
    return TrainStream(loader, batches, open_batches)
