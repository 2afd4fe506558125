"""A reused shared-memory batch ring: workers stack each batch into a preallocated slot instead of a fresh segment.

A stock worker's collate stacks every batch into a *new* shared-memory segment; the worker first-touches all of its
pages and the main process receives a file descriptor, maps and later unmaps it (its cost: bench/RESULTS.md).
Here the main process allocates, before any worker starts, `slots` buffers of the largest batch per worker in one
shared tensor. Worker w stacks its k-th batch into slot `k % slots` and hands over a `RingBatch`: the slot's
coordinates, the labels by value. A task whose targets are masks of the images' size (segmentation:
`LoaderPlan.masks`) has a second ring beside it, the masks stacked into the same slot number: by value a batch of
224 px masks is ~3 MB pickled, piped and unpickled. Unpickling it in the main process (as the loader receives it, in
the main thread or the pin-memory thread) copies the images (and masks) out into ordinary tensors, so nothing that
leaves the loader aliases a slot.

A slot may be rewritten only after its previous batch was copied out. DataLoader keeps at most prefetch_factor
batches per worker outstanding, and the ring has two slots more; but that is DataLoader's internal behaviour, not
its API. So the ring does not trust it: the main process marks each slot's batch received after the copy, and a
worker whose next slot is still unreceived stacks that batch the stock way (a fresh segment), counts an overrun
and warns once. A torch or torchdata change that breaks the bound costs speed, never data; tests/test_shm_ring.py
asserts there are no overruns with the real loader, so such a change also fails a test.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

from loadout.data.fast.encoded import EMPTY_IMAGES, Encoded, EncodedSample
from loadout.data.loader.batch import (
    Batch,
    WholeBatch,
    batch_view,
    channels_innermost,
    collate,
    collate_indices,
    collate_labels,
    readable,
    stack_images,
    stackable,
)
from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.shm import SHM_PATH, shm_fix
from loadout.errors import ConfigError

log = logging.getLogger(__name__)

_RINGS: weakref.WeakValueDictionary[str, ShmRing] = weakref.WeakValueDictionary()  # token -> ring, this process


def _by_value(column: torch.Tensor | None):
    """A label column as it crosses the result queue: a numpy array (pickled by value, no shared-memory segment)."""
    return None if column is None else column.numpy()


def _take(token: str, worker: int, count: int, n: int, channels_last: bool, targets, indices, bad: int,
          encoded: tuple | None = None) -> Batch:
    """Unpickling a RingBatch (in the loader's process): the images (or, under data.decode=device, the encoded
    files: `encoded` = (bytes used, offsets, geometry)) copied out of their slot, and the masks where `targets` is
    None (they lie in the mask ring), the slot marked received; labels back as tensors."""
    ring = _RINGS[token]
    indices = None if indices is None else torch.from_numpy(indices)
    if encoded is None:  # the masks first: copying the images out marks the slot received
        targets = ring.copy_masks(worker, count, n) if targets is None else torch.from_numpy(targets)
        return Batch(ring.copy_out(worker, count, n, channels_last), targets, indices, bad)
    labels = torch.from_numpy(targets), indices
    size, offsets, geometry = encoded
    data = ring.copy_flat(worker, count, size, pin=False)  # nvJPEG reads host pointers: pinning would only cost
    return Batch(EMPTY_IMAGES, *labels, bad, encoded=Encoded(data, offsets, geometry))


class RingBatch:
    """What a worker hands over: its `count`-th batch lies in the ring (slot count % slots), the rest by value."""

    __slots__ = ("token", "worker", "count", "n", "channels_last", "targets", "indices", "bad", "encoded")

    def __init__(self, token: str, worker: int, count: int, n: int, channels_last: bool, targets, indices,
                 bad: int, encoded: tuple | None = None):
        self.token, self.worker, self.count, self.n = token, worker, count, n
        self.channels_last, self.targets, self.indices, self.bad = channels_last, targets, indices, bad
        self.encoded = encoded

    def __reduce__(self):
        return _take, (self.token, self.worker, self.count, self.n, self.channels_last, self.targets,
                       self.indices, self.bad, self.encoded)


class ShmRing:
    """The collate_fn of a loader with workers: `collate`'s batches, the images passed through a ring of `slots`
    shared buffers of `shape` (the largest batch) per worker. A batch that does not fit (another image shape or
    dtype), or whose slot is not free yet, takes the plain collate; so does a call outside a worker."""

    def __init__(self, num_workers: int, slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False, mask_shape: tuple[int, int, int] | None = None):
        if num_workers < 1 or slots < 1:
            raise ValueError("a ShmRing needs num_workers >= 1 and slots >= 1")
        self.slots, self.pin_memory = slots, pin_memory
        try:
            self.buffers = torch.empty((num_workers, slots, *shape), dtype=dtype).share_memory_()
            self.masks = None if mask_shape is None else \
                torch.empty((num_workers, slots, *mask_shape), dtype=torch.uint8).share_memory_()
        except RuntimeError as err:  # torch reserves the pages up front: a full /dev/shm fails here, not later
            masks = "" if mask_shape is None else f" and of masks {mask_shape}"
            raise ConfigError(
                f"data.num_workers={num_workers}: the workers' batch ring needs {num_workers} x {slots} batches of "
                f"{shape}{masks} in {SHM_PATH} and it has no room ({err}). Fix: {shm_fix()}") from err
        # received[w, s] = 1 + the count of worker w's last batch copied out of slot s (0: none since it started)
        self.received = torch.zeros((num_workers, slots), dtype=torch.int64).share_memory_()
        self.overruns = torch.zeros(1, dtype=torch.int64).share_memory_()  # batches that found their slot busy
        self.token = uuid.uuid4().hex
        self._pid, self._count, self._warned = None, 0, False
        _RINGS[self.token] = self

    def __setstate__(self, state: dict) -> None:  # spawn/forkserver: the worker's copy, the same shared buffers
        self.__dict__.update(state)
        _RINGS.setdefault(self.token, self)  # a copy in the ring's own process leaves the original registered

    def copy_out(self, worker: int, count: int, n: int, channels_last: bool) -> torch.Tensor:
        shape = (n, *self.buffers.shape[3:])
        return batch_view(self.copy_flat(worker, count, n * int(np.prod(shape[1:]))), shape, channels_last)

    def copy_flat(self, worker: int, count: int, size: int, pin: bool = True) -> torch.Tensor:
        """The first `size` elements of the slot of worker `worker`'s `count`-th batch, copied (into pinned memory
        where the ring pins and `pin`); the slot received."""
        slot = count % self.slots
        copy = self._copied(self.buffers[worker, slot].view(-1)[:size], pin)
        self.received[worker, slot] = count + 1
        return copy

    def copy_masks(self, worker: int, count: int, n: int) -> torch.Tensor:
        """The `n` masks of worker `worker`'s `count`-th batch, copied (`copy_flat` then marks the slot received)."""
        return self._copied(self.masks[worker, count % self.slots, :n])

    def _copied(self, source: torch.Tensor, pin: bool = True) -> torch.Tensor:
        pinned = pin and self.pin_memory and torch.cuda.is_available()
        copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
        # numpy's single-threaded memcpy: torch's copy_ splits a batch over the intra-op threads, whose barrier
        # waits for cores the workers hold
        np.copyto(copy.numpy(), source.numpy())
        return copy

    def _next_slot(self, worker: int) -> int | None:
        """This worker's next count if its slot's previous batch was received, else None (counted as an overrun)."""
        if self._pid != os.getpid():  # this worker's first batch (fork copies the parent's counter)
            self._pid, self._count = os.getpid(), 0
            self.received[worker].zero_()  # the previous workers (persistent_workers=false) were joined
        count = self._count
        if count >= self.slots and int(self.received[worker, count % self.slots]) != count - self.slots + 1:
            self.overruns += 1
            if not self._warned:
                self._warned = True
                log.warning("worker %d: ring slot %d still holds a batch the loader has not received: DataLoader "
                            "kept more than prefetch_factor batches outstanding; taking the plain collate",
                            worker, count % self.slots)
            return None
        self._count += 1
        return count

    def __call__(self, samples: list):
        info = get_worker_info()
        if info is None:
            return collate(samples)
        if isinstance(samples, WholeBatch):  # a source's whole batch: its images one copy into the slot
            images, good, bad = samples.images, None, 0
        else:
            good, bad = readable(samples)
            if not good:
                return collate(samples)
            if isinstance(good[0][0], EncodedSample):
                return self._encoded(samples, good, bad, info.id)
            images = [sample[0] for sample in good]
        count = self._slot_for(images, info.id)
        if count is None:
            return collate(samples)
        stack_images(images, self.buffers[info.id, count % self.slots])
        if good is None:
            targets, indices = samples.labels, samples.indices
        elif self._stack_masks(good, info.id, count):
            targets, indices = None, collate_indices(good)
        else:
            targets, indices = collate_labels(good, shared=False)
        return RingBatch(self.token, info.id, count, len(images), channels_innermost(images[0]), _by_value(targets),
                         _by_value(indices), bad)

    def _slot_for(self, images: list | torch.Tensor, worker: int) -> int | None:
        """The count whose slot this batch's images go into; None where they do not fit a slot (another shape or
        dtype: warned once) or the slot is not free yet."""
        capacity = self.buffers.shape[2:]
        if (isinstance(images, list) and not stackable(images)) or len(images) > capacity[0] or (
                images[0].dtype != self.buffers.dtype or images[0].shape != capacity[1:]):
            if not self._warned:
                self._warned = True
                log.warning("worker %d: a batch does not fit the shared-memory ring (%s of %s %s): plain collate",
                            worker, len(images), type(images[0]).__name__, getattr(images[0], "shape", "?"))
            return None
        return self._next_slot(worker)

    def _stack_masks(self, good: list, worker: int, count: int) -> bool:
        """The batch's masks stacked into the mask ring's slot, when it has one and they fit (uint8, the images'
        size); else False: they go by value."""
        masks = [sample[1] for sample in good]
        if self.masks is None or not all(isinstance(mask, torch.Tensor) and mask.dtype == torch.uint8 and
                                         mask.shape == self.masks.shape[3:] for mask in masks):
            return False
        torch.stack(masks, out=self.masks[worker, count % self.slots, :len(masks)])
        return True

    def _encoded(self, samples: list, good: list, bad: int, worker: int):
        """data.decode=device: the batch's encoded files back to back in the slot, their offsets and geometry by
        value; a batch larger than a slot takes the plain collate."""
        size = sum(len(sample[0].data) for sample in good)
        if self.buffers.dim() != 3 or self.buffers.dtype != torch.uint8 or size > self.buffers.shape[2]:
            if not self._warned:
                self._warned = True
                log.warning("worker %d: %d bytes of encoded files do not fit a ring slot: plain collate", worker, size)
            return collate(samples)
        count = self._next_slot(worker)
        if count is None:
            return collate(samples)
        encoded = Encoded.join([sample[0] for sample in good], out=self.buffers[worker, count % self.slots])
        targets, indices = collate_labels(good, shared=False)
        return RingBatch(self.token, worker, count, len(good), False, _by_value(targets), _by_value(indices), bad,
                         encoded=(size, encoded.offsets, encoded.geometry))


def build_collate(plan: LoaderPlan):
    """The collate_fn of a loader with `plan`: a ShmRing of its geometry when it has workers, else `collate`."""
    if plan.num_workers == 0:
        return collate
    return ShmRing(plan.num_workers, plan.ring_slots, plan.batch_shape, plan.batch_dtype, pin_memory=plan.pin_memory,
                   mask_shape=plan.mask_shape)
