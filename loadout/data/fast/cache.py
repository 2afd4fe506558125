"""A shared, byte-bounded cache of decoded samples (data.cache_bytes): epoch 2 onward skips JPEG decoding.

The main process allocates one uint8 slab in shared memory (/dev/shm, via torch's shared tensors) before any
worker starts, plus a one-byte "filled" flag per slot. Every worker maps the same pages (inherited under fork,
passed as a file descriptor under spawn), so a sample decoded by any worker is there for all of them. Entries have
a fixed size: the image made square at the resize size (transforms.fit_square), so slot i holds sample i and
nothing is ever evicted; samples past the capacity are simply decoded every time. The slab plus the flags never
exceed `max_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loadout.data.transforms import fit_square


class SharedSampleCache:
    """Sample `i` < `capacity` decoded once, then read from shared memory by every worker: its image and label."""

    def __init__(self, num_samples: int, size: int, max_bytes: int):
        entry = 3 * size * size
        self.size = size
        self.capacity = max(0, min(num_samples, max_bytes // (entry + 9)))  # +9: the slot's label and flag
        self.slab = torch.empty((self.capacity, 3, size, size), dtype=torch.uint8).share_memory_()
        self.labels = torch.empty(self.capacity, dtype=torch.int64).share_memory_()
        self.filled = torch.zeros(self.capacity, dtype=torch.uint8).share_memory_()

    @property
    def nbytes(self) -> int:
        return self.slab.nbytes + self.labels.nbytes + self.filled.nbytes

    def __len__(self) -> int:
        """Slots filled so far."""
        return int(self.filled.sum())

    def fetch(self, index: int, load: Callable[[int], tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int]:
        """Sample `index` as (square uint8 image, label): from the slab, or `load`ed, fitted and stored."""
        if index < self.capacity and self.filled[index]:
            return self.slab[index].clone(), int(self.labels[index])  # a copy: transforms never write the slab
        image, label = load(index)
        image = fit_square(image, self.size)
        if index < self.capacity:
            self.slab[index].copy_(image)
            self.labels[index] = int(label)
            self.filled[index] = 1  # after the pixels: a reader that sees the flag sees the whole sample
        return image, label
