"""Shared helpers for the data-path benchmarks: loadout's config, its data path, timing, and worker memory.

Every benchmark measures both sides of its ratio in one run, interleaved (A B A B, best of each; or item by item,
each item's least time a side, where a ratio must resolve a few per cent), so a machine shared with other jobs
slows both sides alike.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from loadout.data.loader.batch import Batch
from loadout.data.pipeline import DataPipeline
from loadout.dist import DistEnv
from loadout.observe.meter import EpochMeter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the template (train/) from this checkout: the installed package is loadout alone
from train.config import register  # noqa: E402
from train.job import data_from_config  # noqa: E402

DATA = Path(os.environ.get("DATA", ROOT / "data" / "synthetic"))  # the embedded set: 80 px JPEGs
# ImageNet-sized JPEGs for Resize 256 -> RandomCrop 224 (the GPU profiles' sizes): `make bench` makes it
SEED_DATA = Path(os.environ.get("SEED_DATA", ROOT / "data" / "synthetic-320"))
CPU = torch.device("cpu")


def config(*overrides: str, root: Path = DATA):
    """The config as `python -m train hardware=cpu data.root=ROOT ...` composes it."""
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["hardware=cpu", f"data.root={root}", *overrides])


def pipeline(*overrides: str, root: Path = DATA) -> DataPipeline:
    return data_from_config(config(*overrides, root=root), DistEnv(), CPU)


def jpeg_files(root: Path) -> list[Path]:
    """The training JPEGs under `root`, or an error naming the command that makes them."""
    files = sorted((root / "train").glob("*/*.jpg"))
    if not files:
        raise SystemExit(f"no JPEGs under {root}/train: `make bench` makes the benchmark datasets")
    return files


def images_per_s(batches: Iterable, step: Callable[[], None] | None = None) -> float:
    """Images per second over `batches` (loadout/observe/meter.py's EpochMeter), timed from the second batch on (the
    first pays for worker start-up)."""
    meter = EpochMeter()  # times only: no memory sampler
    for index, batch in enumerate(batches):
        meter.waited()
        if step is not None:
            step()
        meter.stepped(batch_size(batch))
        if index == 0:
            meter.restart()
    return meter.summary()["images_per_s"]


def batch_size(batch) -> int:
    """Images in a batch: loadout's Batch, or a stock loader's [images, targets]."""
    return len(batch) if isinstance(batch, Batch) else batch[0].shape[0]


def interleaved_samples(measure_a: Callable[[], float], measure_b: Callable[[], float],
                        rounds: int = 2) -> tuple[list[float], list[float]]:
    """Every measurement of each side, taken A B A B."""
    a, b = [], []
    for _ in range(rounds):
        a.append(measure_a())
        b.append(measure_b())
    return a, b


def interleaved(measure_a: Callable[[], float], measure_b: Callable[[], float], rounds: int = 2,
                best=max) -> tuple[float, float]:
    """Best of `rounds` for each side, measured A B A B."""
    a, b = interleaved_samples(measure_a, measure_b, rounds)
    return best(a), best(b)


def spread(samples: list[float]) -> str:
    return f"{min(samples):.0f}-{max(samples):.0f}"


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{len(os.sched_getaffinity(0))} usable cores, load average {load}, torch {torch.__version__}"


def report(name: str, ratio: float, target: str, ok: bool, detail: str) -> None:
    print(f"{name}: {ratio:.2f} (target {target}) {'PASS' if ok else 'FAIL'}  [{detail}]", flush=True)


def host_batches(data: DataPipeline, epoch: int = 0) -> Iterable:
    """The training stream's uint8 batches as the workers hand them over, before the device copy."""
    data.train.batches.start_epoch, data.train.batches.start_batch = epoch, 0
    return data.train.loader


def first_epoch(data: DataPipeline, batches: Iterator) -> Iterator:
    """The next epoch's batches of `batches` (an iterator over `host_batches(data)`), leaving the rest in it: a
    warm-up epoch and the epochs timed after it are one stream, as in a run. Starting the stream again at epoch 1
    would drop the batches the workers made ahead and restart every reader, which costs a shard reader (its tar
    reopened and read to the sample) more than a folder's."""
    return islice(batches, data.train.batches.batches_per_epoch())


def steady_images_per_s(data: DataPipeline) -> float:
    """Images/s of the training stream's host batches over epochs 1 to the last after a warm-up epoch 0 in the same
    stream (workers started, page cache warm): `data` is built with trainer.epochs >= 2."""
    batches = iter(host_batches(data))
    images_per_s(first_epoch(data, batches))
    return images_per_s(batches)
