#!/usr/bin/env python3
"""Shared sample cache (data.cache_bytes): images/s of epoch 2 (cache hits) over epoch 1 (decode + fill) (>= 3)."""

from __future__ import annotations

from common import first_epoch, host_batches, images_per_s, machine, pipeline, report

CACHED_EPOCHS = 5  # epoch 2 on, in one stream: one cached epoch is too short to time on a shared machine


def epochs() -> tuple[float, float]:
    """(epoch 1's images/s, decoding and filling the cache; the cached epochs' after it)."""
    with pipeline("data.num_workers=2", f"trainer.epochs={CACHED_EPOCHS + 1}", "data.batch_size=64",
                  f"data.cache_bytes={2**30}") as data:
        batches = iter(host_batches(data))
        first = images_per_s(first_epoch(data, batches))
        cached = images_per_s(batches)
        cache = data.samples[0].cache
        assert len(cache) == cache.capacity, "the workers' writes must be visible to every process"
    return first, cached


if __name__ == "__main__":
    runs = [epochs() for _ in range(3)]
    first, second = max(r[0] for r in runs), max(r[1] for r in runs)
    report("cache epoch 2 / epoch 1 img/s", second / first, ">= 3", second / first >= 3,
           f"{second:.0f} vs {first:.0f} img/s (best of {len(runs)} runs; epochs 2-{CACHED_EPOCHS + 1} in one "
           f"stream), 2 workers, batch 64, whole train set cached; {machine()}")
