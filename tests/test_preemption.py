"""Preemption and extension of a single-process run, driven from outside: real signals to `python -m train`, the
checkpoint on disk, and the run resumed with trainer.resume=auto compared with an uninterrupted one bit for bit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loadout.runtime import checkpoint
from tests.conftest import RECORD_SAMPLES, ROOT, epoch_samples, read_metrics, run_cli, training_at, wait_for

STEPS_PER_EPOCH = 15  # tiny_dataset: 240 training images / batch 16


def args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "data.num_workers=2",
            "trainer.epochs=2", "trainer.deterministic=true", RECORD_SAMPLES, "trainer.progress=false",
            f"hydra.run.dir={run_dir}", *extra]


def last_checkpoint(run_dir: Path) -> dict:
    return checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    got, want = last_checkpoint(run_dir)["model"], last_checkpoint(reference)["model"]
    assert [k for k in want if not torch.equal(got[k], want[k])] == [], "weights differ from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> Path:
    """An uninterrupted 2-epoch run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli(args(tiny_dataset, run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_signal_stops_at_a_step_saves_the_position_and_resume_trains_exactly_the_rest(sig, tiny_dataset, reference,
                                                                                      tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *args(tiny_dataset, run_dir)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    proc.send_signal(sig)
    time.sleep(0.05)
    proc.send_signal(sig)  # a second signal, as srun and torchrun forward what the process tree already got
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]  # resumable
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped by" in line]
    assert len(lines) == 1, out[-3000:]
    stopped = re.search(rf"stopped by {sig.name} at epoch 2, batch (\d+); continue with: \S*python\S* -m train (.*)$",
                        lines[0])
    assert stopped, lines[0]
    batch = int(stopped[1])
    assert 0 < batch <= STEPS_PER_EPOCH
    state = last_checkpoint(run_dir)  # whole and loadable, at the stop
    assert {key: state["progress"][key] for key in ("epoch", "step", "batch_in_epoch")} == {
        "epoch": 1, "step": STEPS_PER_EPOCH + batch, "batch_in_epoch": batch}
    assert (state["loader"]["ranks"][0]["epoch"], state["loader"]["ranks"][0]["batch"]) == (1, batch)
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1]

    resumed = run_cli(stopped[2].split(), cwd=tmp_path)  # the line's command, pasted in the same directory
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    for epoch in range(2):  # the same samples, in the same order, each once: nothing repeated or skipped
        assert epoch_samples(run_dir, epoch, 0) == epoch_samples(reference, epoch, 0), epoch
    assert_same_weights(run_dir, reference)


@pytest.mark.slow
def test_sigusr2_prints_every_threads_stack_and_the_run_goes_on_undisturbed(tiny_dataset, reference, tmp_path):
    """`kill -USR2` to the trainer and to one of its DataLoader workers mid-epoch (a run that seems stuck): each
    prints its threads' stacks on stderr, and the run finishes with the uninterrupted run's weights."""
    import psutil

    run_dir, err_file = tmp_path / "run", tmp_path / "stderr"
    with err_file.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "train", *args(tiny_dataset, run_dir)], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=stderr)
    err = err_file.read_text
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    workers = psutil.Process(proc.pid).children()
    assert workers, "the DataLoader's workers"
    # One at a time: two processes dumping into one stderr at once interleave their lines.
    proc.send_signal(signal.SIGUSR2)
    wait_for(lambda: "in _run_module_as_main" in err(), 30, "the trainer's stacks")  # its main thread comes last
    assert "in _worker_loop" not in err(), err()[-3000:]
    workers[0].send_signal(signal.SIGUSR2)
    wait_for(lambda: "in _worker_loop" in err(), 30, "the worker's stacks")
    assert proc.wait(timeout=120) == 0, err()[-3000:]
    assert "train/__main__.py" in err() and "Traceback" not in err(), err()[-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert_same_weights(run_dir, reference)


@pytest.mark.slow
def test_a_finished_run_extended_with_more_epochs_continues_on_a_replanned_schedule(tiny_dataset, reference,
                                                                                     tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    extended = run_cli(args(tiny_dataset, run_dir, "trainer.epochs=3", "trainer.resume=auto"))
    assert extended.returncode == 0, extended.stderr[-3000:]
    out = extended.stdout + extended.stderr
    assert f"re-planned over {3 * STEPS_PER_EPOCH} steps (was {2 * STEPS_PER_EPOCH}), continuing at step 30" in out
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2, 3]
    state = last_checkpoint(run_dir)
    assert state["progress"]["step"] == 3 * STEPS_PER_EPOCH
    assert state["scheduler"]["total_steps"] == 3 * STEPS_PER_EPOCH
    assert state["optimizer"]["param_groups"][0]["lr"] < 1e-3  # annealed to the end of the longer plan


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "epoch 1/" not in result.stdout + result.stderr  # failed before training anything
    return errors[0]


@pytest.mark.slow
def test_a_resume_that_cannot_be_honoured_fails_in_one_line_before_training(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    cut = run_cli(args(tiny_dataset, run_dir, "trainer.max_steps=20", "data.num_workers=0",
                       "data.persistent_workers=false"))  # stops mid-epoch 2, batch 5, with a checkpoint
    assert cut.returncode == 0, cut.stderr[-3000:]
    fewer_epochs = one_line_error(run_cli(args(tiny_dataset, run_dir, "trainer.epochs=1", "trainer.resume=auto")))
    assert "trainer.epochs=1" in fewer_epochs and "has begun epoch 2" in fewer_epochs
    other_batch = one_line_error(run_cli(args(tiny_dataset, run_dir, "data.batch_size=8", "trainer.resume=auto")))
    assert "15 steps an epoch, this run has 30" in other_batch and "data.batch_size" in other_batch
    other_model = one_line_error(run_cli(args(tiny_dataset, run_dir, "model.name=resnet34", "trainer.resume=auto")))
    assert "model.name=resnet34" in other_model
