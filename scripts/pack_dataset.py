#!/usr/bin/env python3
"""Pack an ImageFolder (root/train, root/val) or CIFAR-10 into loadout's memory-mapped uint8 format.

    python scripts/pack_dataset.py data/synthetic data/packed   # train with dataset=packed data.root=data/packed
    python scripts/pack_dataset.py cifar-10-batches-py data/cifar-packed --size 36

Every image is made square at --size px (shorter side resized, centre crop); pick the training resize size
(image_size * 256 / 224 by default) so training skips the Resize step. train/data/fast/packed.py reads the format.
"""

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from train.data.datasets import Cifar10Dataset, ImageFolderDataset
from train.data.fast.packed import IMAGES, META, TARGETS
from train.data.source import as_uint8_tensor
from train.data.transforms import fit_square

log = logging.getLogger(__name__)


class _Fitted(Dataset):
    """(square image, label, ok) of a decodable dataset, for packing with DataLoader workers."""

    def __init__(self, dataset, size: int):
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            image, label = self.dataset[index][:2]
            image = fit_square(as_uint8_tensor(image), self.size)
        except (RuntimeError, OSError, ValueError) as err:
            log.warning("pack: skipping unreadable sample %d: %s", index, err)
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), -1
        return image, int(label)


def pack_split(dataset, out_dir: str | Path, size: int, num_workers: int = 0, source: str = "") -> int:
    """Write `dataset` (any source: `dataset[i]` = (image, label), `.classes`) as a packed split of
    `size` px squares; unreadable samples are left out. Returns the number of samples written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(dataset)
    images = np.lib.format.open_memmap(out_dir / (IMAGES + ".tmp"), mode="w+", dtype=np.uint8,
                                       shape=(n, 3, size, size))
    targets = np.empty(n, dtype=np.int64)
    written = 0
    loader = DataLoader(_Fitted(dataset, size), batch_size=64, num_workers=num_workers)
    for batch_images, batch_targets in loader:
        keep = batch_targets >= 0
        count = int(keep.sum())
        images[written:written + count] = batch_images[keep].numpy()
        targets[written:written + count] = batch_targets[keep].numpy()
        written += count
    images.flush()
    del images
    if written < n:  # drop the unused tail left by skipped samples
        full = np.load(out_dir / (IMAGES + ".tmp"), mmap_mode="r")
        np.save(out_dir / IMAGES, full[:written])
        del full
        (out_dir / (IMAGES + ".tmp")).unlink()
    else:
        (out_dir / (IMAGES + ".tmp")).replace(out_dir / IMAGES)
    np.save(out_dir / TARGETS, targets[:written])
    meta = {"classes": list(dataset.classes), "size": size, "source": source}
    (out_dir / META).write_text(json.dumps(meta, indent=1) + "\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="ImageFolder root with train/ and val/, or a cifar-10-batches-py folder")
    parser.add_argument("out", type=Path, help="output root: gets train/ and val/")
    parser.add_argument("--size", type=int, default=73, help="stored side in px (default 73: image_size 64)")
    parser.add_argument("--workers", type=int, default=2, help="decoding processes")
    parser.add_argument("--full-decode", action="store_true",
                        help="decode JPEGs whole (default: at the smallest DCT scale that keeps --size)")
    args = parser.parse_args()
    cifar = (args.src / "data_batch_1").is_file() or (args.src / "cifar-10-batches-py").is_dir()
    for split in ("train", "val"):
        dataset = Cifar10Dataset(args.src, split) if cifar else ImageFolderDataset(
            args.src, split, min_side=None if args.full_decode else args.size)
        written = pack_split(dataset, args.out / split, args.size, args.workers, source=str(args.src))
        print(f"{args.out / split}: {written} of {len(dataset)} images at {args.size}x{args.size}")


if __name__ == "__main__":
    main()
