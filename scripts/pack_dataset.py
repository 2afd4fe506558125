#!/usr/bin/env python3
"""Pack an ImageFolder (root/train, root/val), CIFAR-10 or a Pascal VOC-layout folder (images and masks) into
loadout's memory-mapped uint8 format.

    python scripts/pack_dataset.py data/synthetic data/packed   # train with dataset=packed data.root=data/packed
    python scripts/pack_dataset.py cifar-10-batches-py data/cifar-packed --size 36
    python scripts/pack_dataset.py data/synthetic-voc data/voc-packed --size 80   # task=segmentation dataset=packed

Every image is made square at --size px (shorter side resized, centre crop); pick the training resize size
(image_size * 256 / 224 by default) so training skips the Resize step. A VOC folder's masks go through the same
square (masks.npy). loadout/data/fast/packed.py reads the format.
"""

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from loadout.data.datasets import Cifar10Dataset, ImageFolderDataset
from loadout.data.fast.packed import IMAGES, MASKS, META, TARGETS
from loadout.data.masks import as_mask, check_mask_size, fit_mask_square
from loadout.data.source import as_uint8_tensor
from loadout.data.transforms import fit_square
from loadout.data.voc import VOCSegmentation

log = logging.getLogger(__name__)


class Fitted(Dataset):
    """(square image, label or square mask, ok) of a decodable dataset, for packing with DataLoader workers."""

    def __init__(self, dataset, size: int):
        self.dataset, self.size = dataset, size
        self.masks = hasattr(dataset, "mask_paths")  # a VOC folder (voc.py)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            image, target = self.dataset[index][:2]
            image, mask = as_uint8_tensor(image), as_mask(target)
            if mask is not None:
                check_mask_size(image, mask)
                target = fit_mask_square(mask, self.size)
            return fit_square(image, self.size), target if mask is not None else int(target), True
        except (RuntimeError, OSError, ValueError) as err:
            log.warning("pack: skipping unreadable sample %d: %s", index, err)
            nothing = torch.zeros(self.size, self.size, dtype=torch.uint8) if self.masks else 0
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), nothing, False


def pack_split(dataset, out_dir: str | Path, size: int, num_workers: int = 0, source: str = "") -> int:
    """Write `dataset` (any source: `dataset[i]` = (image, label), `.classes`; or a VOC folder's (image, mask)) as a
    packed split of `size` px squares; unreadable samples are left out. Returns the number of samples written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(dataset)
    images = np.lib.format.open_memmap(out_dir / (IMAGES + ".tmp"), mode="w+", dtype=np.uint8,
                                       shape=(n, 3, size, size))
    fitted = Fitted(dataset, size)
    targets = np.empty((n, size, size) if fitted.masks else n, dtype=np.uint8 if fitted.masks else np.int64)
    written = 0
    loader = DataLoader(fitted, batch_size=64, num_workers=num_workers)
    for batch_images, batch_targets, keep in loader:
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
    np.save(out_dir / (MASKS if fitted.masks else TARGETS), targets[:written])
    meta = {"classes": list(dataset.classes), "size": size, "source": source}
    (out_dir / META).write_text(json.dumps(meta, indent=1) + "\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="ImageFolder root with train/ and val/, a cifar-10-batches-py folder, "
                        "or a VOC-layout folder (ImageSets/Segmentation/)")
    parser.add_argument("out", type=Path, help="output root: gets train/ and val/")
    parser.add_argument("--size", type=int, default=73, help="stored side in px (default 73: image_size 64)")
    parser.add_argument("--workers", type=int, default=2, help="decoding processes")
    parser.add_argument("--full-decode", action="store_true",
                        help="decode JPEGs whole (default: at the smallest DCT scale that keeps --size)")
    args = parser.parse_args()
    cifar = (args.src / "data_batch_1").is_file() or (args.src / "cifar-10-batches-py").is_dir()
    voc = (args.src / "ImageSets" / "Segmentation").is_dir()
    for split in ("train", "val"):
        dataset = Cifar10Dataset(args.src, split) if cifar else VOCSegmentation(args.src, split) if voc else \
            ImageFolderDataset(args.src, split, min_side=None if args.full_decode else args.size)
        written = pack_split(dataset, args.out / split, args.size, args.workers, source=str(args.src))
        print(f"{args.out / split}: {written} of {len(dataset)} images at {args.size}x{args.size}")


if __name__ == "__main__":
    main()
