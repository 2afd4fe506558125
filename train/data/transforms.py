"""The seed pipeline with torchvision.transforms.v2: Resize -> RandomCrop -> RandomHorizontalFlip -> (Normalize).

Workers keep images uint8. With data.device_transforms=true the float conversion and Normalize run on the device
(train/data/prefetcher.py), so a quarter of the bytes cross to the GPU; otherwise they run here in the workers.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def resize_size(data_cfg) -> int:
    return data_cfg.resize_size or round(data_cfg.image_size * 256 / 224)


def _to_float(data_cfg) -> list:
    if data_cfg.device_transforms:
        return []
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def build_train_transform(data_cfg) -> v2.Compose:
    return v2.Compose([
        v2.Resize(resize_size(data_cfg), antialias=True),
        v2.RandomCrop(data_cfg.image_size),
        v2.RandomHorizontalFlip(),
        *_to_float(data_cfg),
    ])


def build_val_transform(data_cfg) -> v2.Compose:
    return v2.Compose([
        v2.Resize(resize_size(data_cfg), antialias=True),
        v2.CenterCrop(data_cfg.image_size),
        *_to_float(data_cfg),
    ])


def normalize_on_device(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 NCHW -> normalized float32 on the images' device (the second half of the pipeline)."""
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1) * 255
    out = images.float().sub_(mean).div_(std)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out
