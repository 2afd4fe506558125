"""logger=tensorboard: scalars in the run dir (`make tensorboard`), the config as text at each process's first logged
step."""

from __future__ import annotations

from pathlib import Path

from loadout.observe.trackers import Tracker


class TensorBoardTracker(Tracker):
    """One event file per process start; a resumed run purges the steps it redoes (`purge_step`). The config goes
    in with the first scalars, at their step: a text at a step with nothing else (step 0, before any optimizer
    step) is one TensorBoard's views may never reach. A resumed process writes it again: the resume's overrides may
    have changed it."""

    def __init__(self, run_dir: Path, flush_secs: int = 10):
        self.log_dir, self.flush_secs = Path(run_dir), flush_secs
        self._writer = None
        self._config: str | None = None  # written with the first scalars

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=self.flush_secs)
        self._config = "\n".join(f"    {key}: {value}" for key, value in params.items())

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._config is not None:
            self._writer.add_text("config", self._config, step)
            self._config = None
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def finish(self, status: str) -> None:
        self._writer.close()
