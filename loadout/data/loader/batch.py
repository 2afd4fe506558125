"""The batch every loader yields and every loop reads, and the collate that builds it inside the workers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import default_collate, get_worker_info

from loadout.data.fast.encoded import EMPTY_IMAGES, Encoded, EncodedSample


@dataclass
class Batch:
    """One batch. On the host `images` are uint8 (float when data.device_transforms=false) in the images' own
    layout; out of the device prefetcher they are on the device, float, normalized, in the model's layout.

    `indices` are the dataset indices of the training samples (None for validation); `bad` counts the samples
    skipped as unreadable; `position` is the training loader's state as of this batch (stream.py), what a
    checkpoint taken after it keeps."""

    images: torch.Tensor
    targets: torch.Tensor
    indices: torch.Tensor | None = None
    bad: int = 0
    position: dict | None = None
    encoded: Encoded | None = None  # data.decode=device: the files to decode on the device (images empty till then)
    decode_fallbacks: int = 0  # of those, the files the device decoder refused, decoded on the CPU

    def __len__(self) -> int:
        return self.targets.shape[0]

    def pin_memory(self) -> Batch:
        """DataLoader's pin-memory thread calls this on custom batch types (torch.utils.data docs). Encoded files
        stay in pageable memory: nvJPEG reads them through host pointers, never by an asynchronous copy."""
        return dataclasses.replace(self, images=self.images.pin_memory(), targets=self.targets.pin_memory())


class WholeBatch(Sequence):
    """A training batch a source read whole (`read_crops`): its images already one (N, C, H, W) tensor, its labels
    and indices int64 columns, so the collate copies the images once rather than splitting them into samples and
    stacking them back. Still the sequence of `(image, label, index)` samples any other collate_fn reads."""

    __slots__ = ("images", "labels", "indices")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor):
        self.images, self.labels, self.indices = images, labels, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return self.images[k], int(self.labels[k]), int(self.indices[k])


def empty_batch(bad: int) -> Batch:
    """A batch whose samples were all unreadable: the loop counts it and moves on."""
    return Batch(torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), bad)


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


def stack_images(images: list | torch.Tensor, storage: torch.Tensor | None = None) -> torch.Tensor:
    """torch.stack of same-shape CHW images (or a copy of a batch of them) into a batch laid out as the images are:
    channels_last when they are HWC in memory (a row copy, where an NCHW batch needs a transposing one). Into
    `storage` when given (a shared-memory ring slot); in a worker, else, into shared memory as default_collate does."""
    shape = (len(images), *images[0].shape)
    if storage is None:
        storage = torch.empty(math.prod(shape), dtype=images[0].dtype)
        if get_worker_info() is not None:
            storage.share_memory_()
    out = batch_view(storage, shape, channels_innermost(images[0]))
    if isinstance(images, torch.Tensor):
        out.copy_(images)
    else:
        torch.stack(images, out=out)
    return out


def readable(samples: list) -> tuple[list, int]:
    """The samples a dataset could read (None marks one it could not), and how many it could not."""
    good = [sample for sample in samples if sample is not None]
    return good, len(samples) - len(good)


def collate_labels(good: list, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Targets and, for training samples `(image, target, index)`, the indices. `shared=False` (the ring, which
    pickles what it returns by value anyway) stacks tensor targets (masks) in ordinary memory: default_collate in a
    worker makes a new shared-memory segment for them every batch."""
    if not shared and isinstance(good[0][1], torch.Tensor):
        return torch.stack([sample[1] for sample in good]), collate_indices(good)
    columns = default_collate([sample[1:] for sample in good])
    return columns[0], (columns[1] if len(columns) > 1 else None)


def collate_indices(good: list) -> torch.Tensor | None:
    """The dataset indices of training samples `(image, target, index)`; None for validation's `(image, target)`."""
    return default_collate([sample[2] for sample in good]) if len(good[0]) > 2 else None


def collate(samples: list | WholeBatch) -> Batch:
    """The collate_fn without the shared-memory ring: the readable samples' images stacked in their own layout
    (`stack_images`), unreadable ones counted in `bad`. A WholeBatch's images are one batch already: in a worker
    copied into shared memory, in the main process taken as they are."""
    if isinstance(samples, WholeBatch):
        images = samples.images if get_worker_info() is None else stack_images(samples.images)
        return Batch(images, samples.labels, samples.indices)
    good, bad = readable(samples)
    if not good:
        return empty_batch(bad)
    images = [sample[0] for sample in good]
    targets, indices = collate_labels(good)
    if isinstance(images[0], EncodedSample):
        return Batch(EMPTY_IMAGES, targets, indices, bad, encoded=Encoded.join(images))
    return Batch(stack_images(images) if stackable(images) else default_collate(images), targets, indices, bad)
