"""dataset=shards: WebDataset tar shards, on a local disk, over HTTP or in an S3-compatible store, read map-style.

Each shard gets an index of its members' offsets (as `wids` does), built once from a local copy and cached beside the
shard cache, so sample i is a seek and a read like any other source's: the sampler, per-sample seeding, the ring,
data.decode=device and exact resume work unchanged. A sample is the members sharing a key (`dir/stem.ext`): its
image (`.jpg`, `.jpeg`, `.png` or `.webp`) and its class (`.cls`, an integer, or `.json` with "label" or "cls");
other members are ignored. Shards written by the `webdataset` library's ShardWriter read as they are.

Shards and classes come from `<root>/_info.json` (timm's convention, what scripts/make_shards.py writes:
{"classes": [...], "splits": {"train": {"filenames": [...], "shard_lengths": [...]}, ...}}), else from a listing of
`<root>/<split>/*.tar` (a local folder or S3; HTTP needs the _info.json). The training order reads shards mostly in
sequence (loader.ShardWindowSampler, data.shuffle_window).
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import torch

from train.config import ConfigError
from train.data.decode import decode_image_file
from train.data.shard_store import ShardError, ShardStore, is_remote

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
INDEX_VERSION = 1


def list_shards(root: str, split: str) -> tuple[list[str], list[str] | None]:
    """(shard URLs, class names or None) of `split` under `root`; a store that cannot be reached (no server, no
    credentials) fails in one line naming `root`, never a credential."""
    try:
        return _list_shards(root, split)
    except ConfigError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ShardError(f"data.root={root}: cannot list its shards: {type(err).__name__}: {first}") from err


def _list_shards(root: str, split: str) -> tuple[list[str], list[str] | None]:
    fs, path = fsspec.core.url_to_fs(root)
    info = f"{path.rstrip('/')}/_info.json"
    if fs.exists(info):
        with fs.open(info) as f:
            meta = json.load(f)
        if split not in meta.get("splits", {}):
            raise ConfigError(f"data.root={root}: _info.json has no split {split!r} (it has "
                              f"{', '.join(meta.get('splits', {})) or 'none'})")
        names = meta["splits"][split]["filenames"]
        return [f"{root.rstrip('/')}/{name}" for name in names], meta.get("classes")
    if root.startswith(("http://", "https://")):
        raise ConfigError(f"data.root={root}: no _info.json there; an HTTP server cannot be listed, so write one "
                          "(scripts/make_shards.py does)")
    found = sorted(fs.glob(f"{path.rstrip('/')}/{split}/*.tar"))
    if not found:
        raise ConfigError(f"data.root={root}: no shards at {root}/{split}/*.tar and no _info.json; make them with "
                          "`python scripts/make_shards.py SRC OUT`")
    return [fs.unstrip_protocol(p) if is_remote(root) else p for p in found], None


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


class ShardSource:
    """One split of a sharded dataset (train/data/source.py's interface): `classes`, `targets`, `paths`
    (`<shard URL>#<key>`), `read_bytes`, `min_side`; `shard_starts`, the first sample of each shard."""

    def __init__(self, root: str, split: str = "train", cache_dir: str | None = None, cache_bytes: int = 0,
                 min_side: int | None = None, timeout: float | None = None):
        root = str(root).rstrip("/")
        self.store = ShardStore(cache_dir, cache_bytes, timeout)
        urls, classes = list_shards(root, split)
        indexes = [self._index(url) for url in urls]  # before any worker: downloads what it must, once per node
        lengths = [len(index["labels"]) for index in indexes]
        if not sum(lengths):
            raise ConfigError(f"data.root={root}: the {split} shards hold no image with a .cls or .json label")
        self.urls = urls
        self.shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.offsets = np.concatenate([index["offsets"] for index in indexes])
        self.sizes = np.concatenate([index["sizes"] for index in indexes])
        self.targets = np.concatenate([index["labels"] for index in indexes])
        self.paths = np.concatenate([np.char.add(f"{url}#".encode(), index["keys"])
                                     for url, index in zip(urls, indexes, strict=True)])
        self.classes = list(classes) if classes else [str(i) for i in range(int(self.targets.max()) + 1)]
        self.min_side = min_side

    def _index(self, url: str) -> dict[str, np.ndarray]:
        """The shard's index from the cache, else built from its local copy and cached (atomically)."""
        cached = self.store.cached(url, ".index.npz")
        local = None if is_remote(url) else Path(url.removeprefix("file://"))
        if local is not None and not local.is_file():
            raise ShardError(f"shard {url} does not exist (listed in the _info.json of data.root)")
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
            raise ConfigError(f"data.root: shard {url} is not a readable tar file ({err})") from err
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.npz")
        np.savez(partial, version=INDEX_VERSION, stamp=stamp, **index)
        partial.replace(cached)
        return index

    def __len__(self) -> int:
        return len(self.targets)

    def read_bytes(self, index: int) -> bytes:
        """The sample's encoded image: a seek and a read in its shard's local copy."""
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        url = self.urls[shard]
        try:
            f = open(self.store.local(url), "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:  # evicted by another process since this one last read it: fetched again
            self.store.forget(url)
            f = open(self.store.local(url), "rb")  # noqa: SIM115
        with f:
            f.seek(int(self.offsets[index]))
            data = f.read(int(self.sizes[index]))
        if len(data) != self.sizes[index]:
            raise OSError(f"shard {self.urls[shard]} ends inside this sample (truncated)")
        return data

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return decode_image_file(self.read_bytes(index), self.min_side), int(self.targets[index])
