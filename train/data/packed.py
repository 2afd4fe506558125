"""The packed format: a split decoded once into one memory-mapped uint8 array, read with no per-sample decode.

Layout of one split folder (`scripts/pack_dataset.py` writes root/train and root/val):
    images.npy   uint8 (N, 3, S, S): every image made square at S px (transforms.fit_square), C-contiguous
    targets.npy  int64 (N,)
    meta.json    {"classes": [...], "size": S, "source": "..."}
Workers open the array with numpy's memmap on first use (never pickled to them), so all of them share the page
cache: one copy of the data in RAM whatever the number of workers, and no copy-on-read growth.

Samples are fetched a batch at a time (`__getitems__`, `seeded_items`): the batch's indices in sorted order (the
page cache reads forwards), each image's crop copied straight from the map into one batch array. For training,
the seed pipeline's RandomCrop + RandomHorizontalFlip run vectorised from each sample's 64-bit draw (resumable.py):
no torch RNG, no transform dispatch per sample.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from train.config import ConfigError
from train.data.transforms import BATCHABLE, fit_square

log = logging.getLogger(__name__)

IMAGES, TARGETS, META = "images.npy", "targets.npy", "meta.json"
Transform = Callable[[torch.Tensor], torch.Tensor]


def _crop_flip_plan(transform) -> tuple[tuple[int, int], float, list] | None:
    """((crop h, w), flip p, the rest) when `transform` is RandomCrop (no padding) -> [RandomHorizontalFlip] ->
    per-pixel steps (ToDtype, Normalize) that apply to a whole batch; None for any other pipeline."""
    steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
    if not steps or type(steps[0]) is not v2.RandomCrop or steps[0].padding is not None or steps[0].pad_if_needed:
        return None
    size, flip = tuple(steps[0].size), 0.0
    rest = steps[1:]
    if rest and type(rest[0]) is v2.RandomHorizontalFlip:
        flip, rest = float(rest[0].p), rest[1:]
    if not all(type(step) in BATCHABLE for step in rest):
        return None
    return size, flip, rest


class PackedDataset(Dataset):
    """One packed split: `.classes`, `.targets` (numpy) and `.size` (the stored side), uint8 CHW samples; root/<split>
    (or a split folder itself without `split`). It applies its `transform` itself, to whole batches."""

    decoded = True  # stored as pixels: nothing for the sample cache to save

    def __init__(self, root: str | Path, split: str | None = None, transform: Transform | None = None):
        self.split_dir = Path(root) / split if split is not None else Path(root)
        missing = [name for name in (IMAGES, TARGETS, META) if not (self.split_dir / name).is_file()]
        if missing:
            raise ConfigError(f"data.root: {self.split_dir} is not a packed split (missing {', '.join(missing)}); "
                              "make one with `python scripts/pack_dataset.py SRC OUT` or use dataset=imagefolder")
        meta = json.loads((self.split_dir / META).read_text())
        self.classes: list[str] = list(meta["classes"])
        self.size: int = int(meta["size"])
        self.targets = np.load(self.split_dir / TARGETS)
        self.transform = transform
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

    def load(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.images[index]))  # a private copy of one image's pages

    def __getitem__(self, index: int):
        image = self.load(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])

    def load_many(self, indices) -> torch.Tensor:
        """uint8 (n, 3, S, S) of `indices`, in their order, read from the map in sorted order."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        batch = np.empty((len(indices), *self.images.shape[1:]), dtype=np.uint8)
        batch[order] = self.images[indices[order]]  # one fancy-indexed read
        return torch.from_numpy(batch)

    def __getitems__(self, indices) -> list:
        """A batch of `dataset[i]` (the DataLoader calls this with each batch of indices)."""
        images = self.load_many(indices)
        if self.transform is not None:
            images = [self.transform(image) for image in images]
        return list(zip(images, self.targets[np.asarray(indices, dtype=np.int64)].tolist(), strict=True))

    def seeded_items(self, indices: np.ndarray, seeds: np.ndarray) -> list | None:
        """The samples at `indices` with their random crop and flip taken from `seeds` (uint64, one per sample;
        resumable.py), vectorised over the batch; None when the transform is not RandomCrop -> RandomHorizontalFlip
        -> per-pixel steps (the caller then seeds torch's RNG per sample)."""
        plan = _crop_flip_plan(self.transform)
        if plan is None:
            return None
        (height, width), flip_p, rest = plan
        images = self.images
        side_h, side_w = images.shape[2:]
        if height > side_h or width > side_w:
            raise ValueError(f"Required crop size {(height, width)} is larger than input image size "
                             f"{(side_h, side_w)}: pack at data.image_size or larger")
        seeds = np.asarray(seeds, dtype=np.uint64)
        top = (((seeds >> np.uint64(40)) * np.uint64(side_h - height + 1)) >> np.uint64(24)).tolist()
        left = ((((seeds >> np.uint64(16)) & np.uint64(0xFFFFFF)) * np.uint64(side_w - width + 1))
                >> np.uint64(24)).tolist()
        flip = ((seeds & np.uint64(0xFFFF)).astype(np.float64) < flip_p * 65536).tolist()
        index_list = np.asarray(indices, dtype=np.int64).tolist()
        batch = np.empty((len(index_list), images.shape[1], height, width), dtype=np.uint8)
        for k in sorted(range(len(index_list)), key=index_list.__getitem__):  # forwards through the map
            y, x = top[k], left[k]
            crop = images[index_list[k], :, y:y + height, x:x + width]
            batch[k] = crop[..., ::-1] if flip[k] else crop
        out = torch.from_numpy(batch)
        for step in rest:
            out = step(out)
        return list(zip(out, self.targets[index_list].tolist(), strict=True))


class _Fitted(Dataset):
    """(square image, label, ok) of a decodable dataset, for packing with DataLoader workers."""

    def __init__(self, dataset, size: int):
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            image = fit_square(self.dataset.load(index), self.size)
        except (RuntimeError, OSError, ValueError) as err:
            log.warning("pack: skipping unreadable sample %d: %s", index, err)
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), -1
        return image, int(self.dataset.targets[index])


def pack_split(dataset, out_dir: str | Path, size: int, num_workers: int = 0, source: str = "") -> int:
    """Write `dataset` (anything with `.load(i)` -> uint8 CHW, `.targets`, `.classes`) as a packed split of
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
