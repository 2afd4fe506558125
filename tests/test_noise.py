"""What a run prints besides its own lines, driven through the real CLI on a CPU box: torchdata's worker-count advice
once as one log line, the pin_memory notice as one log line (no warnings.warn source lines), and debug=profiler
without libkineto's GPU probe errors, pointing at viewers that exist."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import run_cli

WARNINGS_WARN = re.compile(r"\.py:\d+: \w*Warning: ")  # warnings.warn's format: file:line: Category: text, then source


@pytest.mark.slow
def test_a_cpu_run_with_workers_and_the_profiler_says_each_thing_once(tiny_dataset, tmp_path):
    if torch.cuda.is_available():
        return  # the CPU box's noise; on CUDA pinning is real and libkineto's messages may matter
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                      "data.num_workers=4", "data.pin_memory=true", "trainer.progress=false", "debug=profiler",
                      "trainer.profiler.wait=0", "trainer.profiler.warmup=1", "trainer.profiler.active=1",
                      "trainer.max_steps=3", "logger=[]", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    lines = log.splitlines()
    assert sum("This DataLoader will create 4 worker processes" in line for line in lines) == 1, log
    assert sum("data.pin_memory=true without CUDA" in line for line in lines) == 1, log
    assert not WARNINGS_WARN.search(log), log
    assert "gpuGetDeviceCount" not in log and "ERROR:" not in log and "USDT:" not in log, log
    (traced,) = [line for line in lines if "profiler: 1 steps traced into" in line]
    (trace,) = (run_dir / "profiler").glob("*.pt.trace.json")
    assert str(trace) in traced and "ui.perfetto.dev" in traced and "TensorBoard" not in traced
