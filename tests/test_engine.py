"""The epoch loop's figures: the learning rate logged is the one the optimizer step used; an epoch stopped and
resumed mid-way logs the training figures of an uninterrupted one."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from loadout.build import instantiate
from loadout.dist import DistEnv, seed_everything
from loadout.runtime.stop import Stopped, StopSignal
from tests.conftest import compose_config, read_metrics, trainer_for
from train.job import data_from_config
from train.loop.engine import Trainer

CPU = torch.device("cpu")


def used_lrs(cfg, total_steps: int) -> list[float]:
    """The lr of each optimizer step of a run planned over `total_steps`, read before the scheduler moves on."""
    optimizer = instantiate("optimizer", cfg.optimizer)([torch.zeros(1, requires_grad=True)])
    scheduler = instantiate("scheduler", cfg.scheduler)(optimizer, total_steps=total_steps, last_epoch=-1)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_the_logged_lr_is_the_one_the_last_step_of_the_epoch_used(tiny_dataset, tmp_path):
    """OneCycle's value after the run's last step lies past its cosine's end and rises again: the figure must be
    the lr the last step trained with, not the scheduler's next."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=48",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=2",
                          "trainer.progress=false", "scheduler=onecycle", "model._target_=tests.tiny_net.TinyNet",
                          "logger=[]"])
    data = data_from_config(cfg, DistEnv(), CPU)
    trainer = trainer_for(cfg, data, tmp_path)
    trainer.fit()
    per_epoch, total = trainer.plan.total_steps // 2, trainer.plan.total_steps
    lrs = used_lrs(cfg, total)
    logged = [record["lr"] for record in read_metrics(tmp_path)]
    assert logged == [lrs[per_epoch - 1], lrs[total - 1]]
    assert logged[-1] != trainer.step.scheduler.get_last_lr()[0]  # the scheduler has moved on (and up)


class SigtermAt:
    """A callback the test installs: a real SIGTERM to this process as the loop starts batch `batch` of `epoch`
    (both 1-based)."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.at = (epoch - 1, batch)

    def on_train_batch(self, trainer, batch) -> None:
        if (trainer.progress.epoch, trainer.progress.batch_in_epoch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


TRAIN_IMAGES = 240  # tiny_dataset: 10 classes x 24, 15 batches of 16
BAD = ("circle/00002.jpg", "square/00003.jpg", "triangle/00005.jpg", "ring/00007.jpg", "cross/00011.jpg")
ADDITIVE = ("train_loss", "grad_norm", "lr", "images", "bad_samples", "decode_fallbacks", "skipped_steps")


def two_epochs(root: Path, run_dir: Path, resume: Path | None = None, callbacks=(), stop=None) -> Trainer:
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=2", "data.persistent_workers=false", "trainer.epochs=2",
                          "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet", "logger=[]"])
    seed_everything(cfg.trainer.seed, DistEnv())  # the same initial weights in every run
    data = data_from_config(cfg, DistEnv(), CPU)
    trainer = trainer_for(cfg, data, run_dir, stop=stop, callbacks=callbacks)
    if resume is not None:
        trainer.resume(resume)
    return trainer


def test_an_epoch_stopped_and_resumed_midway_logs_the_training_figures_of_an_uninterrupted_one(tiny_dataset,
                                                                                             tmp_path):
    """Sums and means of per-batch figures cover the whole epoch, to the last bit: the checkpoint keeps the
    epoch's counts, and the resumed meter adds on to its loss sum in the uninterrupted order. Unreadable files on
    both sides of the stop count in the same record."""
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    for name in BAD:
        (root / "train" / name).write_bytes(b"not a jpeg at all")
    two_epochs(root, tmp_path / "reference").fit()

    run_dir = tmp_path / "run"
    with StopSignal() as stop, pytest.raises(Stopped) as stopped:
        two_epochs(root, run_dir, callbacks=[SigtermAt(epoch=2, batch=7)], stop=stop).fit()
    assert (stopped.value.epoch, stopped.value.batch) == (1, 7)
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1]
    two_epochs(root, run_dir, resume=run_dir / "checkpoints" / "last.pt").fit()

    got, want = read_metrics(run_dir), read_metrics(tmp_path / "reference")
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == [1, 2]
    for mine, theirs in zip(got, want, strict=True):
        assert {key: mine[key] for key in ADDITIVE} == {key: theirs[key] for key in ADDITIVE}, mine["epoch"]
        assert mine["images"] + mine["bad_samples"] == TRAIN_IMAGES and mine["bad_samples"] == len(BAD)
