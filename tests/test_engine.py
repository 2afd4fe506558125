"""The epoch loop's figures: the learning rate logged is the one the optimizer step used."""

from __future__ import annotations

import torch

from tests.conftest import compose_config, read_metrics
from train.build import instantiate
from train.data import data_from_config
from train.dist import DistEnv
from train.loop.engine import Trainer
from train.loop.model import build_model

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
    trainer = Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, data.num_classes, CPU), tmp_path)
    trainer.fit()
    per_epoch, total = trainer.plan.total_steps // 2, trainer.plan.total_steps
    lrs = used_lrs(cfg, total)
    logged = [record["lr"] for record in read_metrics(tmp_path)]
    assert logged == [lrs[per_epoch - 1], lrs[total - 1]]
    assert logged[-1] != trainer.step.scheduler.get_last_lr()[0]  # the scheduler has moved on (and up)
