#!/usr/bin/env python3
"""DirectCompose (loadout/data/transforms.py: v2's steps called directly on one tensor) against a plain v2.Compose of
the same steps: whole-loader images/s (2 workers, real JPEG decode, the training transform, uint8 batches), on the
default path (data/synthetic, 64 px, augment=crop_flip) and on ImageNet's recipe over real photos (data/photos-500,
224 px, augment=imagenet, crop-aware decode either way). DirectCompose earns its place if the default path gains
>= 3 %; rounds alternate the two sides and the ratio is the median of each round's pair.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from common import CPU, DATA, ROOT, config, host_batches, images_per_s, machine, report, spread
from torchvision.transforms import v2

from loadout.build import instantiate
from loadout.dist import DistEnv
from train.job import data_from_config

REAL_DATA = Path(os.environ.get("REAL_DATA", ROOT / "data" / "photos-500"))
ROUNDS, TARGET = 5, 1.03
LOADER = ("data.num_workers=2", "data.batch_size=64")
PATHS = {  # name: (root, overrides, epochs a measurement reads, whether the decision rests on it)
    "default (synthetic 64 px, crop_flip)": (DATA, ("augment=crop_flip",), 6, True),
    "photos-500 224 px, imagenet": (REAL_DATA, ("augment=imagenet", "dataset=imagefolder", "data.image_size=224"), 2,
                                    False),
}


class PlainCompose:
    """A recipe whose pipelines are the same steps in a plain v2.Compose."""

    def __init__(self, recipe):
        self.recipe = recipe

    def train_transform(self, data_cfg, input_size: int | None = None) -> v2.Compose:
        return v2.Compose(list(self.recipe.train_transform(data_cfg, input_size).transforms))

    def val_transform(self, data_cfg, input_size: int | None = None) -> v2.Compose:
        return v2.Compose(list(self.recipe.val_transform(data_cfg, input_size).transforms))


def rate(root: Path, overrides: tuple[str, ...], epochs: int, plain: bool) -> float:
    """Images/s over `epochs` epochs of one pipeline's training batches, from the second batch on."""
    cfg = config(*LOADER, *overrides, f"trainer.epochs={epochs}", root=root)
    recipe = instantiate("augment", cfg.augment)
    with data_from_config(cfg, DistEnv(), CPU, PlainCompose(recipe) if plain else recipe) as data:
        kind = type(data.samples[0].transform).__name__
        assert (kind == "Compose") == plain, kind
        return images_per_s(host_batches(data, 0))


if __name__ == "__main__":
    if not any((REAL_DATA / "train").glob("*/*.JPEG")):
        raise SystemExit(f"no JPEGs under {REAL_DATA}/train: `make bench` makes them (scripts/make_photos.py)")
    for name, (root, overrides, epochs, decides) in PATHS.items():
        direct, plain = [], []
        for _ in range(ROUNDS):
            direct.append(rate(root, overrides, epochs, plain=False))
            plain.append(rate(root, overrides, epochs, plain=True))
        ratio = statistics.median(d / p for d, p in zip(direct, plain, strict=True))
        detail = (f"DirectCompose {spread(direct)}, v2.Compose {spread(plain)} img/s over {ROUNDS} alternating rounds "
                  f"(best / best {max(direct) / max(plain):.2f}), 2 workers, batch 64; {machine()}")
        name = f"compose DirectCompose / v2.Compose loader img/s, {name}"
        if decides:
            report(name, ratio, f">= {TARGET} to keep it", ratio >= TARGET, detail)
        else:
            print(f"{name}: {ratio:.2f} (reference) [{detail}]", flush=True)
