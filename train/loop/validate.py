"""trainer.mode=validate: a checkpoint's weights evaluated on the val split, one metrics row. Another way to run than
the epoch loop (engine.py), with its own reasons to change: what it loads, what its row and line say."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from train.loop import checkpoint
from train.observe.meter import append_jsonl

if TYPE_CHECKING:
    from train.loop.engine import Trainer

log = logging.getLogger("train.loop.engine")  # the run's lines keep one logger name


def validate_checkpoint(trainer: Trainer, path: Path) -> dict:
    """The checkpoint at `path` loaded into `trainer`'s model and evaluated by it; rank 0 writes the row."""
    state = checkpoint.load(path)
    checkpoint.load_model(trainer.step.model, state, path, trainer.model_name)
    if "precision" in state:  # auto on a bf16 CPU evaluates in the precision the run measured and trained in
        trainer.step.auto.load_state_dict(state["precision"])
    # the row names the precision it evaluated in: run.json's, written before the checkpoint was read, may differ
    record = {"mode": "validate", "checkpoint": str(path), "epoch": state["progress"]["epoch"],
              "precision": trainer.step.precision, **trainer.evaluate()}
    if trainer.env.is_main:
        append_jsonl(trainer.metrics_path, record)
        figure = trainer.step.task.best[0]
        log.info("validate %s: val_loss %.4f  %s %.3f on %d samples in %s", path, record["val_loss"], figure,
                 record[figure], record["val_samples"], record["precision"])
    return record
