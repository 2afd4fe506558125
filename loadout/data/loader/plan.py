"""The loader's geometry, resolved once: workers, batch shape, ring slots, the shared memory it all needs.

The loader (loader.py), the workers' batch ring (ring.py), the /dev/shm check (shm.py) and `python -m train.tune`
all read one `LoaderPlan`, built before any worker starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch

from loadout.data.config import WORKER_ONLY_KNOBS
from loadout.dist import DistEnv

log = logging.getLogger(__name__)

RING_SPARE_SLOTS = 2  # the ring keeps prefetch_factor + 2 slots per worker (ring.py says why)
STUCK_WORKER_TIMEOUT_S = 600.0  # data.timeout=null: a batch that takes longer than this is a stuck worker


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


def num_workers_for(value: int | str, local_world_size: int = 1, typed: bool = True, cores: int | None = None) -> int:
    """data.num_workers for this process: `auto` = `worker_share`. Under torchrun a profile's fixed count (a100: 12
    per GPU) is capped to the share (at least 1), so 8 processes on a 64-core node start 6 each, not 96 in all; a
    count typed on the command line (`typed`) is honoured, with a warning when it oversubscribes."""
    if value == "auto":
        return worker_share(local_world_size, cores)
    workers = int(value)
    if local_world_size <= 1 or workers == 0:
        return workers
    share = max(1, worker_share(local_world_size, cores))
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


def effective_pin_memory(requested: bool, device: torch.device) -> bool:
    if requested and device.type != "cuda":
        log.warning("data.pin_memory=true without CUDA: pinned memory is off (set data.pin_memory=false to silence)")
        return False
    return requested


def loader_shm_bytes(num_workers: int, prefetch_factor: int, batch_bytes: int, headroom: float = 1.25) -> int:
    """Shared memory a loader holds for its lifetime: the ring's `prefetch_factor + 2` slots per worker; `headroom`
    covers the small per-batch segments and allocator slack. 0 without workers (no batch crosses processes)."""
    if num_workers < 0 or prefetch_factor < 0 or batch_bytes < 0 or headroom < 0:
        raise ValueError("num_workers, prefetch_factor, batch_bytes and headroom must be >= 0")
    if num_workers == 0:
        return 0
    return int(num_workers * (max(prefetch_factor, 1) + RING_SPARE_SLOTS) * batch_bytes * headroom)


@dataclass(frozen=True)
class LoaderPlan:
    """One loader's settled geometry. Both loaders (training, validation) of a run share it."""

    num_workers: int
    batch_size: int
    prefetch_factor: int  # batches per worker in flight (DataLoader's default 2 when data.prefetch_factor is null)
    pin_memory: bool
    image_size: int
    dtype: torch.dtype  # of the images a worker hands over: uint8 (data.device_transforms) or float32
    encoded_batch_bytes: int = 0  # data.decode=device: room for one batch of encoded files (0: workers decode)
    masks: bool = False  # the task's targets are (H, W) masks of the images' size: the ring holds them too

    @classmethod
    def from_config(cls, data, env: DistEnv, device: torch.device, typed_workers: bool = True) -> LoaderPlan:
        """From the `data:` section; `typed_workers`: data.num_workers came from the command line."""
        workers = num_workers_for(data.num_workers, env.local_world_size, typed_workers)
        return cls(workers, data.batch_size, data.prefetch_factor or 2, effective_pin_memory(data.pin_memory, device),
                   data.image_size, torch.uint8 if data.device_transforms else torch.float32)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The largest batch a worker hands over: images, or a batch of encoded files (data.decode=device)."""
        if self.encoded_batch_bytes:
            return (self.encoded_batch_bytes,)
        return (self.batch_size, 3, self.image_size, self.image_size)

    def for_task(self, task) -> LoaderPlan:
        """This plan for `task` (train/task): with a mask ring where its targets are masks."""
        return dataclasses.replace(self, masks=task.mask_targets)

    @property
    def mask_shape(self) -> tuple[int, int, int] | None:
        """The largest batch of uint8 masks a worker hands over beside its images, or None (labels, or encoded
        files: the masks then go by value)."""
        if not self.masks or self.encoded_batch_bytes:
            return None
        return (self.batch_size, self.image_size, self.image_size)

    @property
    def batch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.encoded_batch_bytes else self.dtype

    @property
    def ring_slots(self) -> int:
        return self.prefetch_factor + RING_SPARE_SLOTS

    @property
    def shm_bytes(self) -> int:
        """The /dev/shm a run holds: a ring for each of its two loaders (training, validation)."""
        batch_bytes = math.prod(self.batch_shape) * self.batch_dtype.itemsize + math.prod(self.mask_shape or (0,))
        return 2 * loader_shm_bytes(self.num_workers, self.prefetch_factor, batch_bytes)

    def loader_kwargs(self, data) -> dict:
        """DataLoader keyword arguments: the worker-only knobs of `data` only where DataLoader accepts them."""
        from loadout.data.loader.workers import init_worker

        kwargs = dict(num_workers=self.num_workers, pin_memory=self.pin_memory, in_order=data.in_order)
        if self.num_workers > 0:
            kwargs.update({key: getattr(data, key) for key in WORKER_ONLY_KNOBS}, worker_init_fn=init_worker)
            if data.timeout is None:
                kwargs["timeout"] = STUCK_WORKER_TIMEOUT_S
        return kwargs
