"""Datasets: JPEG ImageFolder (the embedded default and real data) and CIFAR-10's python batches, built from the
`dataset:` config group (`_target_`) like any user's own; `build_datasets` wraps each split in `Prepared`.

Metadata lives in numpy arrays, never Python lists: a list of paths read by every worker is copied page by page
into each worker (copy-on-read refcounts, pytorch/pytorch#13246) and worker memory grows over an epoch.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from train.config import ConfigError
from train.data.cache import SharedSampleCache
from train.data.decode import decode_image_file
from train.data.prepared import Prepared, Transform, as_uint8_tensor
from train.data.transforms import build_val_transform, resize_size

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class ImageFolderDataset(Dataset):
    """root/<split>/<class>/<image> (or root/<class>/<image> without a split) with classes sorted by name; decodes
    with libjpeg-turbo into a uint8 CHW tensor, a JPEG at the smallest DCT scale whose shorter side stays >=
    `min_side` (decode.py; None: always whole; loadout sets it from data.resize_size when data.scaled_decode)."""

    def __init__(self, root: str | Path, split: str | None = None, min_side: int | None = None):
        root = split_root(root, split) if split is not None else Path(root)
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
        self.min_side = min_side

    def __len__(self) -> int:
        return len(self.targets)

    def load(self, index: int) -> torch.Tensor:
        """The decoded uint8 CHW image."""
        with open(self.paths[index].decode(), "rb") as f:
            return decode_image_file(f.read(), self.min_side)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.load(index), int(self.targets[index])


class Cifar10Dataset(Dataset):
    """CIFAR-10 from its standard python-batches folder (cifar-10-batches-py); never downloaded at run time."""

    decoded = True  # its images are pixels already: nothing for the sample cache to save

    def __init__(self, root: str | Path, split: str = "train"):
        root = Path(root)
        if not root.exists():
            raise ConfigError(f"data.root={str(root)!r} does not exist: point it at cifar-10-batches-py")
        train = split == "train"
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

    def __len__(self) -> int:
        return len(self.targets)

    def load(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.images[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.load(index), int(self.targets[index])


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


def build_datasets(cfg, train_transform: Transform | None = None,
                   val_transform: Transform | None = None) -> tuple[Prepared, Prepared, int]:
    """(train, val, num_classes): `dataset._target_` built with split="train" and "val", each wrapped in
    `Prepared` with the augmentation recipe's transforms (augment.*; validation: Resize -> CenterCrop)."""
    from train.config import fitted_spec, instantiate

    data_cfg = cfg.data
    spec = fitted_spec("dataset", cfg.dataset, optional=("root",))  # a class of your own may take no root
    train, val = (instantiate("dataset", spec, split=split) for split in ("train", "val"))
    check_dataset(cfg, train, val)
    if data_cfg.scaled_decode and hasattr(train, "min_side"):  # both splits resize the shorter side first
        train.min_side = val.min_side = resize_size(data_cfg)
    cache = None
    if data_cfg.cache_bytes:
        if getattr(train, "decoded", False):
            raise ConfigError(f"data.cache_bytes={data_cfg.cache_bytes}: the sample cache is for datasets that "
                              f"decode ({cfg.dataset._target_} stores decoded images already): set it to 0")
        cache = _shared_cache(data_cfg, len(train))
    input_size = getattr(train, "size", None)  # the side of square inputs (packed, cached): no Resize for them
    train_input = resize_size(data_cfg) if cache is not None else input_size  # the cache stores fitted squares
    train_transform = train_transform or instantiate("augment", cfg.augment).train_transform(data_cfg, train_input)
    val_transform = val_transform or build_val_transform(data_cfg, input_size)
    return (Prepared(train, train_transform, data_cfg.on_bad_sample, cache),
            Prepared(val, val_transform, data_cfg.on_bad_sample), len(train.classes))


def check_dataset(cfg, train: Dataset, val: Dataset) -> None:
    """What the data path needs of a dataset, checked before any worker starts: classes, the same on both splits,
    and a first sample of (image, label)."""
    target = cfg.dataset._target_
    for split, dataset in (("train", train), ("val", val)):
        if not hasattr(dataset, "classes") or not hasattr(dataset, "__len__"):
            raise ConfigError(f"dataset._target_={target}: the {split} split needs `classes` (the class names) and "
                              "`__len__`: a map-style Dataset")
        if len(dataset) == 0:
            raise ConfigError(f"dataset._target_={target}: the {split} split is empty")
    if list(train.classes) != list(val.classes):
        raise ConfigError(f"dataset._target_={target} (data.root={cfg.data.root!r}): train and val have different "
                          "classes")
    if hasattr(train, "transform"):  # transforms itself (packed): its samples are its own business
        return
    try:
        image, label = train[0][:2]
        as_uint8_tensor(image)
        int(label)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"dataset._target_={target}: dataset[0] must be (image, label) with a PIL image or a uint8 "
                          f"CHW tensor and an integer label ({err})") from err
