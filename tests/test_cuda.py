"""The CUDA paths, on a CUDA machine (`make gpu-check` runs `pytest -m cuda`); skipped here without one.

The prefetcher's batches against the CPU path's, pinned batches and a copy that overlaps compute (profiler trace),
no host sync in a training step (torch.cuda.set_sync_debug_mode), nor in one after resuming AdamW, fp16's GradScaler
skipping an inf step and holding the LR (the inf injected by a gradient hook the test installs), a real out-of-memory
halving the micro-batch (memory capped with set_per_process_memory_fraction), channels_last reaching the model, and the
GPU gauges. The mid-epoch resume on CUDA is in test_distributed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loadout.data.loader.batch import Batch
from loadout.data.loader.prefetcher import DevicePrefetcher
from loadout.dist import DistEnv
from loadout.observe.memory import MemorySampler, gpu_utilization
from loadout.observe.meter import EpochMeter
from tests.conftest import compose_config, trainer_for
from train.job import data_from_config
from train.loop.engine import Trainer
from train.loop.model import build_model
from train.task import build_task

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here (make gpu-check on a GPU)")]
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def config(root: Path, *extra: str):
    return compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                           "data.num_workers=2", "data.pin_memory=true", "trainer.epochs=1", "trainer.progress=false",
                           *extra])


def epoch(data, first: int | None = None) -> list:
    data.set_epoch(0)
    batches = []
    for batch in data.train:
        images, targets = batch.images, batch.targets
        batches.append((images.cpu(), targets.cpu()))
        if first is not None and len(batches) == first:
            break
    return batches


def test_prefetcher_batches_equal_the_cpu_path(tiny_dataset):
    on_gpu = epoch(data_from_config(config(tiny_dataset), DistEnv(), CUDA))
    on_cpu = epoch(data_from_config(config(tiny_dataset), DistEnv(), CPU))
    assert len(on_gpu) == len(on_cpu) > 0
    for (a, ta), (b, tb) in zip(on_gpu, on_cpu, strict=True):
        assert torch.equal(ta, tb)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # normalized on different devices
    data = data_from_config(config(tiny_dataset), DistEnv(), CUDA)
    data.set_epoch(0)
    host = list(data.train.loader)[:3]  # uint8 batches as the workers hand them over, pinned
    assert all(batch.images.is_pinned() for batch in host)
    raw = DevicePrefetcher(host, CUDA, normalize=False, channels_last=False)
    for images, device_images in zip((b.images for b in host), (b.images for b in raw), strict=True):
        assert device_images.device.type == "cuda" and torch.equal(device_images.cpu(), images)  # bit for bit


def test_the_copy_of_the_next_batch_overlaps_the_current_compute():
    """A profiler trace: a host-to-device copy on the prefetcher's side stream runs while a kernel runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    batches = [Batch(torch.randint(0, 255, (128, 3, 224, 224), dtype=torch.uint8).pin_memory(),
                     torch.zeros(128, dtype=torch.long).pin_memory()) for _ in range(8)]
    weights = torch.randn(4096, 4096, device=CUDA)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _batch in DevicePrefetcher(batches, CUDA, normalize=True, channels_last=True):
            for _ in range(10):  # compute on the default stream while the next batch copies
                weights = torch.tanh(weights @ weights / 4096)
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [e for e in gpu if "Memcpy HtoD" in e.name]
    kernels = [e for e in gpu if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    assert any(c.time_range.start < k.time_range.end and k.time_range.start < c.time_range.end
               for c in copies for k in kernels), "no copy ran during a kernel"


def trainer(root: Path, tmp_path: Path, *extra: str) -> Trainer:
    cfg = config(root, "trainer.device=cuda", "logger=[]", *extra)
    data = data_from_config(cfg, DistEnv(), CUDA)
    model = build_model(cfg.model, data.num_classes, CUDA, channels_last=cfg.trainer.channels_last)
    return trainer_for(cfg, data, tmp_path, model=model, device=CUDA)


def test_a_training_step_never_syncs_the_host(tiny_dataset, tmp_path):
    """bf16 (no GradScaler): after a warm-up step, steps, the meter and the stop agreement run with CUDA's sync
    debug mode set to raise on any synchronizing call."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no native bf16 on this GPU (fp16's GradScaler reads found-inf on the host by design)")
    run = trainer(tiny_dataset, tmp_path, "trainer.precision=bf16")
    run.step.ddp.train()
    run.data.set_epoch(0)
    meter = EpochMeter(CUDA)
    batches = iter(run.data.train)
    run.step(next(batches))  # warm-up: cuDNN autotuning, first allocations
    torch.cuda.synchronize()
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            loss, updated = run.step(batch)
            meter.stepped(len(batch), loss, batch.bad)
            run.agreement.agree()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps >= 3


def test_a_step_after_resuming_adamw_never_syncs_the_host(tiny_dataset, tmp_path):
    """pytorch/pytorch#128208: Adam's `step` counters read onto the GPU make every step read each one back (an
    `.item()` per parameter). Resumed from a checkpoint, they stay on the CPU, and a step runs with CUDA's sync debug
    mode set to raise."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no native bf16 on this GPU (fp16's GradScaler reads found-inf on the host by design)")
    extra = ("trainer.precision=bf16", "optimizer=adamw", "trainer.max_steps=1")
    first = trainer(tiny_dataset, tmp_path, *extra)
    first.train_epoch()
    first.save()
    run = trainer(tiny_dataset, tmp_path, *extra)
    run.resume(first.checkpoint_path)
    adam = list(run.step.optimizer.state.values())
    assert adam and all(not s["step"].is_cuda and s["exp_avg"].is_cuda for s in adam)
    run.step.ddp.train()
    run.data.set_epoch(0)
    batches = iter(run.data.train)
    run.step(next(batches))  # warm-up: cuDNN autotuning, first allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            run.step(next(batches))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_grad_scaler_skips_a_step_with_inf_gradients_holds_the_lr_and_takes_the_next(tiny_dataset, tmp_path):
    run = trainer(tiny_dataset, tmp_path, "trainer.precision=fp16", "trainer.max_steps=1")
    first = next(run.step.model.parameters())
    poisoned = first.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before, scale, lr = first.detach().clone(), run.step.scaler.get_scale(), run.step.scheduler.get_last_lr()[0]
    run.train_epoch()
    assert torch.equal(first.detach(), before), "a step with inf gradients must be skipped"
    assert run.step.scaler.get_scale() < scale and run.step.scheduler.get_last_lr()[0] == lr
    poisoned.remove()
    run.tc.max_steps = 2
    run.train_epoch()
    assert not torch.equal(first.detach(), before)


def test_running_out_of_gpu_memory_halves_the_micro_batch_and_trains_the_same_batch(tiny_dataset, tmp_path):
    """ResNet-50 at 224 px, batch 256, with this process capped to 3 GiB of the GPU: a real OutOfMemoryError, then
    slices small enough to fit."""
    cfg = config(tiny_dataset, "trainer.device=cuda", "trainer.precision=auto", "model.name=resnet50",
                 "data.batch_size=256", "data.image_size=224", "trainer.micro_batch_size=auto")
    model = build_model(cfg.model, 10, CUDA, channels_last=True)
    from train.loop.step import TrainStep

    step = TrainStep.from_config(cfg, DistEnv(), CUDA, model, total_steps=10, task=build_task(cfg))
    batch = Batch(torch.randn(256, 3, 224, 224, device=CUDA).contiguous(memory_format=torch.channels_last),
                  torch.randint(0, 10, (256,), device=CUDA))
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(3 * 2**30 / total, CUDA)
    try:
        loss, updated = step(batch)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
    assert updated and torch.isfinite(loss) and step.micro_batch.size < 256


def test_channels_last_batches_reach_the_model(tiny_dataset, tmp_path):
    run = trainer(tiny_dataset, tmp_path, "trainer.channels_last=true", "trainer.max_steps=2")
    seen = []
    run.step.model.register_forward_pre_hook(lambda module, args: seen.append(
        args[0].is_cuda and args[0].is_contiguous(memory_format=torch.channels_last)))
    run.train_epoch()
    assert seen and all(seen)


def test_gpu_memory_and_utilisation_gauges_report():
    sampler = MemorySampler(CUDA)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=CUDA)
    sample = sampler.sample()
    assert sample.gpu_allocated >= block.numel() and sample.gpu_peak >= sample.gpu_allocated
    assert sample.gpu_reserved >= sample.gpu_allocated
    util = gpu_utilization(CUDA)
    assert util is None or 0 <= util <= 100
