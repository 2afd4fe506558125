#!/usr/bin/env python3
"""Segmentation's loader over classification's, images/s at the same image size (target >= 0.8): data only.

Both read the same JPEGs (the embedded VOC-layout set, data/synthetic-voc: 80 px), each file by voc.read_file,
through loadout's Samples path and a DataLoader with its shared-memory ring and data.num_workers workers, to
data.image_size (64). Classification takes each image with a label through its default recipe (augment=crop_flip:
Resize -> RandomCrop -> flip); segmentation takes the image and its PNG mask through augment=segmentation (scale ->
crop as ScaledCrop -> flip, one draw for both). The difference is the mask: its file read, its PNG decode, its
geometry, its bytes through the hand-over.
The second line gives the CPU time per image of all the loader's processes (its workers' and the main one's), whose
ratio a machine shared with other jobs shifts far less than the images/s; the third each stage's cost per sample
in one thread's CPU time: where the ratio goes.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import ROOT, images_per_s, interleaved_samples, machine, report, spread
from torch.utils.data import DataLoader

from train.data.augment import Recipe
from train.data.fast.decode import decode_image_file
from train.data.loader.plan import LoaderPlan
from train.data.loader.ring import build_collate
from train.data.masks import decode_mask
from train.data.samples import Samples
from train.data.seg_augment import SegmentationRecipe, joint
from train.data.voc import VOCSegmentation, read_file

VOC_DATA = Path(os.environ.get("VOC_DATA", ROOT / "data" / "synthetic-voc"))
WORKERS, BATCH, EPOCHS = 2, 64, 8


class DataCfg:
    image_size, resize_size, device_transforms = 64, None, True


class ImagesOnly:
    """The VOC set's images, each with a label: what a classifier's source gives."""

    def __init__(self, source: VOCSegmentation):
        self.source, self.classes = source, source.classes

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):  # read as VOCSegmentation reads its image: the mask is the difference
        return decode_image_file(read_file(self.source.paths[index].decode())), 0


def loader(source, transform) -> DataLoader:
    plan = LoaderPlan(num_workers=WORKERS, batch_size=BATCH, prefetch_factor=2, pin_memory=False,
                      image_size=DataCfg.image_size, dtype=torch.uint8)
    keys = [(epoch, index) for epoch in range(EPOCHS) for index in torch.randperm(len(source)).tolist()]
    return DataLoader(Samples(source, transform, seed=0), sampler=keys, batch_size=BATCH, num_workers=WORKERS,
                      collate_fn=build_collate(plan))


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have been joined (a loader's workers, once it ends)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def measure(source, transform) -> tuple[float, float]:
    """(images/s, CPU microseconds per image over all the loader's processes) of one pass of `loader`."""
    start = cpu_seconds()
    rate = images_per_s(loader(source, transform))  # exhausted: its workers are joined
    return rate, (cpu_seconds() - start) / (EPOCHS * len(source)) * 1e6


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


def stage_costs(voc: VOCSegmentation, classify, segment, count: int = 200) -> str:
    """Per sample, one thread: the mask's file read, the decodes and each recipe's transform."""
    mask_paths = [voc.mask_paths[i].decode() for i in range(count)]
    images = [Path(voc.paths[i].decode()).read_bytes() for i in range(count)]
    masks = [read_file(path) for path in mask_paths]
    decoded = [decode_image_file(data) for data in images]
    decoded_masks = [decode_mask(data) for data in masks]
    pair = joint(segment)  # as Samples calls it
    torch.set_num_threads(1)
    costs = {"mask read": cpu_us(lambda i: read_file(mask_paths[i]), count),
             "image decode": cpu_us(lambda i: decode_image_file(images[i]), count),
             "mask decode": cpu_us(lambda i: decode_mask(masks[i]), count),
             "classification transform": cpu_us(lambda i: classify(decoded[i]), count),
             "segmentation transform (image + mask)": cpu_us(lambda i: pair(decoded[i], decoded_masks[i]), count)}
    return ", ".join(f"{name} {us:.0f}" for name, us in costs.items())


def main() -> None:
    if not (VOC_DATA / ".complete").exists():
        raise SystemExit(f"no {VOC_DATA}: `make dataset` (scripts/make_dataset.py --task segmentation) makes it")
    voc = VOCSegmentation(VOC_DATA)
    classify = Recipe(crop="random").train_transform(DataCfg())
    segment = SegmentationRecipe().train_transform(DataCfg())
    seg, cls = interleaved_samples(lambda: measure(voc, segment), lambda: measure(ImagesOnly(voc), classify),
                                   rounds=3)
    (seg_rate, seg_cpu), (cls_rate, cls_cpu) = zip(*seg, strict=True), zip(*cls, strict=True)
    ratio = max(seg_rate) / max(cls_rate)
    report("segmentation loader / classification loader", ratio, ">= 0.8", ratio >= 0.8,
           f"images/s at {DataCfg.image_size} px from {len(voc)} 80 px JPEGs, {WORKERS} workers, batch {BATCH}: "
           f"segmentation {spread(seg_rate)}, classification {spread(cls_rate)}; {machine()}")
    print(f"  CPU per image, all the loader's processes, us: segmentation {spread(seg_cpu)}, classification "
          f"{spread(cls_cpu)}: classification / segmentation {min(cls_cpu) / min(seg_cpu):.2f}", flush=True)
    print(f"  per sample, us of one thread's CPU: {stage_costs(voc, classify, segment)}", flush=True)


if __name__ == "__main__":
    main()
