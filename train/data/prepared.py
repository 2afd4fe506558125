"""What loadout adds to any map-style dataset that returns (image, label): the image as a uint8 CHW tensor (from a
PIL image too), the shared sample cache, the augmentation, and unreadable samples skipped (data.on_bad_sample).

A dataset class stays this simple (a user's own, or loadout's ImageFolderDataset); `Prepared` wraps it. A dataset
with a `transform` attribute of its own (the packed format: it transforms whole batches) gets the transform set
there instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as F

from train.data.activity import sample_name
from train.data.cache import SharedSampleCache
from train.data.loader import LoaderError

log = logging.getLogger(__name__)

Transform = Callable[[torch.Tensor], torch.Tensor]
UNREADABLE = (OSError, ValueError, RuntimeError)  # what decoding a broken file raises (PIL, libjpeg-turbo, torch)


class BadSampleError(LoaderError):
    """An unreadable sample under data.on_bad_sample=raise."""


def as_uint8_tensor(image) -> torch.Tensor:
    """A dataset's image as the data path carries it: uint8 CHW (a PIL image is converted, RGB)."""
    if isinstance(image, Image.Image):
        return F.pil_to_tensor(image.convert("RGB"))
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3:
        raise TypeError(f"a dataset image must be a PIL image or a uint8 CHW tensor, got {type(image).__name__}"
                        f"{tuple(image.shape) if isinstance(image, torch.Tensor) else ''}")
    return image


class Prepared(Dataset):
    """`dataset[i]` = (image, label) made ready for a batch: (transformed uint8 or float tensor, int label), or None
    for an unreadable sample (counted by the collate) unless `on_bad_sample` is "raise"."""

    def __init__(self, dataset: Dataset, transform: Transform, on_bad_sample: str = "warn",
                 cache: SharedSampleCache | None = None):
        self.dataset, self.on_bad_sample, self.cache = dataset, on_bad_sample, cache
        self.transform = transform
        if hasattr(dataset, "transform"):  # it transforms its own samples (and whole batches)
            dataset.transform, self.transform = transform, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):  # classes, targets, paths, seeded_items, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _load(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index][:2]
        return as_uint8_tensor(image), label

    def __getitem__(self, index: int):
        if self.transform is None:
            return self.dataset[index]
        try:
            image, label = self._load(index) if self.cache is None else self.cache.fetch(index, self._load)
        except UNREADABLE as err:
            where = sample_name(self.dataset, index)
            if self.on_bad_sample == "raise":
                raise BadSampleError(f"cannot read {where}: {err} (data.on_bad_sample=warn skips such samples)") \
                    from err
            log.warning("skipping unreadable sample %s: %s", where, err)
            return None
        return self.transform(image), int(label)
