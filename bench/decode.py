#!/usr/bin/env python3
"""JPEG decoding in one process, one thread: loadout's decoder (loadout/data/fast/decode.py: simplejpeg, at the DCT
scale the resize needs) against torchvision.io.decode_image and PIL, images/s on the embedded set (80 px), a 320 px set
(Resize 256 -> RandomCrop 224) and ImageNet-sized 500 px JPEGs. At these sizes no DCT scale keeps the resize size,
so every file is decoded whole: loadout / torchvision >= 1 is no regression (12 MP photos: bench/photos.py). The
same on real photographs (scripts/make_photos.py: ~500x375, quality 90), which compress less simply than the
synthetic sets.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import torch
from common import DATA, ROOT, SEED_DATA, jpeg_files, machine, report
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from loadout.data.fast.decode import decode_image_file

IMAGENET_DATA = Path(os.environ.get("IMAGENET_DATA", ROOT / "data" / "synthetic-500"))
REAL_DATA = Path(os.environ.get("REAL_DATA", ROOT / "data" / "photos-500"))
DECODERS = {
    "loadout": lambda raw, side: decode_image_file(raw, side),
    "torchvision": lambda raw, side: decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                                                  mode=ImageReadMode.RGB),
    "PIL": lambda raw, side: F.pil_to_tensor(Image.open(io.BytesIO(raw)).convert("RGB")),
}


def rates(files: list[bytes], resize: int, rounds: int = 5) -> dict[str, float]:
    """Images/s of each decoder from each file's least decode time of `rounds` tries, the decoders taking turns file
    by file: a busy stretch of a shared machine meets them all, and a file's least time is its undisturbed cost."""
    best = {name: [float("inf")] * len(files) for name in DECODERS}
    turns = list(DECODERS.items())
    for round_ in range(rounds):
        for index, raw in enumerate(files):
            first = (round_ + index) % len(turns)  # who goes first rotates: none always meets a cold cache
            for name, decode in turns[first:] + turns[:first]:
                start = time.perf_counter()
                decode(raw, resize)
                best[name][index] = min(best[name][index], time.perf_counter() - start)
    return {name: len(files) / sum(times) for name, times in best.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    sets = ((DATA, 73), (SEED_DATA, 256), (IMAGENET_DATA, 256), (REAL_DATA, 256))  # resize sizes of 64 / 224 px crops
    for root, resize in sets:
        paths = sorted((root / "train").glob("*/*.JPEG")) if root == REAL_DATA else jpeg_files(root)
        if not paths:
            raise SystemExit(f"no JPEGs under {root}/train: `make bench` makes them (scripts/make_photos.py)")
        files = [path.read_bytes() for path in paths[:1000]]
        rate = rates(files, resize)
        ratio = rate['loadout'] / rate["torchvision"]
        report(f"decode loadout / torchvision.io, {root.name}", ratio, ">= 1 (no regression)", ratio >= 1,
               f"loadout {rate['loadout']:.0f}, torchvision.io {rate['torchvision']:.0f}, PIL {rate['PIL']:.0f} img/s "
               f"(loadout / PIL {rate['loadout'] / rate['PIL']:.2f}), {len(files)} JPEGs; {machine()}")
