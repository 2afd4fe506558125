"""The `data:` section: where the dataset lives, the image sizes and every DataLoader knob, typed here beside the
loader that reads it (loadout/data/loader/plan.py), with the checks Hydra cannot make.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loadout.errors import bad_value, shown

# The closed choices, enforced by OmegaConf as the command line is read; a StrEnum equals its text ("cpu").
Sampler = StrEnum("Sampler", ["auto", "random", "sequential", "weighted", "distributed"])
MultiprocessingContext = StrEnum("MultiprocessingContext", ["fork", "spawn", "forkserver"])
OnBadSample = StrEnum("OnBadSample", ["warn", "raise"])
Decode = StrEnum("Decode", ["cpu", "device"])
# DataLoader knobs that mean something only with workers, and the values that leave each off (the first is set).
WORKER_ONLY_KNOBS: dict[str, tuple] = {
    "prefetch_factor": (None,),
    "persistent_workers": (False,),
    "timeout": (None, 0),
    "multiprocessing_context": (None,),
}


@dataclass
class DataConfig:
    """Where the dataset lives, the image sizes, and every DataLoader knob under DataLoader's own name."""

    root: str = "data/synthetic"
    image_size: int = 64
    resize_size: int | None = None  # default: image_size * 256 / 224 (the ImageNet recipe)
    # DataLoader knobs. batch_size is per process (per GPU) under torchrun.
    batch_size: int = 32
    shuffle: bool = True
    sampler: Sampler = Sampler.auto
    num_workers: Any = "auto"  # an integer, or "auto" = floor(0.75 * usable cores / processes on this node)
    pin_memory: bool = False
    prefetch_factor: int | None = None  # batches per worker; None = DataLoader's default
    persistent_workers: bool = False
    drop_last: bool = True
    timeout: float | None = None  # seconds a worker may take for one batch; null = 600 with workers, 0 = forever
    multiprocessing_context: MultiprocessingContext | None = None
    in_order: bool = True
    # Host-to-device path.
    non_blocking: bool = True
    device_transforms: bool = True  # uint8 to the device, normalize there
    # Data-path extras.
    scaled_decode: bool = True  # decode large JPEGs at the DCT scale (1/2, 1/4, 1/8) the resize needs, not whole
    cache_bytes: int = 0  # shared-memory cache of decoded training samples (JPEG datasets); 0 = off
    on_bad_sample: OnBadSample = OnBadSample.warn  # warn (skip and count) | raise
    # cpu: workers decode | device: workers ship encoded bytes, the batch is decoded on the training device
    # (torchcodec: batched nvJPEG on CUDA; loadout/data/fast/encoded.py)
    decode: Decode = Decode.cpu
    # between epochs and once within a long first epoch: the worker count the measured pace asks (within the cores'
    # share and memory), or a deeper prefetch, where the diagnosis says the workers are the bound; fewer when memory
    # nears its limit (loadout/data/loader/autotune.py)
    autotune: bool = False


def drop_worker_knobs(cfg: Any, typed: set[str] = frozenset()) -> list[str]:
    """With data.num_workers=0 the worker-only knobs mean nothing: those not `typed` on the command line (a
    profile's, a sweep's) are turned off, so `hardware=a100 data.num_workers=0` works. Returns the keys changed."""
    changed = []
    if cfg.data.num_workers != 0:
        return changed
    for key, off in WORKER_ONLY_KNOBS.items():
        if cfg.data[key] not in off and f"data.{key}" not in typed:
            cfg.data[key] = off[0]
            changed.append(f"data.{key}")
    return changed


def check_values(data: Any) -> None:
    """Reject `data:` values that cannot work, naming the key and the fix, before any worker starts: the composed
    `data:` section or a plain `DataConfig` (build_data checks what it is given)."""
    if data.decode == "device" and not data.device_transforms:
        bad_value("data.decode", data.decode, "decoded on the device, images are normalized there too: set "
              "data.device_transforms=true")
    if data.decode == "device" and data.cache_bytes:
        bad_value("data.cache_bytes", data.cache_bytes, "the sample cache holds CPU-decoded pixels: set it to 0 with "
              "data.decode=device")
    nw = data.num_workers
    if not (nw == "auto" or (isinstance(nw, int) and not isinstance(nw, bool))):
        bad_value("data.num_workers", nw, "use an integer >= 0 or auto")
    for key in ("batch_size", "image_size"):
        if getattr(data, key) < 1:
            bad_value(f"data.{key}", getattr(data, key), "use a positive integer")
    for key in ("timeout", "cache_bytes"):
        if (getattr(data, key) or 0) < 0:
            bad_value(f"data.{key}", getattr(data, key), "use a number >= 0")
    if data.resize_size is not None and data.resize_size < data.image_size:
        bad_value("data.resize_size", data.resize_size, f"use a size >= data.image_size ({data.image_size}) or null")
    if isinstance(nw, int) and nw < 0:
        bad_value("data.num_workers", nw, "use an integer >= 0 or auto")
    if data.prefetch_factor is not None and data.prefetch_factor < 1:
        bad_value("data.prefetch_factor", data.prefetch_factor, "use an integer >= 1 or null")


def check_data(data: Any) -> None:
    """`check_values`, and a worker-only knob typed with data.num_workers=0 (after `drop_worker_knobs`, which turns
    off those a profile set): the command line's check. The loader itself ignores them without workers (a run that
    data.autotune starts at 0 workers keeps its prefetch depth for later)."""
    check_values(data)
    nw = data.num_workers
    for key, off in WORKER_ONLY_KNOBS.items():
        value = getattr(data, key)
        if nw == 0 and value not in off:
            bad_value(f"data.{key}", value, f"only valid with data.num_workers > 0: set data.{key}={shown(off[0])} "
                      "or raise data.num_workers")
