#!/usr/bin/env python3
"""Packed memmap format vs JPEG ImageFolder: images/s of loadout's loader, same settings (target >= 5)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

from common import DATA, ROOT, interleaved, machine, pipeline, report, steady_images_per_s

SETTINGS = ("data.num_workers=2", "trainer.epochs=4", "data.batch_size=64")


def rate(*overrides: str) -> float:
    return steady_images_per_s(pipeline(*SETTINGS, *overrides))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        # 73 px: the resize size of the cpu profile's 64 px crops
        subprocess.run([sys.executable, str(ROOT / "scripts" / "pack_dataset.py"), str(DATA), tmp, "--size", "73"],
                       check=True, capture_output=True)
        packed, jpeg = interleaved(lambda: rate("dataset=packed", f"data.root={tmp}"), lambda: rate(),
                                   rounds=3)
    report("packed / JPEG img/s", packed / jpeg, ">= 5", packed / jpeg >= 5,
           f"{packed:.0f} vs {jpeg:.0f} img/s, 2 workers, batch 64, 64 px crops; {machine()}")
