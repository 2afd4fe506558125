"""Reading one row (a sample) of an HDF5 dataset at a time, as fast as the file allows, in the process that opened it.

h5py's `dataset[i]` builds a selection on every call, which costs as much as the read itself (and a fancy index of a
batch, `dataset[[i, j, ...]]`, costs a millisecond a row): `Rows` keeps one selection per dataset and moves it. Pixels
stored without compression, contiguous or one image a chunk (scripts/convert_dataset.py writes them so), are not read
through HDF5 at all: their file offsets are found once at start (`pixel_offsets`) and each process maps the file, so
a row is a view of the page cache, as the packed format's are, and every worker shares the one copy.
"""

from __future__ import annotations

import numpy as np


def pixel_offsets(images) -> np.ndarray | None:
    """Each row's byte offset in the file, where every row is stored whole and uncompressed (contiguous, or one row a
    chunk); else None (HDF5 reads it)."""
    if images.dtype != np.uint8 or images.compression is not None or images._filters:
        return None
    row_bytes = int(np.prod(images.shape[1:]))
    if images.chunks is None:
        start = images.id.get_offset()
        return None if start is None else start + row_bytes * np.arange(images.shape[0], dtype=np.int64)
    if images.chunks != (1, *images.shape[1:]) or images.id.get_num_chunks() != images.shape[0]:
        return None  # several rows a chunk, or rows never written (HDF5 gives their fill value)
    offsets = np.full(images.shape[0], -1, dtype=np.int64)

    def found(info) -> None:
        offsets[info.chunk_offset[0]] = info.byte_offset

    images.id.chunk_iter(found)
    return None if (offsets < 0).any() else offsets


class Rows:
    """`rows[i]`: row i of an open h5py dataset as a numpy array (a vlen row: its uint8 array), through one reused
    selection; `rows.mapped(file, offsets)` reads rows stored whole as views of the mapped file instead."""

    def __init__(self, dataset):
        import h5py

        self.dataset, self.shape, self.dtype = dataset, dataset.shape[1:], dataset.dtype
        self.space = dataset.id.get_space()
        self.memory = h5py.h5s.create_simple((1, *self.shape))
        self.type = h5py.h5t.py_create(self.dtype)  # else h5py makes the memory type on every read
        self.zeros, self.count = (0,) * len(self.shape), (1, *self.shape)
        self.map: np.ndarray | None = None
        self.offsets: np.ndarray | None = None
        self.row_bytes = int(np.prod(self.shape))

    def mapped(self, path: str, offsets: np.ndarray) -> Rows:
        self.map, self.offsets = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray), offsets
        return self

    def __getitem__(self, index: int) -> np.ndarray:
        if self.map is not None:
            start = int(self.offsets[index])
            return self.map[start:start + self.row_bytes].reshape(self.shape)
        out = np.empty(self.count, dtype=self.dtype)
        self.space.select_hyperslab((index, *self.zeros), self.count)
        self.dataset.id.read(self.memory, self.space, out, mtype=self.type)
        return out[0]
