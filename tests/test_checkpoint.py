"""Checkpoints: one dict of Stateful parts with a format version; what a resume cannot honour fails in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.observe.epoch_counts import EpochCounts
from loadout.runtime import checkpoint
from tests.conftest import compose_config, read_metrics, trainer_for
from train.job import data_from_config
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
    return trainer_for(cfg, data, tmp_path)


def test_a_checkpoint_holds_each_stateful_part_and_the_format(trainer):
    trainer.save()
    state = checkpoint.load(trainer.checkpoint_path)
    assert state["format"] == checkpoint.FORMAT
    assert set(state) == {"format", "model", "optimizer", "scheduler", "scaler", "micro_batch", "precision",
                          "progress", "plan", "loader", "meter", "trackers"}
    assert state["meter"] is None  # saved at an epoch's start: no counts to carry
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
    other = trainer_for(cfg, trainer.data, Path(tmp_path), model=build_model(cfg.model, 10, CPU))
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
    first = trainer_for(cfg, data, tmp_path, model=build_model(cfg.model, 10, CPU))
    first.fit()
    state = checkpoint.load(first.checkpoint_path)
    assert all(tensor.device == CPU for tensor in tensors(state))
    resumed = trainer_for(cfg, data, tmp_path, model=build_model(cfg.model, 10, CPU))
    resumed.resume(first.checkpoint_path)
    adam = resumed.step.optimizer.state.values()
    assert adam and all(s["step"].device == CPU and s["step"].item() == 2 for s in adam)
    on_meta = torch.optim.AdamW(build_model(cfg.model, 10, torch.device("meta")).parameters())
    on_meta.load_state_dict(state["optimizer"])
    assert all(s["step"].device == CPU and s["exp_avg"].is_meta and s["exp_avg_sq"].is_meta
               for s in on_meta.state.values())


def cut_short(tiny_dataset, run_dir: Path, max_steps: int | None) -> Trainer:
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=1",
                          f"trainer.max_steps={max_steps or 'null'}", "trainer.progress=false",
                          "model._target_=tests.tiny_net.TinyNet", "logger=[]"])
    data = data_from_config(cfg, DistEnv(), CPU)
    return trainer_for(cfg, data, run_dir, model=build_model(cfg.model, 10, CPU))


def test_a_mid_epoch_checkpoint_keeps_the_epochs_counts_and_one_without_them_resumes_from_zero(tiny_dataset,
                                                                                              tmp_path):
    """trainer.max_steps cuts epoch 1 after 3 batches; resumed, its record counts all 15 (240 images). A checkpoint
    written before the counts were kept still resumes: the record then counts the batches after the resume."""
    first = cut_short(tiny_dataset, tmp_path / "first", max_steps=3)
    first.fit()
    state = checkpoint.load(first.checkpoint_path)
    assert [(rank["steps"], rank["images"]) for rank in state["meter"]] == [(3, 48)]
    resumed = cut_short(tiny_dataset, tmp_path / "first", max_steps=None)
    resumed.resume(first.checkpoint_path)
    resumed.fit()
    assert [(r["images"], r["epoch_complete"]) for r in read_metrics(tmp_path / "first")] == [(48, False), (240, True)]

    del state["meter"]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    from_old = cut_short(tiny_dataset, tmp_path / "old", max_steps=None)
    from_old.resume(old)
    from_old.fit()
    assert [r["images"] for r in read_metrics(tmp_path / "old")] == [240 - 48]


def test_at_another_process_count_rank_0_carries_the_sums_and_every_rank_the_figures_ranks_share():
    """Saved by two ranks, resumed by three: the counts that differ by rank are summed once (on rank 0), so the
    epoch's summary over ranks adds up; steps, optimizer steps and gradient norms are every rank's alike."""
    saved = [{"images": 32, "steps": 2, "updates": 2, "bad_samples": 1, "decode_fallbacks": 0, "skipped_steps": 0,
              "loss_sum": 70.5, "grad_norm_sum": 3.25, "lr": 0.1, "source_samples": [20, 12]},
             {"images": 31, "steps": 2, "updates": 2, "bad_samples": 0, "decode_fallbacks": 1, "skipped_steps": 0,
              "loss_sum": 69.0, "grad_norm_sum": 3.25, "lr": 0.1, "source_samples": [15, 16]}]
    shares = [EpochCounts(DistEnv(rank=rank, world_size=3), CPU).share(saved) for rank in range(3)]
    assert shares[0] == {**saved[0], "images": 63, "bad_samples": 1, "decode_fallbacks": 1, "loss_sum": 139.5,
                         "source_samples": [35, 28]}
    for share in shares[1:]:
        assert (share["images"], share["loss_sum"], share["bad_samples"], share["source_samples"]) == (0, 0, 0, [])
        assert (share["steps"], share["updates"], share["grad_norm_sum"], share["lr"]) == (2, 2, 3.25, 0.1)
    same = [EpochCounts(DistEnv(rank=rank, world_size=2), CPU).share(saved) for rank in range(2)]
    assert same == saved  # at the checkpoint's process count each rank goes on from its own
