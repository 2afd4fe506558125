"""What watches and tunes the loop from outside, through one interface: a hook is any object defining some of

- `on_epoch_start(trainer)`
- `on_train_batch(trainer, batch)` (before the step)
- `on_step(trainer, meter, updated)` (after each batch's step; `updated`: the optimizer stepped)
- `on_epoch_record(trainer, record)` (the epoch's record, before its checkpoint: what it keeps can still change)
- `on_save(trainer)` (every rank, before a checkpoint is written)
- `on_epoch_end(trainer, record)` (after the epoch's checkpoint)
- `on_fit_end(trainer)`

The built-ins below are added only when their feature is on, so a default run calls none of them per batch; the
`callbacks:` config group's `_target_`s are hooks too, called after the built-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

HOOKS = ("on_epoch_start", "on_train_batch", "on_step", "on_epoch_record", "on_save", "on_epoch_end", "on_fit_end")


class Hooks:
    """Each hook name's bound methods, looked up once: a call per batch costs a loop over what is there."""

    def __init__(self, hooks: Sequence[object]):
        self.methods: dict[str, list[Callable]] = {
            name: [getattr(hook, name) for hook in hooks if callable(getattr(hook, name, None))] for name in HOOKS}

    def __call__(self, name: str, trainer, *args) -> None:
        for method in self.methods[name]:
            method(trainer, *args)


class Tracking:
    """Trackers and Prometheus (loadout/observe/monitoring.py): a window of step figures every few seconds, the
    epoch's record."""

    def __init__(self, monitor):
        self.monitor = monitor

    def on_step(self, trainer, meter, updated: bool) -> None:
        self.monitor.on_step(trainer.progress.step, meter)

    def on_epoch_record(self, trainer, record: dict) -> None:
        self.monitor.on_epoch(trainer.progress.step, record)


class ProgressLines:
    """trainer.progress in a log (no terminal): a line every trainer.progress_every_s."""

    def __init__(self, console):
        self.console = console

    def on_step(self, trainer, meter, updated: bool) -> None:
        if updated:
            tc = trainer.tc
            self.console.stepped(f"epoch {trainer.progress.epoch + 1}/{tc.epochs}", meter, trainer.progress.step,
                                 trainer.plan.last_step(tc.max_steps))


class Profiling:
    """trainer.profiler: torch.profiler over a window of the optimizer steps (loadout/observe/profiling.py), started
    with the first epoch."""

    def __init__(self, make_profiler: Callable[[], object]):
        self.make_profiler, self.profiler = make_profiler, None

    def on_epoch_start(self, trainer) -> None:
        if self.profiler is None:
            self.profiler = self.make_profiler()

    def on_step(self, trainer, meter, updated: bool) -> None:
        if updated:
            self.profiler.step()

    def on_fit_end(self, trainer) -> None:
        if self.profiler is not None:
            self.profiler.stop()


class Autotuning:
    """data.autotune (loadout/data/loader/autotune.py): the loader's plan moved toward the doctor's measured best,
    once within a long first epoch and after each complete epoch that has another after it."""

    def __init__(self, autotune):
        self.autotune = autotune

    def on_epoch_start(self, trainer) -> None:
        self.autotune.epoch_started()

    def on_step(self, trainer, meter, updated: bool) -> None:
        self.autotune.during_epoch(trainer.progress.batch_in_epoch, trainer.batches.per_epoch, meter, trainer.doctor)

    def on_epoch_record(self, trainer, record: dict) -> None:
        if record["epoch_complete"] and trainer.progress.epoch < trainer.tc.epochs and not trainer.done():
            self.autotune.after_epoch(trainer.doctor.finding)  # before the checkpoint, which keeps the choice
