"""Byte strings (LMDB keys) kept in two numpy arrays, one buffer and its offsets: a Python list of keys would be
copied page by page into every worker as its refcounts are touched (datasets.py says why), and numpy's fixed-width
bytes_ drops trailing NUL bytes, which a binary key may end with."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteKeys:
    """`keys[i]`: the i-th byte string, as given."""

    def __init__(self, keys: Iterable[bytes]):
        keys = list(keys)
        self.offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(key) for key in keys], out=self.offsets[1:])
        self.blob = np.frombuffer(b"".join(keys), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> bytes:
        return self.blob[self.offsets[index]:self.offsets[index + 1]].tobytes()
