"""Process-wide settings a training process makes once: they let the loader's workers keep the cores.

`idle_threads_sleep`: torch's OpenMP threads spin after every parallel region by default, waiting for the next one;
beside DataLoader workers those spins take the cores the workers decode on (end to end 1.3x faster with the threads
sleeping instead, on 2 cores: bench/RESULTS.md). It must run before torch is imported, since the OpenMP runtime reads
the setting as it loads; a value the user set is kept.

`keep_large_blocks`: on a CPU device the main process makes a float batch every step (a batch of 64 at 224 px is
38.5 MiB). glibc serves a block over its mmap threshold (at most 32 MiB by default) with a fresh mmap and unmaps it on
free, so that batch page-faults through 9.4 k fresh zeroed pages every time. Raising the mmap and trim thresholds to
the batch's size makes it come from the heap and stay there between batches. The workers fork after it and inherit it:
each may then keep up to that much freed memory, which is why it is sized to the batch and left off on a GPU. A C
library without glibc's `mallopt` (musl), or one that refuses the size, is left as it is.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
GLIBC_MMAP_CEILING = 32 << 20  # glibc's dynamic mmap threshold grows to this on its own


def idle_threads_sleep() -> None:
    """OMP_WAIT_POLICY=PASSIVE for this process and its children, unless already set."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_large_blocks(block_bytes: int) -> bool:
    """Blocks up to `block_bytes` served from the heap and reused after free; False where nothing changed (blocks
    that small are reused already, or the C library has no `mallopt` or refused)."""
    if block_bytes <= GLIBC_MMAP_CEILING:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    kept = block_bytes + (1 << 20)  # room for the allocator's header and alignment
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, kept)) and bool(mallopt(M_TRIM_THRESHOLD, kept))
