#!/usr/bin/env python3
"""Make the embedded default dataset: a synthetic ImageFolder of real JPEG files (deterministic from --seed)."""

import argparse
from pathlib import Path

from train.data.synthetic import COMPLETE_MARKER, make_synthetic_imagefolder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/synthetic", help="output folder (gets train/ and val/)")
    parser.add_argument("--train-per-class", type=int, default=150)
    parser.add_argument("--val-per-class", type=int, default=30)
    parser.add_argument("--size", type=int, default=80, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--photo", metavar="WxH", help="photo-like JPEGs of W x H px instead (4032x3024: 12 MP "
                        "camera photos, 1-4 MB each at quality 92)")
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder is complete")
    args = parser.parse_args()
    if (Path(args.out) / COMPLETE_MARKER).exists() and not args.force:
        print(f"{args.out} already complete (use --force to rewrite)")
        return
    photo = tuple(int(side) for side in args.photo.lower().split("x")) if args.photo else None
    out = make_synthetic_imagefolder(args.out, args.train_per_class, args.val_per_class, args.size, args.seed,
                                     photo=photo)
    print(f"wrote {out}/train and {out}/val")


if __name__ == "__main__":
    main()
