#!/usr/bin/env python3
"""Segmentation end to end: `python -m train task=segmentation` against a stock run built the way pytorch/vision's
references/segmentation builds it, on the same VOC folder, model, sizes and epochs (target: images/s >= 1.3x).

The stock run (`--stock`, this file in a process of its own) reads as torchvision.datasets.VOCSegmentation does (PIL),
transforms with the reference's SegmentationPresetTrain on its v2 path (RandomResize 0.5-2x the base size, flip,
PadIfSmaller, RandomCrop, PILToTensor, ToDtype, Normalize), batches through a plain DataLoader with the reference's
padding collate (workers restarted each epoch: no persistent_workers), and trains with cross-entropy (ignore_index 255)
in fp32 (the reference's --amp is CUDA only). So that the two runs differ only in how they feed and run the step, it
takes loadout's settings where the reference has its own: the base size (loadout's data.resize_size default, image_size
* 256 / 224), SGD (lr 0.05, Nesterov, weight decay 5e-4), OneCycleLR, BatchNorm momentum 0.1 (model.norm_momentum) and
the validation geometry (resize to image_size x image_size, so both score the same pixels). Both models are
torchvision's lraspp_mobilenet_v3_large, untrained. Each side runs as a fresh process, ROUNDS rounds taken in turn (A B,
B A, A B, B A: a load that rises or falls over the run weighs on both sides alike); the figure is the median over the
rounds of each round's ratio of training images/s (images over the epochs' training seconds: loadout's from its
metrics.jsonl), with the rounds' spread beside it (a median of paired rounds: a best of each side over two rounds swung
with the other jobs on a shared box). loadout trains in fp32 as stock does (on a CPU with native bf16 auto would take
bf16, which lraspp trains slower in: `make tune` measures that, bench/RESULTS.md); its precision (from plan.json), the
whole process's wall and CPU time and the last epoch's val mIoU (one confusion-matrix definition:
train/task/segmentation.py) are printed beside it, so a faster run that learns less shows. Eight epochs of 12 steps: at
four, the one-time start-up (loadout's persistent workers forked from a process holding the model, whose pages its first
two epochs then copy on write; stock's per-epoch worker restarts) weighed a third of the run. The second line gives each
side's images/s by epoch and the ratio over epochs 3-8 alone, what a longer run settles to.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from common import ROOT, machine, report, spread
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from train.task.segmentation import scores

VOC_DATA = Path(os.environ.get("VOC_DATA", ROOT / "data" / "synthetic-voc"))
SIZE, BATCH, WORKERS, EPOCHS, ROUNDS = 64, 32, 2, 8, 4  # epochs of ~2 s on 2 quiet cores
START_UP = 2  # epochs that pay each side's one-time costs (workers forked, first kernels): left out of `steady`
BASE_SIZE = round(SIZE * 256 / 224)  # loadout's data.resize_size default
LR, MOMENTUM, WEIGHT_DECAY, PCT_START = 0.05, 0.9, 5e-4, 0.15  # conf/optimizer/sgd.yaml, conf/scheduler/onecycle.yaml
NORM_MOMENTUM = 0.1  # conf/model/segmentation.yaml
IGNORE = 255
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class StockVOC(Dataset):
    """A VOC-layout split read as torchvision.datasets.VOCSegmentation reads it (PIL), its target a tv_tensors.Mask
    as the reference's v2 path wraps it."""

    def __init__(self, root: Path, split: str, transforms):
        self.ids = (root / "ImageSets" / "Segmentation" / f"{split}.txt").read_text().split()
        self.root, self.transforms = root, transforms

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        image = Image.open(self.root / "JPEGImages" / f"{self.ids[index]}.jpg").convert("RGB")
        mask = Image.open(self.root / "SegmentationClass" / f"{self.ids[index]}.png")
        mask = tv_tensors.Mask(F.pil_to_tensor(mask)[0])
        return self.transforms(image, mask)


class PadIfSmaller(v2.Transform):
    """The reference's v2 padding: right and bottom up to `size`, images with 0, masks with 255 (ignore)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def make_params(self, flat_inputs: list) -> dict:
        height, width = F.get_size(flat_inputs[0])
        return {"padding": [0, 0, max(self.size - width, 0), max(self.size - height, 0)]}

    def transform(self, inpt, params):
        if not any(params["padding"]):
            return inpt
        return F.pad(inpt, params["padding"], fill=IGNORE if isinstance(inpt, tv_tensors.Mask) else 0)


def to_float() -> list:
    return [v2.PILToTensor(), v2.ToDtype({torch.Tensor: torch.float32, tv_tensors.Mask: torch.int64, "others": None},
                                         scale=True), v2.Normalize(MEAN, STD), v2.ToPureTensor()]


def preset_train() -> v2.Compose:
    """SegmentationPresetTrain(base_size, crop_size), backend pil, use_v2."""
    return v2.Compose([v2.RandomResize(int(0.5 * BASE_SIZE), int(2.0 * BASE_SIZE)), v2.RandomHorizontalFlip(0.5),
                       PadIfSmaller(SIZE), v2.RandomCrop(SIZE), *to_float()])


def preset_val() -> v2.Compose:
    return v2.Compose([v2.Resize((SIZE, SIZE)), *to_float()])


def pad_collate(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's utils.collate_fn: each batch padded to its largest sample, images with 0, masks with 255."""
    def cat_list(tensors, fill):
        shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors), strict=True)]
        out = tensors[0].new_full((len(tensors), *shape), fill)
        for tensor, slot in zip(tensors, out, strict=True):
            slot[..., :tensor.shape[-2], :tensor.shape[-1]].copy_(tensor)
        return out
    images, targets = zip(*batch, strict=True)
    return cat_list(images, 0), cat_list(targets, IGNORE)


def stock_run(out: Path) -> None:
    """The stock baseline, in this process: per epoch, training images and seconds, then val mIoU."""
    torch.manual_seed(0)
    train_set, val_set = StockVOC(VOC_DATA, "train", preset_train()), StockVOC(VOC_DATA, "val", preset_val())
    classes = len((VOC_DATA / "classes.txt").read_text().split())
    train_loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=pad_collate,
                              drop_last=True)
    val_loader = DataLoader(val_set, batch_size=BATCH, num_workers=WORKERS, collate_fn=pad_collate)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                     num_classes=classes)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = NORM_MOMENTUM
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, pct_start=PCT_START,
                                                    total_steps=EPOCHS * len(train_loader))
    epochs = []
    for epoch in range(EPOCHS):
        model.train()
        start, images = time.perf_counter(), 0
        for image, target in train_loader:
            loss = torch.nn.functional.cross_entropy(model(image)["out"], target, ignore_index=IGNORE)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss.item()  # the reference's MetricLogger reads every step's loss
            images += image.shape[0]
        seconds = time.perf_counter() - start
        model.eval()
        confusion = torch.zeros(classes * classes, dtype=torch.int64)
        with torch.inference_mode():
            for image, target in val_loader:
                predicted, scored = model(image)["out"].argmax(1), target != IGNORE
                confusion += torch.bincount(target[scored] * classes + predicted[scored], minlength=classes**2)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": scheduler.state_dict(), "epoch": epoch}, out.with_suffix(".pt"))
        epochs.append({"images": images, "epoch_s": seconds,
                       **scores(confusion.reshape(classes, classes).double().numpy())})
    out.write_text(json.dumps(epochs))


def timed(command: list[str], log: Path) -> tuple[float, float]:
    """Wall seconds of `command` as a fresh process from this checkout, and the CPU seconds of it and its workers
    (steadier than wall time on a shared machine); its output goes to `log`."""
    start, cpu = time.perf_counter(), cpu_of_children()
    with open(log, "w") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n" + "\n".join(tail))
    return time.perf_counter() - start, cpu_of_children() - cpu


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(epochs: list[dict], wall: float, cpu: float) -> dict:
    def rate(rows: list[dict]) -> float:
        return sum(e["images"] for e in rows) / sum(e["epoch_s"] for e in rows)

    return {"images_per_s": rate(epochs), "steady": rate(epochs[START_UP:]),
            "epochs": [e["images"] / e["epoch_s"] for e in epochs], "miou": epochs[-1]["val_miou"], "wall": wall,
            "cpu": cpu}


def loadout_side(tmp: Path, index: int) -> dict:
    run_dir = tmp / f"loadout-{index}"
    wall, cpu = timed([sys.executable, "-m", "train", "task=segmentation", "hardware=cpu", f"data.root={VOC_DATA}",
                       f"data.image_size={SIZE}", f"data.batch_size={BATCH}", f"data.num_workers={WORKERS}",
                       f"trainer.epochs={EPOCHS}", "trainer.precision=fp32", "logger=[]", f"hydra.run.dir={run_dir}"],
                      tmp / f"loadout-{index}.log")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    precision = json.loads((run_dir / "plan.json").read_text())["precision"]
    return {**summary([row for row in map(json.loads, lines) if "epoch_s" in row], wall, cpu), "precision": precision}


def stock_side(tmp: Path, index: int) -> dict:
    out = tmp / f"stock-{index}.json"
    wall, cpu = timed([sys.executable, __file__, "--stock", str(out)], tmp / f"stock-{index}.log")
    return summary(json.loads(out.read_text()), wall, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", type=Path, help="run only the stock baseline, writing its epochs' figures here")
    args = parser.parse_args()
    if not (VOC_DATA / ".complete").exists():
        raise SystemExit(f"no {VOC_DATA}: `make dataset` (scripts/make_dataset.py --task segmentation) makes it")
    if args.stock:
        return stock_run(args.stock)
    ours, stock = [], []
    with tempfile.TemporaryDirectory(prefix="seg-e2e-") as tmp:
        for index in range(ROUNDS):
            sides = [(ours, loadout_side), (stock, stock_side)]
            for results, side in sides if index % 2 == 0 else sides[::-1]:
                results.append(side(Path(tmp), index))
            print("  round", index + 1, *(f"{name} {r[-1]['images_per_s']:.1f} img/s, {r[-1]['wall']:.0f} s wall, "
                                          f"{r[-1]['cpu']:.0f} CPU s, mIoU {r[-1]['miou']:.3f};"
                                          for name, r in (("loadout", ours), ("stock", stock))), flush=True)
    rate = [r["images_per_s"] for r in ours], [r["images_per_s"] for r in stock]
    ratios = [a / b for a, b in zip(*rate, strict=True)]
    ratio = statistics.median(ratios)
    wall = statistics.median(b["wall"] / a["wall"] for a, b in zip(ours, stock, strict=True))
    cpu = statistics.median(b["cpu"] / a["cpu"] for a, b in zip(ours, stock, strict=True))
    miou = [f"{min(r['miou'] for r in side):.3f}-{max(r['miou'] for r in side):.3f}" for side in (ours, stock)]
    precision = "/".join(sorted({r["precision"] for r in ours}))
    median = [statistics.median(side) for side in rate]
    steady = [a["steady"] / b["steady"] for a, b in zip(ours, stock, strict=True)]
    by_epoch = [" ".join(f"{statistics.median(epoch):.0f}" for epoch in zip(*(r["epochs"] for r in side), strict=True))
                for side in (ours, stock)]
    report("segmentation end to end, loadout / stock reference", ratio, ">= 1.3", ratio >= 1.3,
           f"median of {ROUNDS} rounds' training img/s ratios (rounds {min(ratios):.2f}-{max(ratios):.2f}), "
           f"lraspp_mobilenet_v3_large at {SIZE} px, batch {BATCH}, {WORKERS} workers, {EPOCHS} epochs on "
           f"{VOC_DATA.name}: loadout in {precision} {spread(rate[0])} img/s (median {median[0]:.0f}), stock "
           f"{spread(rate[1])} (median {median[1]:.0f}); whole process {wall:.2f}x less wall time, "
           f"{cpu:.2f}x less CPU time (medians); val mIoU loadout {miou[0]}, stock {miou[1]}; {machine()}")
    print(f"  img/s by epoch (medians over the rounds): loadout {by_epoch[0]}; stock {by_epoch[1]}; epochs "
          f"{START_UP + 1}-{EPOCHS} alone (each side's start-up left out): {statistics.median(steady):.2f} "
          f"(rounds {min(steady):.2f}-{max(steady):.2f})", flush=True)

if __name__ == "__main__":
    main()
