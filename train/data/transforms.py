"""The seed pipeline with torchvision.transforms.v2: Resize -> RandomCrop -> RandomHorizontalFlip -> (Normalize).

Workers keep images uint8. With data.device_transforms=true the float conversion and Normalize run on the device
(`DeviceNormalize`, used by train/data/prefetcher.py), so a quarter of the bytes cross to the GPU; otherwise they
run here in the workers. Inputs that are already square at the resize size (the packed format, the shared sample
cache) skip the Resize step: `fit_square` is the one place that makes them.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def resize_size(data_cfg) -> int:
    return data_cfg.resize_size or round(data_cfg.image_size * 256 / 224)


def fit_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """Shorter side to `size`, then the centre `size` x `size` square (the packed format and the sample cache)."""
    return F.center_crop(F.resize(image, [size], antialias=True), [size, size])


def _resize(data_cfg, input_size: int | None) -> list:
    size = resize_size(data_cfg)
    return [] if input_size == size else [v2.Resize(size, antialias=True)]


def _to_float(data_cfg) -> list:
    if data_cfg.device_transforms:
        return []
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def build_train_transform(data_cfg, input_size: int | None = None) -> v2.Compose:
    """`input_size`: the side of inputs already made square by `fit_square` (None: any decoded image)."""
    return v2.Compose([
        *_resize(data_cfg, input_size),
        v2.RandomCrop(data_cfg.image_size),
        v2.RandomHorizontalFlip(),
        *_to_float(data_cfg),
    ])


def build_val_transform(data_cfg, input_size: int | None = None) -> v2.Compose:
    return v2.Compose([
        *_resize(data_cfg, input_size),
        v2.CenterCrop(data_cfg.image_size),
        *_to_float(data_cfg),
    ])


class DeviceNormalize:
    """uint8 NCHW -> float32 normalized with MEAN/STD, on whatever device the batch is on (one fused pass)."""

    def __init__(self, device: torch.device):
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().sub_(self.mean).div_(self.std)
