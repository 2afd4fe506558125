"""Where a sample's time goes, per stage, cheap enough to stay on: a few `perf_counter_ns` reads per sample.

Worker side: `CLOCK`, this process's running sums, is lapped by samples.py as a sample is read, decoded and
augmented; a read and decode done in one source call (`source[index]`) is split by the thread's CPU time (decoding
burns CPU, a slow disk or store does not). A thread's CPU time is a system call, many times the cost of a
`perf_counter_ns` read, so one such call in SPLIT_EVERY is measured and the others are given the CPU time the
measured ones took. `TimedCollate` times the collate and adds the sums, with the sample count, to this worker's row of a
`StageBoard`: a shared tensor allocated before any worker starts, one row per worker and one for the main process
(num_workers=0), so nothing rides on the batch and nothing is pickled per batch.

Main side (`MainStages`): the hand-off (the main thread's CPU while it receives a batch from the workers: unpickle,
copy out of the ring, hand out the next indices; waiting costs no CPU) and the host->device copy (the prefetcher's
work; CUDA events on its side stream). The loop's wait and compute come from loadout/observe/metrics.py's EpochMeter.
`StageTimes.snapshot()` gives all the sums at a moment; an epoch's figures are the difference of two.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import get_worker_info

WORKER_STAGES = ("read", "decode", "augment", "collate")
MAIN_STAGES = ("handoff", "copy")
READ, DECODE, AUGMENT, COLLATE = range(len(WORKER_STAGES))
SAMPLES = len(WORKER_STAGES)  # the board's last column: samples collated


SPLIT_EVERY = 16  # one split call in this many reads the thread's CPU time
NEWEST = 0.25  # the weight of each measured call in the CPU time a call is expected to take


class StageClock:
    """One process's worker-stage sums (ns). `start()` at a sample's start, `lap(stage)` after each stage,
    `split(wall_stage, cpu_stage)` right after `start()` and one call that did both stages: its CPU time to
    `cpu_stage`, the rest to `wall_stage`. A call not measured is given the CPU time the measured ones took (a
    moving mean), not their share of the wall: decoding an image costs about the same each time, while waits come
    in spikes (a shard's download falls on the one sample that reaches it). Plain ints, not numpy: an add costs
    ~50 ns, a numpy one ~150."""

    def __init__(self) -> None:
        self.sums = [0] * len(WORKER_STAGES)
        self._mark = 0
        self._cpu: int | None = None  # the thread's CPU time at start(), read only on a measured call
        self._countdown = 0  # split calls until the next measured one (the first is measured)
        self._cpu_per_call = 0.0  # the CPU ns a call is expected to take

    def start(self) -> None:
        self._mark = time.perf_counter_ns()
        self._cpu = time.thread_time_ns() if self._countdown == 0 else None

    def lap(self, stage: int) -> None:
        now = time.perf_counter_ns()
        self.sums[stage] += now - self._mark
        self._mark = now

    def split(self, wall_stage: int, cpu_stage: int) -> None:
        now = time.perf_counter_ns()
        wall = now - self._mark
        self._mark = now
        if self._cpu is None:
            self._countdown -= 1
            used = min(wall, int(self._cpu_per_call))
        else:
            used = min(max(time.thread_time_ns() - self._cpu, 0), wall)
            self._cpu_per_call += (used - self._cpu_per_call) * (NEWEST if self._cpu_per_call else 1.0)
            self._cpu, self._countdown = None, SPLIT_EVERY - 1
        self.sums[cpu_stage] += used
        self.sums[wall_stage] += wall - used

    def take(self) -> np.ndarray:
        sums, self.sums = self.sums, [0] * len(WORKER_STAGES)
        return np.array(sums, dtype=np.int64)


CLOCK = StageClock()  # this process's: a worker's, or the main process's with num_workers=0


class StageBoard:
    """Worker-stage sums and sample counts, one row per worker plus one for the main process (the last)."""

    def __init__(self, num_workers: int):
        self.table = torch.zeros((num_workers + 1, len(WORKER_STAGES) + 1), dtype=torch.int64).share_memory_()
        self._rows: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"table": self.table}

    def __setstate__(self, state: dict) -> None:
        self.table, self._rows = state["table"], None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:  # a numpy view of the shared table: an add costs ~100 ns, a torch index ~5 us
            self._rows = self.table.numpy()
        return self._rows

    def add(self, worker: int | None, sums: np.ndarray, samples: int) -> None:
        row = self.rows[-1 if worker is None else worker]
        row[:SAMPLES] += sums
        row[SAMPLES] += samples

    def totals(self) -> np.ndarray:
        return self.rows.sum(axis=0)


class TimedCollate:
    """A loader's collate_fn, timed: the batch's stage sums go to this worker's row of `board`."""

    def __init__(self, collate, board: StageBoard):
        self.collate, self.board = collate, board

    def __call__(self, samples: list):
        start = time.perf_counter_ns()
        batch = self.collate(samples)
        CLOCK.sums[COLLATE] += time.perf_counter_ns() - start
        info = get_worker_info()
        self.board.add(None if info is None else info.id, CLOCK.take(), len(samples))
        return batch


class MainStages:
    """The main process's stage sums (ns): the hand-off and the host->device copy, and the batches received."""

    def __init__(self) -> None:
        self.sums = np.zeros(len(MAIN_STAGES), dtype=np.int64)
        self._events: deque = deque()  # CUDA (start, end) events of copies not yet read

    def add(self, stage: int, ns: int) -> None:
        self.sums[stage] += ns

    def add_events(self, start, end) -> None:
        self._events.append((start, end))
        while self._events and self._events[0][1].query():
            first, last = self._events.popleft()
            self.sums[1] += int(first.elapsed_time(last) * 1e6)

    def settle(self) -> None:
        """Read every copy's events (after a device sync: at an epoch's end)."""
        while self._events:
            first, last = self._events.popleft()
            last.synchronize()
            self.sums[1] += int(first.elapsed_time(last) * 1e6)


HANDOFF, COPY = range(len(MAIN_STAGES))


@dataclass
class StageTimes:
    """Every stage's clock of one loader: the workers' board and the main process's sums."""

    board: StageBoard
    main: MainStages
    carried: dict[str, float] | None = None  # the sums of the clocks this one took over from
    successor: StageTimes | None = None  # the clocks that took over from this one

    @classmethod
    def for_workers(cls, num_workers: int) -> StageTimes:
        return cls(StageBoard(num_workers), MainStages())

    def hand_over(self, successor: StageTimes) -> None:
        """The loader was replaced (data.autotune): `successor` goes on from this one's sums, and this one reads as
        the successor does, so an epoch's two snapshots span the change whichever clocks they were taken from."""
        successor.carried = self.snapshot()
        self.successor = successor

    def snapshot(self) -> dict[str, float]:
        """Seconds in each stage so far, and the samples collated."""
        if self.successor is not None:
            return self.successor.snapshot()
        self.main.settle()
        totals = self.board.totals()
        seconds = {name: int(totals[i]) / 1e9 for i, name in enumerate(WORKER_STAGES)}
        seconds.update({name: int(self.main.sums[i]) / 1e9 for i, name in enumerate(MAIN_STAGES)})
        now = {**seconds, "samples": int(totals[SAMPLES])}
        return now if self.carried is None else {key: value + self.carried[key] for key, value in now.items()}


def since(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0) for key in after}
