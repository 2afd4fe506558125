#!/usr/bin/env python3
"""How close the sharded training order is to a full shuffle, and how sequential its reads stay: labels only, no
images, no training (seconds).

For shard sets written as users write them (a folder walked class by class into webdataset ShardWriter shards, or
shuffled first as scripts/make_shards.py does), the order loader.ShardWindowSampler draws with the window
shard_order.shard_window picks at the default settings (dataset.shuffle_window=null), beside the old default of 4 shards
and a full shuffle:
- distinct labels in a batch of BATCH, as a share of a full shuffle's (target >= 0.95 at the default settings where
  the window can hold CLASS_SHARDS shards a class; label mixing is what training needs);
- mean rank displacement (how far a sample moves from where it was written), as a share of a full shuffle's;
- distinct shards one of WORKERS workers touches per SPAN samples it reads (batches go to workers in turn): the reads'
  sequentiality, and the shards the node cache and the worker's held indexes need at once.
The last set, ImageNet-sized and sorted in 1000-sample shards, needs more than shard_order.MOST_SAMPLES: the one-line
warning the run would log shows, and its figure is the bounded window's.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadout.data.loader.samplers import ShardWindowSampler  # noqa: E402
from loadout.data.remote.shard_order import shard_window, spread_of_labels  # noqa: E402

BATCH, WORKERS, SPAN, SEED = 64, 2, 1000, 0


def sorted_set(classes: int, per_class: int, per_shard: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels in written order, shard starts) of a folder walked class by class into shards of `per_shard`."""
    labels = np.repeat(np.arange(classes), per_class)
    return labels, np.append(np.arange(0, len(labels), per_shard), len(labels))


def shuffled_set(classes: int, per_class: int, per_shard: int) -> tuple[np.ndarray, np.ndarray]:
    labels, starts = sorted_set(classes, per_class, per_shard)
    return np.random.default_rng(1).permutation(labels), starts


def distinct_per_batch(labels: np.ndarray, order: np.ndarray) -> float:
    batches = np.sort(labels[order[:len(order) // BATCH * BATCH]].reshape(-1, BATCH), axis=1)
    return float(((np.diff(batches, axis=1) != 0).sum(axis=1) + 1).mean())


def displacement(order: np.ndarray) -> float:
    return float(np.abs(order - np.arange(len(order))).mean())


def shards_per_span(starts: np.ndarray, order: np.ndarray) -> float:
    """Distinct shards a worker touches per SPAN samples it reads, averaged over the workers' spans."""
    shard = np.searchsorted(starts, order, side="right") - 1
    batches = shard[:len(shard) // BATCH * BATCH].reshape(-1, BATCH)
    counts = []
    for worker in range(WORKERS):
        reads = batches[worker::WORKERS].ravel()
        counts += [len(np.unique(reads[i:i + SPAN])) for i in range(0, len(reads) - SPAN + 1, SPAN)]
    return float(np.mean(counts)) if counts else float(len(np.unique(shard)))


def window_order(starts: np.ndarray, window: int) -> np.ndarray:
    return ShardWindowSampler(starts, window, SEED, 0, 1).order()


def compare(name: str, labels: np.ndarray, starts: np.ndarray) -> float:
    """Print the three orders' figures for one shard set; returns the default order's label-mixing share."""
    classes = int(labels.max()) + 1
    spread = spread_of_labels([labels[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)], classes)
    print(f"\n{name}: {len(labels)} samples, {classes} classes, {len(starts) - 1} shards of "
          f"{len(labels) / (len(starts) - 1):.0f}")
    window = shard_window(starts, None, lambda: spread)
    full = np.random.default_rng(SEED).permutation(len(labels))
    reference = (distinct_per_batch(labels, full), displacement(full))
    share = 0.0
    for label, order, shards in (("old default, 4 shards", window_order(starts, 4), 4),
                                 ("default (sized)", window_order(starts, window), window),
                                 ("full shuffle", full, len(starts) - 1)):
        mixing = distinct_per_batch(labels, order) / reference[0]
        share = mixing if label.startswith("default") else share
        print(f"  {label:22s} window {min(shards, len(starts) - 1):5d} shards: distinct labels/batch "
              f"{distinct_per_batch(labels, order):6.1f} ({mixing:.2f} of full), rank displacement "
              f"{displacement(order) / reference[1]:.2f} of full, shards a worker touches per {SPAN} samples "
              f"{shards_per_span(starts, order):6.1f}")
    return share


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="  log: %(levelname)s %(message)s", stream=sys.stdout)
    results = {
        "synthetic set, folder walk, ShardWriter": compare("the embedded synthetic set walked into ShardWriter "
                                                            "shards (class-sorted)", *sorted_set(10, 150, 97)),
        "synthetic set, make_shards.py": compare("the same, shuffled first (scripts/make_shards.py)",
                                                 *shuffled_set(10, 150, 97)),
        "100 classes x 1000, folder walk": compare("100 classes x 1000 walked into shards of 97 (class-sorted)",
                                                   *sorted_set(100, 1000, 97)),
        "100 classes x 1000, make_shards.py": compare("the same, shuffled first (scripts/make_shards.py)",
                                                      *shuffled_set(100, 1000, 97)),
        "ImageNet-sized, folder walk": compare("1000 classes x 1300 walked into shards of 1000 (class-sorted; "
                                               "beyond the sized window's bound)", *sorted_set(1000, 1300, 1000)),
    }
    print()
    for name, share in list(results.items())[:4]:
        print(f"default order's distinct labels a batch / full shuffle's, {name}: {share:.2f} (target >= 0.95) "
              f"{'PASS' if share >= 0.95 else 'FAIL'}")
    print(f"(reference, bounded window) ImageNet-sized, folder walk: {results['ImageNet-sized, folder walk']:.2f}")
