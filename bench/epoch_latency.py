#!/usr/bin/env python3
"""First-batch latency, epoch 2 over epoch 1, on the embedded dataset (target <= 0.15).

The loop is the engine's: set_epoch, train an epoch (a 10 ms stand-in step per batch, as a GPU would take), run
validation, next epoch. The kit's TrainStream keeps the workers decoding epoch 2 while epoch 1 ends and validation
runs; a stock persistent-workers DataLoader starts epoch 2 by handing out new indices and waiting a whole batch.
"""

from __future__ import annotations

import time

from common import images_per_s, machine, pipeline, report
from torch.utils.data import DataLoader

from train.data.workers import collate_skipping_bad

SETTINGS = ("data.num_workers=2", "data.persistent_workers=true", "trainer.epochs=2", "data.batch_size=64")


def step() -> None:
    time.sleep(0.01)


def first_batches(train, set_epoch, val) -> list[float]:
    latencies = []
    for epoch in range(2):
        set_epoch(epoch)
        start = time.perf_counter()
        for index, _ in enumerate(train):
            if index == 0:
                latencies.append(time.perf_counter() - start)
            step()
        images_per_s(val)
    return latencies


def kit() -> list[float]:
    data = pipeline(*SETTINGS)
    return first_batches(data.train_loader, data.set_epoch, data.on_device(data.val_loader))


def stock() -> list[float]:
    data = pipeline(*SETTINGS)
    dataset = data.train_loader.loader.dataset.dataset  # the same JPEG dataset and transforms
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True,
                        collate_fn=collate_skipping_bad, drop_last=True)
    return first_batches(loader, lambda epoch: None, data.on_device(data.val_loader))


if __name__ == "__main__":
    ours, theirs = kit(), stock()
    ratio = ours[1] / ours[0]
    report("first batch epoch 2 / epoch 1", ratio, "<= 0.15", ratio <= 0.15,
           f"kit {1000 * ours[0]:.0f} -> {1000 * ours[1]:.1f} ms; stock persistent DataLoader {1000 * theirs[0]:.0f} "
           f"-> {1000 * theirs[1]:.0f} ms (ratio {theirs[1] / theirs[0]:.2f}); 2 workers, batch 64; {machine()}")
