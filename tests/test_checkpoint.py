"""Checkpoints: one dict of Stateful parts with a format version; what a resume cannot honour fails in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from train.data import data_from_config
from train.dist import DistEnv
from train.errors import ConfigError
from train.loop import checkpoint
from train.loop.engine import Trainer
from train.loop.model import build_model

CPU = torch.device("cpu")


def small_config(tiny_dataset):
    return compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                           "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=2",
                           "trainer.progress=false", "model.name=resnet18"])


@pytest.fixture
def trainer(tiny_dataset, tmp_path):
    cfg = small_config(tiny_dataset)
    data = data_from_config(cfg, DistEnv(), CPU)
    return Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, data.num_classes, CPU), tmp_path)


def test_a_checkpoint_holds_each_stateful_part_and_the_format(trainer):
    trainer.save()
    state = checkpoint.load(trainer.checkpoint_path)
    assert state["format"] == checkpoint.FORMAT
    assert set(state) == {"format", "model", "optimizer", "scheduler", "scaler", "micro_batch", "progress", "plan",
                          "loader", "trackers"}
    assert state["plan"] == {"epochs": 2, "steps_per_epoch": 15, "world_size": 1, "step_shift": 0}
    trainer.resume(trainer.checkpoint_path)  # and reads back


@pytest.mark.parametrize(("content", "message"), [
    ({"model": {}, "progress": {}}, "has checkpoint format None, this loadout reads format"),
    (b"not a checkpoint", "not a readable checkpoint"),
])
def test_a_file_of_another_format_is_refused_in_one_line(trainer, tmp_path, content, message):
    path = tmp_path / "other.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=message) as err:
        trainer.resume(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_resume_with_fewer_epochs_than_begun_or_another_model_fails_in_one_line(trainer, tiny_dataset, tmp_path):
    trainer.progress.epoch = 2
    trainer.save()
    trainer.plan.epochs = 1  # as a run with trainer.epochs=1 plans itself
    with pytest.raises(ConfigError, match="has begun epoch 2 already"):
        trainer.resume(trainer.checkpoint_path)
    trainer.plan.epochs = 2
    cfg = small_config(tiny_dataset)
    cfg.model.name = "resnet34"
    other = Trainer.from_config(cfg, DistEnv(), CPU, trainer.data, build_model(cfg.model, 10, CPU), Path(tmp_path))
    with pytest.raises(ConfigError, match="holds another model"):
        other.resume(trainer.checkpoint_path)


def tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    return [tensor for value in values for tensor in tensors(value)]


def test_a_resumed_adamw_keeps_its_step_counters_on_the_cpu_and_its_moments_on_the_parameters_device(tiny_dataset,
                                                                                                      tmp_path):
    """pytorch/pytorch#128208: Adam's `step` read onto the GPU costs a host sync per parameter every step. The
    checkpoint is read onto the CPU whatever the run's device; Optimizer.load_state_dict then moves the moments to
    each parameter's device and leaves `step` where it is. The meta device stands in for a GPU here."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=1",
                          "trainer.max_steps=2", "trainer.progress=false", "optimizer=adamw",
                          "model._target_=tests.tiny_net.TinyNet", "logger=[]"])
    data = data_from_config(cfg, DistEnv(), CPU)
    first = Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, 10, CPU), tmp_path)
    first.fit()
    state = checkpoint.load(first.checkpoint_path)
    assert all(tensor.device == CPU for tensor in tensors(state))
    resumed = Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, 10, CPU), tmp_path)
    resumed.resume(first.checkpoint_path)
    adam = resumed.step.optimizer.state.values()
    assert adam and all(s["step"].device == CPU and s["step"].item() == 2 for s in adam)
    on_meta = torch.optim.AdamW(build_model(cfg.model, 10, torch.device("meta")).parameters())
    on_meta.load_state_dict(state["optimizer"])
    assert all(s["step"].device == CPU and s["exp_avg"].is_meta and s["exp_avg_sq"].is_meta
               for s in on_meta.state.values())
