"""Sampler + DataLoader from data.* (every knob under DataLoader's own name), checked before any worker starts."""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Iterator

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

from train.config import WORKER_ONLY_KNOBS
from train.data.ring import build_collate
from train.data.workers import init_worker, loader_seed, mixed_seed
from train.dist import DistEnv

log = logging.getLogger(__name__)


STUCK_WORKER_TIMEOUT_S = 600.0  # data.timeout=null: a batch that takes longer than this is a stuck worker


class LoaderError(RuntimeError):
    """A DataLoader worker died or timed out; the message names the likely cause and the fix."""


def usable_cores() -> int:
    """CPUs this process may run on (a cpuset or taskset counts; a CFS quota such as compose `cpus:` does not)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def worker_share(local_world_size: int = 1, cores: int | None = None) -> int:
    """floor(0.75 x usable cores / processes on this node): the workers one process may start without the node's
    processes oversubscribing its cores (the rest for the main processes and the OS)."""
    cores = usable_cores() if cores is None else cores
    return max(0, math.floor(0.75 * cores / max(local_world_size, 1)))


def resolve_num_workers(value: int | str, local_world_size: int = 1, cores: int | None = None) -> int:
    """`auto` = `worker_share`; an integer is taken as it is."""
    return worker_share(local_world_size, cores) if value == "auto" else int(value)


def plan_num_workers(value: int | str, local_world_size: int, typed: bool, cores: int | None = None) -> int | str:
    """data.num_workers for this process (`auto` stays `auto`). Under torchrun a profile's fixed count (a100: 12
    per GPU) is capped to the `worker_share` (at least 1), so 8 processes on a 64-core node start 6 each, not 96 in
    all; a count typed on the command line (`typed`) is honoured, with a warning when it oversubscribes."""
    if value == "auto" or local_world_size <= 1:
        return value
    workers = int(value)
    share = max(1, worker_share(local_world_size, cores)) if workers > 0 else 0
    if workers <= share:
        return workers
    cores = usable_cores() if cores is None else cores
    total = f"{workers} x {local_world_size} processes = {workers * local_world_size} workers on {cores} cores"
    if typed:
        log.warning("data.num_workers=%d: %s oversubscribes this node (%d each would fit)", workers, total, share)
        return workers
    log.info("data.num_workers: the profile's %d capped to %d per process (%s would oversubscribe this node; "
             "set data.num_workers on the command line to override)", workers, share, total)
    return share


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
        raise ValueError("data.sampler=weighted needs a dataset with .targets")
    counts = np.bincount(targets)
    return torch.as_tensor(1.0 / counts[targets], dtype=torch.double)


class EpochSeededSampler(Sampler[int]):
    """A random sampler whose order is a function of (seed, rank, epoch) alone: `set_epoch` reseeds its generator,
    so a run resumed at epoch e draws epoch e's order again without replaying the epochs before it."""

    def __init__(self, sampler: RandomSampler | WeightedRandomSampler, seed: int, rank: int):
        self.sampler, self.seed, self.rank = sampler, seed, rank
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.generator.manual_seed(mixed_seed(self.seed, self.rank, epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def build_sampler(dataset: Dataset, data_cfg, env: DistEnv, train: bool, seed: int) -> Sampler:
    if not train:
        return ShardSampler(len(dataset), env.rank, env.world_size) if env.distributed else SequentialSampler(dataset)
    kind = data_cfg.sampler
    if kind == "auto":
        kind = "distributed" if env.distributed else ("random" if data_cfg.shuffle else "sequential")
    if env.distributed and kind != "distributed":
        log.warning("data.sampler=%s with %d processes: every rank sees the whole dataset", kind, env.world_size)
    generator = torch.Generator().manual_seed(loader_seed(seed, env.rank))
    if kind == "distributed":
        return DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=data_cfg.shuffle,
                                  seed=seed, drop_last=data_cfg.drop_last)
    if kind == "random":
        return EpochSeededSampler(RandomSampler(dataset, generator=generator), seed, env.rank)
    if kind == "weighted":
        weighted = WeightedRandomSampler(_class_balanced_weights(dataset), len(dataset), generator=generator)
        return EpochSeededSampler(weighted, seed, env.rank)
    return SequentialSampler(dataset)


def loader_kwargs(data_cfg, num_workers: int, pin_memory: bool) -> dict:
    """DataLoader keyword arguments; prefetch/persistence/timeouts only where DataLoader accepts them."""
    kwargs = dict(batch_size=data_cfg.batch_size, num_workers=num_workers, pin_memory=pin_memory,
                  in_order=data_cfg.in_order)
    if num_workers > 0:
        kwargs.update({key: data_cfg[key] for key in WORKER_ONLY_KNOBS}, worker_init_fn=init_worker)
        if data_cfg.timeout is None:
            kwargs["timeout"] = STUCK_WORKER_TIMEOUT_S
    return kwargs


def effective_pin_memory(requested: bool, device: torch.device) -> bool:
    if requested and device.type != "cuda":
        warnings.warn("data.pin_memory=true without CUDA: pinned memory is off (set data.pin_memory=false to silence)",
                      stacklevel=2)
        return False
    return requested


def checked_loader_kwargs(data_cfg, env: DistEnv, device: torch.device) -> dict:
    """`loader_kwargs` for this process's share of the cores, after the /dev/shm check (before workers start)."""
    num_workers = resolve_num_workers(data_cfg.num_workers, env.local_world_size)
    pin_memory = effective_pin_memory(data_cfg.pin_memory, device)
    kwargs = loader_kwargs(data_cfg, num_workers, pin_memory)
    if num_workers > 0:
        from train.data.shm import warn_if_shm_too_small

        item_bytes = 4 if not data_cfg.device_transforms else 1
        batch_bytes = data_cfg.batch_size * 3 * data_cfg.image_size**2 * item_bytes
        warn_if_shm_too_small(num_workers, data_cfg.prefetch_factor or 2, batch_bytes)
    return kwargs


def stateful_loader(dataset: Dataset, **kwargs) -> StatefulDataLoader:
    """A torchdata StatefulDataLoader, without the deprecation notice its constructor raises on torch >= 2.14
    (`torch.set_vital`, harmless) in every run and benchmark."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, **kwargs)


def build_loader(dataset: Dataset, data_cfg, env: DistEnv, device: torch.device, *,
                 seed: int) -> StatefulDataLoader:
    """The evaluation loader: a StatefulDataLoader over `dataset` in order (each rank its own contiguous shard),
    configured from data.*. The training loader is the TrainStream (stream.py), the one way to build it."""
    kwargs = checked_loader_kwargs(data_cfg, env, device)
    sampler = build_sampler(dataset, data_cfg, env, train=False, seed=seed)
    generator = torch.Generator().manual_seed(loader_seed(seed, env.rank))
    return stateful_loader(dataset, sampler=sampler, collate_fn=build_collate(data_cfg, kwargs),
                              drop_last=False, generator=generator, **kwargs)


def shutdown_workers(loader: StatefulDataLoader) -> None:
    """End `loader`'s worker processes now (persistent ones live as long as its iterator), as Lightning does
    between stages. Leaving it to the garbage collector is slow when a reference cycle holds the iterator: the
    collector may finalize the iterator's index queues first, the workers never receive their exit message, and
    each is killed only after DataLoader's 5 s join timeout."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # a worker stuck in a read gets SIGTERM from it (init_worker lets that in)
    loader._iterator = None


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
        return LoaderError(f"{text}. Likely cause: {cause}. Fix: give the container more shared memory (compose "
                           "shm_size, `docker run --shm-size=8g` or `--ipc=host`), or lower data.num_workers, "
                           "data.prefetch_factor or data.batch_size")
    return None
