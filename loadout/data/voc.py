"""dataset=voc: semantic segmentation masks in the Pascal VOC layout, a source (source.py) whose samples are
(image, mask).

    root/JPEGImages/<id>.jpg                 the images
    root/SegmentationClass/<id>.png          their masks: class index per pixel (palette P or grayscale L), 255 = ignore
    root/ImageSets/Segmentation/<split>.txt  the ids of each split, one a line
    root/classes.txt                         optional: the class names, one a line (index 0 first); else VOC's 21

The image is decoded whole with loadout's decoder (decode.py; never DCT-scaled: its mask covers the stored size),
the mask as class indices (masks.py). A missing or broken file, or a mask of another size, is a bad sample
(samples.py skips and counts it, naming the file). Paths live in numpy arrays (datasets.py says why).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loadout.data.fast.decode import UNREADABLE, decode_image_file
from loadout.data.masks import decode_mask
from loadout.errors import ConfigError

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")
READ_BLOCK = 1 << 16


def read_file(path: str) -> bytes:
    """A file's bytes through os.read: about half the CPU of `open(path, "rb").read()` (no buffered file object) on
    the small files a sample reads two of (bench/segmentation.py)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while chunk := os.read(fd, READ_BLOCK):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


class VOCSegmentation(Dataset):
    """The `split` ids of a VOC-layout folder at `root`: each sample a uint8 CHW image and a uint8 (H, W) mask."""

    def __init__(self, root: str | Path, split: str = "train"):
        given, root = str(root), Path(root)
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise ConfigError(f"data.root={given!r}: no {listing} (the VOC layout: JPEGImages/, SegmentationClass/, "
                              "ImageSets/Segmentation/{train,val}.txt); run `make dataset` for data/synthetic-voc")
        ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
        if not ids:
            raise ConfigError(f"data.root={given!r}: {listing} lists no ids")
        names = root / "classes.txt"
        self.classes = [line.strip() for line in names.read_text().splitlines() if line.strip()] \
            if names.is_file() else list(VOC_CLASSES)
        self.paths = np.array([str(root / "JPEGImages" / f"{i}.jpg") for i in ids], dtype=np.bytes_)
        self.mask_paths = np.array([str(root / "SegmentationClass" / f"{i}.png") for i in ids], dtype=np.bytes_)

    def __len__(self) -> int:
        return len(self.paths)

    def read_files(self, index: int) -> tuple[bytes, bytes]:
        """The sample's JPEG and PNG mask as stored (scripts/make_shards.py writes them into shards unchanged)."""
        return read_file(self.paths[index].decode()), read_file(self.mask_paths[index].decode())

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = decode_image_file(read_file(self.paths[index].decode()))
        mask_path = self.mask_paths[index].decode()
        try:
            mask = decode_mask(read_file(mask_path))
        except UNREADABLE as err:  # the log line names the image; say which mask
            raise OSError(f"its mask {mask_path}: {err}") from err
        return image, mask
