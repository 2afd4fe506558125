"""loadout's own sources (source.py): JPEG ImageFolder (the embedded default and real data) and CIFAR-10's python
batches, built from the `dataset:` config group (`_target_`) like any user's own.

Metadata lives in numpy arrays, never Python lists: a list of paths read by every worker is copied page by page
into each worker (copy-on-read refcounts, pytorch/pytorch#13246) and worker memory grows over an epoch.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loadout.data.fast.decode import decode_image_file
from loadout.errors import ConfigError

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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label = self.read_encoded(index)
        return decode_image_file(data, self.min_side), label

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The encoded file and its label (data.decode=device decodes it on the training device)."""
        with open(self.paths[index].decode(), "rb") as f:
            return f.read(), int(self.targets[index])


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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.images[index]), int(self.targets[index])


def split_root(root: str | Path, split: str) -> Path:
    """root/<split> for ImageFolder-style datasets, with an error naming the key and the fix."""
    given, root = str(root), Path(root)  # the value as typed: Path would fold a URL's // (and hide it from masking)
    if not root.exists():
        raise ConfigError(
            f"data.root={given!r} does not exist: run `make dataset` for the embedded default, or set data.root "
            "to a folder with train/ and val/"
        )
    path = root / split
    if not path.is_dir():
        raise ConfigError(f"data.root={str(root)!r} has no {split}/ folder: expected {root}/{split}/<class>/<image>")
    return path
