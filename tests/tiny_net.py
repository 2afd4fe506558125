"""Models the tests install through `model._target_` (built with num_classes, like any model of your own): a small
conv net with BatchNorm that trains in well under a second an epoch on the tiny datasets, and one whose forward fails
the way a CUDA library does when its own allocation fails: a plain RuntimeError, not torch.OutOfMemoryError."""

from __future__ import annotations

import os

import torch
from torch import nn

# cuDNN 9 (the only cuDNN torch 2.11-2.14 ships) as torch words it: `cuDNN error: ` + cudnnGetErrorString
CUDNN_ALLOC_FAILED = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"


class TinyNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class AllocFailingNet(TinyNet):
    """Raises `message` in `times` forwards in a row from the `at`-th (1-based) forward in training, or in
    evaluation (`during="eval"`). The retries of a halved micro-batch run forwards too."""

    def __init__(self, num_classes: int, at: int = 2, times: int = 1, during: str = "train",
                 message: str = CUDNN_ALLOC_FAILED) -> None:
        super().__init__(num_classes)
        self.at, self.times, self.during, self.message = at, times, during, message
        self.forwards = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training == (self.during == "train"):
            self.forwards += 1
            if self.at <= self.forwards < self.at + self.times:
                raise RuntimeError(self.message)
        return super().forward(images)


class OutOfMemoryOnRank(TinyNet):
    """Runs out of memory as torch does (torch.OutOfMemoryError) on torchrun's rank `rank` for a training forward of
    more than `limit` samples: a model too big for one rank's GPU at the configured batch."""

    def __init__(self, num_classes: int, rank: int = 1, limit: int = 8) -> None:
        super().__init__(num_classes)
        self.rank, self.limit = rank, limit

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training and images.shape[0] > self.limit and int(os.environ.get("RANK", 0)) == self.rank:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({images.shape[0]} samples)")
        return super().forward(images)
