"""Local copies of shards that live elsewhere (http(s)://, s3://, anything fsspec opens): one download per shard per
node, safe under concurrent readers, bounded in size.

Every worker of every rank on a node shares one cache folder (dataset.cache_dir). A shard is downloaded by the
first process that needs it (often the main process's fetch-ahead threads, fetch_ahead.py), under an exclusive lock on
`<name>.lock`, into a temporary file that is renamed into place when whole: a reader never sees a torn file, and the
others wait on the lock and then find the copy. The lock is a POSIX record lock, which a forked worker does not
inherit (a worker forked while the main process downloads never holds that download's lock) and which a process's
threads share (so they queue on a threading lock per URL as well). With
dataset.cache_bytes > 0 the least recently used copies are removed until the cache fits. Credentials and endpoints
come the standard way for each protocol (for S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or a profile), never from
the config, and no message carries them: a shard is named by its URL.

A download that stalls (no byte for a fifth of data.timeout) or fails is tried again with back-off, then fails
naming the shard, well within data.timeout; one refused (403: an expired credential) or missing (404) fails at once.
A read of such a shard is a bad sample, skipped and counted. After a store stopped answering, this process fails its
downloads at once for COOL_DOWN_S (each a bad sample) rather than waiting out every shard's tries, then tries again.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fsspec

from loadout.data.remote.shard_download import download
from loadout.data.remote.shard_order import check_window
from loadout.errors import ConfigError, bad_value, first_line

log = logging.getLogger(__name__)

RETRIES = 3  # a failed or stalled download is tried this many times, with back-off, before the error stands
COOL_DOWN_S = 30.0  # after a store stopped answering, its downloads fail at once for this long
DEFAULT_TIMEOUT_S = 600.0  # data.timeout=null: the DataLoader's own stuck-worker limit (plan.py)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loadout" / "shards"


def check_store_knobs(cache_bytes: int, shuffle_window: int | None, prefetch_shards: int | None) -> None:
    """A sharded source's store settings (conf/dataset/shards.yaml, parquet.yaml), checked before anything is
    fetched: one line naming the key and the fix. prefetch_shards=None: the loader's default (samplers.py)."""
    for key, value in (("cache_bytes", cache_bytes), ("prefetch_shards", prefetch_shards)):
        if (value or 0) < 0:
            bad_value(f"dataset.{key}", value, "use an integer >= 0 (0: off)")
    check_window(shuffle_window)


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


class ShardStore:
    """`local(url)`: a path on this node holding the shard at `url` (the URL itself for a local file)."""

    def __init__(self, cache_dir: str | Path | None = None, max_bytes: int = 0, timeout: float | None = None):
        self.cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
        self.max_bytes = max_bytes
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        # per attempt: the tries and their back-off end before data.timeout calls the worker stuck
        self.attempt_timeout = timeout / (RETRIES + 2) if timeout else None
        self._known: dict[str, Path] = {}  # this process's copies already found: no stat or touch per sample
        self._down: tuple[float, str] | None = None  # (until when, why): the store stopped answering
        self._threads_of: dict[str, threading.Lock] = {}  # a lock per URL for this process's threads
        self._threads_lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_known": {}, "_down": None, "_threads_of": {}, "_threads_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _threads_lock=threading.Lock())

    def forget(self, url: str) -> None:
        """`url`'s copy went (evicted by another process): the next `local` fetches it again."""
        self._known.pop(url, None)

    def cached(self, url: str, suffix: str = "") -> Path:
        """Where `url`'s copy (or a file derived from it, `suffix`) lives in the cache."""
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        return self.cache_dir / f"{digest}-{Path(url.split('?')[0]).name}{suffix}"

    def local(self, url: str, reader: Callable[[], Callable[[memoryview], None]] | None = None) -> Path:
        """`reader`: where this call downloads the shard, `reader()` is called as each try starts and the function it
        returns is fed the shard's bytes as they arrive (the tar index, built with no second pass)."""
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
        if self._down is not None and time.monotonic() < self._down[0]:
            raise ShardError(f"shard {url} skipped: its store stopped answering {self._down[1]}",
                             about=f"the store {self._down[1]}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with self._threads_lock:
            threads = self._threads_of.setdefault(url, threading.Lock())
        # the file lock keeps other processes out; a process's own threads (fetching ahead) queue on `threads`
        with threads, open(path.with_name(path.name + ".lock"), "w") as lock:
            try:
                fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                waited = False
            except OSError:  # another process is downloading it: wait, then find it
                fcntl.lockf(lock, fcntl.LOCK_EX)
                waited = True
            if not path.exists():
                if waited:  # that download failed after its tries (or 404, or 403): not tried again by every waiter
                    raise ShardError(f"shard {url} skipped: another process's download of it just failed", url)
                self._download(url, path, reader)
                self.evict(keep=path)
        self._known[url] = path
        return path

    def open(self, url: str):
        """`url` for reading: its local copy where there is one, else read in place from the store by range
        requests (a few bytes of a remote file, such as a parquet footer, without fetching all of it)."""
        path = self.cached(url) if is_remote(url) else Path(url.removeprefix("file://"))
        if not is_remote(url) or path.exists():
            return open(path, "rb")  # noqa: SIM115 (the caller closes it)
        fs, remote = self._filesystem(url)
        return fs.open(remote, "rb")

    def _download(self, url: str, path: Path, reader) -> None:
        partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.part")
        for attempt in range(1, RETRIES + 1):
            try:
                with open(partial, "wb", buffering=0) as out:
                    download(url, out, self.attempt_timeout, reader() if reader else None, self._filesystem)
                    os.fsync(out.fileno())
                partial.replace(path)  # whole, or not there at all
                return
            except FileNotFoundError as err:
                partial.unlink(missing_ok=True)
                raise ShardError(f"shard {url} does not exist ({type(err).__name__})", url) from err
            except PermissionError as err:  # refused (403: an expired or revoked credential): trying again won't do
                partial.unlink(missing_ok=True)
                raise ShardError(f"shard {url}: access refused ({first_line(err)})", url) from err
            except Exception as err:  # network, server: retried, then named
                partial.unlink(missing_ok=True)
                if attempt == RETRIES:
                    why = f"{type(err).__name__}: {first_line(err)}"
                    self._down = (time.monotonic() + COOL_DOWN_S, f"({why})")
                    raise ShardError(f"cannot download shard {url} after {RETRIES} tries: {why}", url) from err
                log.warning("shard %s: %s; trying again", url, type(err).__name__)
                time.sleep(min(0.5 * 2**attempt, (self.attempt_timeout or 60) / 2))

    def _filesystem(self, url: str):
        """(filesystem, path) of `url`, with per-attempt timeouts (no byte for that long is a stalled read) and one
        try inside the client: the retries are this store's."""
        timeout, options = self.attempt_timeout, {}
        if url.startswith(("http://", "https://")):
            import aiohttp

            options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=timeout,
                                                                          sock_read=timeout)}}
        elif url.startswith(("s3://", "s3a://")):
            limits = {} if timeout is None else {"connect_timeout": timeout, "read_timeout": timeout}
            options = {"config_kwargs": {**limits, "retries": {"total_max_attempts": 1}}}
        fs, path = fsspec.core.url_to_fs(url, **options)
        if hasattr(fs, "retries"):  # s3fs's own retry count (a documented class attribute)
            fs.retries = 1
        return fs, path

    def evict(self, keep: Path) -> None:
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
    is a bad sample; a ConfigError, so at start-up it is a one-line error. `about`: what failed (a shard's URL, or
    the store while it is down), so its samples are logged once (samples.py), not each."""

    def __init__(self, message: str, about: str = ""):
        super().__init__(message)
        self.about = about or message

