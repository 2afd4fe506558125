"""Faults a long run meets, driven from outside: a planted file that runs code when unpickled, a learning rate that
diverges, a disk that fills (a tmpfs of a set size, filled by the test), a truncated checkpoint, and a second
process on the same run dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loadout.runtime import checkpoint
from tests.conftest import ROOT, run_cli, wait_for

CPU = torch.device("cpu")


class RunsCode:
    """What a malicious weights file holds: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# -- 1. no file runs code --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["model.weights", "trainer.resume"])
@pytest.mark.slow
def test_a_weights_file_that_runs_code_is_refused_and_never_runs(small_run_args, tmp_path, key):
    marker, planted = tmp_path / "pwned", tmp_path / "downloaded.pt"
    torch.save({"format": checkpoint.FORMAT, "model": RunsCode(marker)}, planted)
    result = run_cli([*small_run_args, "trainer.epochs=1", f"{key}={planted}"], timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert f"{key}='{planted}': refused" in line and "posix.system" in line, result.stderr
    assert not marker.exists(), "the planted command ran"


# -- 2. divergence ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_divergence_stops_in_one_line_and_keeps_the_last_finite_checkpoint(small_run_args, tmp_path):
    """optimizer.lr=1e6 with a checkpoint after every step: the first losses are finite and saved, then the loss goes
    non-finite. The run stops at once with one line and exit 4; the checkpoint on disk holds finite weights; no NaN
    epoch reaches metrics.jsonl or best.pt. A retry of the same config stops at once."""
    args = [*small_run_args, "trainer.epochs=2", "model.name=resnet18", "optimizer.lr=1e6",
            "trainer.checkpoint_every_steps=1"]
    result = run_cli(args, timeout=300)
    assert result.returncode == 4, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "diverged by step" in line and "non-finite loss" in line and "last finite loss" in line, line
    assert "trainer.on_nonfinite=skip" in line
    last = checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LAST
    state = torch.load(last, weights_only=True)
    assert f"the checkpoints hold step {state['progress']['step']}" in line
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert not (last.parent / checkpoint.BEST).exists()
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or "NaN" not in metrics.read_text()
    again = run_cli(args, timeout=120)
    assert again.returncode == 4 and "a retry of the same config, refused" in again.stderr


@pytest.mark.slow
def test_skip_drops_non_finite_steps_then_stops_after_too_many_in_a_row(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "trainer.epochs=1", "model.name=resnet18", "optimizer.lr=1e6",
                      "trainer.on_nonfinite=skip", "trainer.nonfinite_skips=3"], timeout=300)
    assert result.returncode == 4, result.stderr[-2000:]
    assert "3 steps in a row had non-finite gradients and were skipped" in result.stderr.strip().splitlines()[-1]


# -- 3. a full disk --------------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs the test mounts (root only), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_keeps_the_previous_checkpoint_and_resumes(tiny_dataset, small_disk, tmp_path):
    """mobilenet_v3_small (about 12 MiB a checkpoint with momentum) saving every 2 steps; once the first checkpoint
    is on disk the test fills the disk. The next save fails: one line (path, size, free space), exit 74, and the
    checkpoint before it loads whole."""
    run_dir = small_disk / "run"
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
            "data.num_workers=1", "trainer.progress=false", "trainer.epochs=2", "model.name=mobilenet_v3_small",
            "trainer.checkpoint_every_steps=2", "trainer.keep_checkpoints=1", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    last = checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST
    wait_for(last.is_file, timeout=120, what="the first checkpoint")
    process.send_signal(signal.SIGSTOP)  # fill the disk between two saves
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * max(free - 2**20, 0))
    process.send_signal(signal.SIGCONT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 74, stderr[-2000:]
    line = stderr.strip().splitlines()[-1]
    assert f"cannot write checkpoint {last}: no space left" in line and "MiB free" in line, line
    assert "resume with trainer.resume=auto" in line
    assert checkpoint.load(last)["progress"]["step"] == 2  # the previous checkpoint, whole
    assert not list(last.parent.glob(".*.tmp")), "a partial file was left behind"
    (small_disk / "filler").unlink()
    resumed = run_cli([*args, "trainer.resume=auto"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in next(run_dir.glob("*.log")).read_text()


def test_a_read_only_checkpoint_dir_is_one_line(tmp_path):
    if os.geteuid() == 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o500)
    try:
        part = torch.nn.Linear(4, 4)
        with pytest.raises(checkpoint.CheckpointWriteError) as err:
            checkpoint.save({"model": part}, folder / checkpoint.LAST)
        assert "\n" not in str(err.value)
        assert "read-only" in str(err.value) or "no permission" in str(err.value), err.value
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(folder)], check=False)


# -- 4. one bad checkpoint -----------------------------------------------------------------------------------------
def test_keep_checkpoints_rotates_and_resume_auto_skips_a_truncated_last(tmp_path, caplog):
    folder = checkpoint.checkpoint_dir(tmp_path)
    for step in (1, 2, 3):
        progress = checkpoint_part({"step": step, "epoch": 0, "batch_in_epoch": step})
        checkpoint.save({"progress": progress}, folder / checkpoint.LAST, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["last.1.pt", "last.pt"]
    assert torch.load(folder / "last.1.pt", weights_only=True)["progress"]["step"] == 2
    last = folder / checkpoint.LAST
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a node lost mid-copy
    assert checkpoint.find_resume_path("auto", tmp_path) == folder / "last.1.pt"
    assert "skipped" in caplog.text and "truncated or not a complete file" in caplog.text
    assert "central directory" not in caplog.text and "miniz" not in caplog.text


def checkpoint_part(state: dict):
    class Part:
        def state_dict(self) -> dict:
            return state

    return Part()


# -- 5. one run dir, one run ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_run_on_the_same_run_dir_is_refused_and_a_dead_holder_is_taken_over(small_run_args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [*small_run_args, "trainer.epochs=20", "trainer.checkpoint_every_steps=2"]
    first = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / "run" / "run.lock"
        wait_for(lambda: lock.is_file() and lock.read_text(), timeout=120, what="the first run's lock")
        second = run_cli(args, timeout=120)
        assert second.returncode == 2
        line = second.stderr.strip().splitlines()[-1]
        assert "another run is training in it" in line and f"pid {first.pid}" in line, line
        wait_for((checkpoint.checkpoint_dir(tmp_path / "run") / checkpoint.LAST).is_file, 120, "a checkpoint")
    finally:
        first.kill()  # SIGKILL: the holder dies without releasing anything
        first.wait()
    time.sleep(0.5)
    third = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=1"], timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    log = next((tmp_path / "run").glob("*.log")).read_text()
    assert "run dir lock taken over from host" in log and f"pid {first.pid}" in log
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_run_dir_without_room_for_two_checkpoints_is_one_warning_at_start(tmp_path, caplog):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    checkpoint.warn_if_little_room(tmp_path, state_bytes=free, keep=2)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "less than 2 checkpoints" in warnings[0] and str(tmp_path) in warnings[0]
    caplog.clear()
    checkpoint.warn_if_little_room(tmp_path, state_bytes=1024, keep=2)
    assert not caplog.records
