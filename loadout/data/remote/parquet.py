"""dataset=parquet: Hugging Face image datasets in every parquet layout `datasets` writes, from a folder, HTTP or an
S3-compatible store, read map-style by row group (pyarrow); no download from the Hub at run time.

Files: `<root>/data/<split>-*.parquet` (as `datasets`' `push_to_hub` and `to_parquet` write them; `val` is also
found as `validation`), or `<root>/<split>/*.parquet`. The image and label columns, the class names and each row's
image are read as `datasets` reads them (parquet_rows.py): embedded bytes, or a path absolute or relative to the
parquet file. Each row group is a "shard" to the training order (loader.ShardWindowSampler reads a window of row
groups at a time), and a worker keeps the row group it read last, so consecutive samples cost one read.

Remote files: at start only each file's footer and label column are read, in place (range requests). The node keeps
what is read in the cache folder of tar shards (shard_store.py), fetched when the order first reaches it
(fetch_ahead.py) or a worker reads it. A file up to `whole_file_bytes` is fetched whole: a few requests. A larger one
is never fetched whole: each row group's image column is read in place, one range request a column chunk, through a
handle of the reading process and thread (fsspec's clients are per process), and kept as its own small parquet file,
so a window of row groups shuffled together and later epochs read the node's copy.

Segmentation (`mask_column`): each row's mask is a PNG in that column (masks.py), read with its image; the class
names come from `classes` (a mask column names none); the image is decoded whole (never DCT-scaled: its mask covers
the stored size); an unreadable mask, or one of another size, is a bad sample (samples.py skips and counts it).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from loadout.data.fast.decode import UNREADABLE, decode_image_file
from loadout.data.masks import decode_mask
from loadout.data.remote.parquet_rows import Layout, check_labels, image_of
from loadout.data.remote.shard_store import ShardError, ShardStore, check_store_knobs, is_remote
from loadout.data.remote.shards import SamplePaths
from loadout.errors import ConfigError

SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "test")}
WHOLE_FILE_BYTES = 64 << 20  # a larger remote file is read by row group in place, never fetched whole


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
        listing = " (an HTTP server must list its folders, as nginx's `autoindex on` does)" if root.startswith(
            "http") else ""
        raise ShardError(f"data.root={root}: cannot list its parquet files: {type(err).__name__}{listing}") from err
    raise ConfigError(f"data.root={root}: no parquet files for the {split} split (looked for data/{split}-*.parquet "
                      f"and {split}/*.parquet)")


def open_in_place(store: ShardStore, url: str):
    """`url` for reading: the local file or the node's copy, else the remote file itself with one range request a
    read (no read-ahead: a label or image column chunk, not the megabytes after it)."""
    f = store.open(url)
    if not hasattr(f, "fs"):  # a local file
        return f
    with f:
        return f.fs.open(f.path, "rb", cache_type="none", size=f.size)


class ParquetSource:
    """One split of a parquet image dataset (source.py, capabilities.py): `classes`, `targets` (not with
    masks), `paths`, `read_encoded`, `min_side`, `shard_starts` (the first row of each row group) and `fetch_shard`.
    `classes`: the class names (or their count) where the files do not name them, as with `mask_column`."""

    def __init__(self, root: str, split: str = "train", cache_dir: str | None = None, cache_bytes: int = 0,
                 min_side: int | None = None, timeout: float | None = None,
                 whole_file_bytes: int = WHOLE_FILE_BYTES, mask_column: str | None = None,
                 classes: list[str] | int | None = None, shuffle_window: int | None = None,
                 prefetch_shards: int | None = None):
        root = str(root).rstrip("/")
        check_store_knobs(cache_bytes, shuffle_window, prefetch_shards)
        self.shuffle_window, self.prefetch_shards = shuffle_window, prefetch_shards  # the sampler reads them
        self.store = ShardStore(cache_dir, cache_bytes, timeout)
        self.urls = list_files(root, split)
        groups, counts, labels, sizes, layout = [], [], [], [], None
        for number, url in enumerate(self.urls):
            try:
                with open_in_place(self.store, url) as f:  # the footer and the label column only: no image is read
                    sizes.append(f.seek(0, os.SEEK_END))
                    parquet = pq.ParquetFile(f)
                    found = Layout.of(parquet.schema_arrow, url, mask_column)
                    if layout and (found.image, found.label) != (layout.image, layout.label):
                        raise ConfigError(f"data.root: {url} has the columns `{found.image}`, `{found.label}` where "
                                          f"{self.urls[0]} has `{layout.image}`, `{layout.label}`")
                    layout = layout if layout and layout.classes else found
                    if found.label is not None:
                        column = parquet.read(columns=[found.label]).column(found.label)
                        check_labels(column, url, found.label)
                        labels.append(column.to_numpy())
                    for group in range(parquet.num_row_groups):
                        groups.append((number, group))
                        counts.append(parquet.metadata.row_group(group).num_rows)
            except (OSError, pa.ArrowException) as err:
                raise ShardError(f"data.root: cannot read {url}: {type(err).__name__}") from err
        self.layout, self.whole_file_bytes = layout, whole_file_bytes
        self.in_place = [is_remote(url) and size > whole_file_bytes for url, size in zip(self.urls, sizes, strict=True)]
        self.groups = np.array(groups, dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if layout.mask is None:  # labels to offer (a mask source has none: data.sampler=weighted is refused)
            self.targets = np.concatenate(labels).astype(np.int64)
        named = [str(i) for i in range(classes)] if isinstance(classes, int) else classes and list(classes)
        self.classes = named or layout.classes or ([str(i) for i in range(int(self.targets.max()) + 1)]
                                                   if layout.mask is None else None)
        if not self.classes:
            raise ConfigError(f"dataset.mask_column={mask_column}: masks name no classes: set dataset.classes to "
                              "their names ([background, ...], index 0 first) or their count")
        self.paths = SamplePaths(np.array([f"{self.urls[f]}#rowgroup{g}" for f, g in groups]), self.shard_starts)
        self.min_side = min_side
        self._held: tuple[int, list] | None = None  # this process's last row group: (its number, its images)
        self._handles: dict[tuple[int, int, int], pq.ParquetFile] = {}  # (pid, thread, file): in-place handles

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": None, "_handles": {}}

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def fetch_shard(self, group: int) -> None:
        """The row group onto this node before the workers read it (the fetch-ahead thread calls this): its file, or
        for a file read in place the row group's own copy."""
        number, row_group = self.groups[group].tolist()
        if self.in_place[number]:
            self._row_group_copy(number, row_group)
        else:
            self.store.local(self.urls[number])

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The sample's encoded image and its label (-1 with masks), from the row group this process holds or reads
        now."""
        cells, url = self._row(index)
        return self._file(cells[0], url), -1 if self.layout.mask else int(self.targets[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        if self.layout.mask is None:
            data, label = self.read_encoded(index)
            return decode_image_file(data, self.min_side), label
        (image, mask), url = self._row(index)
        image = decode_image_file(self._file(image, url))  # whole: the mask covers the stored size
        try:
            return image, decode_mask(self._file(mask, url))
        except UNREADABLE as err:  # the log line names the row group; say it is the mask
            raise OSError(f"its mask (column `{self.layout.mask}`): {err}") from err

    def _row(self, index: int) -> tuple[list, str]:
        """The cells of the index's row (image, and mask), and its file's URL."""
        group = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        if self._held is None or self._held[0] != group:
            number, row_group = self.groups[group].tolist()
            columns = self.layout.columns
            if self.in_place[number]:
                try:
                    table = pq.read_table(self._row_group_copy(number, row_group), columns=columns)
                except FileNotFoundError:  # evicted by another process between the check and the read: once more
                    table = pq.read_table(self._row_group_copy(number, row_group), columns=columns)
            else:
                table = pq.ParquetFile(self.store.local(self.urls[number])).read_row_group(row_group, columns=columns)
            self._held = (group, [column.to_pylist() for column in table.columns])
        row = index - int(self.shard_starts[group])
        return [column[row] for column in self._held[1]], self.urls[int(self.groups[group][0])]

    def _file(self, cell, url: str) -> bytes:
        """A cell's encoded file: embedded bytes, or the file its path names."""
        data, path = image_of(cell, url)
        return self._read_image_file(path) if data is None else data

    def _row_group_copy(self, number: int, row_group: int) -> Path:
        """The node's copy of a row group's columns (image, and mask) of file `number` (read in place), made by the
        first process or thread to need it: written aside, then renamed into place, so no reader sees a torn file.
        Named by its columns: a copy another run made of other columns is not this one."""
        url = self.urls[number]
        columns = hashlib.sha1("\0".join(self.layout.columns).encode()).hexdigest()[:8]  # any name is a file name
        path = self.store.cached(url, f".rowgroup{row_group}.{columns}.parquet")
        if path.exists():
            return path
        key = (os.getpid(), threading.get_ident(), number)
        if key not in self._handles:  # a handle is never shared across a fork or between threads
            self._handles[key] = pq.ParquetFile(open_in_place(self.store, url))
        try:
            table = self._handles[key].read_row_group(row_group, columns=self.layout.columns)
        except (OSError, pa.ArrowException):
            self._handles.pop(key).close()
            raise
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.part")
        try:
            pq.write_table(table, partial)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        self.store.evict(keep=path)  # row-group copies count against dataset.cache_bytes like whole files
        return path

    def _read_image_file(self, path: str) -> bytes:
        """A path-only row's image file: a missing one is an OSError, a bad sample skipped and counted."""
        if not is_remote(path):
            return Path(path.removeprefix("file://")).read_bytes()
        with self.store.open(path) as f:
            return f.read()
