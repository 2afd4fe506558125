"""The training stream's position is torchdata's StatefulDataLoader state, taken per batch before any prefetch.

A state taken mid-epoch while the workers (and a one-ahead prefetcher) hold later batches resumes with exactly the
remaining batches; the checkpoint's loader state is a StatefulDataLoader state that a fresh loader restores from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from loadout.data.loader.stream import EpochBatchSampler
from loadout.dist import DistEnv
from loadout.runtime import checkpoint
from tests.conftest import compose_config, trainer_for
from train.job import data_from_config
from train.loop.engine import Trainer

CPU = torch.device("cpu")


def pipeline(root: Path, workers: int, *extra: str):
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                          f"data.num_workers={workers}", f"data.persistent_workers={str(workers > 0).lower()}",
                          "trainer.epochs=2", *extra])
    return data_from_config(cfg, DistEnv(), CPU)


def one_ahead(stream) -> None:
    """Make `stream` draw as the CUDA DevicePrefetcher does on CPU too: batch n+1 leaves the loader before batch n
    reaches the loop."""
    device_batches = stream.to_device
    stream.to_device = lambda batches: _one_ahead(device_batches(batches))


def _one_ahead(batches: Iterable) -> Iterator:
    pending = None
    for batch in batches:
        if pending is not None:
            yield pending
        pending = dataclasses.replace(batch, images=batch.images.clone())
    if pending is not None:
        yield pending


def drain(stream, epochs: range) -> list:
    out = []
    for epoch in epochs:
        stream.set_epoch(epoch)
        out += [(batch.images.clone(), batch.targets.clone(), batch.indices.clone()) for batch in stream]
    return out


def same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        all(torch.equal(a, b) for a, b in zip(g, w, strict=True)) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("stop", [4, 15])  # mid-epoch 0; the last batch of epoch 0 (epoch 1's batches in flight)
def test_state_taken_with_batches_in_flight_resumes_with_exactly_the_rest(tiny_dataset, stop):
    reference = drain(pipeline(tiny_dataset, 2).train, range(2))
    per_epoch = len(reference) // 2
    first = pipeline(tiny_dataset, 2, "data.prefetch_factor=2").train
    one_ahead(first)
    first.set_epoch(0)
    seen = 0
    for seen, _ in enumerate(first, start=1):
        if seen == stop:
            break
    state = first.state_dict()
    drawn = first.batches.state_dict()  # the sampler's own position: what the workers and prefetcher were given
    assert (drawn["epoch"] * per_epoch + drawn["batch"]) - stop >= 3, "meant to checkpoint with batches in flight"
    assert (state["epoch"], state["batch"]) == divmod(stop, per_epoch)
    sampler_state = state["loader"]["_snapshot"]["_main_snapshot"]["_index_sampler_state"]
    assert sampler_state == {"epoch": state["epoch"], "batch": state["batch"]}, "the loader's state is the stream's"
    first.close()

    resumed = pipeline(tiny_dataset, 2, "data.prefetch_factor=2").train
    one_ahead(resumed)
    resumed.set_epoch(state["epoch"])
    resumed.load_state_dict(state)
    assert resumed.loader.next_iter_state is state["loader"], "restored through StatefulDataLoader.load_state_dict"
    assert same(drain(resumed, range(state["epoch"], 2)), reference[stop:])


def test_loader_state_for_another_worker_count_resumes_by_position_said_in_one_line(tiny_dataset, caplog):
    reference = drain(pipeline(tiny_dataset, 0).train, range(2))
    first = pipeline(tiny_dataset, 2).train
    first.set_epoch(0)
    for seen, _ in enumerate(first, start=1):
        if seen == 5:
            break
    state = first.state_dict()
    first.close()
    caplog.set_level(logging.INFO, logger="loadout.data.loader.stream")
    resumed = pipeline(tiny_dataset, 0).train
    resumed.load_state_dict(state)  # a 2-worker state into 0 workers
    assert "loader state is for 2 workers, this loader has 0" in caplog.text
    assert resumed.loader.next_iter_state is None
    assert same(drain(resumed, range(2)), reference[5:])
    data = pipeline(tiny_dataset, 0)
    data.positions(DistEnv()).load_state_dict({"ranks": [state]})  # the engine's checkpoint entry
    assert same(drain(data.train, range(2)), reference[5:])  # another process count: tests/test_world_size_resume.py


class Keys(Dataset):
    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int]:
        return key

    def __len__(self) -> int:
        return 10


def test_epoch_batch_sampler_follows_torchdatas_stateful_protocol():
    batches = EpochBatchSampler(range(10), batch_size=4, drop_last=False, epochs=2)
    loader = StatefulDataLoader(Keys(), batch_sampler=batches, collate_fn=lambda b: b)
    it = iter(loader)
    assert [next(it) for _ in range(2)] == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 4), (0, 5), (0, 6), (0, 7)]]
    assert loader.state_dict()["_index_sampler_state"] == {"epoch": 0, "batch": 2}
    next(it)
    state = loader.state_dict()
    assert state["_index_sampler_state"] == {"epoch": 1, "batch": 0}  # an epoch's end is the next one's start
    fresh = StatefulDataLoader(Keys(), batch_sampler=EpochBatchSampler(range(10), 4, False, 2),
                               collate_fn=lambda b: b)
    fresh.load_state_dict(state)
    assert list(fresh) == list(it) == [[(1, 0), (1, 1), (1, 2), (1, 3)], [(1, 4), (1, 5), (1, 6), (1, 7)],
                                       [(1, 8), (1, 9)]]


@pytest.mark.slow
def test_checkpoint_holds_the_stateful_dataloader_state_and_resume_restores_it(tiny_dataset, tmp_path):
    """A mid-epoch checkpoint written by the engine: its loader entry is StatefulDataLoader.state_dict() of the
    training loader; a trainer resuming from it hands that state to its StatefulDataLoader and trains the rest."""
    overrides = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                 "data.num_workers=2", "data.persistent_workers=true", "data.prefetch_factor=2", "trainer.epochs=2",
                 "trainer.checkpoint_every_steps=3", "trainer.max_steps=4",
                 "trainer.progress=false", "model.name=resnet18"]
    cfg = compose_config(overrides)

    def trainer(run_dir: Path) -> Trainer:
        data = data_from_config(cfg, DistEnv(), CPU)
        return trainer_for(cfg, data, run_dir)

    first = trainer(tmp_path / "a")
    first.train_epoch()  # stops after step 4 (max_steps); the checkpoint is from step 3
    state = checkpoint.load(first.checkpoint_path)
    first.data.train.close()
    assert state["progress"]["batch_in_epoch"] == 3
    assert len(state["loader"]["ranks"]) == 1  # one stream state per rank
    saved = state["loader"]["ranks"][0]
    assert (saved["epoch"], saved["batch"], saved["num_workers"]) == (0, 3, 2)
    loader_state = saved["loader"]
    assert set(loader_state) == {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
    assert loader_state["_snapshot"]["_snapshot_step"] == 3
    assert loader_state["_snapshot"]["_main_snapshot"]["_index_sampler_state"] == {"epoch": 0, "batch": 3}

    second = trainer(tmp_path / "b")
    second.resume(first.checkpoint_path)
    assert second.data.train.loader.next_iter_state == loader_state
    rest = [batch.indices.tolist() for batch in second.data.train]
    whole = pipeline(tiny_dataset, 2, "data.prefetch_factor=2").train
    whole.set_epoch(0)
    assert rest == [batch.indices.tolist() for batch in whole][3:]
