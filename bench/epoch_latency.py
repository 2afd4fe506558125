#!/usr/bin/env python3
"""First-batch latency, epoch 2 over epoch 1, on the embedded dataset (target <= 0.15).

The loop is the engine's: set_epoch, train an epoch (a 10 ms stand-in step per batch, as a GPU would take), run
validation, next epoch. loadout's TrainStream keeps the workers decoding epoch 2 while epoch 1 ends and validation
runs; a stock persistent-workers DataLoader starts epoch 2 by handing out new indices and waiting a whole batch.

Each trial starts a fresh loader (epoch 1 pays for the workers' start-up, as in a real run); loadout and stock trials
alternate, and the ratio is the median of the trials' ratios. On a 2-core box two busy workers leave the main
process a share of a core, so the same epoch-2 batch takes 1.5 ms in one trial and 6 ms in the next (the main
process's own work: the copy out of the ring, the CPU normalize): one trial alone is noise, the median is the loader.
"""

from __future__ import annotations

import statistics
import time

from common import images_per_s, interleaved_samples, machine, pipeline, report
from torch.utils.data import DataLoader

from loadout.data.loader.batch import collate
from loadout.data.loader.stateful import shutdown_workers

SETTINGS = ("data.num_workers=2", "data.persistent_workers=true", "trainer.epochs=2", "data.batch_size=64")
TRIALS = 5


def step() -> None:
    time.sleep(0.01)


def first_batches(train, set_epoch, val) -> tuple[float, float]:
    """Seconds to the first batch of epoch 1 and of epoch 2."""
    latencies = []
    for epoch in range(2):
        set_epoch(epoch)
        start = time.perf_counter()
        for index, _ in enumerate(train):
            if index == 0:
                latencies.append(time.perf_counter() - start)
            step()
        images_per_s(val)
    return latencies[0], latencies[1]


def loadout() -> tuple[float, float]:
    with pipeline(*SETTINGS) as data:
        return first_batches(data.train, data.set_epoch, data.val)


def stock() -> tuple[float, float]:
    with pipeline(*SETTINGS) as data:
        dataset = data.samples[0]  # the same JPEG source, transforms and seeding
        loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True,
                            collate_fn=collate, drop_last=True)
        try:
            return first_batches(loader, lambda epoch: None, data.val)
        finally:
            shutdown_workers(loader)


def summary(trials: list[tuple[float, float]]) -> tuple[float, str]:
    """The median of the trials' epoch 2 / epoch 1 ratios, and every trial as 'epoch 1 -> epoch 2 ms'."""
    ratio = statistics.median(second / first for first, second in trials)
    return ratio, ", ".join(f"{1000 * first:.0f} -> {1000 * second:.1f}" for first, second in trials)


if __name__ == "__main__":
    ours, theirs = interleaved_samples(loadout, stock, rounds=TRIALS)
    (ratio, loadout_trials), (stock_ratio, stock_trials) = summary(ours), summary(theirs)
    report("first batch epoch 2 / epoch 1", ratio, "<= 0.15", ratio <= 0.15,
           f"median of {TRIALS} trials; loadout ms {loadout_trials}; stock persistent DataLoader ratio "
           f"{stock_ratio:.2f} "
           f"(ms {stock_trials}); 2 workers, batch 64; {machine()}")
