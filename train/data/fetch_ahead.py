"""Remote shards fetched before the workers reach them: a sampler wrapper whose thread, in the main process, brings
the next shards of this rank's order onto the node while the workers read the current ones.

The order is the sampler's (a function of seed and epoch), drawn in the main process as the DataLoader hands
batches to the workers, so how far it has been drawn is how far the workers have got (plus their prefetch). The
thread keeps the shards the order has reached and the next `ahead` ones in the node's cache (the source's
`fetch_shard`: a download under the node's lock, then the index); the workers find them there and read at local
speed. A shard the thread cannot fetch is left to the workers, whose read then fails as a bad sample or fetches it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import Sampler

log = logging.getLogger(__name__)


class FetchAhead(Sampler[int]):
    """`sampler`'s order, unchanged, while a daemon thread fetches the next `ahead` shards it reaches
    (`fetch(shard)`; `starts`: the first index of each shard)."""

    def __init__(self, sampler: Sampler[int], starts: np.ndarray, fetch: Callable[[int], None], ahead: int):
        self.sampler, self.starts, self.fetch, self.ahead = sampler, starts, fetch, ahead
        self._plan: tuple[np.ndarray, np.ndarray] | None = None  # shards in order of first use, and where
        self._drawn = 0  # how many indices of the current order have been handed out
        self._wake = threading.Event()
        self._lock = threading.Lock()  # a new order and the thread's decision to end exclude each other
        self._thread: threading.Thread | None = None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        shards = np.searchsorted(self.starts, order, side="right") - 1
        _, first = np.unique(shards, return_index=True)
        first.sort()
        plan = (shards[first], first)
        with self._lock:
            self._drawn, self._plan = 0, plan
            if self._thread is None:  # one thread while an order is being drawn; it ends when that is done
                self._thread = threading.Thread(target=self._run, name="loadout-fetch-ahead", daemon=True)
                self._thread.start()
        self._wake.set()
        try:
            for drawn, index in enumerate(order.tolist(), start=1):
                self._drawn = drawn
                yield index
        finally:  # drawn to the end, or abandoned (a seek, a closed loader): nothing more to fetch for it
            with self._lock:
                if self._plan is plan:
                    self._plan = None

    def _run(self) -> None:
        plan, fetched, failing = None, set(), False
        while True:
            with self._lock:
                if self._plan is None:  # the order was drawn to its end or abandoned
                    self._thread = None
                    return
                if plan is not self._plan:  # a new order (an epoch, a resume): the cache may have let shards go
                    plan, fetched = self._plan, set()
            sequence, first_use = plan
            reached = int(np.searchsorted(first_use, self._drawn, side="right"))
            wanted = [int(s) for s in sequence[max(reached - 1, 0):reached + self.ahead] if int(s) not in fetched]
            if not wanted:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            shard = wanted[0]
            try:
                self.fetch(shard)
                failing = False
            except Exception as err:  # the workers' own reads meet it too: a bad sample, skipped and counted
                if not failing:  # once an outage, not once a shard
                    log.warning("fetching shard %d ahead: %s (the workers fetch what they need themselves)", shard, err)
                failing = True
            fetched.add(shard)
