"""dataset=parquet: Hugging Face image datasets in their parquet layout, from a folder, HTTP or an S3-compatible store,
read map-style by row group (pyarrow); no download from the Hub at run time.

Files: `<root>/data/<split>-*.parquet` (as `datasets`' `push_to_hub` and `to_parquet` write them; `val` is also
found as `validation`), or `<root>/<split>/*.parquet`. Columns: `image` (the Hub's struct of `bytes` and `path`, or
plain bytes) and `label`; class names from the file's Hugging Face features metadata (a ClassLabel's names) when
present. Each row group is a "shard" to the training order (loader.ShardWindowSampler reads a window of row groups at
a time), and a worker keeps the row group it read last, so consecutive samples cost one read. Remote files are kept
on the node by the same store as tar shards (shard_store.py): at start only each file's footer and label column
are read, in place; a file is fetched whole when the order first reaches it (fetch_ahead.py) or a worker reads it.
"""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from train.config import ConfigError
from train.data.decode import decode_image_file
from train.data.shard_store import ShardError, ShardStore, is_remote
from train.data.shards import SamplePaths

SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "test")}


def list_files(root: str, split: str) -> list[str]:
    """The split's parquet files under `root`, in name order."""
    try:
        fs, path = fsspec.core.url_to_fs(root)
        base = path.rstrip("/")
        for name in SPLIT_NAMES.get(split, (split,)):
            for pattern in (f"{base}/data/{name}-*.parquet", f"{base}/{name}/*.parquet"):
                found = sorted(fs.glob(pattern))
                if found:
                    return [fs.unstrip_protocol(p) if is_remote(root) else p for p in found]
    except Exception as err:
        raise ShardError(f"data.root={root}: cannot list its parquet files: {type(err).__name__}") from err
    raise ConfigError(f"data.root={root}: no parquet files for the {split} split (looked for data/{split}-*.parquet "
                      f"and {split}/*.parquet)")


def class_names(schema) -> list[str] | None:
    """The label column's ClassLabel names from the Hugging Face features metadata, if any."""
    metadata = (schema.metadata or {}).get(b"huggingface")
    if not metadata:
        return None
    features = json.loads(metadata).get("info", {}).get("features", {})
    names = features.get("label", {}).get("names")
    return list(names) if names else None


class ParquetSource:
    """One split of a parquet image dataset (train/data/source.py's interface): `classes`, `targets`, `paths`,
    `read_encoded`, `min_side`, `shard_starts` (the first row of each row group) and `fetch_shard`."""

    def __init__(self, root: str, split: str = "train", cache_dir: str | None = None, cache_bytes: int = 0,
                 min_side: int | None = None, timeout: float | None = None):
        root = str(root).rstrip("/")
        self.store = ShardStore(cache_dir, cache_bytes, timeout)
        self.urls = list_files(root, split)
        groups, labels, classes = [], [], None
        for number, url in enumerate(self.urls):
            try:
                with self.store.open(url) as f:  # the footer and the label column only: no image is fetched
                    parquet = pq.ParquetFile(f)
                    names = parquet.schema_arrow.names
                    if "image" not in names or "label" not in names:
                        raise ConfigError(f"data.root: {url} has no `image` and `label` columns (it has "
                                          f"{', '.join(names)})")
                    classes = classes or class_names(parquet.schema_arrow)
                    for group in range(parquet.num_row_groups):
                        groups.append((number, group))
                        labels.append(parquet.read_row_group(group, columns=["label"]).column("label").to_numpy())
            except (OSError, pa.ArrowException) as err:
                raise ShardError(f"data.root: cannot read {url}: {type(err).__name__}") from err
        self.groups = np.array(groups, dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum([len(part) for part in labels])]).astype(np.int64)
        self.targets = np.concatenate(labels).astype(np.int64)
        self.classes = classes or [str(i) for i in range(int(self.targets.max()) + 1)]
        self.paths = SamplePaths(np.array([f"{self.urls[f]}#rowgroup{g}" for f, g in groups]), self.shard_starts)
        self.min_side = min_side
        self._held: tuple[int, list] | None = None  # this process's last row group: (its number, its images)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": None}

    def __len__(self) -> int:
        return len(self.targets)

    def fetch_shard(self, group: int) -> None:
        """The row group's file onto this node (the fetch-ahead thread calls this before the workers read)."""
        self.store.local(self.urls[int(self.groups[group][0])])

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The sample's encoded image and its label, from the row group this process holds or reads now."""
        group = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        if self._held is None or self._held[0] != group:
            number, row_group = self.groups[group].tolist()
            table = pq.ParquetFile(self.store.local(self.urls[number])).read_row_group(row_group, columns=["image"])
            self._held = (group, table.column("image").to_pylist())
        image = self._held[1][index - int(self.shard_starts[group])]
        data = image.get("bytes") if isinstance(image, dict) else image
        if not data:
            raise OSError(f"{self.paths[index]}: no image bytes")
        return data, int(self.targets[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label = self.read_encoded(index)
        return decode_image_file(data, self.min_side), label
