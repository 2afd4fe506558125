#!/usr/bin/env python3
"""Make the embedded default dataset: a synthetic ImageFolder of real JPEG files (deterministic from --seed).

Ten classes, each a shape with its own hue, at random position, size and brightness over a noisy background, so a
small CNN climbs well above chance within two epochs while every sample still goes through real JPEG decoding.

`--task segmentation` makes the segmentation set instead (dataset=voc): a Pascal VOC-layout folder of JPEG images
with one to three shapes (circle, square, triangle, cross; each class its own hue) on textured backgrounds, their
palette-PNG masks (class index per pixel, 255 on a thin border round each shape, as VOC marks its borders), and
ImageSets/Segmentation/{train,val}.txt.
"""

import argparse
import colorsys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

SEGMENTATION_CLASSES = ("background", "circle", "square", "triangle", "cross")
CLASSES = ("circle", "square", "triangle", "hstripes", "vstripes", "checker", "diagonal", "ring", "cross", "dots")
COMPLETE_MARKER = ".complete"


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], color: tuple) -> None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "square":
        draw.rectangle(box, fill=color)
    elif kind == "triangle":
        draw.polygon([(x0 + w // 2, y0), (x1, y1), (x0, y1)], fill=color)
    elif kind == "hstripes":
        for y in range(y0, y1, 6):
            draw.rectangle((x0, y, x1, y + 2), fill=color)
    elif kind == "vstripes":
        for x in range(x0, x1, 6):
            draw.rectangle((x, y0, x + 2, y1), fill=color)
    elif kind == "checker":
        step = max(w // 4, 2)
        for i, x in enumerate(range(x0, x1, step)):
            for j, y in enumerate(range(y0, y1, step)):
                if (i + j) % 2 == 0:
                    draw.rectangle((x, y, x + step - 1, y + step - 1), fill=color)
    elif kind == "diagonal":
        for k in range(-h, w, 7):
            draw.line((x0 + k, y1, x0 + k + h, y0), fill=color, width=3)
    elif kind == "ring":
        draw.ellipse(box, outline=color, width=max(w // 7, 2))
    elif kind == "cross":
        t = max(w // 6, 2)
        draw.rectangle((x0 + w // 2 - t, y0, x0 + w // 2 + t, y1), fill=color)
        draw.rectangle((x0, y0 + h // 2 - t, x1, y0 + h // 2 + t), fill=color)
    elif kind == "dots":
        r = max(w // 10, 2)
        for x in range(x0 + r, x1 - r, 3 * r):
            for y in range(y0 + r, y1 - r, 3 * r):
                draw.ellipse((x - r, y - r, x + r, y + r), fill=color)


def render_sample(label: int, rng: np.random.Generator, size: int = 80) -> Image.Image:
    """One image of class `label`."""
    background = rng.integers(0, 90, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background, "RGB")
    hue = (label / len(CLASSES) + rng.uniform(-0.03, 0.03)) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, rng.uniform(0.7, 1.0), rng.uniform(0.75, 1.0))
    color = (int(r * 255), int(g * 255), int(b * 255))
    extent = int(rng.integers(size // 2, size - 8))
    x0 = int(rng.integers(0, size - extent))
    y0 = int(rng.integers(0, size - extent))
    _draw_shape(ImageDraw.Draw(image), CLASSES[label], (x0, y0, x0 + extent, y0 + extent), color)
    return image


def fractal_field(generator: torch.Generator, height: int, width: int, roughness: float = 0.65) -> torch.Tensor:
    """(3, H, W) float noise with detail at every scale, as photos have: a 4-pixel grid upsampled twofold again and
    again to full size, each level adding noise `roughness` times as strong as the one before."""
    sizes = [(height, width)]
    while sizes[-1][0] > 4:
        sizes.append(((sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2))
    field = torch.randn(1, 3, *sizes[-1], generator=generator)
    amplitude = 1.0
    for size in reversed(sizes[:-1]):
        amplitude *= roughness
        field = torch.nn.functional.interpolate(field, size=size, mode="bilinear", align_corners=False)
        field += amplitude * torch.randn(1, 3, *size, generator=generator)
    return field[0]


def render_photo(label: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-sized image of class `label` that compresses like a camera photo (about 1.4 MB at 12 MP, quality 92):
    smooth colour over every scale plus sensor grain, with the class's shape in its hue over a large part of it."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
    pixels = 128 + 45 * fractal_field(generator, height, width) + 2 * torch.randn(3, height, width, generator=generator)
    image = Image.fromarray(pixels.clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy(), "RGB")
    shape = render_sample(label, rng, size=min(width, height) // 8).resize((width, height), Image.BICUBIC)
    mask = Image.fromarray((np.asarray(shape).max(axis=2) > 90).astype(np.uint8) * 140, "L")
    return Image.composite(shape, image, mask)


def make_synthetic_imagefolder(
    out: str | Path, train_per_class: int = 150, val_per_class: int = 30, size: int = 80, seed: int = 0,
    quality: int = 90, photo: tuple[int, int] | None = None,
) -> Path:
    """Write out/train/<class>/*.jpg and out/val/<class>/*.jpg; the same seed gives the same bytes. `photo`:
    (width, height) of photo-like images (`render_photo`, JPEG quality 92) instead of `size`-px shapes."""
    out = Path(out)
    for split, per_class, split_seed in (("train", train_per_class, seed), ("val", val_per_class, seed + 1)):
        rng = np.random.default_rng(split_seed)
        for label, name in enumerate(CLASSES):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                image = render_sample(label, rng, size) if photo is None else render_photo(label, rng, *photo)
                image.save(folder / f"{i:05d}.jpg", quality=quality if photo is None else 92)
    shape = f"size={size}" if photo is None else f"photo={photo[0]}x{photo[1]}"
    (out / COMPLETE_MARKER).write_text(f"seed={seed} train={train_per_class} val={val_per_class} {shape}\n")
    return out


def voc_palette() -> list[int]:
    """Pascal VOC's colour map (its devkit's bit interleaving): index i's colour, 255 cream-white as in VOC."""
    palette = []
    for index in range(256):
        r = g = b = 0
        c = index
        for bit in range(8):
            r |= ((c >> 0) & 1) << (7 - bit)
            g |= ((c >> 1) & 1) << (7 - bit)
            b |= ((c >> 2) & 1) << (7 - bit)
            c >>= 3
        palette += [r, g, b]
    palette[-3:] = [224, 224, 192]
    return palette


def render_segmentation_sample(rng: np.random.Generator, size: int) -> tuple[Image.Image, Image.Image]:
    """One image of 1-3 shapes over a textured background, and its mask (a P image of class indices)."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
    tint = torch.from_numpy(rng.uniform(70, 150, size=(3, 1, 1))).float()
    pixels = tint + 35 * fractal_field(generator, size, size)
    image = Image.fromarray(pixels.clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy(), "RGB")
    mask = Image.new("L", (size, size), 0)
    draw, mask_draw = ImageDraw.Draw(image), ImageDraw.Draw(mask)
    for _ in range(int(rng.integers(1, 4))):
        label = int(rng.integers(1, len(SEGMENTATION_CLASSES)))
        hue = ((label - 1) / (len(SEGMENTATION_CLASSES) - 1) + rng.uniform(-0.04, 0.04)) % 1.0
        r, g, b = colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))
        extent = int(rng.integers(size // 5, size // 2))
        x0, y0 = (int(v) for v in rng.integers(0, size - extent, size=2))
        box = (x0, y0, x0 + extent, y0 + extent)
        kind = SEGMENTATION_CLASSES[label]
        _draw_shape(draw, kind, box, (int(r * 255), int(g * 255), int(b * 255)))
        _draw_shape(mask_draw, kind, box, label)
    classes = np.asarray(mask)
    border = np.zeros_like(classes, dtype=bool)  # a pixel with a 4-neighbour of another class: ignored, as VOC does
    border[1:] |= classes[1:] != classes[:-1]
    border[:-1] |= classes[:-1] != classes[1:]
    border[:, 1:] |= classes[:, 1:] != classes[:, :-1]
    border[:, :-1] |= classes[:, :-1] != classes[:, 1:]
    indexed = Image.fromarray(np.where(border, 255, classes).astype(np.uint8), "P")
    indexed.putpalette(voc_palette())
    return image, indexed


def make_synthetic_voc(out: str | Path, train: int = 400, val: int = 100, size: int = 80, seed: int = 0,
                       quality: int = 90) -> Path:
    """Write the VOC layout at `out` (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/, classes.txt); the
    same seed gives the same bytes."""
    out = Path(out)
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    for split, count, split_seed in (("train", train, seed), ("val", val, seed + 1)):
        rng = np.random.default_rng(split_seed)
        ids = [f"{split}_{i:05d}" for i in range(count)]
        for name in ids:
            image, mask = render_segmentation_sample(rng, size)
            image.save(out / "JPEGImages" / f"{name}.jpg", quality=quality)
            mask.save(out / "SegmentationClass" / f"{name}.png")
        (out / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
    (out / "classes.txt").write_text("".join(f"{name}\n" for name in SEGMENTATION_CLASSES))
    (out / COMPLETE_MARKER).write_text(f"seed={seed} train={train} val={val} size={size} task=segmentation\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=("classification", "segmentation"), default="classification",
                        help="segmentation: a VOC-layout folder of images and masks (default --out data/synthetic-voc; "
                        "--train-per-class and --val-per-class count images)")
    parser.add_argument("--out", help="output folder (default data/synthetic: gets train/ and val/)")
    parser.add_argument("--train-per-class", type=int)
    parser.add_argument("--val-per-class", type=int)
    parser.add_argument("--size", type=int, default=80, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--photo", metavar="WxH", help="photo-like JPEGs of W x H px instead (4032x3024: 12 MP "
                        "camera photos, 1-4 MB each at quality 92)")
    parser.add_argument("--force", action="store_true", help="rewrite even if the folder is complete")
    args = parser.parse_args()
    segmentation = args.task == "segmentation"
    args.out = args.out or ("data/synthetic-voc" if segmentation else "data/synthetic")
    if (Path(args.out) / COMPLETE_MARKER).exists() and not args.force:
        print(f"{args.out} already complete (use --force to rewrite)")
        return
    if segmentation:
        out = make_synthetic_voc(args.out, args.train_per_class or 400, args.val_per_class or 100, args.size, args.seed)
        print(f"wrote {out} (VOC layout: JPEGImages, SegmentationClass, ImageSets/Segmentation)")
        return
    photo = tuple(int(side) for side in args.photo.lower().split("x")) if args.photo else None
    out = make_synthetic_imagefolder(args.out, args.train_per_class or 150, args.val_per_class or 30, args.size,
                                     args.seed, photo=photo)
    print(f"wrote {out}/train and {out}/val")


if __name__ == "__main__":
    main()
