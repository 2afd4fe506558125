"""The GPU path's logic, on CPU: why CUDA is unusable said in one line, one GPU per rank, no silent CPU fallback,
collectives that never desynchronise (an all-unreadable batch on one rank, the stop agreement), out of memory
(auto micro-batches agreed over two gloo ranks; otherwise one line and a status a retry does not repeat), a scaler
state from any precision, and BatchMix's seeding. What only a GPU can show is in test_cuda.py."""

from __future__ import annotations

import logging

import pytest
import torch

from loadout.device import CudaFacts, cuda_index, why_no_cuda
from loadout.dist import DistEnv, group_timeout
from loadout.errors import ConfigError
from loadout.run import no_retry
from loadout.runtime import checkpoint
from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import RECORD_SAMPLES, assert_each_sample_once, compose_config, read_metrics, run_cli
from tests.test_distributed import only_run_dir, torchrun
from train.augment import BatchMix
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task

CPU = torch.device("cpu")
OOM_CALLBACK = "+callbacks.oom._target_=tests.out_of_memory.OutOfMemoryAt"


# -- 2. no silent CPU fallback, no wrong GPU ----------------------------------------------------------------------
@pytest.mark.parametrize(("facts", "said"), [
    (CudaFacts(None, None), "CPU-only build"),
    (CudaFacts("13.0", ""), "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    (CudaFacts("13.0", None), "no NVIDIA driver found"),
    (CudaFacts("13.0", None, driver_cuda="12.2", driver_version="535.104.05", init_error=0),
     "the NVIDIA driver is too old for this torch: driver 535.104.05 supports CUDA up to 12.2"),
    (CudaFacts("12.8", None, driver_cuda="12.4", driver_version="550.54", init_error=0), "likely too old"),
    (CudaFacts("12.4", None, driver_cuda="12.4", driver_version="550.54", init_error=100), "the driver sees no GPU"),
])
def test_why_cuda_is_unusable_is_said_with_its_likely_cause(facts, said):
    reason = why_no_cuda(facts)
    assert said in reason and "\n" not in reason, reason


def test_each_rank_takes_its_own_gpu_and_a_missing_one_names_nproc_per_node():
    assert cuda_index("cuda", DistEnv(local_rank=1, local_world_size=2, world_size=2, rank=1), device_count=2) == 1
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but 2 GPU\(s\) are visible.*--nproc_per_node=2.*NPROC=2"):
        cuda_index("cuda", DistEnv(local_rank=2, local_world_size=3, world_size=3, rank=2), device_count=2)
    with pytest.raises(ConfigError, match=r"trainer.device=cuda:1: under torchrun every rank would train on GPU 1"):
        cuda_index("cuda:1", DistEnv(local_rank=0, local_world_size=2, world_size=2), device_count=2)
    assert cuda_index("cuda:1", DistEnv(), device_count=2) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")
@pytest.mark.parametrize(("env", "said"), [({}, "CUDA is unusable here"),
                                           ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU")])
@pytest.mark.slow
def test_a_gpu_profile_without_usable_cuda_fails_in_one_line_instead_of_training_on_the_cpu(small_run_args, env, said):
    result = run_cli([*small_run_args, "hardware=a100"], env=env, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "hardware=cpu" in lines[0], result.stderr


@pytest.mark.slow
def test_every_run_logs_its_device(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=1"], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device: cpu" in next((tmp_path / "run").glob("*.log")).read_text()


# -- 4. collectives ------------------------------------------------------------------------------------------------
def test_the_process_group_outwaits_a_stuck_dataloader_worker():
    assert group_timeout(None).total_seconds() >= 600
    assert group_timeout(3600).total_seconds() > 3600


@pytest.mark.slow
def test_a_batch_unreadable_on_one_rank_only_keeps_ddp_in_step(tmp_path):
    """Sequential sharding puts indices 8, 10, 12, 14 in rank 0's second batch: all four unreadable, rank 1's fine.
    Rank 0 still runs its (empty) forward and backward, so both ranks meet in every gradient all-reduce and the run
    ends. (Index 0 stays readable: the build reads it to check the dataset.)"""
    root = make_synthetic_imagefolder(tmp_path / "data", train_per_class=16, val_per_class=2, size=40)
    first_class = sorted(p for p in (root / "train").iterdir())[0]
    for path in sorted(first_class.iterdir())[8:16:2]:
        path.write_bytes(b"not a jpeg")
    args = ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=4", "data.num_workers=1",
            "data.shuffle=false", "trainer.epochs=1", "trainer.progress=false", "model.name=resnet18"]
    result = torchrun(args, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_metrics(only_run_dir(tmp_path))[-1]
    assert record["bad_samples"] == 4 and record["images"] == 160 - 4, record  # 2 ranks x 20 batches of 4


# -- 5. out of memory -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_out_of_memory_on_one_rank_halves_the_micro_batch_on_every_rank_and_trains_every_sample(tiny_dataset,
                                                                                                tmp_path):
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=20",
            "data.num_workers=1", "trainer.epochs=2", "trainer.progress=false", "model.name=resnet18",
            "trainer.micro_batch_size=auto", RECORD_SAMPLES, OOM_CALLBACK, "+callbacks.oom.rank=1",
            "+callbacks.oom.batch=2", "+callbacks.oom.times=2"]
    result = torchrun(args, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    log = next(run_dir.glob("*.log")).read_text()
    assert "another rank ran out of memory" in log  # rank 0 adopted rank 1's size through the agreement
    saved = checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)
    assert saved["micro_batch"] == {"size": 5}  # 20 -> 10 -> 5, on rank 0 too, and kept for a resume
    assert_each_sample_once(run_dir, epochs=2, ranks=2, dataset_size=240, per_rank=120)


@pytest.mark.slow
def test_out_of_memory_without_auto_is_one_line_exit_3_and_a_retry_of_the_same_config_stops_at_once(small_run_args,
                                                                                                    tmp_path):
    args = [*small_run_args, "trainer.epochs=1", OOM_CALLBACK, "+callbacks.oom.batch=2"]
    result = run_cli(args, timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: out of memory: data.batch_size=16, micro-batch 16") and \
        "trainer.micro_batch_size=auto" in line, result.stderr
    again = run_cli([*args, "trainer.resume=auto"], timeout=120)
    assert again.returncode == 3 and "a retry of the same config, refused" in again.stderr, again.stderr
    assert "epoch 1/1" not in next((tmp_path / "run").glob("*.log")).read_text()
    fixed = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=1", "trainer.micro_batch_size=8"],
                    timeout=300)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert not (tmp_path / "run" / no_retry.NOTE).exists()


def test_micro_batches_give_the_whole_batch_gradient(tiny_dataset):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=8",
                          "trainer.precision=fp32", "model._target_=tests.tiny_net.TinyNet"])
    grads = {}
    for size in (None, 3):
        torch.manual_seed(0)
        model = build_model(cfg.model, 10, CPU).eval()  # eval: BatchNorm's batch statistics aside
        cfg.trainer.micro_batch_size = size
        step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=1, task=build_task(cfg))
        step.optimizer.step = lambda *a, **k: None  # keep the gradients to compare: no update
        step.optimizer.zero_grad = lambda *a, **k: None
        from loadout.data.loader.batch import Batch

        torch.manual_seed(1)
        step(Batch(torch.randn(8, 3, 32, 32), torch.arange(8) % 10))
        grads[size] = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads[3], grads[None], rtol=1e-4, atol=1e-6)


# -- 6. resume across devices and precisions -------------------------------------------------------------------------
def test_a_scaler_state_from_any_precision_resumes(tiny_dataset, caplog):
    caplog.set_level(logging.INFO)
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "model.name=resnet18"])
    step = TrainStep.from_config(cfg, DistEnv(), CPU, build_model(cfg.model, 10, CPU), total_steps=1,
                                 task=build_task(cfg))
    fp16_state = torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict()
    step.load_scaler(fp16_state)  # an fp16 run's scaler into this run's disabled one
    assert "does not apply here (it was written by an fp16 run)" in caplog.text
    step.scaler = torch.amp.GradScaler("cpu")  # this run needs a scaler (fp16 on CUDA: the same class and rule)
    step.load_scaler({})  # as a CPU, bf16 or fp32 run wrote it: torch would raise "state dict is empty"
    assert "written without one" in caplog.text and step.scaler.get_scale() == 2.0**16
    step.load_scaler(fp16_state)
    assert step.scaler.get_scale() == 1024.0


# -- 8. batch mix --------------------------------------------------------------------------------------------------
def test_batch_mix_seeds_only_its_cpu_draws_and_keeps_channels_last(monkeypatch):
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    mix = BatchMix(10, seed=0, mixup_alpha=0.2, cutmix_alpha=0.0)
    images = torch.rand(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    state = torch.get_rng_state()
    mixed, targets = mix(images, torch.arange(4), epoch=0, batch=1)
    again, _ = mix(images, torch.arange(4), epoch=0, batch=1)
    assert not reseeded, "the GPUs' generators were reseeded"
    assert torch.equal(state, torch.get_rng_state()) and torch.equal(mixed, again)
    assert mixed.is_contiguous(memory_format=torch.channels_last) and targets.shape == (4, 10)


def test_no_retry_note_ignores_the_resume_key_and_yields_to_a_changed_config(tmp_path):
    cfg = compose_config(["hardware=cpu"])
    no_retry.note(tmp_path, cfg, 3, "out of memory: ...")
    cfg.trainer.resume = "auto"
    with pytest.raises(no_retry.RetryRefused) as refused:
        no_retry.check(tmp_path, cfg)
    assert refused.value.status == 3
    cfg.data.batch_size = 8
    no_retry.check(tmp_path, cfg)
    assert not (tmp_path / no_retry.NOTE).exists()
