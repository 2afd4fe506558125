"""Running out of memory the ways a GPU does besides torch.OutOfMemoryError: cuDNN's and cuBLAS's own allocations
fail as plain RuntimeErrors. The model (tests/tiny_net.py, installed through model._target_) raises cuDNN's error
from outside loadout's code; `trainer.micro_batch_size=auto` halves on it, and without auto, in evaluation or on a
batch's way to the device it ends the run as torch's does: one line, exit 3. A halved slice compiles afresh."""

from __future__ import annotations

import pytest
import torch

from loadout.data.loader.batch import Batch
from loadout.dist import DistEnv
from loadout.runtime import checkpoint
from loadout.runtime.micro_batch import MicroBatch, OutOfMemory, is_out_of_memory, said_in_one_line
from tests.conftest import compose_config, run_cli
from tests.tiny_net import CUDNN_ALLOC_FAILED
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task

CPU = torch.device("cpu")
FAILING_MODEL = "model._target_=tests.tiny_net.AllocFailingNet"


@pytest.mark.parametrize(("err", "counts"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError(CUDNN_ALLOC_FAILED), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"), True),
    # a broken cuDNN says this too: out of memory only with the GPU nearly full, and this box has none
    (RuntimeError("FIND was unable to find an engine to execute this computation"), False),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x10)"), False),
    (ValueError("Expected more than 1 value per channel when training"), False),
])
def test_a_cuda_librarys_failed_allocation_counts_as_out_of_memory(err, counts):
    assert is_out_of_memory(err) == counts


def test_no_engine_counts_as_out_of_memory_only_on_a_nearly_full_gpu(monkeypatch):
    monkeypatch.setattr("loadout.runtime.micro_batch.gpu_nearly_full", lambda: True)  # what a full GPU's query gives
    assert is_out_of_memory(RuntimeError("GET was unable to find an engine to execute this computation"))


def bn_step(micro_batch_size, batch_size: int = 16) -> TrainStep:
    cfg = compose_config(["hardware=cpu", "data.image_size=32", f"data.batch_size={batch_size}",
                          "trainer.precision=fp32", f"trainer.micro_batch_size={micro_batch_size}",
                          "model._target_=tests.tiny_net.TinyNet"])  # BatchNorm: no slice of one sample
    return TrainStep.from_config(cfg, DistEnv(), CPU, build_model(cfg.model, 10, CPU), total_steps=4,
                                 task=build_task(cfg))


def test_a_model_with_batch_norm_never_trains_on_a_one_sample_slice():
    step = bn_step(4, batch_size=9)
    images, targets = torch.randn(9, 3, 32, 32), torch.arange(9) % 10
    assert [len(x) for x, _ in step._slices(images, targets)] == [4, 5]  # the 1-sample rest joins the slice before
    loss, updated = step(Batch(images, targets))
    assert updated and torch.isfinite(loss)
    auto = bn_step("auto")
    sizes = []
    while auto.micro_batch.halve():
        sizes.append(auto.micro_batch.size)
    assert sizes == [8, 4, 2]  # halving stops at 2
    auto.micro_batch.load_state_dict({"size": 1})  # a checkpoint from before the floor
    assert auto.micro_batch.size == 2 and bn_step(1).micro_batch.size == 2
    cfg = compose_config(["hardware=cpu", "trainer.micro_batch_size=auto"])
    plain = TrainStep.from_config(cfg, DistEnv(), CPU, torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10)),
                                  total_steps=4, task=build_task(cfg))
    assert plain.micro_batch.smallest == 1


def test_out_of_memory_outside_a_step_becomes_the_steps_one_line_and_other_errors_pass():
    with pytest.raises(OutOfMemory) as caught, said_in_one_line(MicroBatch("auto", 16), CPU, " in evaluation"):
        raise RuntimeError("CUDA error: out of memory")
    assert str(caught.value).startswith("out of memory in evaluation: data.batch_size=16, micro-batch 16, on cpu; ")
    assert "lower data.batch_size" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(RuntimeError, match="shapes"), said_in_one_line(MicroBatch(None, 16), CPU, " in evaluation"):
        raise RuntimeError("shapes cannot be multiplied")


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines, result.stdout[-2000:]
    return lines[-1]


@pytest.mark.slow
def test_a_cudnn_allocation_failure_halves_an_auto_micro_batch_and_the_run_goes_on(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=3", "trainer.micro_batch_size=auto",
                      FAILING_MODEL, "+model.at=2"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    log = next((tmp_path / "run").glob("*.log")).read_text()
    assert "out of memory with micro-batches of 16: trying 8" in log
    saved = checkpoint.load(checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LAST)
    assert saved["micro_batch"] == {"size": 8} and saved["progress"]["step"] == 3


@pytest.mark.slow
def test_one_rank_out_of_memory_halves_for_every_rank_with_precision_auto(small_run_args, tmp_path):
    """torchrun, 2 ranks, rank 1 out of memory above 8 samples: the first step halves to 8 on every rank and the run
    finishes, with trainer.precision=auto and more than 20 steps (where the run once timed the model on a full
    batch before its first step, outside this recovery: exit 3)."""
    from tests.test_distributed import torchrun

    result = torchrun([*small_run_args, "trainer.epochs=3", "trainer.precision=auto", "trainer.micro_batch_size=auto",
                       "data.num_workers=1", "model._target_=tests.tiny_net.OutOfMemoryOnRank"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = checkpoint.load(checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LAST)
    assert saved["micro_batch"] == {"size": 8} and saved["progress"]["epoch"] == 3
    assert saved["progress"]["step"] > 20


@pytest.mark.slow
@pytest.mark.parametrize(("where", "overrides"), [
    ("", ["+model.at=2"]),  # in a step, without trainer.micro_batch_size=auto
    (" in evaluation", ["+model.during=eval", "+model.at=1", "trainer.micro_batch_size=auto"]),
])
def test_a_cudnn_allocation_failure_without_a_smaller_slice_is_one_line_and_exit_3(small_run_args, where, overrides):
    result = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=2", FAILING_MODEL, *overrides],
                     timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    line = error_line(result)
    assert line.startswith(f"error: out of memory{where}: data.batch_size=16, micro-batch 16, on cpu; "), line
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_a_smaller_micro_batch_compiles_afresh_instead_of_running_past_dynamos_recompile_limit(tiny_dataset):
    """Each micro-batch size is a graph of its own (dynamic=False). With the limit at one graph a frame, and
    Dynamo told to raise where it would otherwise fall back to eager in silence (its documented config knobs), a
    step after the ranks agreed on a smaller slice still runs compiled."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "trainer.precision=fp32", "trainer.compile=true", "trainer.micro_batch_size=auto",
                          "model._target_=tests.tiny_net.TinyNet"])
    step = TrainStep.from_config(cfg, DistEnv(), CPU, build_model(cfg.model, 10, CPU), total_steps=4,
                                 task=build_task(cfg))
    batch = Batch(torch.randn(16, 3, 32, 32), torch.arange(16) % 10)
    torch.compiler.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            step(batch)
            step.micro_batch.agree(8)  # as when another rank ran out of memory
            loss, updated = step(batch)
    finally:
        torch.compiler.reset()
    assert updated and torch.isfinite(loss) and step.compiled.size == 8
