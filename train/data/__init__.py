"""The data path: dataset -> transforms -> sampler -> DataLoader (every knob) -> device prefetcher.

The training loop sees only `DataPipeline`: loaders with state, and batches on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from train.data.datasets import build_datasets
from train.data.loader import build_loader
from train.data.prefetcher import DevicePrefetcher
from train.data.transforms import build_train_transform, build_val_transform
from train.dist import DistEnv


@dataclass
class DataPipeline:
    train_loader: StatefulDataLoader
    val_loader: StatefulDataLoader
    num_classes: int
    device: torch.device
    normalize_on_device: bool
    channels_last: bool
    non_blocking: bool

    def on_device(self, loader) -> DevicePrefetcher:
        """Iterate `loader` with batches on the device, normalized and in the model's memory format."""
        return DevicePrefetcher(loader, self.device, normalize=self.normalize_on_device,
                                channels_last=self.channels_last, non_blocking=self.non_blocking)

    def set_epoch(self, epoch: int) -> None:
        """A new order each epoch for samplers that have one (DistributedSampler); runs in the main process."""
        sampler = self.train_loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def build_data(cfg, env: DistEnv, device: torch.device) -> DataPipeline:
    """Datasets and loaders from cfg.data; every check that can fail runs here, before any worker starts."""
    data = cfg.data
    train_ds, val_ds, num_classes = build_datasets(data, build_train_transform(data), build_val_transform(data))
    seed = cfg.trainer.seed
    return DataPipeline(
        train_loader=build_loader(train_ds, data, env, device, train=True, seed=seed),
        val_loader=build_loader(val_ds, data, env, device, train=False, seed=seed),
        num_classes=num_classes,
        device=device,
        normalize_on_device=data.device_transforms,
        channels_last=cfg.trainer.channels_last,
        non_blocking=data.non_blocking,
    )
