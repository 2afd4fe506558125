"""Experiment trackers, the `logger` config group: `logger=[tensorboard,mlflow]` (tensorboard, csv, mlflow, wandb, or
a `_target_` of your own that subclasses `Tracker`).

Rank 0 alone logs. Each tracker gets the composed config once (flattened to dotted keys), every window of step
figures and every epoch record (loadout/observe/monitoring.py calls them), on a thread of their own (delivery.py): a
slow or dead tracking server costs figures in that tracker, never a training step or the run. The trackers' run ids are
a part of every checkpoint, so a resumed run (trainer.resume=auto, a torchrun restart, a Slurm requeue) continues the
*same* tracker run. A tracker whose library is not installed, or that lacks what it needs to start (wandb without
a key or an offline mode), fails at start in one line naming the fix; one that still cannot open its run at the
first log is warned about in one line and left out, and the run goes on. No tracker writes into the working directory
on its own: their files default to the run dir.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from loadout.credentials import without_credentials
from loadout.errors import ConfigError, first_line
from loadout.observe.metrics import EPOCH
from loadout.observe.trackers.delivery import Delivery

log = logging.getLogger(__name__)
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"  # how a run ended (stopped: by a signal, resumable)


def finite_numbers(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of `values` (no None, NaN, flag or text): what a scalar tracker can plot."""
    return {key: float(value) for key, value in values.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)}


class Tracker:
    """One tracker. `start` opens (or, given the saved `run_id`, reopens) its run and returns the id to save;
    `step` is the optimizer step the run starts or resumes at. A scalar tracker implements `log`; the windows and
    the epoch records (`epoch/<key>`) reach it as finite numbers."""

    def start(self, run_id: str | None, params: dict[str, str], step: int) -> str | None:
        return None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Finite numbers by key, at the optimizer step `step`."""

    def log_window(self, step: int, scalars: dict[str, float | None]) -> None:
        """A window of step figures: `train/<key>` and `memory/<key>` (loadout/observe/metrics.py's WINDOW and
        MEMORY)."""
        self.log(step, finite_numbers(scalars))

    def log_epoch(self, step: int, record: dict[str, Any]) -> None:
        """One epoch's record, as in metrics.jsonl (loadout/observe/metrics.py's EPOCH)."""
        self.log(step, finite_numbers({f"epoch/{key}": record[key] for key in EPOCH if key in record}))

    def finish(self, status: str) -> None:
        """The run ended: FINISHED, STOPPED (by a signal; a resume continues it) or FAILED."""


def flat_params(cfg: Any) -> dict[str, str]:
    """A composed config as `section.key` -> value text: every tracker's run parameters (a URL's credentials
    masked)."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = without_credentials(str(node))

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


class Trackers:
    """Rank 0's trackers, started on the first log (after a resume has restored their run ids), and their run ids
    as a Stateful checkpoint part."""

    def __init__(self, trackers: dict[str, Tracker] | None = None, params: dict[str, str] | None = None):
        self.trackers, self.params = trackers or {}, params or {}
        self.run_ids: dict[str, str] = {}
        self._delivery: Delivery | None = None  # started with the trackers' runs

    @classmethod
    def from_config(cls, cfg: Any, run_dir: Path, is_main: bool) -> Trackers:
        """The `logger:` section's trackers on rank 0 (none elsewhere), each built with `run_dir`."""
        from loadout.build import instantiate

        if not is_main or not cfg.get("logger"):
            return cls()
        trackers = {name: instantiate(f"logger.{name}", spec, run_dir=run_dir) for name, spec in cfg.logger.items()}
        for name, tracker in trackers.items():
            if not isinstance(tracker, Tracker):
                raise ConfigError(f"logger.{name}._target_: built a {type(tracker).__name__}, not a "
                                  "loadout.observe.trackers.Tracker")
        return cls(trackers, flat_params(cfg))

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def state_dict(self) -> dict:
        return dict(self.run_ids)

    def load_state_dict(self, state: dict) -> None:
        self.run_ids = dict(state)  # a resume loads them before the first log starts the trackers

    def _start(self, step: int) -> Delivery:
        """The trackers' runs opened (here, so their ids are known to the next checkpoint), and their thread."""
        if self._delivery is None:
            for name, tracker in list(self.trackers.items()):
                try:
                    run_id = tracker.start(self.run_ids.get(name), self.params, step)
                except Exception as err:  # a tracker only observes: it never ends the run it watches
                    log.warning("logger.%s could not start its run (%s: %s): the run goes on without it; "
                                "metrics.jsonl has every figure", name, type(err).__name__, first_line(err))
                    del self.trackers[name]
                    continue
                if run_id is not None:
                    self.run_ids[name] = run_id
            self._delivery = Delivery()
        return self._delivery

    def log_window(self, step: int, scalars: dict[str, float]) -> None:
        delivery = self._start(step)
        for name, tracker in self.trackers.items():
            delivery.call(name, tracker.log_window, step, dict(scalars))

    def log_epoch(self, step: int, record: dict[str, Any]) -> None:
        delivery = self._start(step)
        for name, tracker in self.trackers.items():
            delivery.call(name, tracker.log_epoch, step, dict(record))

    def finish(self, status: str) -> None:
        """Each tracker's run closed after its queued figures; a tracker that cannot is warned about and the run
        ends as it would have."""
        if self._delivery is None:
            return
        for name, tracker in self.trackers.items():
            self._delivery.call(name, tracker.finish, status)
        self._delivery.close()
