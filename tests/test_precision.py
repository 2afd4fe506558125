"""trainer.precision: auto decided from the device (bf16 where native, fp16 + GradScaler before Ampere, fp32 on a CPU
without native bf16; on a CPU with native bf16, bf16 measured against fp32 on a copy of the model, the choice kept by
a resume), the old keys refused, the LR schedule held on a step fp16 skips, and bf16 learning as fp32."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from torch import nn

from tests.conftest import compose_config, read_metrics, run_cli
from train.config import validate
from train.data import data_from_config
from train.data.loader.batch import Batch
from train.dist import DistEnv
from train.errors import ConfigError
from train.loop import checkpoint
from train.loop.config import Precision
from train.loop.cpu_precision import MEASURE_MIN_STEPS, RunPrecision, choose, measure
from train.loop.engine import Trainer
from train.loop.model import build_model
from train.loop.precision import cpu_flags, resolve
from train.loop.step import TrainStep
from train.tune.measure import PRECISION_FILE, settle_once

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


def test_whether_a_run_measures_depends_on_its_config_alone(caplog):
    """Every rank of a run must agree on entering the measurement's all-reduce, whatever its own CPU's flags."""
    caplog.set_level(logging.INFO)
    steps = MEASURE_MIN_STEPS + 1
    waiting = RunPrecision("auto", CPU, steps=steps, flags=NATIVE)
    assert waiting.pending and waiting.value == "bf16"
    plain = RunPrecision("auto", CPU, steps=steps, flags={"avx2", "avx512f"})
    assert plain.pending and plain.value == "fp32"  # joins the vote, without measuring (below)
    for chosen, run in (("bf16", RunPrecision("auto", CPU, steps=MEASURE_MIN_STEPS, flags=NATIVE)),  # debug=default
                        ("bf16", RunPrecision("auto", CPU, steps=steps, flags=NATIVE, training=False)),  # validate
                        ("fp32", RunPrecision("auto", CPU, steps=steps, flags=set(), deterministic=True)),
                        ("fp32", RunPrecision("fp32", CPU, steps=steps, flags=NATIVE)),
                        ("bf16", RunPrecision("bf16", CPU, steps=steps, flags=set()))):
        assert not run.pending and run.value == chosen
    caplog.clear()
    repeatable = RunPrecision("auto", CPU, steps=steps, flags=NATIVE, deterministic=True)
    assert not repeatable.pending and repeatable.value == "bf16"
    assert caplog.text.count("precision: bf16") == 1 and "trainer.deterministic=true" in caplog.text


def test_auto_on_a_cpu_without_native_bf16_is_fp32_without_measuring(caplog):
    caplog.set_level(logging.INFO)
    model = SegmentationLike()
    calls = counted(model)
    run = RunPrecision("auto", CPU, steps=10**6, flags={"avx2", "avx512f"})
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "fp32" and calls == []
    assert "no avx512_bf16 or amx_bf16 on this CPU" in caplog.text and "measured" not in caplog.text
    assert run.state_dict() == {"precision": "fp32", "measured": False}  # not a timing: a resume votes again


def test_a_measured_bf16_record_on_a_cpu_without_native_bf16_gives_fp32(caplog):
    """Emulated bf16 is slower than fp32: a checkpoint's bf16 does not carry onto such a CPU, voting or not."""
    caplog.set_level(logging.INFO)
    model = SegmentationLike()
    calls = counted(model)
    bf16_record = {"precision": "bf16", "measured": True}
    run = RunPrecision("auto", CPU, steps=10**6, flags={"avx2"})
    run.load_state_dict(bf16_record)
    assert run.pending  # the vote runs whatever the checkpoint says
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "fp32" and calls == []
    assert run.state_dict() == {"precision": "fp32", "measured": False}
    for quiet in (RunPrecision("auto", CPU, steps=10**6, flags={"avx2"}, deterministic=True),
                  RunPrecision("auto", CPU, steps=10**6, flags={"avx2"}, training=False)):
        quiet.load_state_dict(bf16_record)
        assert quiet.value == "fp32" and not quiet.measured


def other_rank(monkeypatch, *vector: float) -> None:
    """The measurement's all-reduce as a 2-rank run would see it: this rank's vector plus another's
    [bf16 s, fp32 s, timed, native, 1, over the cap, fp32 record, bf16 record]."""
    monkeypatch.setattr("train.loop.cpu_precision.all_reduce_sum",
                        lambda values, device: [mine + theirs for mine, theirs in zip(values, vector, strict=True)])


def test_a_rank_without_native_bf16_makes_every_rank_take_fp32(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    other_rank(monkeypatch, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    model = SegmentationLike()
    calls = counted(model)
    run = RunPrecision("auto", CPU, steps=10**6, flags=NATIVE)
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "fp32" and calls  # this rank measured
    assert "no avx512_bf16 or amx_bf16 on the CPU of 1 of 2 ranks" in caplog.text and not run.measured


def test_the_ranks_mean_times_decide(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    other_rank(monkeypatch, 30.0, 10.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # the other: fp32 far faster, so the mean
    run = RunPrecision("auto", CPU, steps=10**6, flags=NATIVE)
    assert run.settle(SegmentationLike(), (4, 3, 16, 16), channels_last=False) == "fp32"
    assert "mean over 2 rank(s)" in caplog.text and run.state_dict() == {"precision": "fp32", "measured": True}


def test_a_warm_up_step_over_the_cap_keeps_bf16_without_timing_more(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("train.loop.cpu_precision.MEASURE_CAP_S", 0.0)  # every step is over it
    model = SegmentationLike()
    calls = counted(model)
    run = RunPrecision("auto", CPU, steps=10**6, flags=NATIVE)
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "bf16" and len(calls) == 1
    assert not run.measured  # a resume measures again
    assert "not measured against fp32: a warm-up forward + backward of 4x3x16x16 took over 0 s" in caplog.text


def test_a_rank_with_a_record_and_one_without_meet_in_the_vote_and_take_the_record(monkeypatch, caplog):
    """Ranks may load different checkpoints: each votes, the one with a record does not time, the record decides."""
    caplog.set_level(logging.INFO)
    other_rank(monkeypatch, 0.3, 0.1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # the other timed: fp32 far faster
    model = SegmentationLike()
    calls = counted(model)
    run = RunPrecision("auto", CPU, steps=10**6, flags=NATIVE)
    run.load_state_dict({"precision": "bf16", "measured": True})
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "bf16" and calls == []
    assert run.measured and "measured by the checkpoint's run; not measured again" in caplog.text
    other_rank(monkeypatch, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0)  # the other's record says fp32
    model = SegmentationLike()
    calls = counted(model)
    run = RunPrecision("auto", CPU, steps=10**6, flags=NATIVE)
    assert run.settle(model, (4, 3, 16, 16), channels_last=False) == "fp32" and calls  # this rank timed
    assert run.measured and "measured by another rank's checkpoint" in caplog.text


def small_trainer(tiny_dataset, run_dir) -> Trainer:
    """TinyNet on the tiny set as `python -m train hardware=cpu` builds it, told its CPU has native bf16 (from
    outside, so the measurement runs on any machine)."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=2",
                          "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet"])
    data = data_from_config(cfg, DistEnv(), CPU)
    trainer = Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, data.num_classes, CPU,
                                                                         channels_last=True), run_dir)
    trainer.step.auto = RunPrecision("auto", CPU, steps=trainer.plan.total_steps, flags=NATIVE)
    return trainer


def one_batch() -> Batch:
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return Batch(images.contiguous(memory_format=torch.channels_last), torch.arange(16) % 10)


def test_the_first_step_measures_once_the_checkpoint_records_it_and_a_resume_keeps_it(tiny_dataset, tmp_path,
                                                                                       caplog):
    caplog.set_level(logging.INFO)
    trainer = small_trainer(tiny_dataset, tmp_path)
    first = next(trainer.step.model.parameters()).detach().clone()
    trainer.step(one_batch())
    assert not trainer.step.auto.pending and trainer.step.precision in ("bf16", "fp32")
    assert caplog.text.count("measured on this model") == 1 and "a forward + backward of 16x3x32x32" in caplog.text
    assert not torch.equal(next(trainer.step.model.parameters()), first)  # and the step trained
    trainer.step(one_batch())
    assert caplog.text.count("measured on this model") == 1
    trainer.save()
    state = checkpoint.load(trainer.checkpoint_path)
    assert state["precision"] == {"precision": trainer.step.precision, "measured": True}

    other = "fp32" if trainer.step.precision == "bf16" else "bf16"  # whatever this run would measure, the record wins
    trainer.step.auto.value = other
    trainer.save()
    caplog.clear()
    resumed = small_trainer(tiny_dataset, tmp_path)
    resumed.resume(trainer.checkpoint_path)
    assert resumed.step.auto.pending  # the vote still runs: another rank's CPU may lack native bf16
    resumed.step(one_batch())
    assert resumed.step.precision == other and resumed.step.auto.measured
    assert "measured by the checkpoint's run; not measured again" in caplog.text
    assert "measured on this model" not in caplog.text


def test_a_checkpoint_from_before_the_record_measures_as_a_new_run(tiny_dataset, tmp_path):
    trainer = small_trainer(tiny_dataset, tmp_path)
    trainer.step(one_batch())
    trainer.save()
    state = checkpoint.load(trainer.checkpoint_path)
    del state["precision"]
    torch.save(state, trainer.checkpoint_path)
    resumed = small_trainer(tiny_dataset, tmp_path)
    resumed.resume(trainer.checkpoint_path)
    assert resumed.step.auto.pending and resumed.step.precision == "bf16"
    resumed.step(one_batch())
    assert not resumed.step.auto.pending


def test_an_unmeasured_record_is_measured_again(tiny_dataset, tmp_path):
    """A smoke run's bf16 (too short to measure) or a record without the flag does not stand for a measurement."""
    trainer = small_trainer(tiny_dataset, tmp_path)
    for record in ({"precision": "fp32", "measured": False}, {"precision": "fp32"}):
        trainer.step.auto.load_state_dict(record)
        assert trainer.step.auto.pending and trainer.step.auto.record is None and trainer.step.precision == "bf16"


def test_validate_evaluates_in_the_precision_the_checkpoint_measured(tiny_dataset, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = small_trainer(tiny_dataset, tmp_path)
    trainer.step.auto.adopt("fp32", "a test")
    assert trainer.step.settle_precision() == "fp32" and trainer.step.auto.measured
    trainer.save()
    (tmp_path / "validate").mkdir()
    validating = small_trainer(tiny_dataset, tmp_path / "validate")
    validating.step.auto = RunPrecision("auto", CPU, steps=10**6, training=False, flags=NATIVE)
    assert validating.step.precision == "bf16"
    record = validating.validate(trainer.checkpoint_path)
    assert validating.step.precision == record["precision"] == "fp32" and record["val_samples"] > 0
    assert "precision: fp32 (trainer.precision=auto: measured by the checkpoint's run" in caplog.text
    assert read_metrics(tmp_path / "validate")[-1]["precision"] == "fp32"  # the row says what it evaluated in


def test_a_tune_sweep_measures_once_per_model_and_every_job_trains_in_it(tiny_dataset, tmp_path):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "model._target_=tests.tiny_net.TinyNet"])

    def settled(outputs: int) -> tuple[str, list]:
        model = build_model(cfg.model, outputs, CPU, channels_last=True)
        forwards = counted(model)
        step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=100)
        step.auto = RunPrecision("auto", CPU, steps=100, flags=NATIVE)
        return settle_once(step, cfg, tmp_path, outputs), forwards

    (first, forwards), (second, none) = settled(10), settled(10)
    assert first == second in ("bf16", "fp32") and len(forwards) == 6 and none == []
    assert list(json.loads((tmp_path / PRECISION_FILE).read_text()).values()) == [first]
    _, forwards = settled(7)  # another head is another model: measured on its own
    assert len(forwards) == 6 and len(json.loads((tmp_path / PRECISION_FILE).read_text())) == 2
    assert [path.name for path in tmp_path.iterdir()] == [PRECISION_FILE]  # no temporary file left


@pytest.mark.parametrize("garbage", ['{"model": ', "[1, 2]", "\x00\xff"])
def test_a_tune_precision_file_that_does_not_read_is_measured_again_and_rewritten(tiny_dataset, tmp_path, garbage):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "model._target_=tests.tiny_net.TinyNet"])
    (tmp_path / PRECISION_FILE).write_bytes(garbage.encode("latin-1"))
    step = TrainStep.from_config(cfg, DistEnv(), CPU, build_model(cfg.model, 10, CPU, channels_last=True),
                                 total_steps=100)
    step.auto = RunPrecision("auto", CPU, steps=100, flags=NATIVE)
    chosen = settle_once(step, cfg, tmp_path, 10)
    assert list(json.loads((tmp_path / PRECISION_FILE).read_text()).values()) == [chosen]


RANKS = {  # each rank's CPU flags and checkpoint record
    "native": (NATIVE, None), "plain": ({"avx2"}, None),
    "bf16 record": (NATIVE, "bf16"), "fp32 record": (NATIVE, "fp32"),
}


def _settle_on_a_rank(rank: int, init: str, out: str, kinds: tuple[str, str]) -> None:
    """One rank of a 2-process gloo group, its CPU flags and checkpoint record as RANKS[kinds[rank]] says."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        flags, saved = RANKS[kinds[rank]]
        run = RunPrecision("auto", CPU, steps=10**6, flags=flags)
        if saved:
            run.load_state_dict({"precision": saved, "measured": True})
        chosen = run.settle(SegmentationLike(), (4, 3, 16, 16), channels_last=False)
        with open(f"{out}.{rank}", "w") as f:
            f.write(chosen)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("kinds", "expected"), [(("native", "plain"), "fp32"), (("bf16 record", "native"), "bf16"),
                                                 (("bf16 record", "fp32 record"), "fp32"),
                                                 (("bf16 record", "plain"), "fp32")])
def test_ranks_with_and_without_native_bf16_or_a_record_meet_in_one_all_reduce(tmp_path, kinds, expected):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    init, out = f"file://{tmp_path / 'store'}", str(tmp_path / "chosen")
    ranks = [context.Process(target=_settle_on_a_rank, args=(rank, init, out, kinds)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)  # a rank left alone in the all-reduce would wait here
    hung = [process.pid for process in ranks if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert not hung and [process.exitcode for process in ranks] == [0, 0]
    assert [(tmp_path / f"chosen.{rank}").read_text() for rank in range(2)] == [expected, expected]


@pytest.mark.parametrize("setting", list(Precision))
def test_the_checkpoint_record_is_plain_text_a_weights_only_load_takes(setting, tmp_path):
    """The config's StrEnum never reaches a checkpoint: torch.load(weights_only=True) refuses its class."""
    if setting == Precision.fp16:
        return  # CUDA only
    record = RunPrecision(setting, torch.device("cpu"), steps=1).state_dict()
    assert type(record["precision"]) is str
    torch.save({"precision": record}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["precision"] == record
