"""logger=tensorboard: scalars in the run dir (`make tensorboard`), the config as text at a run's start."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from train.metrics import EPOCH
from train.trackers import Tracker


class TensorBoardTracker(Tracker):
    """One event file per process start; a resumed run purges the steps it redoes (`purge_step`)."""

    def __init__(self, run_dir: Path, flush_secs: int = 10):
        self.log_dir, self.flush_secs = Path(run_dir), flush_secs
        self._writer = None

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=self.flush_secs)
        if step == 0:
            self._writer.add_text("config", "\n".join(f"    {key}: {value}" for key, value in params.items()))

    def _write(self, step: int, scalars: dict[str, Any]) -> None:
        for tag, value in scalars.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(tag, value, step)

    def log_window(self, step: int, scalars: dict[str, float]) -> None:
        self._write(step, scalars)

    def log_epoch(self, step: int, record: dict[str, Any]) -> None:
        self._write(step, {f"epoch/{key}": record[key] for key in EPOCH if key != "epoch" and key in record
                           and not isinstance(record[key], bool)})

    def finish(self, status: str) -> None:
        self._writer.close()
