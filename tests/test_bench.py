"""The GPU benchmark's measurement code, run on CPU: it works before a GPU ever runs it (the figures need CUDA)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_prefetch  # noqa: E402


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetcher", "synchronous-copy"])
def test_gpu_prefetch_measures_data_wait_over_several_epochs(tiny_dataset, prefetch):
    small = ("model.name=resnet18", "data.batch_size=32", "data.image_size=32", "data.num_workers=2",
             "data.pin_memory=false")  # the a100 profile otherwise: 7 batches an epoch here, 12 steps span two
    fraction = gpu_prefetch.data_wait(prefetch, torch.device("cpu"), *small, root=tiny_dataset, steps=12, warmup=2)
    assert 0 <= fraction < 1


@pytest.mark.slow
def test_gpu_check_runs_a_profile_and_plots_it_on_cpu(tiny_dataset, tmp_path, monkeypatch):
    """scripts/gpu_check.py's run and report code on CPU (its runs need CUDA for real: `make gpu-check`)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "OUT", tmp_path)
    monkeypatch.setattr(gpu_check, "DATA", str(tiny_dataset))
    row = gpu_check.train("cpu", ["hardware=cpu", "data.image_size=32", "data.batch_size=64"], [sys.executable],
                          epochs=2)
    assert row["ok"] and row["images_per_s"] > 0 and 0 <= row["data_wait_frac"] < 1, row
    assert row["measured_images"] == 192 and row["warmup_epoch_s"] > 0, row  # epoch 2 measured, epoch 1 warm-up
    gpu_check.plot([row], tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 0


def test_gpu_check_names_missing_packages_in_one_line_for_any_interpreter():
    """`python3 scripts/gpu_check.py` with an interpreter that lacks loadout's packages (the base Python here)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base), "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base} has torch")
    done = subprocess.run([str(base), "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("gpu-check: missing packages for"), lines
    assert " torch " in lines[0] and "hydra-core" in lines[0], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")
def test_gpu_check_without_cuda_says_why_in_one_line():
    done = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "CUDA is unusable here: " in lines[0], done.stderr


def test_gpu_check_run_dirs_are_plain_names_hydra_takes_as_one_run():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    for name in [*gpu_check.RUNS, "nccl, 2 processes"]:
        assert re.fullmatch(r"[A-Za-z0-9_]+", gpu_check.run_dir_for(name).name), name
