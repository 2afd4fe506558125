#!/usr/bin/env python3
"""JPEG decoding in one process: torchvision.io.decode_jpeg (libjpeg-turbo) vs PIL, images/s on the embedded set
(80 px) and on the seed pipeline's ImageNet-sized set (320 px)."""

from __future__ import annotations

import io
import time
from functools import partial

import torch
from common import DATA, SEED_DATA, interleaved, jpeg_files, machine, report
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F


def torchvision_rate(files: list[bytes]) -> float:
    start = time.perf_counter()
    for raw in files:
        decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return len(files) / (time.perf_counter() - start)


def pil_rate(files: list[bytes]) -> float:
    start = time.perf_counter()
    for raw in files:
        F.pil_to_tensor(Image.open(io.BytesIO(raw)).convert("RGB"))
    return len(files) / (time.perf_counter() - start)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for root in (DATA, SEED_DATA):
        files = [path.read_bytes() for path in jpeg_files(root)[:1000]]
        tv, pil = interleaved(partial(torchvision_rate, files), partial(pil_rate, files), rounds=3)
        report(f"decode torchvision.io / PIL, {root.name}", tv / pil, "> 1 keeps decode_image the default", tv > pil,
               f"torchvision.io {tv:.0f} img/s, PIL {pil:.0f} img/s, {len(files)} JPEGs; {machine()}")
