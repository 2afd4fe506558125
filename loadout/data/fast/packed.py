"""The packed format: a split decoded once into one memory-mapped uint8 array, read with no per-sample decode.

Layout of one split folder (scripts/pack_dataset.py writes root/train and root/val):
    images.npy   uint8 (N, 3, S, S): every image made square at S px (transforms.fit_square), C-contiguous
    targets.npy  int64 (N,): the labels; or, for segmentation (packed from a VOC folder),
    masks.npy    uint8 (N, S, S): each image's mask through the same square (NEAREST_EXACT: masks.fit_mask_square)
    meta.json    {"classes": [...], "size": S, "source": "..."}
Workers open the arrays with numpy's memmap on first use (never pickled to them), so all of them share the page
cache: one copy of the data in RAM whatever the number of workers, and no copy-on-read growth. A mask plane costs a
third of its image and no decode at all; the square keeps the centre of a non-square image and mask alike, so
validation scores that square (a VOC folder's validation scores the whole image).

For training, RandomCrop + RandomHorizontalFlip run a batch at a time (`read_crops`, boxes drawn by
transforms.CropFlipPlan from each sample's seed): no torch RNG, no transform dispatch per sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loadout.errors import ConfigError

IMAGES, TARGETS, META, MASKS = "images.npy", "targets.npy", "meta.json", "masks.npy"


class PackedDataset(Dataset):
    """One packed split: `.classes`, `.targets` (numpy; not with masks) and `.size` (the stored side), uint8 CHW
    samples with their label or mask; root/<split> (or a split folder itself without `split`); it crops whole training
    batches itself (`read_crops`)."""

    decoded = True  # stored as pixels: nothing for the sample cache to save

    def __init__(self, root: str | Path, split: str | None = None):
        self.split_dir = Path(root) / split if split is not None else Path(root)
        has_masks = (self.split_dir / MASKS).is_file()
        missing = [name for name in (IMAGES, MASKS if has_masks else TARGETS, META)
                   if not (self.split_dir / name).is_file()]
        if missing:
            raise ConfigError(f"data.root: {self.split_dir} is not a packed split (missing {', '.join(missing)}); "
                              "make one with `python scripts/pack_dataset.py SRC OUT` or use dataset=imagefolder")
        meta = json.loads((self.split_dir / META).read_text())
        self.classes: list[str] = list(meta["classes"])
        self.size: int = int(meta["size"])
        if has_masks:  # no labels to offer: data.sampler=weighted is refused
            self._length = len(np.load(self.split_dir / MASKS, mmap_mode="r"))
        else:
            self.targets = np.load(self.split_dir / TARGETS)
            self._length = len(self.targets)
        self.has_masks = has_masks
        self._images: np.ndarray | None = None
        self._masks: np.ndarray | None = None

    def __getstate__(self) -> dict:  # a worker opens its own map: never pickle the array's pages
        return {**self.__dict__, "_images": None, "_masks": None}

    @property
    def images(self) -> np.ndarray:
        """The memory-mapped (N, 3, S, S) array, as a plain ndarray view (numpy's memmap subclass costs
        microseconds per indexing)."""
        if self._images is None:
            self._images = np.load(self.split_dir / IMAGES, mmap_mode="r").view(np.ndarray)
        return self._images

    @property
    def masks(self) -> np.ndarray:
        """The memory-mapped (N, S, S) mask array (a pack of masks), as `images` is."""
        if self._masks is None:
            self._masks = np.load(self.split_dir / MASKS, mmap_mode="r").view(np.ndarray)
        return self._masks

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        image = torch.from_numpy(np.array(self.images[index]))  # a private copy
        if self.has_masks:
            return image, torch.from_numpy(np.array(self.masks[index]))
        return image, int(self.targets[index])

    def read_crops(self, indices, tops: list[int], lefts: list[int], height: int, width: int,
                   flips: list[bool]) -> torch.Tensor:
        """uint8 (n, 3, height, width): sample indices[k]'s box at (tops[k], lefts[k]), mirrored where flips[k],
        each copied straight from the map into one batch array, in index order (the page cache reads forwards)."""
        index_list = np.asarray(indices, dtype=np.int64).tolist()
        images = self.images
        return crop_batch(lambda k: images[index_list[k]], sorted(range(len(index_list)), key=index_list.__getitem__),
                          tops, lefts, height, width, flips)


def crop_batch(image_of, order, tops: list[int], lefts: list[int], height: int, width: int,
               flips: list[bool], channels_last: bool = False) -> torch.Tensor:
    """uint8 (n, 3, height, width): image_of(k)'s box at (tops[k], lefts[k]), mirrored where flips[k], taken in
    `order` (every k once) into one batch array. image_of(k) is (3, H, W), or (H, W, 3) with `channels_last`: then
    the batch is HWC in memory too (a permuted view), so each box row is one contiguous copy, and the boxes to mirror
    are gathered and mirrored by torch in one call (numpy's reversed copy of 3-byte pixels runs a few bytes at a time;
    torch's flip of one small box costs as much again in the call)."""
    if not channels_last:
        batch = np.empty((len(tops), 3, height, width), dtype=np.uint8)
        for k in order:
            y, x = tops[k], lefts[k]
            crop = image_of(k)[:, y:y + height, x:x + width]
            batch[k] = crop[..., ::-1] if flips[k] else crop
        return torch.from_numpy(batch)
    batch = np.empty((len(tops), height, width, 3), dtype=np.uint8)
    mirrored = [k for k in order if flips[k]]
    boxes, j = np.empty((len(mirrored), height, width, 3), dtype=np.uint8), 0
    for k in order:
        y, x = tops[k], lefts[k]
        if flips[k]:
            boxes[j] = image_of(k)[y:y + height, x:x + width]
            j += 1
        else:
            batch[k] = image_of(k)[y:y + height, x:x + width]
    if mirrored:
        batch[mirrored] = torch.from_numpy(boxes).flip(2).numpy()
    return torch.from_numpy(batch).permute(0, 3, 1, 2)
