"""What a person watching a run sees while an epoch trains: on a terminal a tqdm bar; in a log (Slurm, Kubernetes,
`docker compose up -d`: stderr is not a terminal) one line every `every_s` seconds instead, with the epoch, the step
out of the run's total, images/s, the data-wait share and the time left."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

from loadout.observe.meter import EpochMeter

# No tqdm monitor thread (tqdm's documented switch): it ends on its own clock, and a thread ending while the loop
# forks a loader's workers can leave the child waiting forever on CPython 3.11's thread-state lock (seen once: a
# validation worker stuck in fork under a CPU hog). It only retunes a stalled bar's refresh.
tqdm.monitor_interval = 0

log = logging.getLogger("train.loop.progress")
T = TypeVar("T")


def duration(seconds: float) -> str:
    """12s, 4m05s, 3h02m."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Console:
    """`show`: this process reports progress at all (trainer.progress, rank 0); a terminal on stderr gets the bar,
    anything else the lines."""

    def __init__(self, show: bool, every_s: float):
        self.show, self.every_s = show, every_s
        self.interactive = sys.stderr.isatty()
        self._last = time.perf_counter()
        self._since: tuple[float, int] | None = None  # (time, step) this process started training at

    def track(self, items: Iterable[T], desc: str, total: int) -> Iterator[T]:
        """`items` with a bar on a terminal (nothing more elsewhere)."""
        with tqdm(total=total, desc=desc, leave=False, disable=not (self.show and self.interactive),
                  dynamic_ncols=True) as bar:
            for item in items:
                yield item
                bar.update(1)

    def stepped(self, desc: str, meter: EpochMeter, step: int, total_steps: int) -> None:
        """After a training step: in a log, one line when `every_s` has passed since the last."""
        if not self.show or self.interactive:
            return
        now = time.perf_counter()
        if self._since is None:
            self._since = (now, step)
        if now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - meter.start
        started, first = self._since
        rate = (step - first) / (now - started) if now > started else 0.0
        eta = duration((total_steps - step) / rate) if rate > 0 else "?"
        log.info("%s  step %d/%d  %.0f img/s  data_wait %.1f%%  ETA %s", desc, step, total_steps,
                 meter.images / elapsed if elapsed > 0 else 0.0,
                 100 * meter.data_wait_s / elapsed if elapsed > 0 else 0.0, eta)
