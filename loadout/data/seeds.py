"""Every seed loadout derives, from one mixer: splitmix64 folded over the keys, vectorised with numpy.

Each use names its purpose as the first key after the run's seed (SAMPLE, SAMPLER, LOADER, BATCH_MIX), so two uses
with the same numbers never share a stream. A sample's randomness is a function of (seed, epoch, index) alone,
which is what makes a resumed run draw the same pixels whatever its workers, ranks and restarts.
"""

from __future__ import annotations

import numpy as np

SAMPLE, SAMPLER, LOADER, BATCH_MIX, MIX = range(5)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic): a bijection with full avalanche."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def mix(seed: int, *keys) -> np.ndarray:
    """Well-mixed 64-bit draws (uint64) of `seed` and `keys` (ints or arrays, broadcast): distinct keys give
    unrelated draws."""
    state = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64) + _GOLDEN)
    with np.errstate(over="ignore"):
        for key in keys:
            state = _splitmix64((state ^ np.asarray(key, dtype=np.int64).astype(np.uint64)) + _GOLDEN)
    return state


def mixed_seed(seed: int, *keys: int) -> int:
    """One 63-bit seed (a torch generator's range) from `mix`."""
    return int(mix(seed, *keys)[0]) >> 1


def sample_seeds(seed: int, epochs, indices) -> np.ndarray:
    """The uint64 draws of samples `indices` in `epochs` (broadcast): a whole batch in a few numpy passes."""
    return mix(seed, SAMPLE, epochs, indices)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 63-bit torch seed of one sample in one epoch: its `sample_seeds` draw >> 1."""
    return int(sample_seeds(seed, epoch, index)[0]) >> 1


def loader_seed(seed: int, rank: int) -> int:
    """The seed of one rank's loader generator (DataLoader draws the workers' base seed from it)."""
    return mixed_seed(seed, LOADER, rank)
