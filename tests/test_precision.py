"""trainer.precision: auto decided from the device (bf16 where native, fp16 + GradScaler before Ampere, fp32 on a CPU
without native bf16), the old keys refused, the LR schedule held on a step fp16 skips, and bf16 learning as fp32."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from tests.conftest import compose_config, read_metrics, run_cli
from train.config import validate
from train.dist import DistEnv
from train.errors import ConfigError
from train.loop.model import build_model
from train.loop.precision import cpu_flags, resolve
from train.loop.step import TrainStep

CPU = torch.device("cpu")


def test_auto_takes_bf16_where_the_device_runs_it_natively_and_says_so(caplog):
    caplog.set_level(logging.INFO)
    assert resolve("auto", CPU, flags={"avx512f", "avx512_bf16"}) == "bf16"
    assert "avx512_bf16" in caplog.text
    assert resolve("auto", CPU, flags={"amx_bf16", "amx_tile"}) == "bf16"
    assert resolve("auto", CPU, flags={"avx2", "avx512f"}) == "fp32"
    cuda = torch.device("cuda", 0)
    assert resolve("auto", cuda, cuda_bf16=True) == "bf16"  # Ampere and later: no GradScaler
    assert resolve("auto", cuda, cuda_bf16=False) == "fp16"  # Volta, Turing
    assert resolve("fp32", cuda, cuda_bf16=True) == "fp32" and resolve("bf16", CPU, flags=set()) == "bf16"


def test_this_machine_has_flags_to_decide_from():
    assert "fpu" in cpu_flags() or not cpu_flags()  # Linux lists them; elsewhere auto means fp32


@pytest.mark.parametrize("profile", ["cpu", "auto", "rtx3060", "rtx4080", "a100"])
def test_every_profile_takes_precision_auto(profile):
    cfg = compose_config([f"hardware={profile}"])
    assert cfg.trainer.channels_last is True and cfg.trainer.precision == "auto"


def test_fp16_on_a_cpu_and_unknown_precisions_fail_in_one_line():
    with pytest.raises(ConfigError, match=r"trainer.precision='fp16': fp16 .* is for CUDA"):
        validate(compose_config(["hardware=cpu", "trainer.precision=fp16"]))


def test_a_step_fp16_skips_leaves_the_learning_rate_where_it_was(tiny_dataset):
    """An enabled GradScaler (the CPU's, standing in for CUDA's: the same class and rule) and a gradient hook that
    makes the first step's gradients inf: the optimizer and the schedule both hold, with no warning."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=4",
                          "trainer.precision=fp32", "scheduler=cosine", "model._target_=tests.tiny_net.TinyNet"])
    model = build_model(cfg.model, 10, CPU)
    step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=10)
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step._scale = step.scaler.get_scale()
    from train.data.loader.batch import Batch

    batch = Batch(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    first = next(model.parameters())
    poisoned = first.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before, lr = first.detach().clone(), step.scheduler.get_last_lr()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail here
        _, updated = step(batch)
    assert updated and torch.equal(first.detach(), before), "a step with inf gradients must be skipped"
    assert step.scheduler.get_last_lr()[0] == lr and step.scheduler.last_epoch == 0
    assert step.scaler.get_scale() == 2.0**15
    poisoned.remove()
    step(batch)
    assert not torch.equal(first.detach(), before) and step.scheduler.last_epoch == 1


@pytest.mark.slow
def test_bf16_channels_last_learns_as_well_as_fp32(learn_dataset, tmp_path):
    """3 epochs on the learning set: the cpu profile with bf16 forced on (whatever this CPU) against fp32
    channels_first, the same data and seed."""
    accuracy = {}
    for name, extra in (("bf16", ["trainer.precision=bf16"]),
                        ("fp32", ["trainer.precision=fp32", "trainer.channels_last=false"])):
        run_dir = tmp_path / name
        result = run_cli(["hardware=cpu", f"data.root={learn_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=2", "trainer.epochs=3", "trainer.progress=false",
                          f"hydra.run.dir={run_dir}", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy[name] = read_metrics(run_dir)[-1]["val_acc"]
    assert accuracy["fp32"] > 0.3 and accuracy["bf16"] > 0.3, accuracy  # 10 classes: chance is 0.1
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.1, accuracy
