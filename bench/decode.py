#!/usr/bin/env python3
"""JPEG decoding in one process: torchvision.io.decode_jpeg (libjpeg-turbo) vs PIL, images/s on the embedded set."""

from __future__ import annotations

import io
import time

import torch
from common import DATA, interleaved, machine, report
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

RAW = [p.read_bytes() for p in sorted((DATA / "train").glob("*/*.jpg"))[:1000]]


def torchvision_rate() -> float:
    start = time.perf_counter()
    for raw in RAW:
        decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return len(RAW) / (time.perf_counter() - start)


def pil_rate() -> float:
    start = time.perf_counter()
    for raw in RAW:
        F.pil_to_tensor(Image.open(io.BytesIO(raw)).convert("RGB"))
    return len(RAW) / (time.perf_counter() - start)


if __name__ == "__main__":
    torch.set_num_threads(1)
    tv, pil = interleaved(torchvision_rate, pil_rate, rounds=3)
    report("decode torchvision.io / PIL", tv / pil, "> 1 keeps decode_image the default", tv > pil,
           f"torchvision.io {tv:.0f} img/s, PIL {pil:.0f} img/s, {len(RAW)} JPEGs; {machine()}")
