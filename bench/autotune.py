#!/usr/bin/env python3
"""data.autotune (loadout/data/loader/autotune.py): a training run started badly (data.num_workers=0, prefetch 1) with
autotune on, against the best static loader configuration of this machine, each a real 3-epoch run of the trainer on
the decode-bound run issue 47 names: real photos (`make bench`'s photos-500), RandomResizedCrop 224 + flip, batch 64,
peers.StepModel (a model too small to matter). Each training photo is linked REPEAT times, so an epoch is ten times
the deepest prefetch: otherwise the batches workers make ahead during validation decide a short epoch's figure.

Printed: every run's images/s per epoch, and the tuned run's third epoch over the best static configuration's third
epoch (the same epoch in each run: the same page cache, the same first batch after validation), taken in each round
(the tuned run, then every static one, back to back) and the median over the rounds: a machine shared with other
jobs can change speed many times over between rounds, far less within one. The best static configuration is the one
whose third epoch is fastest by its median over the rounds: each round's fastest would be whichever of two equal
configurations (2 workers at prefetch 2 and 4) the noise favoured. Target: >= 0.95 by the third epoch.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
from pathlib import Path

import torch
from common import config, machine, report
from peers import StepModel
from real_photos import REAL_DATA

from loadout.build import instantiate
from loadout.dist import DistEnv, seed_everything
from train.job import data_from_config
from train.loop.engine import Trainer
from train.task import build_task

CPU = torch.device("cpu")
ROUNDS, TARGET, REPEAT = 3, 0.95, 4
COMMON = ("dataset=imagefolder", "augment=imagenet", "data.batch_size=64", "data.image_size=224",
          "data.prefetch_factor=1", "trainer.epochs=3", "trainer.progress=false", "logger=[]")
STATIC = {"0 workers": ("data.num_workers=0",), "1 worker": ("data.num_workers=1", "data.prefetch_factor=2"),
          "2 workers": ("data.num_workers=2", "data.prefetch_factor=2"),
          "2 workers, prefetch 4": ("data.num_workers=2", "data.prefetch_factor=4")}


def linked(root: Path) -> Path:
    """REAL_DATA under `root` as symlinks: every training photo REPEAT times, the validation photos once."""
    for split, times in (("train", REPEAT), ("val", 1)):
        for photo in (REAL_DATA / split).glob("*/*"):
            folder = root / split / photo.parent.name
            folder.mkdir(parents=True, exist_ok=True)
            for copy in range(times):
                os.symlink(photo, folder / f"{copy}-{photo.name}")
    return root


def epochs_images_per_s(root: Path, *overrides: str) -> list[float]:
    """images/s of each epoch of one real 3-epoch run."""
    cfg = config(*COMMON, *overrides, root=root)
    recipe, task = instantiate("augment", cfg.augment), build_task(cfg)
    with tempfile.TemporaryDirectory() as run_dir, data_from_config(cfg, DistEnv(), CPU, recipe, task=task) as data:
        seed_everything(cfg.trainer.seed, DistEnv())
        trainer = Trainer.from_config(cfg, DistEnv(), CPU, data, StepModel(data.num_classes), Path(run_dir),
                                      recipe=recipe, task=task)
        return [record["images_per_s"] for record in trainer.fit()]


def main() -> None:
    print(machine())
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("loadout.data.loader.autotune").setLevel(logging.INFO)  # its one line a change
    tuned: list[list[float]] = []
    static: dict[str, list[list[float]]] = {name: [] for name in STATIC}
    with tempfile.TemporaryDirectory() as tmp:
        root = linked(Path(tmp))
        for _ in range(ROUNDS):
            tuned.append(epochs_images_per_s(root, "data.num_workers=0", "data.autotune=true"))
            print(f"  autotune from 0 workers, prefetch 1: {' / '.join(f'{x:.0f}' for x in tuned[-1])} img/s by "
                  "epoch", flush=True)
            for name, overrides in STATIC.items():
                static[name].append(epochs_images_per_s(root, *overrides, "data.autotune=false"))
                print(f"  static {name}: {' / '.join(f'{x:.0f}' for x in static[name][-1])} img/s by epoch",
                      flush=True)
    best = max(static, key=lambda name: statistics.median(run[2] for run in static[name]))
    ratios = [run[2] / static[best][round_][2] for round_, run in enumerate(tuned)]
    ratio = statistics.median(ratios)
    report("autotune from num_workers=0 / best static, epoch 3", ratio, f">= {TARGET}", ratio >= TARGET,
           f"median of {ROUNDS} rounds, each {', '.join(f'{r:.2f}' for r in ratios)}; best static: {best}; "
           f"{REAL_DATA.name} x{REPEAT} an epoch")


if __name__ == "__main__":
    main()
