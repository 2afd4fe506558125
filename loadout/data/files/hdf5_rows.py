"""Reading one row (a sample) of an HDF5 dataset at a time, as fast as the file allows, in the process that opened it.

h5py's `dataset[i]` builds a selection on every call, which costs as much as the read itself (and a fancy index of a
batch, `dataset[[i, j, ...]]`, costs a millisecond a row): `Rows` keeps one selection per dataset and moves it. Pixels
stored without compression, contiguous or one image a chunk (scripts/convert_dataset.py writes them so), are not read
through HDF5 at all: their file offsets are found once at start (`pixel_offsets`) and each process maps the file, so
a row is a view of the page cache, as the packed format's are, and every worker shares the one copy. Encoded rows
as h5py writes them by default are found in the file the same way (`heap_spans`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def pixel_offsets(images) -> np.ndarray | None:
    """Each row's byte offset in the file, where every row is stored whole and uncompressed (contiguous, or one row a
    chunk), checked against HDF5's own reads of a few rows; else None (HDF5 reads it)."""
    if images.dtype != np.uint8 or images.id.get_create_plist().get_nfilters():  # compressed, shuffled, ...
        return None
    row_bytes = int(np.prod(images.shape[1:]))
    if images.chunks is None:
        start = images.id.get_offset()
        offsets = None if start is None else start + row_bytes * np.arange(images.shape[0], dtype=np.int64)
        return offsets if offsets is None or agrees(images, offsets, row_bytes) else None
    if images.chunks != (1, *images.shape[1:]) or images.id.get_num_chunks() != images.shape[0]:
        return None  # several rows a chunk, or rows never written (HDF5 gives their fill value)
    offsets = np.full(images.shape[0], -1, dtype=np.int64)

    def found(info) -> None:
        offsets[info.chunk_offset[0]] = info.byte_offset

    images.id.chunk_iter(found)
    return None if (offsets < 0).any() or not agrees(images, offsets, row_bytes) else offsets


def agrees(images, offsets: np.ndarray, row_bytes: int) -> bool:
    """The first, middle and last rows at `offsets` in the file are what HDF5 reads for them."""
    with open(images.file.filename, "rb") as raw:
        for row in {0, len(offsets) // 2, len(offsets) - 1}:
            raw.seek(int(offsets[row]))
            if raw.read(row_bytes) != images[row].tobytes():
                return False
    return True


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

    def mapped(self, path: str, offsets: np.ndarray) -> Rows:
        self.map, self.offsets = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray), offsets
        return self

    def __getitem__(self, index: int) -> np.ndarray:
        if self.map is not None:
            return np.ndarray(self.shape, np.uint8, self.map, int(self.offsets[index]))
        out = np.empty(self.count, dtype=self.dtype)
        self.space.select_hyperslab((index, *self.zeros), self.count)
        self.dataset.id.read(self.memory, self.space, out, mtype=self.type)
        return out[0]

    def at(self, indices) -> Callable[[int], np.ndarray]:
        """k -> row indices[k], for a batch: the mapped rows' offsets are looked up once for all of it (looked up
        row by row, they cost as much as copying the boxes)."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.map is None:
            index_list = indices.tolist()
            return lambda k: self[index_list[k]]
        shape, buffer, starts = self.shape, self.map, self.offsets[indices].tolist()
        return lambda k: np.ndarray(shape, np.uint8, buffer, starts[k])


VLEN_REF = np.dtype([("length", "<u4"), ("collection", "<u8"), ("index", "<u4")])  # a stored vlen element
GLOBAL_HEAP_OBJECT = "<HHIQ"  # index, reference count, reserved, size; then the data, padded to 8 bytes


def heap_spans(f, images) -> np.ndarray | None:
    """(file offset, length) of each encoded row, where h5py wrote the rows as it does by default (a contiguous
    vlen dataset, the bytes in HDF5's global heap): then each process maps the file and a row is a slice of it, no
    HDF5 read at all (HDF5's vlen read costs about twice a file's open and read). The file format's little-endian
    structures (HDF5 spec, "Global Heap") are parsed once at start and checked against HDF5's own reads; anything
    else, or any disagreement, gives None (HDF5 reads the rows)."""
    if images.chunks is not None or images.id.get_offset() is None or f.id.get_create_plist().get_sizes() != (8, 8):
        return None
    refs = np.fromfile(f.filename, dtype=VLEN_REF, count=images.shape[0], offset=images.id.get_offset())
    if len(refs) != images.shape[0] or not refs["collection"].all():
        return None
    spans = np.empty((len(refs), 2), dtype=np.int64)
    with open(f.filename, "rb") as raw:
        for collection in np.unique(refs["collection"]).tolist():
            objects = _heap_objects(raw, collection)
            if objects is None:
                return None
            rows = np.flatnonzero(refs["collection"] == collection)
            for row, index in zip(rows.tolist(), refs["index"][rows].tolist(), strict=True):
                if index not in objects:
                    return None
                spans[row] = objects[index]
    if (spans[:, 1] != refs["length"]).any():
        return None
    rows = Rows(images)
    for row in {0, len(refs) // 2, len(refs) - 1}:
        start, length = spans[row].tolist()
        value = rows[row]
        with open(f.filename, "rb") as raw:
            raw.seek(start)
            if raw.read(length) != (value if isinstance(value, bytes) else value.tobytes()):
                return None
    return spans


def _heap_objects(raw, address: int) -> dict[int, tuple[int, int]] | None:
    """{object index: (file offset, size)} of the global heap collection at `address`, or None if it is not one."""
    import struct

    raw.seek(address)
    head = raw.read(16)
    if len(head) < 16 or head[:4] != b"GCOL" or head[4] != 1:
        return None
    size = int.from_bytes(head[8:16], "little")
    body, objects, at = head + raw.read(size - 16), {}, 16
    while at + 16 <= len(body):
        index, _, _, length = struct.unpack_from(GLOBAL_HEAP_OBJECT, body, at)
        if index == 0:  # the free space: the last object
            break
        objects[index] = (address + at + 16, length)
        at += 16 + (length + 7) // 8 * 8
    return objects


class HeapRows:
    """`rows[i]`: encoded row i as a uint8 view of this process's map of the file (`heap_spans` found where)."""

    def __init__(self, path: str, spans: np.ndarray):
        self.map, self.spans = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray), spans

    def __getitem__(self, index: int) -> np.ndarray:
        start, length = self.spans[index].tolist()
        return self.map[start:start + length]
