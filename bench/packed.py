#!/usr/bin/env python3
"""Packed memmap format vs JPEG ImageFolder: images/s of the kit's loader, same settings (target >= 5)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import DATA, interleaved, machine, pipeline, report, steady_images_per_s

from train.data.datasets import ImageFolderDataset
from train.data.packed import pack_split

SETTINGS = ("data.num_workers=2", "trainer.epochs=4", "data.batch_size=64")


def rate(*overrides: str) -> float:
    return steady_images_per_s(pipeline(*SETTINGS, *overrides))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for split in ("train", "val"):  # 73 px: the resize size of the cpu profile's 64 px crops
            pack_split(ImageFolderDataset(DATA / split), Path(tmp) / split, 73, num_workers=2)
        packed, jpeg = interleaved(lambda: rate("dataset=packed", f"data.root={tmp}"), lambda: rate(),
                                   rounds=3)
    report("packed / JPEG img/s", packed / jpeg, ">= 5", packed / jpeg >= 5,
           f"{packed:.0f} vs {jpeg:.0f} img/s, 2 workers, batch 64, 64 px crops; {machine()}")
