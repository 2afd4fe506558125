#!/usr/bin/env python3
"""Segmentation's loader over classification's, images/s at the same image size (target >= 0.8): data only.

Both read the same JPEGs, each file by voc.read_file, through loadout's Samples path and a DataLoader with its
shared-memory ring and data.num_workers workers, to data.image_size, at two sizes, a line each: the embedded
VOC-layout set (data/synthetic-voc: 80 px, to 64 px, the cpu profile's size) and a VOC-sized one
(data/synthetic-voc-320, which `make bench` makes: 320 px, to 224 px from a 256 base, the GPU profiles' sizes and
close to Pascal VOC's ~500x375 photos). Classification takes each image with a label through its default recipe
(augment=crop_flip: Resize -> RandomCrop -> flip); segmentation takes the image and its PNG mask through
augment=segmentation (scale -> crop as ScaledCrop -> flip, one draw for both). The difference is the mask: its file
read, its PNG decode, its geometry, its bytes through the hand-over. A mask's PNG decode has a fixed cost (~18 us
through libpng or any other decoder) about that of a whole 80 px JPEG, so the small set weighs it far more than
photos do. Under each, the second line gives the CPU time per image of all the loader's processes (its workers' and
the main one's), whose ratio a machine shared with other jobs shifts far less than the images/s; the third each
stage's cost per sample in one thread's CPU time: where the ratio goes.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import ROOT, images_per_s, interleaved_samples, machine, report, spread
from torch.utils.data import DataLoader

from loadout.data.fast.decode import decode_image_file
from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.ring import build_collate
from loadout.data.loader.workers import one_torch_thread
from loadout.data.masks import decode_mask
from loadout.data.samples import Samples
from loadout.data.seg_augment import SegmentationRecipe, joint
from loadout.data.voc import VOCSegmentation, read_file
from train.augment import Recipe

VOC_DATA = Path(os.environ.get("VOC_DATA", ROOT / "data" / "synthetic-voc"))
VOC_SEED_DATA = Path(os.environ.get("VOC_SEED_DATA", ROOT / "data" / "synthetic-voc-320"))
WORKERS, BATCH = 2, 64


@dataclass(frozen=True)
class DataCfg:
    """The data config keys the recipes read, and how many epochs to measure at that size."""

    image_size: int
    epochs: int
    resize_size: int | None = None
    device_transforms: bool = True


SIZES = ((VOC_DATA, DataCfg(image_size=64, epochs=8)), (VOC_SEED_DATA, DataCfg(image_size=224, epochs=4)))


class ImagesOnly:
    """The VOC set's images, each with a label: what a classifier's source gives."""

    def __init__(self, source: VOCSegmentation):
        self.source, self.classes = source, source.classes

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):  # read as VOCSegmentation reads its image: the mask is the difference
        return decode_image_file(read_file(self.source.paths[index].decode())), 0


def loader(source, transform, data_cfg: DataCfg) -> DataLoader:
    """The loader `python -m train` builds for the task: a mask ring beside the images' where samples have masks."""
    plan = LoaderPlan(num_workers=WORKERS, batch_size=BATCH, prefetch_factor=2, pin_memory=False,
                      image_size=data_cfg.image_size, dtype=torch.uint8, masks=isinstance(source, VOCSegmentation))
    keys = [(epoch, index) for epoch in range(data_cfg.epochs) for index in torch.randperm(len(source)).tolist()]
    return DataLoader(Samples(source, transform, seed=0), sampler=keys, batch_size=BATCH, num_workers=WORKERS,
                      collate_fn=build_collate(plan))


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have been joined (a loader's workers, once it ends)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def measure(source, transform, data_cfg: DataCfg) -> tuple[float, float]:
    """(images/s, CPU microseconds per image over all the loader's processes) of one pass of `loader`."""
    start = cpu_seconds()
    rate = images_per_s(loader(source, transform, data_cfg))  # exhausted: its workers are joined
    return rate, (cpu_seconds() - start) / (data_cfg.epochs * len(source)) * 1e6


def cpu_us(work: Callable[[int], object], count: int) -> float:
    """One thread's CPU time per call of work(0..count-1), best of 3 passes, in microseconds."""
    best = float("inf")
    for _ in range(3):
        torch.manual_seed(0)
        start = time.thread_time()
        for index in range(count):
            work(index)
        best = min(best, time.thread_time() - start)
    return best / count * 1e6


def stage_costs(voc: VOCSegmentation, classify, segment, count: int = 100) -> str:
    """Per sample, one thread: the mask's file read, the decodes and each recipe's transform."""
    mask_paths = [voc.mask_paths[i].decode() for i in range(count)]
    images = [Path(voc.paths[i].decode()).read_bytes() for i in range(count)]
    masks = [read_file(path) for path in mask_paths]
    decoded = [decode_image_file(data) for data in images]
    decoded_masks = [decode_mask(data) for data in masks]
    pair = joint(segment)  # as Samples calls it
    with one_torch_thread():  # as a worker runs; the next size's loaders get the process's threads back
        costs = {"mask read": cpu_us(lambda i: read_file(mask_paths[i]), count),
                 "image decode": cpu_us(lambda i: decode_image_file(images[i]), count),
                 "mask decode": cpu_us(lambda i: decode_mask(masks[i]), count),
                 "classification transform": cpu_us(lambda i: classify(decoded[i]), count),
                 "segmentation transform (image + mask)": cpu_us(lambda i: pair(decoded[i], decoded_masks[i]),
                                                                 count)}
    return ", ".join(f"{name} {us:.0f}" for name, us in costs.items())


def compare(root: Path, data_cfg: DataCfg) -> None:
    """The three lines of one image size."""
    voc = VOCSegmentation(root)
    stored = decode_image_file(read_file(voc.paths[0].decode())).shape[-1]
    classify = Recipe(crop="random").train_transform(data_cfg)
    segment = SegmentationRecipe().train_transform(data_cfg)
    seg, cls = interleaved_samples(lambda: measure(voc, segment, data_cfg),
                                   lambda: measure(ImagesOnly(voc), classify, data_cfg), rounds=3)
    (seg_rate, seg_cpu), (cls_rate, cls_cpu) = zip(*seg, strict=True), zip(*cls, strict=True)
    ratio = max(seg_rate) / max(cls_rate)
    report(f"segmentation loader / classification loader at {data_cfg.image_size} px", ratio, ">= 0.8",
           ratio >= 0.8, f"images/s at {data_cfg.image_size} px from {len(voc)} {stored} px JPEGs ({root.name}), "
           f"{WORKERS} workers, batch {BATCH}: segmentation {spread(seg_rate)}, classification {spread(cls_rate)}; "
           f"{machine()}")
    print(f"  CPU per image, all the loader's processes, us: segmentation {spread(seg_cpu)}, classification "
          f"{spread(cls_cpu)}: classification / segmentation {min(cls_cpu) / min(seg_cpu):.2f}", flush=True)
    print(f"  per sample, us of one thread's CPU: {stage_costs(voc, classify, segment)}", flush=True)


def main() -> None:
    for root, _ in SIZES:
        if not (root / ".complete").exists():
            raise SystemExit(f"no {root}: `make dataset` makes data/synthetic-voc, `make bench` both "
                             "(scripts/make_dataset.py --task segmentation --size N --out DIR)")
    for root, data_cfg in SIZES:
        compare(root, data_cfg)


if __name__ == "__main__":
    main()
