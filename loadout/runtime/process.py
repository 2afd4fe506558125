"""Process-wide settings a training process makes once, at its start: they let the loader's workers keep the cores.

`idle_threads_sleep`: torch's OpenMP threads spin after every parallel region by default, waiting for the next one;
beside DataLoader workers those spins take the cores the workers decode on (a run whose workers hold every core went
1.2x faster end to end with the threads sleeping instead: bench/RESULTS.md). It must run before torch is imported,
since the OpenMP runtime reads the setting as it loads; a value the user set is kept.

`keep_large_blocks`: large host allocations kept for reuse instead of handed back to the kernel at every free.
glibc serves a block over its mmap threshold (at most 32 MiB by default) with a fresh mmap and unmaps it on free, so
each batch-sized tensor made on the host (a float batch of 64 at 224 px is 38.5 MiB: the uint8 -> float conversion,
a CPU step's activations) page-faults its way through new zeroed pages every batch. Raising the threshold and the
trim threshold makes such blocks come from the heap and stay there between batches (bench/RESULTS.md has the
figures). Set once per process before the loader's workers fork (they inherit it); a C library without `mallopt`
(musl) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
KEPT_BYTES = 256 << 20  # blocks up to this size come from the heap; this much freed memory stays mapped


def idle_threads_sleep() -> None:
    """OMP_WAIT_POLICY=PASSIVE for this process and its children, unless already set."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_large_blocks(kept_bytes: int = KEPT_BYTES) -> bool:
    """Blocks up to `kept_bytes` served from the heap and reused after free; False where the C library has no
    `mallopt` (nothing changed)."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, kept_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, kept_bytes))
