"""What runs inside DataLoader workers: per-worker seeding and the collate that skips unreadable samples."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate


def mixed_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from a few integers: distinct keys give unrelated streams."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)


def loader_seed(base_seed: int, rank: int) -> int:
    """The seed of one rank's loader generator: distinct per rank, the same for the same (seed, rank)."""
    return mixed_seed(base_seed, rank)


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: give numpy and random the worker's own seed (torch seeds only itself per worker).

    The DataLoader sets each worker's torch seed to base_seed + worker_id, with base_seed drawn from the loader's
    generator (seeded per rank by `loader_seed`), so every (seed, rank, worker) gets its own augmentation stream.
    """
    info = get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed()
    np.random.seed(seed % 2**32)
    random.seed(seed)


def collate_skipping_bad(batch: list) -> tuple:
    """default_collate over the readable samples; the third element counts the skipped ones. Samples carrying
    their index (trainer.record_samples) add a fourth: the indices."""
    good = [sample for sample in batch if sample is not None]
    bad = len(batch) - len(good)
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), bad
    images, targets, *indices = default_collate(good)
    return (images, targets, bad, *indices)
