"""What runs inside DataLoader workers: per-worker seeding, the collate that skips unreadable samples, and the
stacking of images into a batch in their own memory layout."""

from __future__ import annotations

import math
import os
import random
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one torch intra-op thread, as a DataLoader worker runs (`torch.set_num_threads(1)`), then
    give the process its thread count back. For the main process's share of the data work: a parallel region's
    barrier waits for every thread, and with workers on the cores a thread waits for one (bench/RESULTS.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mixed_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from a few integers: distinct keys give unrelated streams."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)


def loader_seed(base_seed: int, rank: int) -> int:
    """The seed of one rank's loader generator: distinct per rank, the same for the same (seed, rank)."""
    return mixed_seed(base_seed, rank)


def init_worker(worker_id: int) -> None:
    """worker_init_fn: the worker's own seeds, and deaf to the stop signals.

    The DataLoader sets each worker's torch seed to base_seed + worker_id, with base_seed drawn from the loader's
    generator (seeded per rank by `loader_seed`), so every (seed, rank, worker) gets its own augmentation stream;
    numpy and random get it here. Slurm signals every process of a job step and Ctrl-C the whole process group,
    workers included; a worker that died of it would be reported as failed while the main process stops cleanly
    and saves its checkpoint (train/stop.py). So workers ignore SIGINT and SIGUSR1, and take SIGTERM only from
    their parent, which is how DataLoader ends a worker that does not exit when asked.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's stop handler, inherited by fork
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask
    threading.Thread(target=_die_on_sigterm_from, args=(os.getppid(),), daemon=True, name="sigterm").start()
    info = get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed()
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _die_on_sigterm_from(parent: int) -> None:
    """Wait for SIGTERMs; die of the first one `parent` sends, as if SIGTERM had never been blocked (the disposition
    is the default one; only this thread unblocks it, so the signal sent again lands here and ends the process)."""
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)


def channels_innermost(image) -> bool:
    """A CHW image tensor laid out HWC in memory: the JPEG decoder's layout, which resize, crop and flip keep."""
    return isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[0] > 1 and image.stride(0) == 1


def batch_view(storage: torch.Tensor, shape: tuple[int, int, int, int], channels_last: bool) -> torch.Tensor:
    """The first prod(shape) elements of contiguous `storage` as an (N, C, H, W) batch: NHWC in memory
    (torch.channels_last) when `channels_last`, else NCHW."""
    n, c, h, w = shape
    flat = storage.view(-1)[: n * c * h * w]
    return flat.view(n, h, w, c).permute(0, 3, 1, 2) if channels_last else flat.view(n, c, h, w)


def stackable(images: list) -> bool:
    first = images[0]
    return isinstance(first, torch.Tensor) and first.dim() == 3 and all(
        isinstance(image, torch.Tensor) and image.shape == first.shape and image.dtype == first.dtype
        for image in images)


def stack_images(images: list, storage: torch.Tensor | None = None) -> torch.Tensor:
    """torch.stack of same-shape CHW images into a batch laid out as the images are: channels_last when they are
    HWC in memory (a row copy, where an NCHW batch costs a transposing copy: 0.59 -> 0.12 ms for 64 images at
    64 px here). Into `storage` when given (a shared-memory ring slot); in a worker, else, into shared memory as
    default_collate does."""
    shape = (len(images), *images[0].shape)
    if storage is None:
        storage = torch.empty(math.prod(shape), dtype=images[0].dtype)
        if get_worker_info() is not None:
            storage.share_memory_()
    out = batch_view(storage, shape, channels_innermost(images[0]))
    torch.stack(images, out=out)
    return out


def collate_skipping_bad(batch: list) -> tuple:
    """default_collate over the readable samples, the images stacked in their own layout (stack_images); the
    third element counts the skipped ones. Samples carrying their index (trainer.record_samples) add a fourth:
    the indices."""
    good = [sample for sample in batch if sample is not None]
    bad = len(batch) - len(good)
    if not good:
        return torch.empty(0), torch.empty(0, dtype=torch.long), bad
    images = [sample[0] for sample in good]
    if not stackable(images):
        images, targets, *indices = default_collate(good)
        return (images, targets, bad, *indices)
    targets, *indices = default_collate([sample[1:] for sample in good])
    return (stack_images(images), targets, bad, *indices)
