"""Datasets: JPEG ImageFolder (the embedded default and real data) and CIFAR-10's python batches.

Metadata lives in numpy arrays, never Python lists: a list of paths read by every worker is copied page by page
into each worker (copy-on-read refcounts, pytorch/pytorch#13246) and worker memory grows over an epoch.
A sample that fails to decode comes back as None: the collate function skips and counts it (data.on_bad_sample).
With data.cache_bytes, decoded training samples live in a shared-memory cache (cache.py) from epoch 2 on.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from train.config import ConfigError
from train.data.cache import SharedSampleCache
from train.data.decode import decode_image_file
from train.data.loader import LoaderError
from train.data.transforms import build_train_transform, build_val_transform, resize_size

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
Transform = Callable[[torch.Tensor], torch.Tensor]


class BadSampleError(LoaderError):
    """An unreadable sample under data.on_bad_sample=raise."""


class ImageFolderDataset(Dataset):
    """root/<class>/<image> with classes sorted by name; decodes with libjpeg-turbo into a uint8 CHW tensor, a
    JPEG at the smallest DCT scale whose shorter side stays >= `min_side` (decode.py; None: always whole)."""

    def __init__(self, root: str | Path, transform: Transform | None = None, on_bad_sample: str = "warn",
                 cache: SharedSampleCache | None = None, min_side: int | None = None):
        root = Path(root)
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        paths, targets = [], []
        for label, name in enumerate(self.classes):
            for path in sorted((root / name).iterdir()):
                if path.suffix.lower() in IMAGE_SUFFIXES:
                    paths.append(str(path))
                    targets.append(label)
        if not paths:
            raise ConfigError(f"data.root: no images under {root} (expected {root}/<class>/<image>.jpg)")
        self.paths = np.array(paths, dtype=np.bytes_)
        self.targets = np.array(targets, dtype=np.int64)
        self.transform = transform
        self.on_bad_sample = on_bad_sample
        self.cache = cache
        self.min_side = min_side

    def __len__(self) -> int:
        return len(self.targets)

    def load(self, index: int) -> torch.Tensor:
        """The decoded uint8 CHW image, before transforms."""
        with open(self.paths[index].decode(), "rb") as f:
            return decode_image_file(f.read(), self.min_side)

    def __getitem__(self, index: int):
        try:
            image = self.load(index) if self.cache is None else self.cache.fetch(index, self.load)
        except (RuntimeError, OSError, ValueError) as err:
            path = self.paths[index].decode()
            if self.on_bad_sample == "raise":
                raise BadSampleError(f"cannot decode {path}: {err} (data.on_bad_sample=warn skips such files)") from err
            log.warning("skipping unreadable image %s: %s", path, err)
            return None
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


class Cifar10Dataset(Dataset):
    """CIFAR-10 from its standard python-batches folder (cifar-10-batches-py); never downloaded at run time."""

    def __init__(self, root: str | Path, train: bool, transform: Transform | None = None):
        root = Path(root)
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ConfigError(
                f"data.root={str(root)!r}: missing CIFAR-10 batch files {missing}; point data.root at the extracted "
                "cifar-10-batches-py folder (from cifar-10-python.tar.gz)"
            )
        images, labels = [], []
        for name in names:
            with open(root / name, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch["labels"])
        self.images = np.concatenate(images)
        self.targets = np.array(labels, dtype=np.int64)
        meta = root / "batches.meta"
        if meta.is_file():
            with open(meta, "rb") as f:
                self.classes = list(pickle.load(f, encoding="latin1")["label_names"])
        else:
            self.classes = [str(i) for i in range(int(self.targets.max()) + 1)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def load(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.images[index])

    def __getitem__(self, index: int):
        image = self.load(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


def split_root(root: str | Path, split: str) -> Path:
    """root/<split> for ImageFolder-style datasets, with an error naming the key and the fix."""
    root = Path(root)
    if not root.exists():
        raise ConfigError(
            f"data.root={str(root)!r} does not exist: run `make dataset` for the embedded default, or set data.root "
            "to a folder with train/ and val/"
        )
    path = root / split
    if not path.is_dir():
        raise ConfigError(f"data.root={str(root)!r} has no {split}/ folder: expected {root}/{split}/<class>/<image>")
    return path


def _shared_cache(data_cfg, num_samples: int) -> SharedSampleCache:
    """The sample cache, allocated here in the main process before any worker starts."""
    from train.data.shm import check_shm

    problem = check_shm(data_cfg.cache_bytes)
    if problem:
        raise ConfigError(f"data.cache_bytes={data_cfg.cache_bytes}: {problem}")
    return SharedSampleCache(num_samples, resize_size(data_cfg), data_cfg.cache_bytes)


def build_datasets(data_cfg, train_transform: Transform | None = None,
                   val_transform: Transform | None = None) -> tuple[Dataset, Dataset, int]:
    """(train, val, num_classes) for data.dataset; transforms default to the seed pipeline for its input size."""
    kind = data_cfg.dataset
    input_size = None  # the side of square inputs (packed, cached): their transforms skip the Resize
    if kind in ("synthetic", "imagefolder"):
        min_side = resize_size(data_cfg) if data_cfg.scaled_decode else None  # both splits resize the shorter side
        train = ImageFolderDataset(split_root(data_cfg.root, "train"), None, data_cfg.on_bad_sample, min_side=min_side)
        val = ImageFolderDataset(split_root(data_cfg.root, "val"), None, data_cfg.on_bad_sample, min_side=min_side)
        if data_cfg.cache_bytes:
            train.cache = _shared_cache(data_cfg, len(train))
    elif kind == "cifar10":
        if not Path(data_cfg.root).exists():
            raise ConfigError(f"data.root={data_cfg.root!r} does not exist: point it at cifar-10-batches-py")
        train = Cifar10Dataset(data_cfg.root, True)
        val = Cifar10Dataset(data_cfg.root, False)
    elif kind == "packed":
        from train.data.packed import PackedDataset

        train = PackedDataset(split_root(data_cfg.root, "train"))
        val = PackedDataset(split_root(data_cfg.root, "val"))
        input_size = train.size
    else:  # validate() rejects this earlier; kept for direct callers
        raise ConfigError(f"data.dataset={kind!r}: unknown dataset")
    if train.classes != val.classes:
        raise ConfigError(f"data.root={data_cfg.root!r}: train/ and val/ have different classes")
    train_input = resize_size(data_cfg) if getattr(train, "cache", None) is not None else input_size
    train.transform = train_transform or build_train_transform(data_cfg, train_input)
    val.transform = val_transform or build_val_transform(data_cfg, input_size)
    return train, val, len(train.classes)
