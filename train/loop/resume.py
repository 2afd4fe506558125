"""A Trainer restored from a checkpoint: its parts loaded by name, the loader's position, the LR schedule re-planned
when the epochs or steps an epoch changed; what cannot be honoured (another batch size mid-epoch, another model)
fails in one line before any worker starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from train.loop import checkpoint
from train.loop.progress import Plan, Progress

if TYPE_CHECKING:
    from train.loop.engine import Trainer

log = logging.getLogger("train.loop.engine")


def restore(trainer: Trainer, path: Path) -> None:
    """`trainer` continued from the checkpoint at `path`."""
    state = checkpoint.load(path)  # on the CPU: load_state_dict moves what belongs on the device
    progress, saved, tc = Progress.from_state(state["progress"]), Plan(**state["plan"]), trainer.tc
    trainer.plan.check_continues(saved, progress, path)
    parts = trainer.parts()
    del parts["plan"], parts["scaler"]  # this run's plan stands (checked above); the scaler loads from any device
    checkpoint.load_model(parts.pop("model"), state, path, trainer.model_name)
    trainer.step.load_scaler(state.get("scaler", {}))
    # checkpoints written before trainer.micro_batch_size, the logger group, data.autotune, the epoch's counts, the
    # precision record lack them
    for name in ("micro_batch", "trackers", "autotune", "meter", "precision"):
        if name not in state:
            parts.pop(name, None)
    if progress.batch_in_epoch >= trainer.batches.per_epoch or tc.overfit_batches:  # no position to go on from
        del parts["loader"]
    for name, part in parts.items():
        part.load_state_dict(state[name])
    if trainer.positions.batch_in_epoch is not None:  # another process count: the rest numbered as the last batches
        trainer.progress.batch_in_epoch = trainer.positions.batch_in_epoch
    trainer.plan.follow(saved, trainer.progress, trainer.batches.per_epoch, tc.grad_accum_steps)
    if {saved.total_steps, trainer.step.total_steps} != {trainer.plan.total_steps}:  # epochs or steps an epoch changed
        trainer.step.total_steps = max(trainer.plan.total_steps, 1)
        trainer.step.scheduler = trainer.step.plan_schedule(progress.step)
        log.info("trainer.epochs=%d: the LR schedule is re-planned over %d steps (was %d), continuing at step %d "
                 "with lr %.4g", tc.epochs, trainer.step.total_steps, saved.total_steps, progress.step,
                 trainer.step.scheduler.get_last_lr()[0])
    trainer.data.set_epoch(progress.epoch)
    log.info("resumed from %s at epoch %d, batch %d, step %d", path, progress.epoch + 1,
             progress.batch_in_epoch, progress.step)
    if progress.epoch >= tc.epochs:
        log.info("the run in %s is complete (trainer.epochs=%d): raise trainer.epochs to train it further",
                 path, tc.epochs)
