"""Remote shards fetched before the workers reach them: a sampler wrapper whose threads, in the main process, bring
the next shards of this rank's order onto the node while the workers read the current ones.

The order is the sampler's (a function of seed and epoch), drawn in the main process as the DataLoader hands
batches to the workers, so how far it has been drawn is how far the workers have got (plus their prefetch). The
threads keep the shards the order has reached and the next `ahead` ones in the node's cache (the source's
`fetch_shard`: a download under the node's lock, then the index); the workers find them there and read at local
speed. Several downloads are in flight at once: one stream's round trips and bandwidth fall behind the workers. A
shard the threads cannot fetch is left to the workers, whose read then fails as a bad sample or fetches it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import Sampler

log = logging.getLogger(__name__)

FETCHES_AT_ONCE = 4  # downloads in flight: one stream's latency and bandwidth cannot keep two workers fed (RESULTS.md)


class FetchAhead(Sampler[int]):
    """`sampler`'s order, unchanged, while FETCHES_AT_ONCE daemon threads fetch the shards it has reached and the next
    `ahead` (`fetch(shard)`; `starts`: the first index of each shard)."""

    def __init__(self, sampler: Sampler[int], starts: np.ndarray, fetch: Callable[[int], None], ahead: int):
        self.sampler, self.starts, self.fetch, self.ahead = sampler, starts, fetch, ahead
        self._plan: tuple[np.ndarray, np.ndarray] | None = None  # shards in order of first use, and where
        self._claimed: set[int] = set()  # shards of the current order a thread has taken on
        self._drawn = 0  # how many indices of the current order have been handed out
        self._failing = False  # warned of the current outage already
        self._lock = threading.Lock()  # a new order, a claim and a thread's decision to end exclude each other
        self._new_order = threading.Condition(self._lock)
        self._threads = 0

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
        with self._lock:  # a new order (an epoch, a resume): the cache may have let shards go, so all are fetched anew
            self._drawn, self._plan, self._claimed = 0, plan, set()
            for _ in range(FETCHES_AT_ONCE - self._threads):  # threads while an order is drawn; they end with it
                threading.Thread(target=self._run, name="loadout-fetch-ahead", daemon=True).start()
            self._threads = FETCHES_AT_ONCE
            self._new_order.notify_all()
        try:
            for drawn, index in enumerate(order.tolist(), start=1):
                self._drawn = drawn
                yield index
        finally:  # drawn to the end, or abandoned (a seek, a closed loader): nothing more to fetch for it
            with self._lock:
                if self._plan is plan:
                    self._plan = None

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._plan is None:  # the order was drawn to its end or abandoned
                    self._threads -= 1
                    return
                sequence, first_use = self._plan
                reached = int(np.searchsorted(first_use, self._drawn, side="right"))
                shard = next((int(s) for s in sequence[max(reached - 1, 0):reached + self.ahead]
                              if int(s) not in self._claimed), None)
                if shard is None:  # all fetched or in flight: look again as the workers move on
                    self._new_order.wait(0.05)
                    continue
                self._claimed.add(shard)
            try:
                self.fetch(shard)
                self._failing = False
            except Exception as err:  # the workers' own reads meet it too: a bad sample, skipped and counted
                if not self._failing:  # once an outage, not once a shard
                    log.warning("fetching shard %d ahead: %s (the workers fetch what they need themselves)", shard, err)
                self._failing = True
