"""Local copies of shards that live elsewhere (http(s)://, s3://, anything fsspec opens): one download per shard per
node, safe under concurrent readers, bounded in size.

Every worker of every rank on a node shares one cache folder (data.shard_cache_dir). A shard is downloaded by the
first process that needs it, under an exclusive lock on `<name>.lock`, into a temporary file that is renamed into
place when whole: a reader never sees a torn file, and the others wait on the lock and then find the copy.
With data.shard_cache_bytes > 0 the least recently used copies are removed until the cache fits. Credentials and
endpoints come the standard way for each protocol (for S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or a profile),
never from the config, and no message carries them: a shard is named by its URL.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path

import fsspec

from train.config import ConfigError

log = logging.getLogger(__name__)

RETRIES = 3  # a failed or stalled download is tried this many times, with back-off, before the error stands
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loadout" / "shards"


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


class ShardStore:
    """`local(url)`: a path on this node holding the shard at `url` (the URL itself for a local file)."""

    def __init__(self, cache_dir: str | Path | None = None, max_bytes: int = 0, timeout: float | None = None):
        self.cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
        self.max_bytes, self.timeout = max_bytes, timeout
        self._known: dict[str, Path] = {}  # this process's copies already found: no stat or touch per sample

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_known": {}}

    def forget(self, url: str) -> None:
        """`url`'s copy went (evicted by another process): the next `local` fetches it again."""
        self._known.pop(url, None)

    def cached(self, url: str, suffix: str = "") -> Path:
        """Where `url`'s copy (or a file derived from it, `suffix`) lives in the cache."""
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        return self.cache_dir / f"{digest}-{Path(url.split('?')[0]).name}{suffix}"

    def local(self, url: str) -> Path:
        if not is_remote(url):
            return Path(url.removeprefix("file://"))
        known = self._known.get(url)
        if known is not None:
            return known
        path = self.cached(url)
        if path.exists():
            os.utime(path)  # recently used: the last to go
            self._known[url] = path
            return path
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others wait, then find it
            if not path.exists():
                self._download(url, path)
                self._evict(keep=path)
        self._known[url] = path
        return path

    def _download(self, url: str, path: Path) -> None:
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        for attempt in range(1, RETRIES + 1):
            try:
                with fsspec.open(url, "rb", **self._options(url)) as source, open(partial, "wb") as out:
                    while chunk := source.read(1 << 22):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                partial.replace(path)  # whole, or not there at all
                return
            except FileNotFoundError as err:
                partial.unlink(missing_ok=True)
                raise ShardError(f"shard {url} does not exist ({type(err).__name__})") from err
            except Exception as err:  # network, server, credentials: retried, then named
                partial.unlink(missing_ok=True)
                if attempt == RETRIES:
                    raise ShardError(f"cannot download shard {url} after {RETRIES} tries: "
                                     f"{type(err).__name__}: {str(err).splitlines()[0][:200]}") from err
                log.warning("shard %s: %s; trying again", url, type(err).__name__)
                time.sleep(0.5 * 2**attempt)

    def _options(self, url: str) -> dict:
        if self.timeout and url.startswith(("http://", "https://")):
            import aiohttp

            return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_read=self.timeout)}}
        return {}

    def _evict(self, keep: Path) -> None:
        """Least recently used copies out until the cache holds at most max_bytes (never `keep`)."""
        if not self.max_bytes:
            return
        copies = sorted((p for p in self.cache_dir.iterdir() if p != keep and p.is_file()
                         and not p.name.endswith((".lock", ".part")) and ".index.npz" not in p.name),
                        key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in copies) + keep.stat().st_size
        for old in copies:
            if total <= self.max_bytes:
                break
            total -= old.stat().st_size
            old.unlink(missing_ok=True)  # a reader that has it open keeps reading its pages


class ShardError(ConfigError, OSError):
    """A shard that cannot be had: one line naming its URL (never a credential). An OSError, so a read in a worker
    is a bad sample; a ConfigError, so at start-up it is a one-line error."""

