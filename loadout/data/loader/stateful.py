"""The one place loadout touches torchdata's StatefulDataLoader beyond its public API.

torchdata is in maintenance (no new development since 2025), so its behaviour is pinned: pyproject.toml bounds its
version and tests/test_stateful.py fails loudly the day one of the private hooks below changes.
- `shutdown_workers`: DataLoader has no public way to end persistent workers now; its iterator does.
- `Loader._get_iterator`: each iterator with workers gets a finalizer on the loader that ends them (below).
- `forget_loaded_state`: `load_state_dict` parks the state for the next `iter()`; a seek after it must drop it.
"""

from __future__ import annotations

import logging
import warnings
import weakref

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

log = logging.getLogger(__name__)
_said: set[str] = set()  # the advice already logged by this process


class Loader(StatefulDataLoader):
    """StatefulDataLoader whose workers end as soon as it is collected, and whose worker-count advice is one log line
    a process (DataLoader warns at construction and at every iterator, with its source line).

    A loader dropped without `shutdown_workers` often sits in a reference cycle with its iterator, and the collector
    may finalize the iterator's queues before the iterator: its workers never get their exit message and are killed
    after DataLoader's 5 s join timeout each, at whatever later line the collection ran. The finalizer holds the
    iterator, so its queues are alive when the loader's collection runs it."""

    _ender: weakref.finalize | None = None

    def _get_iterator(self):
        iterator = super()._get_iterator()
        if self.num_workers > 0:
            if self._ender is not None:
                self._ender.detach()  # the iterator it ends is being replaced, and ends as DataLoader's do
            self._ender = weakref.finalize(self, iterator._shutdown_workers)  # holds the iterator, not the loader
            self._ender.atexit = False  # at exit DataLoader's own handling stands
        return iterator

    def end_workers(self) -> None:
        """End the current iterator's workers now (a no-op once done)."""
        if self._ender is not None:
            self._ender()

    def load_state_dict(self, state_dict: dict) -> None:
        self.end_workers()  # the iterator it drops ends now, as without the finalizer, not after the next one starts
        super().load_state_dict(state_dict)

    def check_worker_number_rationality(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().check_worker_number_rationality()
        for warning in caught:
            text = f"data.num_workers={self.num_workers}: {warning.message}"
            if text not in _said:
                _said.add(text)
                log.warning("%s", text)


def stateful_loader(dataset: Dataset, **kwargs) -> StatefulDataLoader:
    """A StatefulDataLoader, without the deprecation notice its constructor raises on torch >= 2.14
    (`torch.set_vital`, harmless) in every run and benchmark."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return Loader(dataset, **kwargs)


def shutdown_workers(loader: StatefulDataLoader) -> None:
    """End `loader`'s worker processes now (persistent ones live as long as its iterator), as Lightning does
    between stages. Left to the garbage collector, a reference cycle can finalize the iterator's queues first: the
    workers never receive their exit message and each is killed only after DataLoader's join timeout."""
    iterator = getattr(loader, "_iterator", None)
    if isinstance(loader, Loader):
        loader.end_workers()  # the same call, and the finalizer lets the iterator go
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # a worker stuck in a read gets SIGTERM from it (workers.init_worker lets it in)
    loader._iterator = None


def forget_loaded_state(loader: StatefulDataLoader) -> None:
    """Drop a state `load_state_dict` left for the next iterator: the batch sampler's own position rules instead."""
    loader.next_iter_state = None
