"""One shard downloaded into an open file, its bytes handed to a reader (the tar index) as they arrive.

S3 is read by one GetObject of botocore's synchronous client (the standard credential chain and AWS_ENDPOINT_URL, as
s3fs reads them; the object's CRC32 checked where the store keeps one), plain HTTP(S) by one GET over a pooled
urllib3 connection; other protocols through fsspec's own reader. Either way a chunk at a time is written to the file
and fed to the reader, then dropped: the shard is never joined, held whole or read back. s3fs's get_file cost about
three times the CPU a shard (its asyncio loop's many small reads) on the cores the loader's workers want
(bench/RESULTS.md). A refused request (401/403, no credentials) is a PermissionError, a missing object (404) a
FileNotFoundError, anything else an OSError; no message carries a URL's password or query.
"""

from __future__ import annotations

import base64
import os
import re
import threading
from collections.abc import Callable
from typing import BinaryIO
from urllib.parse import urlsplit, urlunsplit

CHUNK = 1 << 18  # bytes read, written and indexed at a time: a MiB a read doubled the CPU a shard (fresh pages each)
_clients: dict[tuple, object] = {}  # (kind, pid, timeout) -> a process's pool or client (a forked child makes its own)
_clients_lock = threading.Lock()


def _after_fork() -> None:  # a worker forked while a thread made a client: the lock it copied is free in it
    global _clients_lock
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def download(url: str, out: BinaryIO, timeout: float | None, fed: Callable[[memoryview], None] | None,
             filesystem: Callable[[str], tuple]) -> int:
    """`url`'s bytes into `out` (and `fed`, chunk by chunk); returns how many. `timeout`: seconds without a byte
    (or to connect) before the read fails; `filesystem(url)`: fsspec's (filesystem, path) for other protocols."""
    if url.startswith(("http://", "https://")):
        return _get(*_without_password(url), out, timeout, fed)
    if url.startswith(("s3://", "s3a://")):
        return _get_object(url, out, timeout, fed)
    fs, path = filesystem(url)
    with fs.open(path, "rb") as source:
        return _copy(source.read, out, fed)


def _get_object(url: str, out: BinaryIO, timeout: float | None, fed) -> int:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, key = url.split("://", 1)[1].partition("/")
    try:
        body = _client("s3", timeout).get_object(Bucket=bucket, Key=key)["Body"]
        with body:
            return _copy(body.read, out, fed)
    except ClientError as err:
        error = err.response.get("Error", {})
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        why = f"{error.get('Code', status)}: {scrub(error.get('Message', ''))}"
        if status in (401, 403):
            raise PermissionError(why) from None
        raise FileNotFoundError(why) if status == 404 else OSError(why) from None
    except NoCredentialsError as err:
        raise PermissionError(first_text(err)) from None
    except BotoCoreError as err:
        raise OSError(f"{type(err).__name__}: {scrub(first_text(err))}") from None


def _get(url: str, headers: dict, out: BinaryIO, timeout: float | None, fed) -> int:
    import urllib3

    try:
        response = _client("http", timeout).request("GET", url, headers=headers, preload_content=False, redirect=True,
                                   retries=urllib3.Retry(total=None, connect=0, read=0, other=0, status=0, redirect=5),
                                   timeout=urllib3.Timeout(connect=timeout, read=timeout))
    except urllib3.exceptions.MaxRetryError as err:  # its message holds the URL: only the cause's goes on
        raise OSError(f"{type(err.reason).__name__}: {scrub(str(err.reason))}") from None
    except urllib3.exceptions.HTTPError as err:
        raise OSError(f"{type(err).__name__}: {scrub(str(err))}") from None
    try:
        if response.status != 200:
            why = f"HTTP {response.status}{_store_code(response.read(4096))}"
            if response.status in (401, 403):
                raise PermissionError(why)
            raise FileNotFoundError(why) if response.status == 404 else OSError(why)
        expected = response.headers.get("Content-Length")
        try:
            got = _copy(lambda size: response.read(size, decode_content=True), out, fed)
        except urllib3.exceptions.HTTPError as err:
            raise OSError(f"{type(err).__name__}: {scrub(str(err))}") from None
        if expected is not None and got != int(expected):
            raise OSError(f"the connection closed after {got} of {expected} bytes")
        return got
    finally:
        response.release_conn()


def _copy(read: Callable[[int], bytes], out: BinaryIO, fed) -> int:
    got = 0
    while chunk := read(CHUNK):
        view = memoryview(chunk)
        out.write(view)
        if fed is not None:
            fed(view)
        got += len(view)
    return got


def _client(kind: str, timeout: float | None):
    """This process's urllib3 pool (`http`) or botocore S3 client (`s3`): connections are never shared with a forked
    child, and one try each (the retries are the store's)."""
    made = (kind, os.getpid(), timeout)
    with _clients_lock:
        if made not in _clients:
            if kind == "http":
                import urllib3

                _clients[made] = urllib3.PoolManager(maxsize=8, block=False)
            else:
                import botocore.config
                import botocore.session

                limits = {} if timeout is None else {"connect_timeout": timeout, "read_timeout": timeout}
                config = botocore.config.Config(**limits, retries={"total_max_attempts": 1}, max_pool_connections=8)
                _clients[made] = botocore.session.get_session().create_client("s3", config=config)
        return _clients[made]


def _without_password(url: str) -> tuple[str, dict]:
    """`http://user:password@host/...` as the URL without them and a basic-auth header (as aiohttp sends them)."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, {}
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
    return urlunsplit(parts._replace(netloc=netloc)), {"Authorization": f"Basic {token}"}


def scrub(text: str) -> str:
    """`text`'s first line without a URL's query or password."""
    return re.sub(r"//[^/@\s]*@", "//", re.sub(r"\?\S*", "?...", text)).splitlines()[0] if text.strip() else ""


def first_text(err: BaseException) -> str:
    return str(err).strip() or type(err).__name__


def _store_code(body: bytes) -> str:
    """An S3 error body's <Code> (AccessDenied, InvalidAccessKeyId, NoSuchKey...), never its other fields."""
    code = re.search(rb"<Code>([A-Za-z]{1,64})</Code>", body)
    return f" {code.group(1).decode()}" if code else ""
