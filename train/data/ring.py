"""A reused shared-memory batch ring: workers stack each batch into a preallocated slot instead of a fresh segment.

A stock worker's collate stacks every batch into a *new* shared-memory segment (`_new_shared` in
default_collate); the worker then first-touches all of its pages and the main process receives a file descriptor,
maps and later unmaps it. On small machines that costs milliseconds per batch whatever the samples (bench/RESULTS.md).
Here the main process allocates, before any worker starts, `slots` buffers of the largest batch per worker in one
shared tensor (inherited under fork, passed by file descriptor under spawn/forkserver). Worker w stacks its k-th
batch into slot `ring[w, k % slots]`, in the images' own memory layout (`stack_images`: channels_last for decoded
JPEGs), and hands over a small `RingBatch`: the slot's coordinates and layout, the targets (and sample indices) as
numpy arrays by value, the skipped-sample count. Unpickling it in the main process copies the
images out of the slot into an ordinary tensor (pinned when the loader pins), so nothing that leaves the loader
ever aliases a slot: the copy is taken the moment the loader receives the batch from the result queue, in the
main thread, or in the pin-memory thread when data.pin_memory=true.

Why a slot is never rewritten before its batch was copied out (torch's DataLoader iterator and torchdata's
StatefulDataLoader iterator, which share this logic): the copy happens when the batch is *received* (unpickled off
the worker result queue, before `_get_data` returns, or in the pin thread before the batch reaches the main
thread). A new index is put only in `_try_put_index`: `prefetch_factor x num_workers` of them when an iterator
starts or resumes, then one per batch yielded (`_process_data`), after that batch was received.
- in_order=true: tasks go to workers strictly round robin and are yielded in task order, so when task t is put,
  every task <= t - prefetch_factor x num_workers has been yielded, hence received; of worker w's tasks, at most
  `prefetch_factor` (t included) are not yet received.
- in_order=false: a task goes to worker w only while `_workers_num_tasks[w] < prefetch_factor x num_workers //
  active workers` = prefetch_factor (map-style datasets keep every worker active), and that count drops only when
  one of w's batches is yielded, after it was received: again at most `prefetch_factor` unreceived tasks per worker.
- an iterator reset (a new epoch's iterator with persistent workers, `load_state_dict`, the fast-forward after it)
  drains or yields every outstanding result through `_get_data`, so through the copy, before new indices go out.
A worker runs its tasks in queue order, one collate per task, so when it writes its k-th batch, batches k - slots
and older belong to tasks at least `slots` tasks back, all received once `slots >= prefetch_factor`. The ring keeps
`prefetch_factor + 2` slots, two spare. Workers started afresh (persistent_workers=false) start at slot 0; the
previous workers were joined first.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate

from train.config import ConfigError
from train.data.shm import RING_SPARE_SLOTS, SHM_PATH
from train.data.workers import batch_view, channels_innermost, collate_skipping_bad, stack_images, stackable

log = logging.getLogger(__name__)

_RINGS: weakref.WeakValueDictionary[str, ShmRing] = weakref.WeakValueDictionary()  # token -> ring, this process


def _by_value(column):
    """A collated column as it crosses the result queue: tensors as numpy arrays (pickled by value, no shared
    memory segment), anything else as is."""
    if isinstance(column, torch.Tensor):
        try:
            return True, column.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks: let torch's reductions move it
            return False, column
    return False, column


def _take(token: str, worker: int, slot: int, n: int, channels_last: bool, columns: list, bad: int) -> tuple:
    """Unpickling a RingBatch (in the loader's process): the images copied out of their slot, the columns back as
    tensors: `(images, targets, bad, *indices)`, as `collate_skipping_bad` returns it."""
    ring = _RINGS[token]
    images = ring.copy_out(worker, slot, n, channels_last)
    targets, *extra = [torch.from_numpy(value) if as_numpy else value for as_numpy, value in columns]
    return (images, targets, bad, *extra)


class RingBatch:
    """What a worker hands over: where its images lie in the ring (and in which layout), everything else by
    value."""

    __slots__ = ("token", "worker", "slot", "n", "channels_last", "columns", "bad")

    def __init__(self, token: str, worker: int, slot: int, n: int, channels_last: bool, columns: list, bad: int):
        self.token, self.worker, self.slot, self.n = token, worker, slot, n
        self.channels_last, self.columns, self.bad = channels_last, columns, bad

    def __reduce__(self):
        return _take, (self.token, self.worker, self.slot, self.n, self.channels_last, self.columns, self.bad)


class ShmRing:
    """The collate_fn of a loader with workers: `collate_skipping_bad`'s batches, the images passed through a ring
    of `slots` shared buffers of `shape` (the largest batch) per worker. Batches that do not fit (another image
    shape or dtype) fall back to the plain collate; so does a call outside a worker."""

    def __init__(self, num_workers: int, slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False):
        if num_workers < 1 or slots < 1:
            raise ValueError("a ShmRing needs num_workers >= 1 and slots >= 1")
        self.slots, self.pin_memory = slots, pin_memory
        try:
            self.buffers = torch.empty((num_workers, slots, *shape), dtype=dtype).share_memory_()
        except RuntimeError as err:  # torch reserves the pages up front: a full /dev/shm fails here, not later
            raise ConfigError(
                f"data.num_workers={num_workers}: the workers' batch ring needs {num_workers} x {slots} batches of "
                f"{shape} in {SHM_PATH} and it has no room ({err}). Fix: more shared memory (compose shm_size, "
                "`docker run --shm-size=8g` or `--ipc=host`), or lower data.num_workers, data.prefetch_factor or "
                "data.batch_size") from err
        self.token = uuid.uuid4().hex
        self._pid, self._count, self._warned = None, 0, False
        _RINGS[self.token] = self

    def __setstate__(self, state: dict) -> None:  # spawn/forkserver: the worker's copy, the same shared buffers
        self.__dict__.update(state)
        _RINGS.setdefault(self.token, self)  # a copy in the ring's own process leaves the original registered

    def copy_out(self, worker: int, slot: int, n: int, channels_last: bool) -> torch.Tensor:
        shape = (n, *self.buffers.shape[3:])
        count = math.prod(shape)
        source = self.buffers[worker, slot].view(-1)[:count]
        pin = self.pin_memory and torch.cuda.is_available()
        copy = torch.empty(count, dtype=source.dtype, pin_memory=pin)
        # numpy's single-threaded memcpy: torch's copy_ splits a batch over the intra-op threads, whose barrier
        # waits for cores the workers hold (milliseconds per batch on 2 cores, vs ~50 us here)
        np.copyto(copy.numpy(), source.numpy())
        return batch_view(copy, shape, channels_last)

    def __call__(self, batch: list):
        info = get_worker_info()
        if info is None:
            return collate_skipping_bad(batch)
        good = [sample for sample in batch if sample is not None]
        bad = len(batch) - len(good)
        images = [sample[0] for sample in good]
        capacity = self.buffers.shape[2:]
        if not good or len(good) > capacity[0] or not stackable(images) or (
                images[0].dtype != self.buffers.dtype or images[0].shape != capacity[1:]):
            if good and not self._warned:
                self._warned = True
                log.warning("worker %d: a batch does not fit the shared-memory ring (%s of %s %s): plain collate",
                            info.id, len(good), type(images[0]).__name__, getattr(images[0], "shape", "?"))
            return collate_skipping_bad(batch)
        if self._pid != os.getpid():  # this worker's first batch (fork copies the parent's counter)
            self._pid, self._count = os.getpid(), 0
        slot = self._count % self.slots
        self._count += 1
        stack_images(images, self.buffers[info.id, slot])
        columns = [_by_value(column) for column in default_collate([sample[1:] for sample in good])]
        return RingBatch(self.token, info.id, slot, len(good), channels_innermost(images[0]), columns, bad)


def build_collate(data_cfg, loader_kwargs: dict):
    """The collate_fn for a loader with `loader_kwargs` (checked_loader_kwargs): a ShmRing sized from data.* when
    it has workers, else `collate_skipping_bad`."""
    num_workers = loader_kwargs.get("num_workers", 0)
    if num_workers == 0:
        return collate_skipping_bad
    prefetch = loader_kwargs.get("prefetch_factor") or 2
    dtype = torch.uint8 if data_cfg.device_transforms else torch.float32
    shape = (data_cfg.batch_size, 3, data_cfg.image_size, data_cfg.image_size)
    return ShmRing(num_workers, prefetch + RING_SPARE_SLOTS, shape, dtype,
                   pin_memory=bool(loader_kwargs.get("pin_memory")))

