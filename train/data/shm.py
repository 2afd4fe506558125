"""Shared-memory (/dev/shm) check for DataLoader workers.

Worker processes hand batches to the main process through shared memory. Docker gives a container 64 MiB of
/dev/shm by default, which a few workers with image batches overflow; the symptom is a worker killed by a
"Bus error" or "unable to write to file </torch_...>: No space left on device". This module estimates what the
loader needs and warns, with the fix, before any worker starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings

log = logging.getLogger(__name__)

SHM_PATH = "/dev/shm"


def _human(n: int) -> str:
    """Bytes in the unit docker's --shm-size accepts, rounded up: 1536 MiB -> '2g', 200 MiB -> '200m'."""
    mib = -(-n // (1 << 20))
    return f"{-(-mib // 1024)}g" if mib >= 1024 else f"{max(mib, 1)}m"


RING_SPARE_SLOTS = 2  # the batch ring (ring.py) keeps prefetch_factor + 2 slots per worker


def estimate_loader_shm_bytes(
    num_workers: int, prefetch_factor: int, batch_bytes: int, headroom: float = 1.25
) -> int:
    """Shared memory a DataLoader holds: the batch ring's `prefetch_factor + 2` slots per worker (ring.py), for the
    loader's lifetime.

    `headroom` covers the small per-batch segments and allocator slack. Returns 0 for `num_workers == 0` (batches
    are built in the main process, no shm).
    """
    if num_workers < 0 or prefetch_factor < 0 or batch_bytes < 0 or headroom < 0:
        raise ValueError("num_workers, prefetch_factor, batch_bytes and headroom must be >= 0")
    if num_workers == 0:
        return 0
    return int(num_workers * (max(prefetch_factor, 1) + RING_SPARE_SLOTS) * batch_bytes * headroom)


def check_shm(required_bytes: int, path: str = SHM_PATH) -> str | None:
    """A one-line warning with the fix when `path` has less free space than `required_bytes`, else None.

    A missing `path` (macOS, Windows) gives None: those platforms do not pass batches through /dev/shm.
    """
    if required_bytes <= 0 or not os.path.isdir(path):
        return None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    if usage.free >= required_bytes:
        return None
    suggested = _human(max(required_bytes, usage.total + required_bytes - usage.free))
    return (
        f"{path} has {_human(usage.free)} free of {_human(usage.total)} but the DataLoader workers may need "
        f"~{_human(required_bytes)}; workers can die with 'Bus error'. Fix: compose `shm_size: {suggested}` "
        f"(or `ipc: host`), `docker run --shm-size={suggested}` (or `--ipc=host`), "
        f"or lower data.num_workers / data.prefetch_factor / data.batch_size."
    )


def warn_if_shm_too_small(
    num_workers: int, prefetch_factor: int, batch_bytes: int, path: str = SHM_PATH
) -> bool:
    """Log (and `warnings.warn`) when the loader's estimated shared memory exceeds free space at `path`.

    Returns True when a warning was issued. Call it before the DataLoader's workers start.
    """
    message = check_shm(estimate_loader_shm_bytes(num_workers, prefetch_factor, batch_bytes), path)
    if message is None:
        return False
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return True
