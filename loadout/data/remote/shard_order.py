"""How many shards the training order shuffles together (dataset.shuffle_window), from how the shards were written.

The order (loader.ShardWindowSampler) shuffles the shards, then the samples of each window of consecutive shards
together: a worker reads a window's shards at a time and a node caches a window per rank, not the dataset. A window
mixes labels only as well as its shards do. Shards written in a shuffled order (scripts/make_shards.py) each look
like a random draw, and DEFAULT_WINDOW of them mix like a full shuffle. Shards written from a folder walk (webdataset's
ShardWriter over an ImageFolder) hold a class or two each, and DEFAULT_WINDOW of them hold a few classes, so training
walks through the classes one after another (issue 37: val_acc 0.20 where the folder reaches 1.00).

So with dataset.shuffle_window=null the window is sized from the labels of a few shards (`LabelSpread`): DEFAULT_WINDOW
shards where they look like random draws, else enough that each class is in about CLASS_SHARDS of them (a window of
sorted shards then holds nearly every class, in proportions close to the whole set's), at most MOST_SAMPLES samples
(what the node cache and each worker's held indexes must hold). The labels are data, so the window, and with it the
order, stays a function of (seed, epoch): a resume at any world or worker count draws it again. A window that cannot
mix label-sorted shards is said in one line, with the fix.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from loadout.errors import bad_value

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 4  # shards shuffled together when they look like random draws (or nothing is known of their labels)
CLASS_SHARDS = 4  # label-sorted shards: the window holds each class in about this many shards
MOST_SAMPLES = 1 << 16  # the most samples a sized window holds (Mosaic's shuffle block is 2**18)
RANDOM_LIKE = 0.5  # a shard holding at least this share of the labels a random draw of its size would is "mixed"
COVERED = 0.9  # a window holding fewer than this share of the classes cannot mix sorted shards: said in one line


class LabelSpread(NamedTuple):
    """The labels of the shards looked at: how many distinct ones a shard holds, and how many a random draw of as
    many samples from `classes` equally likely classes would hold."""

    per_shard: float
    random_draw: float
    classes: int

    @property
    def mixed(self) -> bool:
        return self.per_shard >= RANDOM_LIKE * self.random_draw

    def classes_in(self, shards: int) -> float:
        """The classes a window of `shards` random shards holds, about (each shard its own `per_shard` of them)."""
        return self.classes * (1 - (1 - min(self.per_shard / self.classes, 1.0)) ** shards)

    def window_needed(self) -> int:
        """The shards a window needs to mix these ones like a full shuffle."""
        if self.mixed:
            return DEFAULT_WINDOW
        return max(DEFAULT_WINDOW, math.ceil(CLASS_SHARDS * self.classes / self.per_shard))


def check_window(window: int | None) -> None:
    """dataset.shuffle_window, checked before anything is read: one line naming the key and the fix."""
    if window is not None and window < 1:
        bad_value("dataset.shuffle_window", window, "use an integer >= 1, or null to size it from the shards' labels")


def label_spread(distinct: Sequence[int], lengths: Sequence[int], classes: int) -> LabelSpread | None:
    """The spread of shards holding `distinct[i]` labels in `lengths[i]` samples each (empty ones left out), or None
    where nothing is known."""
    pairs = [(d, n) for d, n in zip(distinct, lengths, strict=True) if n > 0]
    if not pairs or classes < 1:
        return None
    per_shard = float(np.mean([d for d, _ in pairs]))
    random_draw = float(np.mean([classes * (1 - (1 - 1 / classes) ** n) for _, n in pairs]))
    return LabelSpread(per_shard, random_draw, classes)


def spread_of_labels(labels: Sequence[np.ndarray], classes: int) -> LabelSpread | None:
    """`label_spread` of shards given as their label arrays."""
    return label_spread([len(np.unique(shard)) for shard in labels], [len(shard) for shard in labels], classes)


def shard_window(starts: np.ndarray, window: int | None, spread: Callable[[], LabelSpread | None] | None,
                 announce: bool = True) -> int:
    """The shards shuffled together: `window` where set (dataset.shuffle_window), else sized from `spread()` (the
    source's `label_spread`; None: DEFAULT_WINDOW). `announce` (rank 0): log the choice, and warn in one line where
    label-sorted shards are not mixed by it. `spread` is called on every rank only when it sizes the window."""
    shards = len(starts) - 1
    if window is not None and not announce:
        return max(window, 1)
    seen = spread() if spread is not None else None
    if seen is None:
        return DEFAULT_WINDOW if window is None else max(window, 1)
    mean_samples = float(starts[-1]) / max(shards, 1)
    needed = seen.window_needed()
    most = max(1, int(MOST_SAMPLES // max(mean_samples, 1.0)))
    chosen = max(window, 1) if window is not None else min(needed, most)
    if not announce:
        return chosen
    kind = "mixed" if seen.mixed else "sorted by label"
    log.info("dataset.shuffle_window=%s: %d shards shuffled together (of %d; about %d samples): the shards hold %.1f "
             "labels each where a random draw holds %.1f (%s)", window if window is not None else "null",
             min(chosen, shards), shards, round(min(chosen, shards) * mean_samples), seen.per_shard,
             seen.random_draw, kind)
    if not seen.mixed and chosen < min(needed, shards) and seen.classes_in(chosen) < COVERED * seen.classes:
        fix = (f"set dataset.shuffle_window=null (sized: {min(needed, shards)} shards here)" if window is not None and
               needed <= most else f"set dataset.shuffle_window={min(needed, shards)} (about "
               f"{round(min(needed, shards) * mean_samples)} samples a rank in the node cache)")
        log.warning("dataset.shuffle_window: the shards are sorted by label (%.1f of the %d classes in a shard, "
                    "where a shuffled one holds %.1f) and a window of %d shards holds about %.0f classes at a time, so "
                    "training walks through the classes in turn: %s, or write the shards shuffled "
                    "(scripts/make_shards.py)", seen.per_shard, seen.classes, seen.random_draw, chosen,
                    seen.classes_in(chosen), fix)
    return chosen


def window_order(starts: np.ndarray, window: int, rng: np.random.Generator | None) -> np.ndarray:
    """Every sample of shards `starts` in the shard window order: the shards shuffled, then each `window` of them read
    as one shuffled run of samples (reads stay mostly sequential, the node cache bounded); `rng` None: stored order."""
    shards = len(starts) - 1
    sequence = rng.permutation(shards) if rng is not None else np.arange(shards)
    parts = []
    for first in range(0, shards, window):
        part = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in sequence[first:first + window]])
        parts.append(rng.permutation(part) if rng is not None else part)
    return np.concatenate(parts)
