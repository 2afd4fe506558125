"""logger=wandb: a Weights & Biases run (`pip install 'loadout[wandb]'`), its files under `<run dir>/wandb`;
`mode=offline` keeps it on disk until `wandb sync`.

Online (W&B's default) needs an API key. Without one, wandb.init asks for it on a terminal (inside the progress bar)
and raises elsewhere, both at the first log, mid-epoch. Here the key is looked for when the run starts, with W&B's
own lookup and no prompt (WANDB_API_KEY, `wandb login`'s netrc, its settings files); none is one line saying what to
set."""

from __future__ import annotations

from pathlib import Path

from loadout.build import require_extra
from loadout.errors import ConfigError
from loadout.observe.trackers import FINISHED, STOPPED, Tracker

KEYLESS_MODES = ("offline", "disabled", "dryrun")  # modes that never reach a server


class WandbTracker(Tracker):
    """wandb.init with the saved id and resume="allow": a resumed run continues the same W&B run."""

    def __init__(self, run_dir: Path, project: str = "loadout", entity: str | None = None, mode: str | None = None,
                 name: str | None = None):
        self.wandb = require_extra("wandb", "wandb", "logger=wandb")
        self.run_dir, self.project, self.entity, self.mode = Path(run_dir), project, entity, mode
        self.name = name or str(self.run_dir)
        self.run = None
        if mode not in KEYLESS_MODES and not self.wandb.login(prompt=False, verify=False):
            raise ConfigError("logger=[wandb]: no W&B API key (none in WANDB_API_KEY, ~/.netrc or W&B's settings): "
                              "set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to keep the run in "
                              "<run dir>/wandb for `wandb sync` later")

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> str:
        # quiet: W&B's 30-line summary at the end repeats metrics.jsonl; where the run is stays said at its start
        self.run = self.wandb.init(project=self.project, entity=self.entity, mode=self.mode, name=self.name,
                                   dir=str(self.run_dir), id=run_id, resume="allow", config=params,
                                   reinit="create_new", settings=self.wandb.Settings(quiet=True))
        return self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, status: str) -> None:
        if status == STOPPED:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status in (FINISHED, STOPPED) else 1)
