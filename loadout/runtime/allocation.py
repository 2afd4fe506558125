"""Large host allocations kept for reuse instead of handed back to the kernel at every free.

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

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
KEPT_BYTES = 256 << 20  # blocks up to this size come from the heap; this much freed memory stays mapped


def keep_large_blocks(kept_bytes: int = KEPT_BYTES) -> bool:
    """Blocks up to `kept_bytes` served from the heap and reused after free; False where the C library has no
    `mallopt` (nothing changed)."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, kept_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, kept_bytes))
