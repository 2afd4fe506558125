#!/usr/bin/env python3
"""GPU figures (run on a CUDA machine: `make bench` or `python bench/gpu_prefetch.py`):

1. host-to-device: uint8 batches + normalize on the GPU vs float32 batches copied (ms per batch, both pinned);
2. ResNet-50 training at the a100 profile, data_wait_frac with the DevicePrefetcher vs a plain synchronous copy.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
import time

import torch
from common import config, machine

from train.data import build_data
from train.data.transforms import DeviceNormalize
from train.dist import DistEnv
from train.model import build_model


def copy_ms(batch: torch.Tensor, device: torch.device, normalize: DeviceNormalize | None, n: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        x = batch.to(device, non_blocking=True)
        if normalize is not None:
            x = normalize(x)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / n


def data_wait(prefetch: bool, steps: int = 60, warmup: int = 5) -> float:
    """Fraction of the time after `warmup` steps spent waiting for the next batch."""
    cfg = config("hardware=a100", "trainer.epochs=1")
    device = torch.device("cuda")
    data = build_data(cfg, DistEnv(), device)
    net = build_model("resnet50", data.num_classes, device, channels_last=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    normalize = DeviceNormalize(device)
    batches = data.train_loader if prefetch else data.train_loader.loader
    data.set_epoch(0)
    if not prefetch:
        data.train_loader.batches.start_epoch = 0
    wait = 0.0
    mark = start = time.perf_counter()
    for i, (images, targets, *_) in enumerate(batches):
        if not prefetch:
            images = normalize(images.to(device)).contiguous(memory_format=torch.channels_last)
            targets = targets.to(device)
        arrived = time.perf_counter()
        if i >= warmup:
            wait += arrived - mark
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(net(images), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        mark = time.perf_counter()
        if i == warmup - 1:
            start = mark
        if i >= steps:
            break
    return wait / (mark - start)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_prefetch: CUDA is not available here: nothing measured (run `python bench/gpu_prefetch.py` on a "
              "GPU machine)")
        return 0
    device = torch.device("cuda")
    u8 = torch.randint(0, 256, (128, 3, 224, 224), dtype=torch.uint8).pin_memory()
    f32 = u8.float().pin_memory()
    a, b = copy_ms(u8, device, DeviceNormalize(device)), copy_ms(f32, device, None)
    print(f"h2d per batch of 128x3x224x224: uint8 + GPU normalize {a:.2f} ms, float32 copy {b:.2f} ms "
          f"(ratio {b / a:.2f}); {torch.cuda.get_device_name()}; {machine()}")
    w_on, w_off = data_wait(True), data_wait(False)
    print(f"ResNet-50 a100 profile data_wait_frac: prefetcher {w_on:.3f}, synchronous copy {w_off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
