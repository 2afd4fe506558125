"""The packed format: a split decoded once into one memory-mapped uint8 array, read with no per-sample decode.

Layout of one split folder (scripts/pack_dataset.py writes root/train and root/val):
    images.npy   uint8 (N, 3, S, S): every image made square at S px (transforms.fit_square), C-contiguous
    targets.npy  int64 (N,)
    meta.json    {"classes": [...], "size": S, "source": "..."}
Workers open the array with numpy's memmap on first use (never pickled to them), so all of them share the page
cache: one copy of the data in RAM whatever the number of workers, and no copy-on-read growth.

For training, RandomCrop + RandomHorizontalFlip run a batch at a time (`read_crops`, boxes drawn by
transforms.CropFlipPlan from each sample's seed): no torch RNG, no transform dispatch per sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from train.errors import ConfigError

IMAGES, TARGETS, META = "images.npy", "targets.npy", "meta.json"


class PackedDataset(Dataset):
    """One packed split: `.classes`, `.targets` (numpy) and `.size` (the stored side), uint8 CHW samples; root/<split>
    (or a split folder itself without `split`); it crops whole training batches itself (`read_crops`)."""

    decoded = True  # stored as pixels: nothing for the sample cache to save

    def __init__(self, root: str | Path, split: str | None = None):
        self.split_dir = Path(root) / split if split is not None else Path(root)
        missing = [name for name in (IMAGES, TARGETS, META) if not (self.split_dir / name).is_file()]
        if missing:
            raise ConfigError(f"data.root: {self.split_dir} is not a packed split (missing {', '.join(missing)}); "
                              "make one with `python scripts/pack_dataset.py SRC OUT` or use dataset=imagefolder")
        meta = json.loads((self.split_dir / META).read_text())
        self.classes: list[str] = list(meta["classes"])
        self.size: int = int(meta["size"])
        self.targets = np.load(self.split_dir / TARGETS)
        self._images: np.ndarray | None = None

    def __getstate__(self) -> dict:  # a worker opens its own map: never pickle the array's pages
        return {**self.__dict__, "_images": None}

    @property
    def images(self) -> np.ndarray:
        """The memory-mapped (N, 3, S, S) array, as a plain ndarray view (numpy's memmap subclass costs
        microseconds per indexing)."""
        if self._images is None:
            self._images = np.load(self.split_dir / IMAGES, mmap_mode="r").view(np.ndarray)
        return self._images

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self.images[index])), int(self.targets[index])  # a private copy

    def read_crops(self, indices, tops: list[int], lefts: list[int], height: int, width: int,
                   flips: list[bool]) -> torch.Tensor:
        """uint8 (n, 3, height, width): sample indices[k]'s box at (tops[k], lefts[k]), mirrored where flips[k],
        each copied straight from the map into one batch array, in index order (the page cache reads forwards)."""
        index_list = np.asarray(indices, dtype=np.int64).tolist()
        images = self.images
        batch = np.empty((len(index_list), images.shape[1], height, width), dtype=np.uint8)
        for k in sorted(range(len(index_list)), key=index_list.__getitem__):
            y, x = tops[k], lefts[k]
            crop = images[index_list[k], :, y:y + height, x:x + width]
            batch[k] = crop[..., ::-1] if flips[k] else crop
        return torch.from_numpy(batch)
