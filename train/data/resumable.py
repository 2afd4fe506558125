"""A training stream that resumes bit for bit: each sample's augmentation randomness comes from (seed, epoch, index).

A worker's RNG stream depends on which worker got which sample and on all it drew before, none of which
survives a restart (StatefulDataLoader restores the sampler position, not the workers' RNG). So the batch sampler
tags each index with the epoch, in the main process where `set_epoch` runs (stream.py), and the dataset derives
each sample's randomness from (seed, epoch, index) alone. The same sample then gets the same crop and flip whatever
the number of workers or ranks and the restarts in between.

Two ways a dataset takes that randomness:
- per sample (any dataset, any torchvision transform): torch's CPU generator is seeded with `sample_seeds` just
  before `dataset[index]`, so transforms must draw from torch's RNG (all of torchvision's do);
- per batch: a dataset with `seeded_items(indices, seeds)` (the packed format) gets the whole batch's indices and
  64-bit draws at once and applies its augmentation vectorised from those draws.
The DataLoader hands a whole batch of keys to `EpochSeededDataset.__getitems__`, so either way the seeds of a
batch are mixed in one vectorised numpy pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from train.data.workers import one_torch_thread

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic): a bijection with full avalanche."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_seeds(seed: int, epochs, indices) -> np.ndarray:
    """Well-mixed 64-bit draws (uint64) for samples `indices` in `epochs` (arrays or ints, broadcast): a function
    of (seed, epoch, index) alone, a few numpy passes for a whole batch."""
    state = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64) + _GOLDEN)
    for key in (epochs, indices):
        state = _splitmix64((state ^ np.asarray(key, dtype=np.int64).astype(np.uint64)) + _GOLDEN)
    return state


@contextmanager
def main_process_data_work() -> Iterator[None]:
    """num_workers=0: load samples in the main process as a DataLoader worker would, on one torch intra-op thread
    (workers get `torch.set_num_threads(1)`), and without touching the main process's RNG. Per-sample decode and
    transforms gain nothing from more threads, while the idle ones spin on every core (bench/RESULTS.md)."""
    with one_torch_thread(), torch.random.fork_rng(devices=[]):
        yield


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 63-bit torch seed of one sample in one epoch: its `sample_seeds` draw >> 1."""
    return int(sample_seeds(seed, epoch, index)[0]) >> 1


class EpochSeededDataset(Dataset):
    """`dataset[index]` for keys `(epoch, index)`, its randomness drawn from (seed, epoch, index); each sample
    comes back as `(image, target, index)`, so a batch knows which samples it holds (Batch.indices)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):  # classes, targets, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list:
        """The samples of one batch of keys (the DataLoader calls this with each batch)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
        epochs, indices = keys[:, 0], keys[:, 1]
        seeds = sample_seeds(self.seed, epochs, indices)
        samples = None
        if hasattr(self.dataset, "seeded_items") and not hasattr(self.dataset, "set_epoch"):
            samples = self.dataset.seeded_items(indices, seeds)  # None: a transform it cannot batch
        if samples is None and get_worker_info() is None:  # num_workers=0
            with main_process_data_work():
                samples = self._load_each(epochs, indices, seeds)
        elif samples is None:
            samples = self._load_each(epochs, indices, seeds)
        return [sample if sample is None else (*sample, index)
                for sample, index in zip(samples, indices.tolist(), strict=True)]

    def _load_each(self, epochs: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> list:
        epoch_aware = hasattr(self.dataset, "set_epoch")  # curriculum datasets see each sample's own epoch
        generator = torch.default_generator  # the CPU generator only: torch.manual_seed also queues a CUDA reseed
        samples = []
        for epoch, index, seed in zip(epochs.tolist(), indices.tolist(), (seeds >> np.uint64(1)).tolist(),
                                      strict=True):
            if epoch_aware:
                self.dataset.set_epoch(epoch)
            generator.manual_seed(seed)
            samples.append(self.dataset[index])
        return samples
