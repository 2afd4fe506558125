"""Where a run is and what it was planned as: two Stateful parts of every checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from loadout.errors import ConfigError


class Record:
    """A dataclass as a Stateful checkpoint part."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class Progress(Record):
    """Where the run is: restored from a checkpoint, saved into the next one."""

    epoch: int = 0  # the epoch in progress (0-based)
    step: int = 0  # optimizer steps taken in total
    batch_in_epoch: int = 0  # batches of `epoch` already trained
    best: float | None = None  # the task's best figure (train/task/) of the epochs so far: best.pt's epoch

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        progress = cls()
        progress.load_state_dict(state)
        return progress


@dataclass
class RunLength(Record):
    """What the run was planned as: a resumed run is checked against it."""

    epochs: int = 0
    steps_per_epoch: int = 0
    world_size: int = 1
    step_shift: int = 0  # steps beyond epochs x steps_per_epoch: epochs begun at another step count an epoch

    @classmethod
    def for_run(cls, epochs: int, batches_per_epoch: int, grad_accum_steps: int, world_size: int) -> RunLength:
        return cls(epochs, max(batches_per_epoch // grad_accum_steps, 1), world_size)

    @property
    def total_steps(self) -> int:
        """The schedule's length: trainer.max_steps only cuts a run short (smoke runs), so a run stopped by it
        and resumed later follows the same schedule."""
        return self.epochs * self.steps_per_epoch + self.step_shift

    def follow(self, saved: RunLength, progress: Progress, batches_per_epoch: int, grad_accum_steps: int) -> None:
        """Plan the schedule's length on from a checkpoint planned as `saved` and resumed at `progress`: the same
        shift with the same steps an epoch; else (another process count or batch size) the steps taken, the rest of
        the epoch in progress at this run's step count (`batches_per_epoch` numbers it), then whole epochs."""
        if saved.steps_per_epoch == self.steps_per_epoch:
            self.step_shift = saved.step_shift
            return
        rest = max(batches_per_epoch - progress.batch_in_epoch, 0) // grad_accum_steps if progress.batch_in_epoch \
            else 0
        begun = progress.epoch + (progress.batch_in_epoch > 0)
        self.step_shift = progress.step + rest - begun * self.steps_per_epoch

    def last_step(self, max_steps: int | None) -> int:
        """The optimizer step the run ends at: the schedule's end, or trainer.max_steps when that comes first."""
        return min(self.total_steps, max_steps or self.total_steps)

    def batches_left(self, progress: Progress, batches_per_epoch: int, grad_accum_steps: int,
                     max_steps: int | None) -> int:
        """Batches this epoch will train from `progress`: the rest of the epoch, or fewer where max_steps ends the
        run first (what a progress bar and its ETA count)."""
        rest = batches_per_epoch - progress.batch_in_epoch
        steps_left = self.last_step(max_steps) - progress.step
        return max(0, min(rest, steps_left * grad_accum_steps - progress.batch_in_epoch % grad_accum_steps))

    def check_continues(self, saved: RunLength, progress: Progress, path: Path) -> None:
        """This run can continue a checkpoint planned as `saved` and stopped at `progress`; else one line."""
        reached = progress.epoch + (progress.batch_in_epoch > 0)  # epochs begun
        if reached > self.epochs:
            raise ConfigError(f"trainer.epochs={self.epochs}: {path} has begun epoch {reached} already; use "
                              f"trainer.epochs >= {reached} to continue it, or trainer.resume=null to start over")
        if progress.batch_in_epoch and saved.steps_per_epoch != self.steps_per_epoch and \
                saved.world_size == self.world_size:
            raise ConfigError(f"trainer.resume: {path} stopped mid-epoch with {saved.steps_per_epoch} steps an epoch, "
                              f"this run has {self.steps_per_epoch}: resume with its data.batch_size and "
                              "trainer.grad_accum_steps (another process count is fine)")
