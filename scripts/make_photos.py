#!/usr/bin/env python3
"""Make an ImageNet-like JPEG ImageFolder of real photographs (deterministic from --seed), for the decode and loader
benchmarks: synthetic images compress more simply than photos, and a decoder's speed depends on what it decodes.

The photographs are the ones scikit-image (`skimage.data`) and scikit-learn (`load_sample_images`) ship inside their
packages, so nothing is downloaded. One class per photograph; each sample is a random crop of it (40-100 % of the
area, ImageNet's usual aspect ratios, some upright), mirrored at random, rescaled to ImageNet's usual size (longer
side 500 px: ~500x375), colour-jittered (brightness, contrast, saturation, white balance; grey photographs tinted),
with a little sensor grain, saved at quality 90 with ImageNet's `.JPEG` suffix.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

COMPLETE_MARKER = ".complete"
# skimage.data's photographs (colour, then grey ones that get tinted); its drawings, scans and tiny images are left out
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "retina", "rocket",
                  "camera", "brick", "grass", "gravel", "moon", "coins")
ASPECTS = (4 / 3, 4 / 3, 3 / 2, 3 / 2, 1.0, 3 / 4, 2 / 3)  # width / height, landscape mostly, as in ImageNet
LONG_SIDE, QUALITY = 500, 90


def shipped_photos() -> dict[str, Image.Image]:
    """The photographs scikit-image and scikit-learn ship, by name, as RGB PIL images."""
    try:
        from skimage import data
        from sklearn.datasets import load_sample_images
    except ImportError as err:
        raise SystemExit(f"make_photos.py needs scikit-image and scikit-learn ({err}): pip install -e '.[dev]'") \
            from err
    photos = {name: Image.fromarray(getattr(data, name)()).convert("RGB") for name in SKIMAGE_PHOTOS}
    samples = load_sample_images()
    for path, pixels in zip(samples.filenames, samples.images, strict=True):
        photos[Path(path).stem] = Image.fromarray(pixels).convert("RGB")
    return photos


def render(photo: Image.Image, rng: np.random.Generator) -> Image.Image:
    """One sample of `photo`: crop, mirror, rescale, colour jitter, grain."""
    width, height = photo.size
    aspect = ASPECTS[rng.integers(len(ASPECTS))]
    # the largest box of that aspect inside the photo, shrunk to 40-100 % of its area, at a random place
    box_w, box_h = (width, width / aspect) if width / aspect <= height else (height * aspect, height)
    shrink = np.sqrt(rng.uniform(0.4, 1.0))
    box_w, box_h = box_w * shrink, box_h * shrink
    left, top = rng.uniform(0, width - box_w), rng.uniform(0, height - box_h)
    out = (LONG_SIDE, round(LONG_SIDE / aspect)) if aspect >= 1 else (round(LONG_SIDE * aspect), LONG_SIDE)
    image = photo.resize(out, Image.BICUBIC, box=(left, top, left + box_w, top + box_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.asarray(image).astype(np.float32)
    if np.ptp(pixels - pixels.mean(axis=2, keepdims=True)) < 1:  # a grey photograph: tinted, as an old print
        pixels *= rng.uniform(0.75, 1.15, size=3)
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhance(image).enhance(rng.uniform(0.7, 1.3))
    pixels = np.asarray(image).astype(np.float32) * rng.uniform(0.92, 1.08, size=3)  # white balance
    pixels += rng.normal(0, 2.5, size=pixels.shape)  # sensor grain, as a camera's
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def make_photo_imagefolder(out: str | Path, train_per_class: int = 80, val_per_class: int = 5, seed: int = 0) -> Path:
    """Write out/train/<photo>/<photo>_<i>.JPEG and out/val/...; the same seed gives the same bytes."""
    out, photos = Path(out), shipped_photos()
    for split, per_class, split_seed in (("train", train_per_class, seed), ("val", val_per_class, seed + 1)):
        rng = np.random.default_rng(split_seed)
        for name, photo in photos.items():
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                render(photo, rng).save(folder / f"{name}_{i:05d}.JPEG", quality=QUALITY)
    (out / COMPLETE_MARKER).write_text(f"seed={seed} train={train_per_class} val={val_per_class} photos\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/photos-500", help="output folder (gets train/ and val/)")
    parser.add_argument("--train-per-class", type=int, default=80)
    parser.add_argument("--val-per-class", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder is complete")
    args = parser.parse_args()
    if (Path(args.out) / COMPLETE_MARKER).exists() and not args.force:
        print(f"{args.out} already complete (use --force to rewrite)")
        return
    out = make_photo_imagefolder(args.out, args.train_per_class, args.val_per_class, args.seed)
    print(f"wrote {out}/train and {out}/val")


if __name__ == "__main__":
    main()
