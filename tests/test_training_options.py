"""Loop options and datasets beyond the default, each through the real CLI for a few steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loadout.data.datasets import Cifar10Dataset
from loadout.dist import DistEnv
from tests.conftest import compose_config, read_metrics, run_cli, trainer_for
from train.job import data_from_config


def test_cifar10_reads_python_batches(cifar_root):
    train, val = Cifar10Dataset(cifar_root.parent, "train"), Cifar10Dataset(cifar_root, "val")
    assert (len(train), len(val), len(train.classes)) == (100, 30, 10)
    image, label = train[0]
    assert tuple(image.shape) == (3, 32, 32) and 0 <= label < 10


@pytest.mark.slow
def test_cifar10_trains_from_its_folder(cifar_root, small_run_args, tmp_path):
    result = run_cli([*small_run_args, "dataset=cifar10", f"data.root={cifar_root}", "data.resize_size=32",
                      "data.num_workers=1", "trainer.epochs=1", "trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path / "run")[0]["val_samples"] == 30


@pytest.mark.slow
def test_cifar10_missing_batches_is_a_clear_error(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "dataset=cifar10", f"data.root={tmp_path}"])
    assert result.returncode == 2 and "missing CIFAR-10 batch files" in result.stderr


@pytest.mark.slow
def test_bf16_accumulation_channels_last_weighted_sampler(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "data.num_workers=1", "data.sampler=weighted", "trainer.precision=bf16",
                      "trainer.grad_accum_steps=2", "trainer.channels_last=true", "trainer.epochs=1",
                      "trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr
    record = read_metrics(tmp_path / "run")[0]
    assert record["images"] == 3 * 2 * 16  # 3 optimizer steps x 2 micro-batches x batch 16
    assert np.isfinite(record["train_loss"])


def test_micro_batches_short_of_an_accumulation_never_reach_the_next_epoch(tiny_dataset, tmp_path):
    """240 images / batch 16 = 15 micro-batches an epoch, 2 per optimizer step: 7 steps, and the 15th micro-batch's
    gradient is dropped at the epoch's end (as a resumed run, which never saw it, would have it)."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.grad_accum_steps=2",
                          "trainer.epochs=2", "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet"])
    cpu = torch.device("cpu")
    data = data_from_config(cfg, DistEnv(), cpu)
    trainer = trainer_for(cfg, data, tmp_path)
    record = trainer.train_epoch()
    assert record["images"] == 15 * 16 and trainer.progress.step == 7
    assert all(p.grad is None for p in trainer.step.model.parameters())
