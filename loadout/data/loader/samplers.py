"""Samplers and the validation DataLoader from data.* (every knob under DataLoader's own name), and the one-line
explanation of a dead or stuck worker. The training loader is the TrainStream (stream.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import (
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.ring import build_collate
from loadout.data.loader.shm import shm_fix
from loadout.data.loader.stages import StageBoard, TimedCollate
from loadout.data.loader.stateful import stateful_loader
from loadout.data.remote.fetch_ahead import FetchAhead
from loadout.data.remote.shard_order import shard_window, window_order
from loadout.data.seeds import SAMPLER, loader_seed, mixed_seed
from loadout.dist import DistEnv
from loadout.errors import ConfigError, LoaderError

log = logging.getLogger(__name__)

PREFETCH_SHARDS = 8  # shards fetched ahead where the source names no `prefetch_shards` (a source of your own)


class ShardSampler(Sampler[int]):
    """Rank r takes a contiguous 1/world_size of the indices, without padding: each sample counted exactly once."""

    def __init__(self, length: int, rank: int, world_size: int):
        per_rank, extra = divmod(length, world_size)
        self.start = rank * per_rank + min(rank, extra)
        self.stop = self.start + per_rank + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def _class_balanced_weights(dataset: Dataset) -> torch.Tensor:
    targets = getattr(dataset, "targets", None)
    if targets is None:
        raise ConfigError("data.sampler=weighted: the dataset offers no `targets` (every label as an int array, "
                          "loadout/data/source.py); add them or choose another data.sampler")
    counts = np.bincount(targets)
    return torch.as_tensor(1.0 / counts[targets], dtype=torch.double)


class EpochSeededSampler(Sampler[int]):
    """A random sampler whose order is a function of (seed, rank, epoch) alone: `set_epoch` reseeds its generator,
    so a run resumed at epoch e draws epoch e's order again without replaying the epochs before it."""

    def __init__(self, sampler: RandomSampler | WeightedRandomSampler, seed: int, rank: int):
        self.sampler, self.seed, self.rank = sampler, seed, rank
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.generator.manual_seed(mixed_seed(self.seed, SAMPLER, self.rank, epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class ShardWindowSampler(Sampler[int]):
    """A training order that reads shards mostly in sequence: the shards shuffled by (seed, epoch), then the samples
    of each window of `window` shards shuffled together (wids' ChunkedSampler, Mosaic's py1e). Split over ranks in
    contiguous, equal parts, so every rank steps as often (no DDP hang on uneven shards): the order is padded with
    its own first samples, a few of which are then seen twice in the epoch (said once in the log)."""

    def __init__(self, shard_starts: np.ndarray, window: int, seed: int, rank: int, world_size: int,
                 shuffle: bool = True, drop_last: bool = False):
        self.starts, self.window, self.seed, self.rank, self.world = shard_starts, max(window, 1), seed, rank, \
            world_size
        self.shuffle, self.epoch = shuffle, 0
        total = int(shard_starts[-1])
        self.per_rank = total // world_size if drop_last else -(-total // world_size)
        if not drop_last and self.per_rank * world_size > total and rank == 0:
            log.info("data.sampler: %d samples over %d processes: %d of them are seen twice an epoch, so every rank "
                     "steps as often", total, world_size, self.per_rank * world_size - total)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> np.ndarray:
        """Every sample of the epoch, over all ranks."""
        rng = np.random.default_rng(mixed_seed(self.seed, SAMPLER, self.epoch)) if self.shuffle else None
        return window_order(self.starts, self.window, rng)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        need = self.per_rank * self.world
        if need > len(order):
            order = np.concatenate([order, order[:need - len(order)]])
        return iter(order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank].tolist())

    def __len__(self) -> int:
        return self.per_rank


def build_sampler(dataset: Dataset, data, env: DistEnv, train: bool, seed: int) -> Sampler:
    """data.sampler for training (auto: distributed under torchrun, else random or sequential by data.shuffle; a
    source whose order is the training order, dataset=mix, split over ranks as it stands); validation in order,
    each rank its own contiguous shard. Over a source that fetches shards, the next dataset.prefetch_shards of them
    are fetched ahead of the workers (fetch_ahead.py)."""
    sampler = _sampler(dataset, data, env, train, seed)
    fetch = getattr(dataset, "fetch_shard", None)  # Samples: the source's, where it fetches shards
    ahead = shards_ahead(_source(dataset))
    if fetch is not None and ahead > 0:
        return FetchAhead(sampler, dataset.shard_starts, fetch, ahead)
    return sampler


def shards_ahead(source) -> int:
    """How many shards past the one being read `source` has fetched ahead: its `prefetch_shards`, else
    PREFETCH_SHARDS."""
    ahead = getattr(source, "prefetch_shards", None)
    return PREFETCH_SHARDS if ahead is None else ahead


def _source(dataset: Dataset):
    """The source under the per-sample wrapper (Samples), where the store settings live."""
    return getattr(dataset, "source", dataset)


def rank_sampler(dataset: Dataset, data, env: DistEnv, seed: int) -> Callable[[int, int], Sampler[int]]:
    """(rank, world_size) -> the training sampler that rank of that many processes draws from (no shard fetching):
    what a resume at another process count rebuilds the interrupted epoch's order from (reshard.py)."""
    def make(rank: int, world_size: int) -> Sampler[int]:
        other = DistEnv(rank=rank, world_size=world_size, always_ddp=env.always_ddp and world_size == 1)
        return _sampler(dataset, data, other, True, seed, announce=False)
    return make


def _sampler(dataset: Dataset, data, env: DistEnv, train: bool, seed: int, announce: bool = True) -> Sampler:
    if not train:
        return ShardSampler(len(dataset), env.rank, env.world_size) if env.distributed else SequentialSampler(dataset)
    kind = data.sampler
    if getattr(_source(dataset), "ordered", False):  # dataset=mix: its order is the order
        if kind == "weighted":
            raise ConfigError("data.sampler=weighted: dataset=mix draws its own order, each source by its "
                              "dataset.sources.<name>.weight; use data.sampler=auto")
        return ShardWindowSampler(np.array([0, len(dataset)]), 1, seed, env.rank, env.world_size, shuffle=False,
                                  drop_last=data.drop_last)  # one "shard" in order: contiguous equal rank parts
    starts = getattr(dataset, "shard_starts", None)  # Samples: the source's, where it is sharded
    if starts is not None and kind in ("auto", "distributed", "random"):  # sharded data: shards mostly in sequence
        window = shard_window(starts, getattr(_source(dataset), "shuffle_window", None),
                              getattr(dataset, "label_spread", None),
                              announce=announce and env.rank == 0) if data.shuffle else 1
        return ShardWindowSampler(starts, window, seed, env.rank, env.world_size, data.shuffle, data.drop_last)
    if kind == "auto":
        kind = "distributed" if env.distributed else ("random" if data.shuffle else "sequential")
    if env.distributed and kind != "distributed" and announce:
        log.warning("data.sampler=%s with %d processes: every rank sees the whole dataset", kind, env.world_size)
    generator = torch.Generator().manual_seed(loader_seed(seed, env.rank))
    if kind == "distributed":
        return DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=data.shuffle,
                                  seed=seed, drop_last=data.drop_last)
    if kind == "random":
        return EpochSeededSampler(RandomSampler(dataset, generator=generator), seed, env.rank)
    if kind == "weighted":
        weighted = WeightedRandomSampler(_class_balanced_weights(dataset), len(dataset), generator=generator)
        return EpochSeededSampler(weighted, seed, env.rank)
    return SequentialSampler(dataset)


def build_val_loader(samples: Dataset, plan: LoaderPlan, data, env: DistEnv, seed: int) -> StatefulDataLoader:
    """The evaluation loader: every validation sample once, in order (each rank its own contiguous shard)."""
    kwargs = plan.loader_kwargs(data)
    return stateful_loader(samples, batch_size=plan.batch_size, sampler=build_sampler(samples, data, env, False, seed),
                           collate_fn=TimedCollate(build_collate(plan), StageBoard(plan.num_workers)), drop_last=False,
                           generator=torch.Generator().manual_seed(loader_seed(seed, env.rank)), **kwargs)


def explain_loader_error(err: BaseException, stuck_read: str | None = None) -> LoaderError | None:
    """Turn a dead worker or a timeout into an error naming the likely cause (for a timeout, `stuck_read`: the
    worker and the sample it is still reading); None for other errors."""
    text = str(err)
    if "timed out" in text and "DataLoader" in text:
        where = f": {stuck_read}" if stuck_read else ""
        return LoaderError(f"{text}{where}. A worker took longer than data.timeout for one batch: look for a hung read "
                           "(a dead network mount, a file that never ends), or raise data.timeout (0 = wait forever)")
    if "DataLoader worker" in text and ("killed" in text or "exited unexpectedly" in text):
        cause = "Bus error: /dev/shm is too small for the workers' batches" if "Bus error" in text else (
            "a killed worker: usually the out-of-memory killer or /dev/shm too small")
        return LoaderError(f"{text}. Likely cause: {cause}. Fix: {shm_fix()}")
    return None
