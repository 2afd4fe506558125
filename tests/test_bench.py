"""The GPU benchmark's measurement code, run on CPU: it works before a GPU ever runs it (the figures need CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_prefetch  # noqa: E402


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetcher", "synchronous-copy"])
@pytest.mark.slow
def test_gpu_prefetch_measures_data_wait_over_several_epochs(tiny_dataset, prefetch):
    small = ("model.name=resnet18", "data.batch_size=32", "data.image_size=32", "data.num_workers=2",
             "data.pin_memory=false")  # the a100 profile otherwise: 7 batches an epoch here, 12 steps span two
    fraction = gpu_prefetch.data_wait(prefetch, torch.device("cpu"), *small, root=tiny_dataset, steps=12, warmup=2)
    assert 0 <= fraction < 1
