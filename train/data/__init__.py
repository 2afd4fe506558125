"""The data path: dataset -> transforms -> sampler -> DataLoader (every knob) -> device prefetcher.

The training loop sees only `DataPipeline`: loaders with state, and batches on the device. The training loader
is a `TrainStream` (stream.py): one loader iterator spanning all epochs, so the workers prefetch across epoch
boundaries; its batches arrive on the device already.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from train.data.datasets import build_datasets
from train.data.loader import build_loader
from train.data.prefetcher import DevicePrefetcher
from train.data.stream import TrainStream, build_train_stream
from train.dist import DistEnv


@dataclass
class DataPipeline:
    train_loader: TrainStream
    val_loader: StatefulDataLoader
    num_classes: int
    device: torch.device
    normalize_on_device: bool
    channels_last: bool
    non_blocking: bool

    def on_device(self, loader) -> Iterable:
        """Iterate `loader` with batches on the device, normalized and in the model's memory format."""
        if isinstance(loader, TrainStream):
            return loader  # its batches are on the device already
        return DevicePrefetcher(loader, self.device, normalize=self.normalize_on_device,
                                channels_last=self.channels_last, non_blocking=self.non_blocking)

    def set_epoch(self, epoch: int) -> None:
        """Position the training stream at `epoch` (the sampler's own set_epoch runs as its indices are drawn)."""
        self.train_loader.set_epoch(epoch)


def build_data(cfg, env: DistEnv, device: torch.device) -> DataPipeline:
    """Datasets and loaders from cfg.data; every check that can fail runs here, before any worker starts."""
    data = cfg.data
    train_ds, val_ds, num_classes = build_datasets(data)
    seed = cfg.trainer.seed
    pipeline = DataPipeline(
        train_loader=None,
        val_loader=build_loader(val_ds, data, env, device, seed=seed),
        num_classes=num_classes,
        device=device,
        normalize_on_device=data.device_transforms,
        channels_last=cfg.trainer.channels_last,
        non_blocking=data.non_blocking,
    )
    pipeline.train_loader = build_train_stream(train_ds, data, env, device, seed=seed, epochs=cfg.trainer.epochs,
                                               open_batches=pipeline.on_device,
                                               record_indices=cfg.trainer.record_samples)
    return pipeline
