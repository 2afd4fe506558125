#!/usr/bin/env python3
"""ImageNet's recipe on real photographs (scripts/make_photos.py: ~500x375 JPEGs of quality 90): RandomResizedCrop
224 + flip, data only, 2 workers, uint8 batches. loadout (augment=imagenet: crop-aware decode) against stock
torchvision loaders, all measured in the same rounds (targets: loadout / stock >= 2, loadout >= 600 img/s per
usable core).

Two stock loaders, both ImageFolder + v2 + DataLoader at the same batch and workers: torchvision's documented v2
recipe (the default PIL loader, v2.ToImage -> RandomResizedCrop -> RandomHorizontalFlip; "stock, PIL") and the same
with torchvision.io's libjpeg-turbo decoder (`loader=decode_image`; "stock, torchvision.io"); the target holds
against the faster of the two. Also in the same rounds: loadout with data.scaled_decode=false (whole-image decode,
then the crop), which shows what decoding only the crop's pixels buys. Where a sample's time goes, stage by stage:
bench/sample_path.py.
"""

from __future__ import annotations

import os
import statistics
from functools import partial
from itertools import chain
from pathlib import Path

from common import ROOT, images_per_s, machine, pipeline, report, spread, steady_images_per_s
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

REAL_DATA = Path(os.environ.get("REAL_DATA", ROOT / "data" / "photos-500"))
BATCH, WORKERS, EPOCHS, ROUNDS = 64, 2, 2, 3
RATIO_TARGET, PER_CORE_TARGET = 2.0, 600
KIT = ("augment=imagenet", "dataset=imagefolder", "data.image_size=224", f"data.num_workers={WORKERS}",
       f"data.batch_size={BATCH}", f"trainer.epochs={EPOCHS + 1}")


def photo_files(root: Path) -> list[Path]:
    files = sorted((root / "train").glob("*/*.JPEG"))
    if not files:
        raise SystemExit(f"no JPEGs under {root}/train: `make bench` makes them (scripts/make_photos.py)")
    return files


def loadout_rate(*overrides: str) -> float:
    with pipeline(*KIT, *overrides, root=REAL_DATA) as data:
        return steady_images_per_s(data)


def decode_rgb(path: str):
    return decode_image(path, mode=ImageReadMode.RGB)


def stock_rate(torchvision_io: bool) -> float:
    """ImageFolder + v2 RandomResizedCrop(224) + flip + DataLoader, uint8 out; warm-up epoch, then EPOCHS timed."""
    steps = [v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]
    extra = {"loader": decode_rgb} if torchvision_io else {}
    transform = v2.Compose(steps if torchvision_io else [v2.ToImage(), *steps])
    dataset = ImageFolder(str(REAL_DATA / "train"), transform=transform, **extra)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=WORKERS,
                        persistent_workers=True)
    images_per_s(loader)
    return images_per_s(chain.from_iterable(loader for _ in range(EPOCHS)))


if __name__ == "__main__":
    files = photo_files(REAL_DATA)
    kilobytes = statistics.median(f.stat().st_size for f in files) / 1e3
    sides = {"loadout": loadout_rate, "loadout, whole decode": partial(loadout_rate, "data.scaled_decode=false"),
             "stock, torchvision.io": partial(stock_rate, True), "stock, PIL": partial(stock_rate, False)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(ROUNDS):
        for name, side in sides.items():
            rates[name].append(side())
    best = {name: max(values) for name, values in rates.items()}
    stock = max(best["stock, torchvision.io"], best["stock, PIL"])
    cores = len(os.sched_getaffinity(0))
    detail = (f"loadout {best['loadout']:.0f} ({spread(rates['loadout'])}), whole decode "
              f"{best['loadout, whole decode']:.0f}, stock torchvision.io {best['stock, torchvision.io']:.0f} "
              f"({spread(rates['stock, torchvision.io'])}), stock PIL {best['stock, PIL']:.0f} img/s; "
              f"{len(files)} JPEGs, median {kilobytes:.0f} kB; {WORKERS} workers, batch {BATCH}; {machine()}")
    report("real photos, RandomResizedCrop 224: loadout / stock img/s", best["loadout"] / stock,
           f">= {RATIO_TARGET:g}", best["loadout"] / stock >= RATIO_TARGET, detail)
    per_core = best["loadout"] / cores
    report("real photos, RandomResizedCrop 224: loadout img/s per core", per_core, f">= {PER_CORE_TARGET}",
           per_core >= PER_CORE_TARGET, f"{best['loadout']:.0f} img/s on {cores} usable cores")
    print(f"  real photos, crop-aware / whole decode in loadout: {best['loadout'] / best['loadout, whole decode']:.2f}",
          flush=True)
