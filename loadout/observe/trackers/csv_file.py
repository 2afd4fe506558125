"""logger=csv: one row an epoch in `<run dir>/metrics.csv`, the columns loadout/observe/metrics.py's EPOCH
vocabulary."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from loadout.observe.metrics import EPOCH
from loadout.observe.trackers import Tracker


class CsvTracker(Tracker):
    """Appends to the run dir's file, so a resumed run continues its table under the header it was written with."""

    def __init__(self, run_dir: Path, filename: str = "metrics.csv"):
        self.path = Path(run_dir) / filename
        self.columns = ["step", *EPOCH]

    def log_epoch(self, step: int, record: dict[str, Any]) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new:  # a resumed run keeps its file's columns (a newer loadout may know more figures)
            with open(self.path, newline="") as f:
                self.columns = next(csv.reader(f), None) or self.columns
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({"step": step, **record})
