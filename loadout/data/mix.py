"""dataset=mix: several sources in one training order, each its weighted share of an epoch of
`samples_per_epoch` samples (Mosaic Streaming's `Stream(proportion=)`, litdata's `CombinedStreamingDataset(weights=)`).

Each source is built from its own `_target_` spec under `dataset.sources.<name>` with its own store settings (root,
cache, timeout), and may carry a `transform` of its own, applied to its uint8 image before the run's transform.

The mix is the training order: position p of epoch e is a function of (seed, e, p) alone, so the sampler only splits
the positions into contiguous per-rank parts (loader.py) and exact resume, another worker count and another world
size work on positions as for any source. An epoch of N positions gives source k `round(N * w_k / sum(w))` of them
(largest remainders), interleaved stratified: any stretch of the order holds the sources close to their weights. A
source reads its own endless stream of passes: each pass is every sample once, in a fresh order (a shuffle, or the
shard window order for a sharded source, so its reads stay mostly sequential and its node cache bounded), and an
epoch takes the next `count` entries. So a source drawn less than its size goes through all its samples over the
epochs before any repeats (without replacement), and one drawn more repeats whole passes (with replacement only
across passes). data.shuffle=false: every pass in stored order, interleaved evenly.

Classes are the union of the sources' class names (mix_sources.py builds and checks the sources); labels map by name.
Masks (task=segmentation) pass through as their source gives them: their values are class indices, so every source
of masks must name the same classes in the same order, and none may have a transform of its own (it would move the
image without its mask). check_sources reads each source's first readable sample through `read_part` at build, before
any worker starts, and hands the sources whose samples carry masks to `check_masks` (on train and val alike).
Validation reads every source's val split whole, one after another. A source whose read fails is named in the error
(`dataset.sources.<name>`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
import torch

from loadout.data.fast.decode import UNREADABLE
from loadout.data.masks import as_mask
from loadout.data.mix_sources import build_parts, check_mask_parts, pass_window
from loadout.data.remote.shard_order import check_window, window_order
from loadout.data.remote.shard_store import ShardError
from loadout.data.seeds import MIX, mixed_seed
from loadout.data.source import as_uint8_tensor, sample_name
from loadout.errors import ConfigError, first_line

log = logging.getLogger(__name__)

PLANS_HELD = 2  # epochs whose order a process keeps (the workers prefetch across one boundary)


class MixReadError(OSError):
    """A source's sample could not be read (an OSError: the run skips it as a bad sample); names the source."""


class MixSource:
    """The sources of `dataset.sources` mixed by weight (module docstring). Offers `set_epoch` (each sample's epoch
    picks its order), `paths`, `min_side` (handed to the sources that take it), and `parts`/`part_of` for the
    per-source counts in metrics.jsonl; `ordered`: the sampler keeps its order and only splits it over ranks."""

    ordered = True

    def __init__(self, sources: Mapping, split: str = "train", seed: int = 0, samples_per_epoch: int | None = None,
                 shuffle: bool = True, shuffle_window: int | None = None):
        check_window(shuffle_window)
        built = build_parts(sources, split)
        self.split, self.seed, self.shuffle, self.epoch = split, int(seed), bool(shuffle), 0
        self.names = self.parts = built.names
        self.sources, self.transforms = built.sources, built.transforms
        self.classes, self.label_maps = built.classes, built.label_maps
        self.lengths = np.array([len(source) for source in self.sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.paths = MixPaths(self)
        if split != "train":  # validation: every source's split whole, in turn
            self.counts, self.length = self.lengths, int(self.offsets[-1])
            return
        if samples_per_epoch is not None and (not isinstance(samples_per_epoch, int) or samples_per_epoch < 1):
            raise ConfigError(f"dataset.samples_per_epoch={samples_per_epoch!r}: use an integer >= 1, or null for "
                              f"the sources' samples together ({int(self.offsets[-1])})")
        self.length = int(samples_per_epoch or self.offsets[-1])
        self.counts = shares(self.length, built.weights)
        for name, count in zip(self.names, self.counts, strict=True):
            if count == 0:
                raise ConfigError(f"dataset.sources.{name}.weight: gives it none of the {self.length} samples an "
                                  "epoch; raise its weight or dataset.samples_per_epoch")
        self.windows = [pass_window(source, shuffle_window) for source in self.sources]
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("dataset=mix: %d samples an epoch from %s", self.length, ", ".join(
                f"{name} {count} (of {n})" for name, count, n in zip(self.names, self.counts, self.lengths,
                                                                    strict=True)))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_plans": {}}  # each worker draws the epochs it reads

    def __len__(self) -> int:
        return self.length

    @property
    def min_side(self) -> int | None:
        return next((source.min_side for source in self.sources if hasattr(source, "min_side")), None)

    @min_side.setter
    def min_side(self, value: int | None) -> None:
        for source in self.sources:
            if hasattr(source, "min_side"):
                source.min_side = value

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def locate(self, index: int, epoch: int | None = None) -> tuple[int, int]:
        """(source, its sample) at position `index` of `epoch` (default: the epoch `set_epoch` gave)."""
        if self.split != "train":
            part = int(np.searchsorted(self.offsets, index, side="right")) - 1
            return part, int(index - self.offsets[part])
        which, sample = self.plan(self.epoch if epoch is None else epoch)
        return int(which[index]), int(sample[index])

    def part_of(self, epoch: int, indices) -> np.ndarray:
        """The source (its place in `parts`) of each position in `indices` of `epoch`."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.split != "train":
            return np.searchsorted(self.offsets, indices, side="right") - 1
        return self.plan(epoch)[0][indices]

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample) of every position of `epoch`, drawn from (seed, epoch) alone."""
        if epoch not in self._plans:
            while len(self._plans) >= PLANS_HELD:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = self._draw(epoch)
        return self._plans[epoch]

    def _draw(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(mixed_seed(self.seed, MIX, 0, epoch))
        # stratified: the i-th of a source's c draws sits at (i + u) / c of the epoch, u in [0, 1)
        slots = np.concatenate([(np.arange(count) + (rng.random(count) if self.shuffle else 0.5)) / count
                                for count in self.counts])
        which = np.repeat(np.arange(len(self.counts), dtype=np.int16), self.counts)[np.argsort(slots, kind="stable")]
        sample = np.empty(self.length, dtype=np.int64)
        for part, count in enumerate(self.counts):
            sample[which == part] = self._stream(part, epoch * int(count), int(count))
        return which, sample

    def _stream(self, part: int, start: int, count: int) -> np.ndarray:
        """Entries start..start+count of source `part`'s passes (each every sample once, in its own order)."""
        n = int(self.lengths[part])
        first, last = start // n, (start + count - 1) // n
        passes = np.concatenate([self._pass(part, number) for number in range(first, last + 1)])
        return passes[start - first * n:start - first * n + count]

    def _pass(self, part: int, number: int) -> np.ndarray:
        n, starts = int(self.lengths[part]), getattr(self.sources[part], "shard_starts", None)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng(mixed_seed(self.seed, MIX, 1, part, number))
        if starts is None:
            return rng.permutation(n)
        return window_order(starts, self.windows[part], rng)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        return self.read_part(*self.locate(index))

    def read_part(self, part: int, sample: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Sample `sample` of source `part` as the mix gives it: the image through the source's own transform and
        the label mapped onto `classes`, or the image and its mask as they are (`check_masks`). check_sources
        reads each source's first sample through this, so a source the task cannot train on is named."""
        source, name = self.sources[part], self.names[part]
        if hasattr(source, "set_epoch"):
            source.set_epoch(self.epoch)
        try:
            image, target = source[sample][:2]
        except ShardError as err:  # the shard's samples are logged once (samples.py): keep what names it
            raise ShardError(f"dataset.sources.{name}: {err}", err.about) from err
        except UNREADABLE as err:
            raise MixReadError(f"dataset.sources.{name}: {first_line(err)}") from err
        except Exception as err:
            err.add_note(f"reading dataset.sources.{name}, {sample_name(source, sample)}")
            raise
        image, mask = as_uint8_tensor(image), as_mask(target)
        if mask is not None:
            return image, mask
        transform = self.transforms[part]
        return (image if transform is None else transform(image)), int(self.label_maps[part][int(target)])

    def check_masks(self, parts: list[int]) -> None:
        """The sources `parts`, whose samples carry masks, go together: the same classes, no transform of their own
        (mix_sources.py). check_sources calls this at build, on train and val alike."""
        check_mask_parts(self.names, self.sources, self.transforms, parts)


class MixPaths:
    """`paths[p]` names position p as `dataset.sources.<name>: <the source's own name of the sample>`."""

    def __init__(self, mix: MixSource):
        self.mix = mix

    def __getitem__(self, index: int) -> str:
        part, sample = self.mix.locate(int(index))
        return f"dataset.sources.{self.mix.names[part]}: {sample_name(self.mix.sources[part], sample)}"


def shares(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` split by `weights`, rounded by largest remainders (the counts sum to `total` exactly)."""
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:total - int(counts.sum())]] += 1
    return counts
