"""Which sample each DataLoader worker is reading, so that a stuck worker is named, not waited on forever.

A read that never returns (a dead network mount, a FIFO) blocks its worker, and DataLoader only knows that no
batch came within data.timeout. Each worker writes (pid, index, start time) into its row of a small shared tensor
before each sample and clears it after; when the timeout fires, the main process reads the rows and names the
worker and the sample that has been loading longest.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

PID, INDEX, SINCE = range(3)


class ActivityBoard:
    """One row per worker slot: [pid, sample index, time.time() the read began]; index -1 when idle."""

    def __init__(self, slots: int):
        self.rows = torch.full((max(slots, 1), 3), -1.0, dtype=torch.float64).share_memory_()
        self._table: np.ndarray | None = None

    def __getstate__(self) -> dict:  # the shared tensor travels (fd under spawn); the numpy view is made anew
        return {"rows": self.rows, "_table": None}

    @property
    def table(self) -> np.ndarray:
        """`rows` as a numpy view of the same shared pages: a row write is a numpy store, not a torch op."""
        if self._table is None:
            self._table = self.rows.numpy()
        return self._table

    def note(self, slot: int, index: int) -> None:
        self.table[slot] = (os.getpid(), index, time.time())

    def clear(self, slot: int) -> None:
        self.table[slot, INDEX] = -1

    def longest_read(self) -> tuple[int, int, int, float] | None:
        """(slot, pid, sample index, seconds) of the read in progress that began first, or None."""
        busy = [(row, slot) for slot, row in enumerate(self.rows.tolist()) if row[INDEX] >= 0]
        if not busy:
            return None
        row, slot = min(busy, key=lambda item: item[0][SINCE])
        return slot, int(row[PID]), int(row[INDEX]), time.time() - row[SINCE]
