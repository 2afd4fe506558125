"""torchdata's StatefulDataLoader behind loadout/data/loader/stateful.py: the two private hooks loadout relies on behave
as it expects. torchdata is in maintenance; the day a release changes either, these fail loudly (and pyproject.toml's
upper bound keeps such a release out until then)."""

from __future__ import annotations

import gc
import weakref

import psutil
import pytest
import torch
from torch.utils.data import Dataset

from loadout.data.loader.stateful import forget_loaded_state, shutdown_workers, stateful_loader


class Numbers(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def worker_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_shutdown_workers_ends_persistent_workers_at_once():
    before = worker_pids()
    loader = stateful_loader(Numbers(), batch_size=3, num_workers=2, persistent_workers=True)
    assert [batch.tolist() for batch in loader][0] == [0, 1, 2]
    started = worker_pids() - before
    assert len(started) == 2, "persistent workers outlive the epoch"
    workers = list(loader._iterator._workers)
    shutdown_workers(loader)
    assert not (worker_pids() & started)
    assert [worker.exitcode for worker in workers] == [0, 0]  # joined, not terminated after the 5 s join timeout
    assert [batch.tolist() for batch in loader][-1] == [9, 10, 11]  # and the loader starts afresh


@pytest.mark.parametrize("persistent", [True, False])
def test_a_loader_dropped_in_a_reference_cycle_ends_its_workers_cleanly_and_is_collected(persistent):
    """Left to the collector, the iterator's queues could be finalized first: its workers never heard the exit
    message and were killed after DataLoader's join timeout (exit -15); the loader's finalizer ends them first."""
    loader = stateful_loader(Numbers(), batch_size=3, num_workers=2, persistent_workers=persistent)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1, 2]  # mid-epoch: both workers busy or waiting
    workers = list(iterator._workers)
    loader.cycle = loader
    gone = weakref.ref(loader)
    del loader, iterator
    gc.collect()
    assert gone() is None, "the finalizer must not keep the loader alive"
    assert [worker.exitcode for worker in workers] == [0, 0], "joined after their exit message, not terminated"


def test_loading_a_state_ends_the_workers_of_the_iterator_it_drops():
    """As DataLoader does when the dropped iterator goes: before the next iterator's workers start and share its
    ring slots."""
    loader = stateful_loader(Numbers(), batch_size=3, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    loader.load_state_dict(loader.state_dict())
    assert [worker.exitcode for worker in workers] == [0, 0]
    del iterator
    shutdown_workers(loader)


def test_a_loaded_state_is_forgotten_so_the_sampler_position_rules():
    loader = stateful_loader(Numbers(), batch_size=3)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()  # after the first batch
    loader = stateful_loader(Numbers(), batch_size=3)
    loader.load_state_dict(state)
    assert next(iter(loader)).tolist() == [3, 4, 5], "the loaded state applies to the next iterator"
    loader.load_state_dict(state)
    forget_loaded_state(loader)
    assert next(iter(loader)).tolist() == [0, 1, 2], "forgotten: the next iterator starts from its sampler"
