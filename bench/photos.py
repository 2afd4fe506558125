#!/usr/bin/env python3
"""12 MP camera photos trained at 224 px: loadout's data path (JPEGs decoded at the DCT scale the resize needs)
against a stock loader (torchvision ImageFolder + PIL + Resize(256) + RandomCrop(224) + flip + ToTensor), data only,
2 workers each, measured in the same rounds (target: loadout / stock >= 5).

Also in the same rounds: loadout with data.scaled_decode=false (what the scaled decode alone buys). The decoder on
320 px and ImageNet-sized JPEGs, where no scale applies, is in bench/decode.py.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from common import ROOT, host_batches, images_per_s, jpeg_files, machine, pipeline, report, spread
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder

PHOTO_DATA = Path(os.environ.get("PHOTO_DATA", ROOT / "data" / "photos-12mp"))
BATCH, WORKERS, ROUNDS, TARGET = 8, 2, 3, 5.0
KIT = (f"data.num_workers={WORKERS}", f"data.batch_size={BATCH}", "data.image_size=224", "trainer.epochs=3",
       "data.persistent_workers=true", "dataset=imagefolder")


def loadout_rate(root: Path, *overrides: str) -> float:
    """Images/s of loadout's host batches over 3 epochs of one persistent loader (timed from its second batch)."""
    with pipeline(*KIT, *overrides, root=root) as data:
        return images_per_s(host_batches(data, 0))


def stock_rate(root: Path) -> float:
    """pytorch/examples' ImageNet loader as written: PIL decode, Resize(256), RandomCrop(224), flip, ToTensor;
    persistent workers, an epoch to warm up, then one timed from its second batch."""
    transform = transforms.Compose([transforms.Resize(256), transforms.RandomCrop(224),
                                    transforms.RandomHorizontalFlip(), transforms.ToTensor()])
    loader = DataLoader(ImageFolder(str(root / "train"), transform), batch_size=BATCH, shuffle=True,
                        num_workers=WORKERS, drop_last=True, persistent_workers=True)
    for _ in loader:
        pass
    return images_per_s(loader)


def rounds(measures: dict, count: int) -> dict[str, list[float]]:
    """Every measurement of each side, taken in turn, `count` rounds."""
    samples = {name: [] for name in measures}
    for _ in range(count):
        for name, measure in measures.items():
            samples[name].append(measure())
    return samples


if __name__ == "__main__":
    files = jpeg_files(PHOTO_DATA)
    megabytes = statistics.median(f.stat().st_size for f in files) / 1e6
    photos = rounds({"loadout": lambda: loadout_rate(PHOTO_DATA),
                     "loadout, full decode": lambda: loadout_rate(PHOTO_DATA, "data.scaled_decode=false"),
                     "stock": lambda: stock_rate(PHOTO_DATA)}, ROUNDS)
    loadout, full, stock = (max(photos[name]) for name in ("loadout", "loadout, full decode", "stock"))
    report("12 MP photos: loadout / stock img/s", loadout / stock, f">= {TARGET:g}", loadout / stock >= TARGET,
           f"{loadout:.0f} vs {stock:.0f} img/s (loadout {spread(photos['loadout'])}, "
           f"stock {spread(photos['stock'])}); "
           f"{len(files)} JPEGs of 4032x3024, median {megabytes:.1f} MB; {WORKERS} workers, batch {BATCH}, "
           f"224 px crops; {machine()}")
    print(f"  12 MP photos, scaled / full decode in loadout: {loadout / full:.2f} ({loadout:.0f} vs {full:.0f} img/s)")
