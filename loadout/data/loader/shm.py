"""Shared memory (/dev/shm) for DataLoader workers: the one message that says it is too small, and the fix.

Workers hand batches to the main process through shared memory. Docker gives a container 64 MiB of /dev/shm by
default, which a few workers with image batches overflow; the symptom is a worker killed by a "Bus error" or
"unable to write to file </torch_...>: No space left on device". The loader's need (plan.LoaderPlan.shm_bytes) is
checked before any worker starts, and a worker that dies of it later is explained with the same fix.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings

log = logging.getLogger(__name__)

SHM_PATH = "/dev/shm"
SHM_FIX = ("give the container more shared memory (compose `shm_size: {size}` or `ipc: host`, `docker run "
           "--shm-size={size}` or `--ipc=host`), or lower data.num_workers, data.prefetch_factor or data.batch_size")


def _human(n: int) -> str:
    """Bytes in the unit docker's --shm-size accepts, rounded up: 1536 MiB -> '2g', 200 MiB -> '200m'."""
    mib = -(-n // (1 << 20))
    return f"{-(-mib // 1024)}g" if mib >= 1024 else f"{max(mib, 1)}m"


def shm_fix(size: int | None = None) -> str:
    """The fix for too little shared memory, with a size when one is known."""
    return SHM_FIX.format(size=_human(size) if size else "8g")


def check_shm(required_bytes: int, path: str = SHM_PATH) -> str | None:
    """A one-line warning with the fix when `path` has less free space than `required_bytes`, else None. A missing
    `path` (macOS, Windows) gives None: those platforms do not pass batches through /dev/shm."""
    if required_bytes <= 0 or not os.path.isdir(path):
        return None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    if usage.free >= required_bytes:
        return None
    suggested = max(required_bytes, usage.total + required_bytes - usage.free)
    return (f"{path} has {_human(usage.free)} free of {_human(usage.total)} but the DataLoader workers may need "
            f"~{_human(required_bytes)}; workers can die with 'Bus error'. Fix: {shm_fix(suggested)}")


def warn_if_shm_too_small(required_bytes: int, path: str = SHM_PATH) -> bool:
    """Log (and `warnings.warn`) `check_shm`'s message; True when there was one. Before the workers start."""
    message = check_shm(required_bytes, path)
    if message is None:
        return False
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return True
