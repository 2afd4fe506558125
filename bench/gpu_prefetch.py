#!/usr/bin/env python3
"""GPU figures (run on a CUDA machine: `make bench` or `python bench/gpu_prefetch.py`):

1. host-to-device: uint8 batches + normalize on the GPU vs float32 batches copied (img/s and bytes per image, both
   from pinned memory);
2. ResNet-50 training at the a100 profile on the 320 px JPEG set: data_wait_frac with the DevicePrefetcher vs a
   plain synchronous copy of the loader's batches.
Without CUDA it says so and exits 0 (tests/test_bench.py runs `data_wait` on CPU, for the code path only).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from common import SEED_DATA, config, host_batches, machine

from loadout.data.loader.batch import Batch
from loadout.data.pipeline import DataPipeline
from loadout.data.transforms import DeviceNormalize
from loadout.dist import DistEnv
from loadout.observe.meter import EpochMeter
from train.job import data_from_config
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task

BATCH = (128, 3, 224, 224)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_ms(batch: torch.Tensor, device: torch.device, normalize: DeviceNormalize | None, n: int = 50) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        x = batch.to(device, non_blocking=True)
        if normalize is not None:
            x = normalize(x)
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / n


def _prefetched(data: DataPipeline, epochs: int) -> Iterator[Batch]:
    for _ in range(epochs):
        yield from data.train  # one epoch per pass, already on the device


def _copied(data: DataPipeline, device: torch.device) -> Iterator[Batch]:
    normalize = DeviceNormalize(device)
    for batch in host_batches(data, 0):  # every epoch, as the workers hand them over
        images = normalize(batch.images.to(device)).contiguous(memory_format=torch.channels_last)
        yield dataclasses.replace(batch, images=images, targets=batch.targets.to(device))


def data_wait(prefetch: bool, device: torch.device, *overrides: str, root: Path = SEED_DATA, steps: int = 60,
              warmup: int = 5) -> float:
    """Fraction of the training time after `warmup` steps spent waiting for the next batch (loadout/observe/metrics.py's
    definition), training through train/loop/step.py's TrainStep (ResNet-50, AMP on CUDA): the a100 profile on the
    320 px JPEG set unless `overrides` and `root` say otherwise."""
    cfg = config("hardware=a100", f"trainer.epochs={steps + 1}", *overrides, root=root)
    with data_from_config(cfg, DistEnv(), device) as data:
        net = build_model(cfg.model, data.num_classes, device, channels_last=True)
        step = TrainStep.from_config(cfg, DistEnv(), device, net, total_steps=steps, task=build_task(cfg))
        batches: Iterable[Batch] = _prefetched(data, cfg.trainer.epochs) if prefetch else _copied(data, device)
        meter = EpochMeter(device)
        for index, batch in enumerate(batches):
            meter.waited()
            step(batch)
            meter.stepped(len(batch))
            if index == warmup - 1:
                meter.restart()
            if index + 1 == steps:
                break
        else:
            raise RuntimeError(f"data_wait: the loader ran out of batches before {steps} steps")
        return meter.summary()["data_wait_frac"]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_prefetch: CUDA is not available here: nothing measured (run `python bench/gpu_prefetch.py` on a "
              "GPU machine)")
        return 0
    device = torch.device("cuda")
    u8 = torch.randint(0, 256, BATCH, dtype=torch.uint8).pin_memory()
    f32 = u8.float().pin_memory()
    a, b = copy_ms(u8, device, DeviceNormalize(device)), copy_ms(f32, device, None)
    per_image = BATCH[1] * BATCH[2] * BATCH[3]
    print(f"h2d, batches of {'x'.join(map(str, BATCH))} from pinned memory: uint8 + GPU normalize {a:.2f} ms "
          f"({1000 * BATCH[0] / a:.0f} img/s, {per_image} B/img), float32 copy {b:.2f} ms "
          f"({1000 * BATCH[0] / b:.0f} img/s, {4 * per_image} B/img): ratio {b / a:.2f}; "
          f"{torch.cuda.get_device_name()}; {machine()}", flush=True)
    on, off = data_wait(True, device), data_wait(False, device)
    print(f"ResNet-50, a100 profile, 320 px JPEGs: data_wait_frac with the DevicePrefetcher {on:.3f}, with a "
          f"synchronous copy {off:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
