"""torchdata's StatefulDataLoader behind loadout/data/loader/stateful.py: the two private hooks loadout relies on behave
as it expects. torchdata is in maintenance; the day a release changes either, these fail loudly (and pyproject.toml's
upper bound keeps such a release out until then)."""

from __future__ import annotations

import time

import psutil
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
    begun = time.monotonic()
    shutdown_workers(loader)
    assert not (worker_pids() & started) and time.monotonic() - begun < 3  # joined, not left to a 5 s timeout
    assert [batch.tolist() for batch in loader][-1] == [9, 10, 11]  # and the loader starts afresh


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
