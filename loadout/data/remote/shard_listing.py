"""The shards of one split of a sharded dataset: listed from `_info.json` or a folder, and checked to be there before
any worker starts (shards.py's ShardSource reads them)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import fsspec

from loadout.data.remote.shard_store import ShardError, is_remote
from loadout.errors import ConfigError, first_line


class Listing(NamedTuple):
    urls: list[str]
    classes: list[str] | None
    lengths: list[int] | None  # samples per shard, where _info.json says
    distinct: list[int] | None = None  # distinct labels per shard, where _info.json says (make_shards.py)
    masks: bool | None = None  # the samples are (image, mask) pairs, where _info.json says (make_shards.py)


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
                       entry.get("shard_lengths"), entry.get("labels_per_shard"), meta.get("masks"))
    if root.startswith(("http://", "https://")):
        raise ConfigError(f"data.root={root}: no _info.json there; an HTTP server cannot be listed, so write one "
                          "(scripts/make_shards.py does)")
    found = sorted(fs.glob(f"{path.rstrip('/')}/{split}/*.tar"))
    if not found:
        raise ConfigError(f"data.root={root}: no shards at {root}/{split}/*.tar and no _info.json; make them with "
                          "`python scripts/make_shards.py SRC OUT`")
    return Listing([fs.unstrip_protocol(p) if is_remote(root) else p for p in found], None, None)


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
