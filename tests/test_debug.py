"""The debug group and what a person watching a run sees: debug=overfit drives the loss toward 0, debug=limit runs
the whole loop on a few batches (and resumes), debug=profiler leaves a trace and a table, and a run whose output is
not a terminal logs progress lines instead of a bar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli


def args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "data.num_workers=1",
            "trainer.progress=false", "logger=[]", f"hydra.run.dir={run_dir}", *extra]


@pytest.mark.slow
def test_overfit_one_batch_drives_the_loss_toward_zero(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(args(tiny_dataset, run_dir, "debug=overfit", "trainer.epochs=25"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == 25 and all(r["images"] == 16 and r["val_samples"] == 16 for r in records)
    assert records[-1]["train_loss"] < 0.05 * records[0]["train_loss"] and records[-1]["val_acc"] == 1.0


@pytest.mark.slow
def test_limit_runs_the_whole_loop_on_a_few_batches_and_resumes(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(args(tiny_dataset, run_dir, "debug=limit"))
    assert first.returncode == 0, first.stderr[-3000:]
    more = run_cli(args(tiny_dataset, run_dir, "debug=limit", "trainer.epochs=3", "trainer.resume=auto"))
    assert more.returncode == 0, more.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [(r["epoch"], r["images"], r["val_samples"], r["epoch_complete"]) for r in records] == [
        (1, 64, 64, True), (2, 64, 64, True), (3, 64, 64, True)]
    assert "continuing at step 8" in more.stdout + more.stderr


@pytest.mark.slow
def test_profiler_writes_a_trace_and_logs_the_top_operators(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(args(tiny_dataset, run_dir, "debug=profiler"))
    assert result.returncode == 0, result.stderr[-3000:]
    (trace,) = (run_dir / "profiler").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 5
    assert any(e.get("name") == "aten::convolution_backward" for e in events)
    out = result.stdout + result.stderr
    assert f"profiler: 5 steps traced into {run_dir / 'profiler'}" in out and "Self CPU time total" in out


@pytest.mark.slow
def test_profiler_says_when_the_run_ends_before_its_window(tiny_dataset, tmp_path):
    result = run_cli(args(tiny_dataset, tmp_path / "run", "debug=profiler", "trainer.max_steps=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "profiler: the run ended before step 12" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "profiler").exists()


@pytest.mark.slow
def test_a_log_that_is_not_a_terminal_gets_progress_lines_not_a_bar(tiny_dataset, tmp_path):
    result = run_cli(args(tiny_dataset, tmp_path / "run", "trainer.epochs=1", "trainer.progress=true",
                          "trainer.progress_every_s=0.2", "data.num_workers=0", "data.image_size=64"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    lines = re.findall(r"epoch 1/1  step (\d+)/15  \d+ img/s  data_wait \d+\.\d%  ETA (\d+s|\d+m\d\ds|\?)$", out,
                       flags=re.M)
    assert lines, out[-3000:]
    steps = [int(step) for step, _ in lines]
    assert steps == sorted(steps) and steps[-1] <= 15
    assert "it/s" not in out and "\r" not in out  # no tqdm bar in a log
