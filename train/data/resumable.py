"""A training stream that resumes bit for bit: each sample's augmentation RNG comes from (seed, epoch, index).

A worker's RNG stream depends on which worker got which sample and on all it drew before, none of which
survives a restart (StatefulDataLoader restores the sampler position, not the workers' RNG). So the sampler
tags each index with the epoch, in the main process where `set_epoch` runs, and the dataset seeds torch's RNG
from (seed, epoch, index) before the transforms run. The same sample then gets the same crop and flip whatever
the number of workers or ranks and the restarts in between. Transforms must draw from torch's RNG (all of
torchvision's do).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 63-bit seed for one sample in one epoch."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


class EpochIndexSampler(Sampler[tuple[int, int]]):
    """Yields (epoch, index) from `sampler`; `set_epoch` reaches the wrapped sampler (DistributedSampler)."""

    def __init__(self, sampler: Sampler[int]):
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class EpochSeededDataset(Dataset):
    """`dataset[index]` with torch's RNG seeded from (seed, epoch, index); with `with_index` the index rides
    along as a third element (trainer.record_samples)."""

    def __init__(self, dataset: Dataset, seed: int, with_index: bool = False):
        self.dataset = dataset
        self.seed = seed
        self.with_index = with_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):  # classes, targets, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        if get_worker_info() is None:  # num_workers=0: leave the main process's RNG as it was
            with torch.random.fork_rng(devices=[]):
                sample = self._load(epoch, index)
        else:
            sample = self._load(epoch, index)
        if sample is None or not self.with_index:
            return sample
        return (*sample, index)

    def _load(self, epoch: int, index: int):
        if hasattr(self.dataset, "set_epoch"):  # epoch-aware datasets (curriculum) see each sample's own epoch
            self.dataset.set_epoch(epoch)
        # The CPU generator only: torch.manual_seed also queues a CUDA reseed with a stack capture (~0.1 ms/sample).
        torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
        return self.dataset[index]
