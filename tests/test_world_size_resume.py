"""A run stopped mid-epoch at N processes and resumed at M trains the rest of that epoch, each sample once, and then
epochs as an M-process run from the same seed would (loadout/data/loader/reshard.py).

The in-process tests build each rank's real training stream (real DataLoader, real JPEG decoding) at its rank and
world size and hand the checkpoint's positions from one world size to the other; the slow ones stop real torchrun
groups (gloo, CPU) with SIGTERM and resume them at another process count.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from loadout.data.loader.positions import LoaderPositions
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.runtime import checkpoint
from tests.conftest import ROOT, compose_config, training_at, wait_for
from train.job import data_from_config
from train.loop.progress import Progress, RunLength

CPU = torch.device("cpu")
TRAIN, BATCH = 240, 16


def stream(root: Path, rank: int, world_size: int, *extra: str):
    """A rank's training stream; data.drop_last=false unless `extra` says otherwise, so every sample trains."""
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", f"data.batch_size={BATCH}",
                          "data.num_workers=0", "data.drop_last=false", "trainer.epochs=2", *extra])
    return data_from_config(cfg, DistEnv(rank=rank, world_size=world_size), CPU).train


def take(train, epoch: int, count: int | None = None) -> list[int]:
    """The sample indices of the next `count` batches of `epoch` (all the rest when None)."""
    train.set_epoch(epoch)
    out = []
    for number, batch in enumerate(train, start=1):
        out += batch.indices.tolist()
        if number == count:
            break
    return out


def stop(streams: list, epoch: int, count: int) -> tuple[list[int], dict]:
    """Every rank trains `count` batches of `epoch`: what they trained and the checkpoint's loader entry."""
    trained = [i for train in streams for i in take(train, epoch, count)]
    state = {"ranks": [train.state_dict() for train in streams], "batch_size": BATCH}
    for train in streams:
        train.close()
    return trained, state


def resume(root: Path, world_size: int, state: dict, *extra: str) -> tuple[list, list[LoaderPositions]]:
    streams = [stream(root, rank, world_size, *extra) for rank in range(world_size)]
    positions = [LoaderPositions(train, DistEnv(rank=rank, world_size=world_size))
                 for rank, train in enumerate(streams)]
    for position in positions:
        position.load_state_dict(state)
    return streams, positions


@pytest.mark.parametrize(("before", "after", "done"), [(2, 1, 3), (1, 2, 5), (2, 3, 2)])
def test_the_rest_of_the_epoch_is_every_untrained_sample_once_then_epochs_as_a_fresh_run(tiny_dataset, caplog,
                                                                                         before, after, done):
    caplog.set_level(logging.INFO, logger="loadout.data.loader.positions")
    first, state = stop([stream(tiny_dataset, r, before) for r in range(before)], 0, done)
    streams, positions = resume(tiny_dataset, after, state)
    assert all(p.batch_in_epoch == len(streams[0]) - -(-(TRAIN - before * done * BATCH) // after // BATCH)
               for p in positions), "the rest is numbered as the epoch's last batches"
    assert f"resumed mid-epoch at {after} processes from a checkpoint of {before}" in caplog.text
    assert f"the global batch is {BATCH * after} (was {BATCH * before})" in caplog.text
    rests = [take(train, 0) for train in streams]
    assert len({-(-len(rest) // BATCH) for rest in rests}) == 1, "every rank steps as often"
    per_epoch = len(streams[0])
    assert all(train.batches.batches_per_epoch() == per_epoch for train in streams)
    assert streams[0].batch == 0 and streams[0].epoch == 1, "the epoch ended at its last batch"
    counts = Counter(first + [i for rest in rests for i in rest])
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {1}, "each sample exactly once"
    fresh = [stream(tiny_dataset, r, after) for r in range(after)]
    assert [take(train, 1) for train in streams] == [take(train, 1) for train in fresh]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_shards_contiguous_split_resumes_at_another_count_each_sample_once(shards, tmp_path, before, after):
    extra = ("dataset=shards", f"dataset.cache_dir={tmp_path / 'cache'}")
    first, state = stop([stream(shards, r, before, *extra) for r in range(before)], 0, 3)
    streams, _ = resume(shards, after, state, *extra)
    rests = [take(train, 0) for train in streams]
    counts = Counter(first + [i for rest in rests for i in rest])
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {1}
    fresh = [stream(shards, r, after, *extra) for r in range(after)]
    assert [take(train, 1) for train in streams] == [take(train, 1) for train in fresh]


def test_a_checkpoint_after_the_epochs_last_batch_leaves_only_its_validation(tiny_dataset):
    """Saved after the last batch (before validation) the streams are at the next epoch's start: nothing of the
    epoch is left to train at the new count, and the stream is not moved (the next epoch starts afresh)."""
    _, state = stop([stream(tiny_dataset, r, 2) for r in range(2)], 0, 8)
    assert [(r["epoch"], r["batch"]) for r in state["ranks"]] == [(1, 0)] * 2
    streams, positions = resume(tiny_dataset, 1, state)
    assert positions[0].batch_in_epoch == len(streams[0]) == 15
    assert (streams[0].epoch, streams[0].batch) == (0, 0) and positions[0].resumed is None


def test_a_second_stop_in_the_same_epoch_at_yet_another_count_and_at_the_same(tiny_dataset):
    """2 -> 3 -> 3 -> 1 inside one epoch: each checkpoint carries the epoch's earlier splits."""
    trained, state = stop([stream(tiny_dataset, r, 2) for r in range(2)], 0, 2)
    streams, positions = resume(tiny_dataset, 3, state)
    more = [i for train in streams for i in take(train, 0, 1)]
    state = {"ranks": [train.state_dict() for train in streams], "batch_size": BATCH, "segments":
             positions[0].resumed["segments"], "offset": positions[0].resumed["offset"]}
    for train in streams:
        train.close()
    again, _ = resume(tiny_dataset, 3, state)  # the same count: each rank's own position in the resharded epoch
    once_more, state3 = stop(again, 0, 1)
    state3.update(segments=state["segments"], offset=state["offset"])
    last, _ = resume(tiny_dataset, 1, state3)
    rest = take(last[0], 0)
    counts = Counter(trained + more + once_more + rest)
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {1}


def test_drop_last_leaves_out_less_than_a_global_batch_and_never_repeats(tiny_dataset):
    """176 samples left for 3 ranks of 16: 3 whole batches each; the 32 others would be a short batch."""
    trained, state = stop([stream(tiny_dataset, r, 2, "data.drop_last=true") for r in range(2)], 0, 2)
    streams, _ = resume(tiny_dataset, 3, state, "data.drop_last=true")
    rests = [take(train, 0) for train in streams]
    assert [len(rest) for rest in rests] == [3 * BATCH] * 3
    counts = Counter(trained + [i for rest in rests for i in rest])
    assert set(counts.values()) == {1} and len(counts) == TRAIN - 32


def test_another_per_rank_batch_size_is_refused_in_one_line(tiny_dataset):
    _, state = stop([stream(tiny_dataset, r, 2) for r in range(2)], 0, 1)
    with pytest.raises(ConfigError, match=r"^data.batch_size=8: .* keeps the per-rank batch: use data.batch_size=16$"):
        resume(tiny_dataset, 1, state, "data.batch_size=8")


def test_the_lr_plan_counts_the_steps_taken_the_rest_of_the_epoch_at_the_new_count_then_whole_epochs():
    """3 epochs of 15 steps at 2 processes, stopped at step 20 (epoch 2, batch 5); at 1 process an epoch is 30 steps
    and the rest of epoch 2 is numbered as its last 20 batches (batch 10 on)."""
    saved = RunLength(epochs=3, steps_per_epoch=15, world_size=2)
    plan = RunLength(epochs=3, steps_per_epoch=30, world_size=1)
    plan.check_continues(saved, Progress(epoch=1, step=20, batch_in_epoch=5), Path("last.pt"))  # no error
    plan.follow(saved, Progress(epoch=1, step=20, batch_in_epoch=10), batches_per_epoch=30, grad_accum_steps=1)
    assert plan.total_steps == 20 + 20 + 30
    again = RunLength(epochs=3, steps_per_epoch=30, world_size=1)  # a later resume at 1 process keeps that schedule
    again.follow(RunLength(**plan.state_dict()), Progress(epoch=2, step=45), batches_per_epoch=30, grad_accum_steps=1)
    assert again.total_steps == 70
    with pytest.raises(ConfigError, match="resume with its data.batch_size and trainer.grad_accum_steps"):
        RunLength(3, 7, 2).check_continues(saved, Progress(epoch=1, step=20, batch_in_epoch=5), Path("last.pt"))


# -- real torchrun groups stopped by SIGTERM -----------------------------------------------------------------------
TRAINED_LOG = "+callbacks.trained._target_=tests.trained_log.TrainedLog"


def torchrun(args: list[str], nproc: int, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", "--monitor-interval=0.5", "-m", "train", *args],
                            cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


def trained(run_dir: Path, epoch: int) -> dict[int, list[int]]:
    """The samples each rank trained in `epoch`, over every run that wrote to `run_dir`, keyed by world size."""
    out: dict[int, list[int]] = {}
    for path in (run_dir / "trained").glob("ws*_rank*.jsonl"):
        world = int(re.match(r"ws(\d+)_", path.name).group(1))
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["epoch"] == epoch:
                out.setdefault(world, []).extend(row["indices"])
    return out


def args(root: Path, run_dir: Path) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", f"data.batch_size={BATCH}",
            "data.num_workers=1", "data.drop_last=false", "trainer.epochs=2", "trainer.progress=false",
            "model.name=resnet18", TRAINED_LOG, f"hydra.run.dir={run_dir}"]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_sigterm_at_one_process_count_and_resume_at_another(tiny_dataset, tmp_path, before, after):
    run_dir = tmp_path / "run"
    agent = torchrun(args(tiny_dataset, run_dir), before, tmp_path)
    wait_for(lambda: min(training_at(run_dir, rank) for rank in range(before)) >= (0, 3), 300,
             "epoch 1 to be under way")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=120)[0]
    assert agent.returncode != 0 and "stopped by SIGTERM at epoch 1" in out, out[-4000:]
    out = finished(torchrun([*args(tiny_dataset, run_dir), "trainer.resume=auto"], after, tmp_path))
    assert f"resumed mid-epoch at {after} processes from a checkpoint of {before}" in out, out[-4000:]
    assert "the LR schedule is re-planned" in out
    last = checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)
    assert last["progress"]["step"] == RunLength(**last["plan"]).total_steps, "the LR schedule ends with the run"
    epoch0 = trained(run_dir, 0)
    assert set(epoch0) == {before, after}
    counts = Counter(epoch0[before] + epoch0[after])
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {1}, "each sample once"
    fresh_dir = tmp_path / "fresh"
    finished(torchrun(args(tiny_dataset, fresh_dir), after, tmp_path))
    for rank in range(after):
        assert rows(run_dir, after, rank, 1) == rows(fresh_dir, after, rank, 1), rank


def rows(run_dir: Path, world: int, rank: int, epoch: int) -> list[list[int]]:
    lines = (run_dir / "trained" / f"ws{world}_rank{rank}.jsonl").read_text().splitlines()
    return [row["indices"] for row in map(json.loads, lines) if row["epoch"] == epoch]
