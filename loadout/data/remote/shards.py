"""dataset=shards: WebDataset tar shards, on a local disk, over HTTP or in an S3-compatible store, read map-style.

Each shard gets an index of its members' offsets (as `wids` does), built in one pass as a remote shard's bytes
arrive, or from a local shard's headers (tar_index.py), and cached beside the shard cache, so sample i is a seek and
a read like any other source's: the sampler, per-sample seeding, the ring, data.decode=device and exact resume work
unchanged. A sample is the members sharing a key (`dir/stem.ext`): its image (`.jpg`, `.jpeg`, `.png` or `.webp`)
and its class (`.cls`, an integer, or `.json` with "label" or "cls"), or for segmentation its mask (a `.png` beside a
`.jpg`: masks.py's uint8 class map; tar_index.py); other members are ignored. A mask sample's image is decoded
whole (never DCT-scaled: its mask covers the stored size); an unreadable mask, or one of another size, is a bad
sample (samples.py skips and counts it).
Shards written by the `webdataset` library's ShardWriter read as they are.

Shards and classes come from `<root>/_info.json` (timm's convention, what scripts/make_shards.py writes:
{"classes": [...], "splits": {"train": {"filenames": [...], "shard_lengths": [...]}, ...}}, and "masks": true for
segmentation shards, whose classes only _info.json can name; unsaid, the first shard tells), else from a listing of
`<root>/<split>/*.tar` (a local folder or S3; HTTP needs the _info.json; without its counts every shard is indexed
at start). The training order reads shards mostly in sequence (loader.ShardWindowSampler), a window of them at a
time sized from how mixed their labels are (shard_order.py, dataset.shuffle_window): `label_spread` looks at a few
shards' labels, or reads `labels_per_shard` (distinct labels of each shard) from _info.json where make_shards.py
wrote it.
"""

from __future__ import annotations

import logging
import os
import tarfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from loadout.data.fast.decode import UNREADABLE, decode_image_file
from loadout.data.masks import decode_mask
from loadout.data.remote.shard_listing import check_present, list_shards
from loadout.data.remote.shard_order import LabelSpread, label_spread, spread_of_labels
from loadout.data.remote.shard_store import ShardError, ShardStore, check_store_knobs, is_remote
from loadout.data.remote.tar_index import INDEX_KEYS, TarIndexer, holds_masks, index_file
from loadout.errors import ConfigError

log = logging.getLogger(__name__)

INDEX_VERSION = 2  # 2: mask members indexed


class ShardSource:
    """One split of a sharded dataset (source.py, capabilities.py): `classes`, `read_encoded`, `min_side`,
    `paths` (`<shard URL>#<n>`), `shard_starts` (the first sample of each shard) and `fetch_shard`.

    With the sample counts from `_info.json`, nothing is read at build time but that file and a listing (every shard
    there, check_present): a shard is fetched and indexed when the order first reaches it (fetch_ahead.py does that
    ahead of the workers), and a process keeps the indexes of the last shards it read (a window's worth). Without counts
    every shard is indexed first (fetched, when remote). No labels array is offered (they sit in the shards), so
    data.sampler=weighted is refused; `label_spread` says how mixed the shards' labels are (the order's window)."""

    INDEXES_HELD = 64  # at least this many indexes held, and more while they hold at most SAMPLES_HELD samples:
    SAMPLES_HELD = 1 << 17  # a window of label-sorted shards (up to shard_order.MOST_SAMPLES) is read at once
    SHARDS_HELD = 4096  # at most this many, however small (each costs some hundred bytes besides its samples)
    LABELS_LOOKED_AT = 8  # shards whose labels `label_spread` looks at, without counts in _info.json

    def __init__(self, root: str, split: str = "train", cache_dir: str | None = None, cache_bytes: int = 0,
                 min_side: int | None = None, timeout: float | None = None, shuffle_window: int | None = None,
                 prefetch_shards: int | None = None):
        root = str(root).rstrip("/")
        check_store_knobs(cache_bytes, shuffle_window, prefetch_shards)
        self.shuffle_window, self.prefetch_shards = shuffle_window, prefetch_shards  # the sampler reads them
        self.store = ShardStore(cache_dir, cache_bytes, timeout)
        urls, classes, lengths, distinct, masks = list_shards(root, split)
        self.urls = np.array(urls)  # an array, not a list: workers never copy its pages (datasets.py)
        if lengths is None or classes is None:
            log.info("data.root=%s: no sample counts or classes in an _info.json: indexing the %d %s shards now%s",
                     root, len(urls), split, " (each fetched into the cache)" if is_remote(root) else "")
            indexes = [self._index(shard) for shard in range(len(urls))]
            lengths = [len(index["labels"]) for index in indexes]
            highest = max((int(index["labels"].max()) for index in indexes if len(index["labels"])), default=-1)
            classes = classes or [str(i) for i in range(highest + 1)]
            distinct = [len(np.unique(index["labels"])) for index in indexes]
            masks = any(holds_masks(index) for index in indexes) if masks is None else masks
        else:
            check_present(root, urls)
        if not sum(lengths):
            raise ConfigError(f"data.root={root}: the {split} shards hold no image with a .cls or .json label or a "
                              ".png mask")
        self._masks = masks  # None: unsaid in _info.json, the first shard tells when first asked (`masks`)
        if masks and not classes:
            raise ConfigError(f"data.root={root}: mask shards name no classes: write them in _info.json as "
                              '{"classes": [...], "masks": true} (scripts/make_shards.py does from a VOC folder)')
        self.shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.classes = list(classes)
        if distinct is not None and len(distinct) != len(urls):
            raise ConfigError(f"data.root={root}: _info.json's labels_per_shard has {len(distinct)} entries for "
                              f"{len(urls)} {split} shards: fix it or leave it out")
        self._spread = None if distinct is None or masks else [label_spread(distinct, lengths, len(self.classes))]
        self.paths = SamplePaths(self.urls, self.shard_starts)
        self.min_side = min_side
        self._held: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # this process's recent indexes
        self._held_samples = 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": OrderedDict(), "_held_samples": 0}

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def masks(self) -> bool:
        """Whether the samples are (image, mask) pairs: as _info.json says, else as the first shard's do."""
        return self._masks_as_in(0)

    def _masks_as_in(self, shard: int) -> bool:
        """`masks`, where _info.json leaves it unsaid decided by `shard` (the one being read: no other fetched)."""
        if self._masks is None:
            self._masks = holds_masks(self.members(shard))
        return self._masks

    def label_spread(self) -> LabelSpread | None:
        """How mixed the shards' labels are: from _info.json's `labels_per_shard`, else from the labels of
        LABELS_LOOKED_AT shards spread over the list (the same ones on every rank and run; indexed, fetched into the
        node cache when remote, 4 at a time). The training order sizes its window by it (shard_order.py). None for
        masks: no label to mix by (the order's default window)."""
        if self._spread is None and self.masks:
            return None
        if self._spread is None:
            shards = len(self.urls)
            picks = np.unique(np.linspace(0, shards - 1, min(self.LABELS_LOOKED_AT, shards)).round().astype(int))
            with ThreadPoolExecutor(4) as pool:
                labels = list(pool.map(lambda shard: self._index(int(shard))["labels"], picks))
            self._spread = [spread_of_labels(labels, len(self.classes))]
        return self._spread[0]

    def fetch_shard(self, shard: int) -> None:
        """The shard's copy and index onto this node (the fetch-ahead thread calls this before the workers read)."""
        self._index(shard)
        self.store.local(str(self.urls[shard]))

    def _index(self, shard: int) -> dict[str, np.ndarray]:
        """The shard's index from the cache, else built from its local copy and cached (atomically)."""
        url = str(self.urls[shard])
        cached = self.store.cached(url, ".index.npz")
        local = None if is_remote(url) else Path(url.removeprefix("file://"))
        if local is not None and not local.is_file():
            raise ShardError(f"shard {url} does not exist (listed in the _info.json of data.root)", url)
        stamp = 0 if local is None else local.stat().st_mtime_ns
        if cached.exists():
            with np.load(cached) as saved:
                if int(saved["version"]) == INDEX_VERSION and int(saved["stamp"]) == stamp:
                    return {key: saved[key] for key in INDEX_KEYS}
        try:
            if local is not None:
                index = index_file(local)
            else:  # indexed as the bytes arrive, where this call downloads it
                started: list[TarIndexer] = []
                path = self.store.local(url, lambda: started.append(TarIndexer(url)) or started[-1].feed)
                index = started[-1].finish() if started else index_file(path)
        except (tarfile.TarError, OSError) as err:
            if isinstance(err, ShardError):
                raise
            raise ShardError(f"shard {url} is not a readable tar file ({err})", url) from err
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}-{threading.get_ident()}.npz")
        np.savez(partial, version=INDEX_VERSION, stamp=stamp, **index)
        partial.replace(cached)
        return index

    def members(self, shard: int) -> dict[str, np.ndarray]:
        """The shard's index, held by this process while it is among the last read (INDEXES_HELD, or more up to
        SAMPLES_HELD samples and SHARDS_HELD shards: a window's shards are read side by side)."""
        index = self._held.get(shard)
        if index is None:
            index = self._held[shard] = self._index(shard)
            expected = int(self.shard_starts[shard + 1] - self.shard_starts[shard])
            if len(index["labels"]) != expected:
                log.warning("shard %s holds %d readable samples, _info.json says %d", self.urls[shard],
                            len(index["labels"]), expected)
            self._held_samples += len(index["labels"])
            while len(self._held) > self.INDEXES_HELD and (
                    self._held_samples > self.SAMPLES_HELD or len(self._held) > self.SHARDS_HELD):
                self._held_samples -= len(self._held.popitem(last=False)[1]["labels"])
        else:
            self._held.move_to_end(shard)
        return index

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The sample's encoded image and its label (-1 in mask shards): a seek and a read in its shard's copy."""
        (data,), label = self._read(index, "offsets", "sizes")
        if label < 0 and not self._masks_as_in(self._shard_of(index)):
            raise OSError("its key has no .cls or .json label")
        return data, label

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        if not self._masks_as_in(self._shard_of(index)):
            data, label = self.read_encoded(index)
            return decode_image_file(data, self.min_side), label
        (data, mask), _ = self._read(index, "offsets", "sizes", "mask_offsets", "mask_sizes")
        image = decode_image_file(data)  # whole: the mask covers the stored size
        try:
            return image, decode_mask(mask)
        except UNREADABLE as err:  # the log line names the sample; say it is the mask
            raise OSError(f"its .png mask: {err}") from err

    def _shard_of(self, index: int) -> int:
        return int(np.searchsorted(self.shard_starts, index, side="right")) - 1

    def _read(self, index: int, *columns: str) -> tuple[list[bytes], int]:
        """The members at the index's (offset, size) `columns` pairs, and its label: seeks and reads in one open of
        its shard's local copy."""
        shard = self._shard_of(index)
        url, members = str(self.urls[shard]), self.members(shard)
        position = index - int(self.shard_starts[shard])
        if position >= len(members["labels"]):
            raise OSError(f"shard {url} holds {len(members['labels'])} readable samples, not sample {position} "
                          "(truncated, or _info.json counts more)")
        spans = [(int(members[at][position]), int(members[size][position]))
                 for at, size in zip(columns[::2], columns[1::2], strict=True)]
        if any(at < 0 for at, _ in spans):
            raise OSError("its key has no .png mask beside its image")
        try:
            f = open(self.store.local(url), "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:  # evicted by another process since this one last read it: fetched again
            self.store.forget(url)
            f = open(self.store.local(url), "rb")  # noqa: SIM115
        parts = []
        with f:
            for at, size in spans:
                f.seek(at)
                parts.append(f.read(size))
                if len(parts[-1]) != size:
                    raise OSError(f"shard {url} ends inside sample {position} (truncated)")
        return parts, int(members["labels"][position])


class SamplePaths:
    """`paths[i]` = `<shard URL>#<n>`, sample n of its shard: how a bad or stuck sample is named (source.py)."""

    def __init__(self, urls: np.ndarray, starts: np.ndarray):
        self.urls, self.starts = urls, starts

    def __getitem__(self, index: int) -> str:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return f"{self.urls[shard]}#{index - int(self.starts[shard])}"
