"""dataset=shards: WebDataset tar shards, on a local disk, over HTTP or in an S3-compatible store, read map-style.

Each shard gets an index of its members' offsets (as `wids` does), built from a local copy when the shard is first
opened and cached beside the shard cache, so sample i is a seek and a read like any other source's: the sampler,
per-sample seeding, the ring, data.decode=device and exact resume work unchanged. A sample is the members sharing a
key (`dir/stem.ext`): its image (`.jpg`, `.jpeg`, `.png` or `.webp`) and its class (`.cls`, an integer, or `.json`
with "label" or "cls"); other members are ignored. Shards written by the `webdataset` library's ShardWriter read as
they are.

Shards and classes come from `<root>/_info.json` (timm's convention, what scripts/make_shards.py writes:
{"classes": [...], "splits": {"train": {"filenames": [...], "shard_lengths": [...]}, ...}}), else from a listing of
`<root>/<split>/*.tar` (a local folder or S3; HTTP needs the _info.json; without its counts every shard is indexed
at start). The training order reads shards mostly in sequence (loader.ShardWindowSampler), a window of them at a
time sized from how mixed their labels are (shard_order.py, data.shuffle_window): `label_spread` looks at a few
shards' labels, or reads `labels_per_shard` (distinct labels of each shard) from _info.json where make_shards.py
wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import fsspec
import numpy as np
import torch

from train.data.decode import decode_image_file
from train.data.shard_order import LabelSpread, label_spread, spread_of_labels
from train.data.shard_store import ShardError, ShardStore, is_remote
from train.errors import ConfigError, first_line

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
INDEX_VERSION = 1


class Listing(NamedTuple):
    urls: list[str]
    classes: list[str] | None
    lengths: list[int] | None  # samples per shard, where _info.json says
    distinct: list[int] | None = None  # distinct labels per shard, where _info.json says (make_shards.py)


def list_shards(root: str, split: str) -> Listing:
    """The shards of `split` under `root`; a store that cannot be reached (no server, no credentials) fails in one
    line naming `root`, never a credential."""
    try:
        return _list_shards(root, split)
    except ConfigError:
        raise
    except Exception as err:
        raise ShardError(f"data.root={root}: cannot list its shards: {type(err).__name__}: {first_line(err)}") from err


def _list_shards(root: str, split: str) -> Listing:
    fs, path = fsspec.core.url_to_fs(root)
    info = f"{path.rstrip('/')}/_info.json"
    if fs.exists(info):
        with fs.open(info) as f:
            meta = json.load(f)
        if split not in meta.get("splits", {}):
            raise ConfigError(f"data.root={root}: _info.json has no split {split!r} (it has "
                              f"{', '.join(meta.get('splits', {})) or 'none'})")
        entry = meta["splits"][split]
        classes = meta.get("classes") or ([str(i) for i in range(meta["num_classes"])] if "num_classes" in meta
                                          else None)
        return Listing([f"{root.rstrip('/')}/{name}" for name in entry["filenames"]], classes,
                       entry.get("shard_lengths"), entry.get("labels_per_shard"))
    if root.startswith(("http://", "https://")):
        raise ConfigError(f"data.root={root}: no _info.json there; an HTTP server cannot be listed, so write one "
                          "(scripts/make_shards.py does)")
    found = sorted(fs.glob(f"{path.rstrip('/')}/{split}/*.tar"))
    if not found:
        raise ConfigError(f"data.root={root}: no shards at {root}/{split}/*.tar and no _info.json; make them with "
                          "`python scripts/make_shards.py SRC OUT`")
    return Listing([fs.unstrip_protocol(p) if is_remote(root) else p for p in found], None, None)


def index_shard(path: os.PathLike) -> dict[str, np.ndarray]:
    """The samples of one local tar shard, in member order: key, image offset and size, label."""
    members: dict[str, dict[str, tuple[int, int]]] = {}
    size = os.path.getsize(path)
    with tarfile.open(path) as tar:
        try:
            for member in tar:
                if member.isfile() and member.offset_data + member.size <= size:
                    folder, _, name = member.name.rpartition("/")
                    stem, _, ext = name.partition(".")
                    members.setdefault(f"{folder}/{stem}" if folder else stem, {})[ext.lower()] = \
                        (member.offset_data, member.size)
        except tarfile.ReadError as err:  # a truncated shard: the samples before the cut are kept
            log.warning("shard %s ends early (%s): indexing the %d samples before the cut", path, err, len(members))
    keys, offsets, sizes, labels = [], [], [], []
    with open(path, "rb") as f:
        for key, parts in members.items():
            image = next((parts[ext] for ext in IMAGE_EXTENSIONS if ext in parts), None)
            label = _label(f, parts)
            if image is None or label is None:
                continue
            keys.append(key)
            offsets.append(image[0])
            sizes.append(image[1])
            labels.append(label)
    return {"keys": np.array(keys, dtype=np.bytes_), "offsets": np.array(offsets, dtype=np.int64),
            "sizes": np.array(sizes, dtype=np.int64), "labels": np.array(labels, dtype=np.int64)}


def _label(f, parts: dict[str, tuple[int, int]]) -> int | None:
    for ext in ("cls", "json"):
        if ext in parts:
            offset, size = parts[ext]
            f.seek(offset)
            text = f.read(size).decode()
            if ext == "cls":
                return int(text.strip())
            value = json.loads(text)
            value = value.get("label", value.get("cls")) if isinstance(value, dict) else value
            return None if value is None else int(value)
    return None


def check_present(root: str, urls: list[str]) -> None:
    """Every shard _info.json lists is there, before any worker starts: one listing per folder (a local disk, S3),
    or a HEAD per shard, 16 at a time, over HTTP (which cannot be listed)."""
    fs, _ = fsspec.core.url_to_fs(root)
    try:
        if root.startswith(("http://", "https://")):
            def exists(url: str) -> bool:
                try:
                    return bool(fs.info(url))  # a HEAD (fsspec's `exists` GETs the file)
                except FileNotFoundError:
                    return False

            with ThreadPoolExecutor(16) as pool:
                present = dict(zip(urls, pool.map(exists, urls), strict=True))
        else:
            names: dict[str, set[str]] = {}
            for folder in {url.rsplit("/", 1)[0] for url in urls}:
                names[folder] = {path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(folder, detail=False)}
            present = {url: url.rsplit("/", 1)[1] in names[url.rsplit("/", 1)[0]] for url in urls}
    except FileNotFoundError:
        present = {}
    except Exception as err:
        raise ShardError(f"data.root={root}: cannot list its shards: {type(err).__name__}") from err
    missing = [url for url in urls if not present.get(url)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ShardError(f"shard {missing[0]}{more} does not exist (listed in the _info.json of data.root)")


class ShardSource:
    """One split of a sharded dataset (train/data/source.py's interface): `classes`, `read_encoded`, `min_side`,
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
                 min_side: int | None = None, timeout: float | None = None):
        root = str(root).rstrip("/")
        self.store = ShardStore(cache_dir, cache_bytes, timeout)
        urls, classes, lengths, distinct = list_shards(root, split)
        self.urls = np.array(urls)  # an array, not a list: workers never copy its pages (datasets.py)
        if lengths is None or classes is None:
            log.info("data.root=%s: no sample counts or classes in an _info.json: indexing the %d %s shards now%s",
                     root, len(urls), split, " (each fetched into the cache)" if is_remote(root) else "")
            indexes = [self._index(shard) for shard in range(len(urls))]
            lengths = [len(index["labels"]) for index in indexes]
            highest = max((int(index["labels"].max()) for index in indexes if len(index["labels"])), default=-1)
            classes = classes or [str(i) for i in range(highest + 1)]
            distinct = [len(np.unique(index["labels"])) for index in indexes]
        else:
            check_present(root, urls)
        if not sum(lengths):
            raise ConfigError(f"data.root={root}: the {split} shards hold no image with a .cls or .json label")
        self.shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.classes = list(classes)
        if distinct is not None and len(distinct) != len(urls):
            raise ConfigError(f"data.root={root}: _info.json's labels_per_shard has {len(distinct)} entries for "
                              f"{len(urls)} {split} shards: fix it or leave it out")
        self._spread = None if distinct is None else [label_spread(distinct, lengths, len(self.classes))]
        self.paths = SamplePaths(self.urls, self.shard_starts)
        self.min_side = min_side
        self._held: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # this process's recent indexes
        self._held_samples = 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": OrderedDict(), "_held_samples": 0}

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def label_spread(self) -> LabelSpread | None:
        """How mixed the shards' labels are: from _info.json's `labels_per_shard`, else from the labels of
        LABELS_LOOKED_AT shards spread over the list (the same ones on every rank and run; indexed, fetched into the
        node cache when remote, 4 at a time). The training order sizes its window by it (shard_order.py)."""
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
                    return {key: saved[key] for key in ("keys", "offsets", "sizes", "labels")}
        try:
            index = index_shard(self.store.local(url))
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
        """The sample's encoded image and its label: a seek and a read in its shard's local copy."""
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        url, members = str(self.urls[shard]), self.members(shard)
        position = index - int(self.shard_starts[shard])
        if position >= len(members["labels"]):
            raise OSError(f"shard {url} holds {len(members['labels'])} readable samples, not sample {position} "
                          "(truncated, or _info.json counts more)")
        try:
            f = open(self.store.local(url), "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:  # evicted by another process since this one last read it: fetched again
            self.store.forget(url)
            f = open(self.store.local(url), "rb")  # noqa: SIM115
        with f:
            f.seek(int(members["offsets"][position]))
            data = f.read(int(members["sizes"][position]))
        if len(data) != members["sizes"][position]:
            raise OSError(f"shard {url} ends inside sample {position} (truncated)")
        return data, int(members["labels"][position])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label = self.read_encoded(index)
        return decode_image_file(data, self.min_side), label


class SamplePaths:
    """`paths[i]` = `<shard URL>#<n>`, sample n of its shard: how a bad or stuck sample is named (source.py)."""

    def __init__(self, urls: np.ndarray, starts: np.ndarray):
        self.urls, self.starts = urls, starts

    def __getitem__(self, index: int) -> str:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return f"{self.urls[shard]}#{index - int(self.starts[shard])}"
