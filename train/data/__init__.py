"""The data path: dataset -> transforms -> sampler -> DataLoader (every knob) -> device prefetcher -> Batch.

The training loop sees only `DataPipeline`: `train` and `val` both yield `Batch`es on the device through the same
prefetcher. `train` is a `TrainStream` (stream.py): one loader iterator spanning all epochs, so the workers
prefetch across epoch boundaries, with a state a checkpoint keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from train.data.activity import ActivityBoard, Watched, sample_name
from train.data.datasets import build_datasets
from train.data.loader import build_loader, resolve_num_workers, shutdown_workers
from train.data.prefetcher import DevicePrefetcher
from train.data.stream import TrainStream, build_train_stream
from train.dist import DistEnv


@dataclass
class DataPipeline:
    """`close()` (or `with`) ends the workers now; a pipeline simply dropped ends them as its last reference goes."""

    train: TrainStream  # this epoch's rest, on the device; its state_dict() is the position a checkpoint keeps
    val: DevicePrefetcher  # the validation loader's batches on the device; `.loader` is the StatefulDataLoader
    num_classes: int
    activity: Watched | None = None  # what the training workers read (slots 0..n-1), then the validation ones
    val_activity: Watched | None = None

    def set_epoch(self, epoch: int) -> None:
        """Position the training stream at `epoch` (the sampler's own set_epoch runs as its indices are drawn)."""
        self.train.set_epoch(epoch)

    def stuck_read(self) -> str | None:
        """The worker that has been reading one sample longest and that sample, for a timed-out loader's error."""
        if self.activity is None:
            return None
        found = self.activity.board.longest_read()
        if found is None:
            return None
        slot, pid, index, seconds = found
        which = self.activity if slot < self.val_activity.first_slot else self.val_activity
        role = "training" if which is self.activity else "validation"
        return (f"{role} worker {slot - which.first_slot} (pid {pid}) has been reading "
                f"{sample_name(which.dataset, index)} for {seconds:.0f} s")

    def close(self) -> None:
        """End both loaders' worker processes now."""
        self.train.close()
        shutdown_workers(self.train.loader)
        shutdown_workers(self.val.loader)

    def __enter__(self) -> DataPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_data(cfg, env: DistEnv, device: torch.device) -> DataPipeline:
    """Datasets and loaders from cfg.data; every check that can fail runs here, before any worker starts."""
    data = cfg.data
    train_ds, val_ds, num_classes = build_datasets(cfg)
    workers = resolve_num_workers(data.num_workers, env.local_world_size)
    board = ActivityBoard(2 * workers) if workers else None
    if board is not None:  # each worker notes the sample it reads: a stuck one is named when data.timeout fires
        train_ds, val_ds = Watched(train_ds, board), Watched(val_ds, board, first_slot=workers)
    seed = cfg.trainer.seed
    val_loader = build_loader(val_ds, data, env, device, seed=seed)
    # no reference back to the pipeline: the stream holds this, and a cycle would leave its workers to the collector
    to_device = partial(DevicePrefetcher, device=device, normalize=data.device_transforms,
                        channels_last=cfg.trainer.channels_last, non_blocking=data.non_blocking,
                        beside_workers=val_loader.num_workers > 0)  # both loaders have data.num_workers
    train_stream = build_train_stream(train_ds, data, env, device, seed=seed, epochs=cfg.trainer.epochs,
                                      to_device=to_device)
    watched = board is not None
    return DataPipeline(train_stream, to_device(val_loader), num_classes, activity=train_ds if watched else None,
                        val_activity=val_ds if watched else None)
