"""A run cut short by trainer.max_steps says so, through the real CLI: the bar (on a terminal) and the progress
lines (in a log) count to max_steps, not to the epoch's end; the epoch line says it was cut; the logged lr is the
rate the last step used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loadout.build import instantiate
from tests.conftest import ROOT, compose_config, read_metrics, run_cli

STEPS_PER_EPOCH = 15  # tiny_dataset: 240 training images / batch 16
MAX_STEPS = 3


def short_run(root: Path, run_dir: Path) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "data.num_workers=0",
            "trainer.epochs=2", f"trainer.max_steps={MAX_STEPS}", "logger=[]", f"hydra.run.dir={run_dir}"]


def on_a_terminal(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """`python -m train ARGS` with stdin, stdout and stderr a pty, as typed in a terminal: (exit status, output)."""
    import fcntl
    import pty
    import struct
    import termios

    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal's size: tqdm fits it
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=cwd, stdin=side, stdout=side, stderr=side,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(side)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the other side closed: the process ended
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    return proc.wait(timeout=30), out.decode(errors="replace")


def lr_of_step(step: int, total_steps: int) -> float:
    """The rate optimizer step `step` (1-based) uses under the default optimizer and schedule."""
    cfg = compose_config(["hardware=cpu"])
    optimizer = instantiate("optimizer", cfg.optimizer)([torch.nn.Parameter(torch.zeros(1))])
    scheduler = instantiate("scheduler", cfg.scheduler)(optimizer, total_steps=total_steps, last_epoch=-1)
    for _ in range(step - 1):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pty")
def test_the_bar_and_the_epoch_line_count_to_max_steps(tiny_dataset, tmp_path):
    status, out = on_a_terminal(short_run(tiny_dataset, tmp_path / "run"), cwd=tmp_path)
    assert status == 0, out[-3000:]
    totals = set(re.findall(r"epoch 1/2:[^|]*\|[^|]*\| *\d+/(\d+) \[", out))  # "epoch 1/2: 33%|███ | 1/3 [00:01<..."
    assert totals == {str(MAX_STEPS)}, out[-3000:]
    assert f"epoch 1/2 (cut at max_steps={MAX_STEPS})" in out, out[-3000:]
    (record,) = read_metrics(tmp_path / "run")
    assert record["epoch_complete"] is False
    total_steps = 2 * STEPS_PER_EPOCH  # the schedule spans trainer.epochs, max_steps only cuts it
    assert record["lr"] == pytest.approx(lr_of_step(MAX_STEPS, total_steps))
    assert record["lr"] != pytest.approx(lr_of_step(MAX_STEPS + 1, total_steps))  # not the scheduler's next value


@pytest.mark.slow
def test_progress_lines_in_a_log_count_to_max_steps(tiny_dataset, tmp_path):
    result = run_cli([*short_run(tiny_dataset, tmp_path / "run"), "trainer.progress_every_s=0.001"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    steps = re.findall(r"step (\d+)/(\d+)", log)
    assert steps and {total for _, total in steps} == {str(MAX_STEPS)}, log[-3000:]
    assert f"(cut at max_steps={MAX_STEPS})" in log
