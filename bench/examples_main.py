#!/usr/bin/env python3
"""A short run, whole process, against pytorch/examples' imagenet `main.py` run as its README says (issue 47 item 3).

The same model, data (scripts/make_photos.py's real photos), epochs, batch size and workers on each side, each side a
fresh process timed from its start to its exit: `python -m train` at its defaults for this box (hardware=cpu:
precision auto, channels_last, the imagenet recipe) and the stock script, unmodified (bench/third_party/, pinned
below), which trains in fp32 with PIL, RandomResizedCrop + flip + ToTensor + Normalize in its workers. Rounds run the
sides in turn, reversed every other round; the median wall time of each side is compared: stock / loadout >= 1.5.
ARCHS, EPOCHS and ROUNDS come from the environment (defaults: shufflenet_v2_x0_5 and resnet18, 1 epoch, 2 rounds).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, report, spread
from real_photos import REAL_DATA

MAIN = ROOT / "bench" / "third_party" / "pytorch_examples_imagenet_main.py"  # pytorch/examples@77f55b9, BSD-3
ARCHS = os.environ.get("ARCHS", "shufflenet_v2_x0_5,resnet18").split(",")
EPOCHS, ROUNDS = int(os.environ.get("EPOCHS", 1)), int(os.environ.get("ROUNDS", 2))
BATCH, WORKERS, TARGET = 64, 2, 1.5


def wall_seconds(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stdout + done.stderr).strip().splitlines()
        raise SystemExit(f"examples_main: {' '.join(command[:4])} ... exited {done.returncode}: {lines[-1:]}")
    return time.perf_counter() - start


def loadout(arch: str, tmp: Path) -> list[str]:
    return [sys.executable, "-m", "train", "hardware=cpu", f"data.root={REAL_DATA}", "dataset=imagefolder",
            "augment=imagenet", "data.image_size=224", f"data.batch_size={BATCH}", f"data.num_workers={WORKERS}",
            f"trainer.epochs={EPOCHS}", f"model.name={arch}", "trainer.progress=false",
            f"hydra.run.dir={tempfile.mkdtemp(dir=tmp)}"]


def stock(arch: str) -> list[str]:
    return [sys.executable, str(MAIN), "-a", arch, "-j", str(WORKERS), "-b", str(BATCH), "--epochs", str(EPOCHS),
            "--no-accel", str(REAL_DATA)]


def main() -> None:
    print(f"{REAL_DATA}: {EPOCHS} epoch(s), batch {BATCH}, {WORKERS} workers, {ROUNDS} interleaved rounds; "
          f"{machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="examples-main-") as tmp_dir:
        tmp = Path(tmp_dir)
        for arch in ARCHS:
            sides = {"loadout": lambda arch=arch: wall_seconds(loadout(arch, tmp), ROOT),
                     "stock": lambda arch=arch: wall_seconds(stock(arch), tmp)}  # main.py saves checkpoints in cwd
            times: dict[str, list[float]] = {side: [] for side in sides}
            for index in range(ROUNDS):
                for side in list(sides) if index % 2 == 0 else list(sides)[::-1]:
                    times[side].append(sides[side]())
                print(f"  {arch} round {index + 1}: " + ", ".join(f"{side} {values[-1]:.1f} s"
                                                                  for side, values in times.items()), flush=True)
            median = {side: statistics.median(values) for side, values in times.items()}
            ratio = median["stock"] / median["loadout"]
            report(f"{arch}, whole run: pytorch/examples main.py / python -m train (wall)", ratio, f">= {TARGET}",
                   ratio >= TARGET, f"medians {median['stock']:.1f} vs {median['loadout']:.1f} s (stock "
                                    f"{spread(times['stock'])}, loadout {spread(times['loadout'])}); {machine()}")


if __name__ == "__main__":
    main()
