"""The trackers' calls on a thread of their own: a slow or dead tracking server never holds a training step, and
never fails or hangs the run.

An MLflow client retries a request for minutes before it gives up (MLFLOW_HTTP_REQUEST_MAX_RETRIES and its
back-off), and an exception from any tracker would end the run it only observes. Here the training thread queues each
call and goes on; a daemon thread makes the calls in order. A tracker that raises is warned about once until it works
again; a backlog past QUEUED calls drops figures (one warning); at the end the queue gets CLOSE_S to drain. Every
figure is in the run dir's metrics.jsonl whatever the trackers do.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import suppress

from loadout.errors import first_line

log = logging.getLogger(__name__)

QUEUED = 1000  # calls waiting at most: over half an hour of 2 s windows
CLOSE_S = 30.0  # at the end of a run, how long the queued calls get to reach their servers


class Delivery:
    """`call(name, fn, *args)` queues `fn(*args)` for tracker `name`; `close()` waits for the queue, at most CLOSE_S."""

    def __init__(self):
        self._calls: queue.Queue = queue.Queue(QUEUED)
        self._failing: set[str] = set()  # trackers whose last call raised (warned once)
        self._dropping = False  # warned of the current backlog
        self._thread = threading.Thread(target=self._run, name="loadout-trackers", daemon=True)
        self._thread.start()

    def call(self, name: str, fn: Callable, *args) -> None:
        try:
            self._calls.put_nowait((name, fn, args))
        except queue.Full:
            if not self._dropping:
                log.warning("the trackers are %d calls behind (a slow or unreachable server): figures are dropped "
                            "until they catch up; metrics.jsonl keeps every one", QUEUED)
            self._dropping = True

    def close(self) -> None:
        deadline = time.monotonic() + CLOSE_S
        with suppress(queue.Full):
            self._calls.put((None, None, ()), timeout=CLOSE_S)
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            log.warning("the trackers did not deliver their last %d calls within %.0f s (a slow or unreachable "
                        "server); metrics.jsonl has every figure", self._calls.qsize(), CLOSE_S)

    def _run(self) -> None:
        while True:
            name, fn, args = self._calls.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception as err:
                if name not in self._failing:
                    log.warning("logger.%s: %s: %s (its figures are dropped until it answers again; the run goes "
                                "on)", name, type(err).__name__, first_line(err))
                self._failing.add(name)
            else:
                if name in self._failing:
                    log.info("logger.%s answers again", name)
                self._failing.discard(name)
            if self._calls.empty():
                self._dropping = False
