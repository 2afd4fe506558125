"""trainer.precision: auto decided from the device (bf16 where native, fp16 + GradScaler before Ampere, fp32 on a CPU
without native bf16), a checkpoint's fp32 kept by a resume and by validate, make tune's measurement of bf16 against
fp32 on a copy of the model (out of memory there is no error), the LR schedule held on a step fp16 skips, and bf16
learning as fp32."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from torch import nn

from loadout.data.loader.batch import Batch
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.runtime.precision import RunPrecision, cpu_flags, native_bf16, resolve
from loadout.tune.cpu_precision import choose, measure, measured
from loadout.tune.job_record import PRECISION_FILE, settle_once
from tests.conftest import compose_config, read_metrics, run_cli, trainer_for
from train.config import validate
from train.job import data_from_config
from train.loop.config import Precision
from train.loop.engine import Trainer
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task

CPU = torch.device("cpu")
NATIVE = {"avx512f", "avx512_bf16"}  # a CPU with native bf16, whatever this one has


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
    step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=10, task=build_task(cfg))
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step._scale = step.scaler.get_scale()

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


class SegmentationLike(nn.Module):
    """BatchNorm (running statistics), dropout (the global random stream) and torchvision's {"out": ...} output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.5),
                                 nn.Conv2d(8, 4, 1))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.net(images)}


def counted(model: nn.Module) -> list:
    """Every forward of `model` and of its copies (the hook is shared by a deepcopy) appends to the list."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    return calls


def test_measuring_leaves_the_model_its_statistics_and_the_random_streams_as_they_were():
    torch.manual_seed(0)
    model = SegmentationLike().to(memory_format=torch.channels_last).eval()
    calls = counted(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    times = measure(model, (4, 3, 16, 16), channels_last=True)
    assert set(times) == {"bf16", "fp32"} and all(0 < t < 10 for t in times.values()), times
    assert len(calls) == 6  # a warm-up and two timed steps each way, on the copy
    after = model.state_dict()
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


def test_fp32_only_where_it_is_clearly_faster_on_a_step_long_enough_to_tell():
    assert choose(bf16=0.130, fp32=0.110) == "fp32"  # lraspp_mobilenet_v3_large at 64 px on an EPYC
    assert choose(bf16=0.070, fp32=0.100) == "bf16" and choose(bf16=0.105, fp32=0.100) == "bf16"  # within noise
    assert choose(bf16=0.0008, fp32=0.0006) == "bf16"  # a tiny net: dispatch, not arithmetic


class OutOfMemoryAbove(nn.Module):
    """Runs out of memory, as torch does, on a batch of more than `limit` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.conv = limit, nn.Conv2d(3, 4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.conv(images)


def test_running_out_of_memory_while_measuring_is_no_error_and_measures_nothing(caplog):
    caplog.set_level(logging.INFO)
    assert measured(OutOfMemoryAbove(8), (16, 3, 16, 16), channels_last=False) is None
    assert "not measured (out of memory on a batch of 16x3x16x16); bf16 stands" in caplog.text
    assert measured(OutOfMemoryAbove(16), (16, 3, 16, 16), channels_last=False) in ("bf16", "fp32")


def test_a_training_run_decides_auto_from_the_device_alone_and_runs_no_model(caplog):
    """No timing before the first step: it cost start-up and ran outside the step's out-of-memory handling."""
    caplog.set_level(logging.INFO)
    assert RunPrecision("auto", CPU, flags=NATIVE).value == "bf16"
    assert RunPrecision("auto", CPU, flags={"avx2", "avx512f"}).value == "fp32"
    assert "no avx512_bf16 or amx_bf16 on this CPU" in caplog.text
    assert RunPrecision("fp32", CPU, flags=NATIVE).value == "fp32"
    assert RunPrecision("bf16", CPU, flags=set()).value == "bf16"


def test_auto_keeps_a_checkpoints_fp32_where_bf16_is_native_and_nothing_else_changes_a_setting(caplog):
    caplog.set_level(logging.INFO)
    run = RunPrecision("auto", CPU, flags=NATIVE)
    run.load_state_dict({"precision": "fp32", "measured": True})  # a record from before this release reads too
    assert run.value == "fp32" and run.state_dict() == {"precision": "fp32"}
    assert "the checkpoint's run trained in fp32" in caplog.text
    plain = RunPrecision("auto", CPU, flags={"avx2"})  # emulated bf16 is slower than fp32: a bf16 record stays said
    plain.load_state_dict({"precision": "bf16"})
    assert plain.value == "fp32" and "precision: fp32 (the checkpoint was trained in bf16)" in caplog.text
    explicit = RunPrecision("bf16", CPU, flags=NATIVE)
    explicit.load_state_dict({"precision": "fp32"})
    assert explicit.value == "bf16"


def small_trainer(tiny_dataset, run_dir) -> Trainer:
    """TinyNet on the tiny set as `python -m train hardware=cpu` builds it, told its CPU has native bf16 (from
    outside, so the test means the same on any machine)."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=2",
                          "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet"])
    data = data_from_config(cfg, DistEnv(), CPU)
    trainer = trainer_for(cfg, data, run_dir,
                          model=build_model(cfg.model, data.num_classes, CPU, channels_last=True))
    trainer.step.auto = RunPrecision("auto", CPU, flags=NATIVE)
    return trainer


def test_validate_evaluates_in_the_precision_the_checkpoint_trained_in(tiny_dataset, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = small_trainer(tiny_dataset, tmp_path)
    trainer.step.auto.value = "fp32"
    trainer.save()
    (tmp_path / "validate").mkdir()
    validating = small_trainer(tiny_dataset, tmp_path / "validate")
    assert validating.step.precision == "bf16"
    record = validating.validate(trainer.checkpoint_path)
    assert validating.step.precision == record["precision"] == "fp32" and record["val_samples"] > 0
    assert read_metrics(tmp_path / "validate")[-1]["precision"] == "fp32"  # the row says what it evaluated in


needs_native_bf16 = pytest.mark.skipif(not native_bf16(), reason="make tune measures only where bf16 is native")


@needs_native_bf16
def test_a_tune_sweep_measures_once_per_model_and_every_job_trains_in_it(tiny_dataset, tmp_path):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "model._target_=tests.tiny_net.TinyNet"])

    def settled(outputs: int) -> tuple[str, list]:
        model = build_model(cfg.model, outputs, CPU, channels_last=True)
        forwards = counted(model)
        return settle_once(cfg, model, CPU, tmp_path, outputs), forwards

    (first, forwards), (second, none) = settled(10), settled(10)
    assert first == second in ("bf16", "fp32") and len(forwards) == 6 and none == []
    assert list(json.loads((tmp_path / PRECISION_FILE).read_text()).values()) == [first]
    _, forwards = settled(7)  # another head is another model: measured on its own
    assert len(forwards) == 6 and len(json.loads((tmp_path / PRECISION_FILE).read_text())) == 2
    assert [path.name for path in tmp_path.iterdir()] == [PRECISION_FILE]  # no temporary file left


@needs_native_bf16
@pytest.mark.parametrize("garbage", ['{"model": ', "[1, 2]", "\x00\xff"])
def test_a_tune_precision_file_that_does_not_read_is_measured_again_and_rewritten(tiny_dataset, tmp_path, garbage):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "model._target_=tests.tiny_net.TinyNet"])
    (tmp_path / PRECISION_FILE).write_bytes(garbage.encode("latin-1"))
    chosen = settle_once(cfg, build_model(cfg.model, 10, CPU, channels_last=True), CPU, tmp_path, 10)
    assert list(json.loads((tmp_path / PRECISION_FILE).read_text()).values()) == [chosen]


@pytest.mark.parametrize("setting", list(Precision))
def test_the_checkpoint_record_is_plain_text_a_weights_only_load_takes(setting, tmp_path):
    """The config's StrEnum never reaches a checkpoint: torch.load(weights_only=True) refuses its class."""
    if setting == Precision.fp16:
        return  # CUDA only
    record = RunPrecision(setting, torch.device("cpu")).state_dict()
    assert type(record["precision"]) is str
    torch.save({"precision": record}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["precision"] == record
