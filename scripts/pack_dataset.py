#!/usr/bin/env python3
"""Pack an ImageFolder (root/train, root/val) or CIFAR-10 into loadout's memory-mapped uint8 format.

    python scripts/pack_dataset.py data/synthetic data/packed   # train with dataset=packed data.root=data/packed
    python scripts/pack_dataset.py cifar-10-batches-py data/cifar-packed --size 36

Every image is made square at --size px (shorter side resized, centre crop); pick the training resize size
(image_size * 256 / 224 by default) so training skips the Resize step. The format is in train/data/packed.py.
"""

import argparse
from pathlib import Path

from train.data.datasets import Cifar10Dataset, ImageFolderDataset
from train.data.packed import pack_split


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
