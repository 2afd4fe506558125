#!/usr/bin/env python3
"""The per-stage timing's cost (loadout/data/loader/stages.py): samples/s of the per-sample path (read, decode, augment)
and the collate with the stage clocks on, as every run has them, against the same with them off (this benchmark swaps
the clock for one that does nothing and the timed collate for the plain one), in one run.

Measured in one process on the same batches, the sides alternating batch by batch, each batch's least time a side: a
whole-loader comparison on a shared 2-core machine varies by more than the 2 % it must resolve, and so did rounds of
whole passes (A B A B) on a quiet one. The embedded 80 px set decodes fast, so the clocks' share is larger here than
on real photos. The main side's clocks (a CPU-time read per batch received, one per batch copied) are per batch, not
per sample. Target: on / off >= 0.98.

Each size's second line is steadier: the clocks' own cost a sample (start, split, lap and a 64-sample batch's take, the
least of many tight loops) against the best "off" time a sample, as the ratio it implies.
"""

from __future__ import annotations

import time

import torch
from common import DATA, SEED_DATA, config, interleaved_samples, machine, report

import loadout.data.samples as samples_module
from loadout.data.loader.batch import collate
from loadout.data.loader.stages import AUGMENT, DECODE, READ, StageBoard, StageClock, TimedCollate
from loadout.dist import DistEnv
from train.job import data_from_config

ROUNDS, BATCHES, TARGET = 11, 8, 0.98
CPU = torch.device("cpu")


class NoClock(StageClock):
    """A clock that reads nothing: what the loader costs without stage timing."""

    def start(self) -> None: ...

    def lap(self, stage: int) -> None: ...

    def split(self, wall_stage: int, cpu_stage: int) -> None: ...


def batch_times(samples, timed_collate, keys: list) -> tuple[list[float], list[float]]:
    """Each batch's least time through the per-sample path and the collate, clocks on and off, in this process: the
    two sides alternate batch by batch (which goes first alternates too), so a slower stretch of a shared machine
    meets both, and a batch's least of ROUNDS tries is its undisturbed cost."""
    real = samples_module.CLOCK
    sides = {True: (real, timed_collate), False: (NoClock(), collate)}
    on, off = [float("inf")] * len(keys), [float("inf")] * len(keys)
    try:
        for round_ in range(ROUNDS):
            for index, batch_keys in enumerate(keys):
                for timed in (True, False) if (round_ + index) % 2 else (False, True):
                    samples_module.CLOCK, collate_batch = sides[timed]
                    start = time.perf_counter()
                    collate_batch(samples.__getitems__(batch_keys))
                    best = on if timed else off
                    best[index] = min(best[index], time.perf_counter() - start)
    finally:
        samples_module.CLOCK = real
    return on, off


def clock_cost_s(batch: int = 64, batches: int = 50, rounds: int = 40) -> float:
    """Seconds the stage clocks add to a sample on the usual path (one read-and-decode call, then the augment),
    with a batch's `take`: the least of many short tight loops, less the same with the clock that reads nothing."""

    def loop(clock: StageClock) -> float:
        start = time.perf_counter()
        for _ in range(batches):
            for _ in range(batch):
                clock.start()
                clock.split(READ, DECODE)
                clock.lap(AUGMENT)
            clock.take()
        return (time.perf_counter() - start) / (batch * batches)

    on, off = interleaved_samples(lambda: loop(StageClock()), lambda: loop(NoClock()), rounds)
    return max(min(on) - min(off), 0.0)


def measure(name: str, root) -> None:
    cfg = config("data.num_workers=0", "data.batch_size=64", root=root)
    with data_from_config(cfg, DistEnv(), CPU) as data:
        samples = data.samples[0]
        keys = [[(0, i) for i in range(b * 64, (b + 1) * 64)] for b in range(BATCHES)]
        on, off = batch_times(samples, TimedCollate(collate, StageBoard(0)), keys)
    count = sum(map(len, keys))
    rate_on, rate_off = count / sum(on), count / sum(off)
    ratio = rate_on / rate_off
    report(f"stage timing on/off (per-sample path + collate, {name})", ratio, f">= {TARGET}", ratio >= TARGET,
           f"on {rate_on:.0f} samples/s, off {rate_off:.0f} samples/s: each of {BATCHES} batches' least time of "
           f"{ROUNDS} tries a side, the sides alternating batch by batch")
    cost, sample = clock_cost_s(), 1 / rate_off
    implied = sample / (sample + cost)
    report(f"stage timing, the clocks' cost a sample ({name})", implied, f">= {TARGET}", implied >= TARGET,
           f"{cost * 1e9:.0f} ns of a {sample * 1e6:.1f} us sample (the off side)")


def main() -> None:
    print(machine())
    measure("80 px JPEGs", DATA)
    measure("320 px JPEGs", SEED_DATA)


if __name__ == "__main__":
    main()
