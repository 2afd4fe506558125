"""logger=wandb: a Weights & Biases run (`pip install 'loadout[wandb]'`), its files under `<run dir>/wandb`;
`mode=offline` keeps it on disk until `wandb sync`."""

from __future__ import annotations

from pathlib import Path

from train.build import require_extra
from train.trackers import FINISHED, STOPPED, Tracker


class WandbTracker(Tracker):
    """wandb.init with the saved id and resume="allow": a resumed run continues the same W&B run."""

    def __init__(self, run_dir: Path, project: str = "loadout", entity: str | None = None, mode: str | None = None,
                 name: str | None = None):
        self.wandb = require_extra("wandb", "wandb", "logger=wandb")
        self.run_dir, self.project, self.entity, self.mode = Path(run_dir), project, entity, mode
        self.name = name or str(self.run_dir)
        self.run = None

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> str:
        self.run = self.wandb.init(project=self.project, entity=self.entity, mode=self.mode, name=self.name,
                                   dir=str(self.run_dir), id=run_id, resume="allow", config=params,
                                   reinit="create_new")
        return self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, status: str) -> None:
        if status == STOPPED:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status in (FINISHED, STOPPED) else 1)
