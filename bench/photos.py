#!/usr/bin/env python3
"""12 MP camera photos trained at 224 px: the kit's data path (JPEGs decoded at the DCT scale the resize needs)
against a stock loader (torchvision ImageFolder + PIL + Resize(256) + RandomCrop(224) + flip + ToTensor), data only,
2 workers each, measured in the same rounds (target: kit / stock >= 5).

Also in the same rounds: the kit with data.scaled_decode=false (what the scaled decode alone buys). Then the decoder
itself against torchvision's `decode_image` (what the kit used before), one thread, on the 320 px set and on
ImageNet-sized 500 px JPEGs, where no DCT scale keeps the 256 px resize size and the file is decoded whole:
>= 1.00 is no regression.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from common import ROOT, SEED_DATA, host_batches, images_per_s, jpeg_files, machine, pipeline, report, spread
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image

from train.data.decode import decode_image_file
from train.data.workers import one_torch_thread

PHOTO_DATA = Path(os.environ.get("PHOTO_DATA", ROOT / "data" / "photos-12mp"))
IMAGENET_DATA = Path(os.environ.get("IMAGENET_DATA", ROOT / "data" / "synthetic-500"))
BATCH, WORKERS, ROUNDS, TARGET = 8, 2, 3, 5.0
KIT = (f"data.num_workers={WORKERS}", f"data.batch_size={BATCH}", "data.image_size=224", "trainer.epochs=3",
       "data.persistent_workers=true", "data.dataset=imagefolder")


def kit_rate(root: Path, *overrides: str) -> float:
    """Images/s of the kit's host batches over 3 epochs of one persistent loader (timed from its second batch)."""
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


def decode_ms(root: Path) -> tuple[float, float]:
    """Milliseconds per file, best of 3 passes each, interleaved: the kit's decoder (resize size 256) and
    torchvision's, on one thread."""
    datas = [path.read_bytes() for path in jpeg_files(root)]
    decoders = (lambda data: decode_image_file(data, 256),
                lambda data: decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB))
    best = [float("inf"), float("inf")]
    with one_torch_thread():
        for _ in range(3):
            for i, decode in enumerate(decoders):
                start = time.perf_counter()
                for data in datas:
                    decode(data)
                best[i] = min(best[i], (time.perf_counter() - start) / len(datas) * 1e3)
    return best[0], best[1]


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
    photos = rounds({"kit": lambda: kit_rate(PHOTO_DATA),
                     "kit, full decode": lambda: kit_rate(PHOTO_DATA, "data.scaled_decode=false"),
                     "stock": lambda: stock_rate(PHOTO_DATA)}, ROUNDS)
    kit, full, stock = (max(photos[name]) for name in ("kit", "kit, full decode", "stock"))
    report("12 MP photos: kit / stock img/s", kit / stock, f">= {TARGET:g}", kit / stock >= TARGET,
           f"{kit:.0f} vs {stock:.0f} img/s (kit {spread(photos['kit'])}, stock {spread(photos['stock'])}); "
           f"{len(files)} JPEGs of 4032x3024, median {megabytes:.1f} MB; {WORKERS} workers, batch {BATCH}, "
           f"224 px crops; {machine()}")
    print(f"  12 MP photos, scaled / full decode in the kit: {kit / full:.2f} ({kit:.0f} vs {full:.0f} img/s)")
    for name, root in (("320 px", SEED_DATA), ("500 px (ImageNet-sized)", IMAGENET_DATA)):
        ours, theirs = decode_ms(root)
        print(f"  {name}: decode_image_file / torchvision decode_image per file: {theirs / ours:.2f} "
              f"({ours:.2f} vs {theirs:.2f} ms; >= 1.00 is no regression)")
