"""A dataset of your own for loadout: images listed in a CSV file (`path,label` per line, a header first).

Everything a dataset needs: built with a `split` ("train" or "val"), `__len__`, `__getitem__` returning
(image, label) with the image a PIL image or a uint8 CHW tensor, and `classes`. loadout adds the rest: workers, the
shared-memory batch ring, the device prefetcher, per-(seed, epoch, index) augmentation, exact resume, unreadable
files skipped, the sample cache.

    PYTHONPATH=examples/csv_dataset python -m train dataset._target_=csv_images.CsvImages +dataset.csv=list.csv
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset


class CsvImages(Dataset):
    def __init__(self, csv: str, split: str = "train", val_csv: str | None = None):
        """`csv`: the training list; `val_csv`: the validation list (default: the same path with `_val` before the
        suffix, e.g. list_val.csv)."""
        path = Path(csv) if split == "train" else Path(val_csv or Path(csv).with_stem(Path(csv).stem + "_val"))
        rows = _read(path)
        labels = sorted({label for _, label in rows} | {label for _, label in _read(Path(csv))})
        self.classes = labels  # the same on both splits: sorted label names of the training list and this one
        index = {name: i for i, name in enumerate(labels)}
        # numpy arrays, not lists: every worker reads them without copying their pages (copy-on-read)
        self.paths = np.array([str(path.parent / p) for p, _ in rows], dtype=np.bytes_)
        self.targets = np.array([index[label] for _, label in rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return Image.open(self.paths[index].decode()), int(self.targets[index])


def _read(path: Path) -> list[tuple[str, str]]:
    with open(path, newline="") as f:
        return [(row["path"], row["label"]) for row in csv.DictReader(f)]
