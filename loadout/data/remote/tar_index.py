"""A tar shard's sample index built in one pass over its bytes, as they arrive from the store or from a mapped file.

`TarIndexer.feed` takes the shard's bytes in order, in chunks of any size: it reads each 512-byte header where it
starts (name, size, typeflag, checksum; ustar's prefix, GNU long names and pax `path`/`size` records as tarfile does)
and keeps the bytes of the small members that carry labels (`.cls`, `.json`), skipping every other member's data
without looking at it. A download thus needs no second pass over the file, and a local shard (mapped, `index_file`)
has only its headers' pages read. A PNG beside another image of its key (`.png`, `.mask.png` or `.seg.png` beside a
`.jpg`) is that image's segmentation mask: its offset and size are indexed too. Damage ends the index where
tarfile's iteration would end: a bad first header is a TarError (not a tar file); a bad later one, or the end of the
bytes inside a member, keeps the samples before it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tarfile

import numpy as np

log = logging.getLogger(__name__)

BLOCK = 512
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json")
MASK_EXTENSIONS = ("mask.png", "seg.png", "png")  # a key's mask: the first of these that is not its image
INDEX_KEYS = ("keys", "offsets", "sizes", "labels", "mask_offsets", "mask_sizes")
FILE_TYPES = (b"0", b"\0", b"7")  # tarfile's REGTYPE, AREGTYPE, CONTTYPE: members with data to read
ZEROS = bytes(BLOCK)


class TarIndexer:
    """Feed a shard's bytes in order (`feed`), then `finish()`: its samples, in member order (`index_shard`'s dict)."""

    def __init__(self, name: str):
        self.name = name  # for messages: the shard's URL
        self.fed = 0  # bytes fed so far
        self._start, self._length, self._kind = 0, BLOCK, "header"  # the next record wanted, and what it is
        self._held = bytearray()  # the wanted record's bytes that came in earlier chunks
        self._member: tuple[str, str] = ("", "")  # (key, ext) of the label member being read
        self._long_name: str | None = None  # a GNU long name or pax path for the next member
        self._pax_size: int | None = None
        self._global_path: str | None = None
        self.members: dict[str, dict[str, tuple[int, int]]] = {}  # key -> ext -> (offset, size)
        self.label_bytes: dict[str, dict[str, bytes]] = {}  # key -> ext -> bytes of its .cls / .json
        self.ended = False  # the end-of-archive block (or a bad header) was met
        self.error: str | None = None  # why these bytes are no tar file at all (raised by `finish`)

    def feed(self, chunk) -> None:
        """The next bytes of the shard (bytes, bytearray, memoryview or a mapped file). Never raises: a download
        goes on whatever its bytes are, and `finish` says what they held."""
        with memoryview(chunk) as view:
            begin, end = self.fed, self.fed + len(view)
            while not self.ended:
                start, stop = self._start, self._start + self._length
                if stop > end:  # the wanted record is not all here yet: keep what is
                    if start < end:
                        self._held += view[max(start, begin) - begin:]
                    break
                if self._held:
                    record = bytes(self._held) + view[:stop - begin].tobytes()
                    self._held.clear()
                else:
                    record = view[start - begin:stop - begin].tobytes()
                self._take(record)
            self.fed = end

    def _take(self, record: bytes) -> None:
        kind = self._kind
        if kind == "header":
            self._header(record)
            return
        if kind == "label":
            key, ext = self._member
            self.label_bytes.setdefault(key, {})[ext] = record
        elif kind == "long name":
            self._long_name = record.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind in ("pax", "global pax"):
            self._pax(record, kind == "global pax")
        self._next_header(self._start, self._length)

    def _next_header(self, data_start: int, size: int) -> None:
        self._start, self._length, self._kind = data_start + -(-size // BLOCK) * BLOCK, BLOCK, "header"

    def _header(self, block: bytes) -> None:
        offset = self._start
        if block == ZEROS:  # the end of the archive
            self.ended = True
            return
        try:
            stored = int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
            size = _number(block[124:136])
        except ValueError:
            stored, size = -1, 0
        if stored != BLOCK // 2 + sum(block[:148]) + sum(block[156:]):  # the checksum counts its own field as spaces
            if offset == 0:
                self.error = "not a tar file (its first header's checksum is wrong)"
            else:
                    log.warning("shard %s: a bad tar header at byte %d: indexing the %d samples before it", self.name,
                            offset, len(self.members))
            self.ended = True
            return
        typeflag, data_start = block[156:157], offset + BLOCK
        if typeflag in (b"L", b"x", b"g"):  # metadata for the next member (or all of them)
            self._start, self._length = data_start, size
            self._kind = {b"L": "long name", b"x": "pax", b"g": "global pax"}[typeflag]
            return
        name, self._long_name = self._long_name or self._global_path or _name(block), None
        if self._pax_size is not None:
            size, self._pax_size = self._pax_size, None
        if typeflag in FILE_TYPES:
            folder, _, base = name.rpartition("/")
            stem, _, ext = base.partition(".")
            key, ext = f"{folder}/{stem}" if folder else stem, ext.lower()
            self.members.setdefault(key, {})[ext] = (data_start, size)
            if ext in LABEL_EXTENSIONS:
                self._start, self._length, self._kind, self._member = data_start, size, "label", (key, ext)
                return
        self._next_header(data_start, size)

    def _pax(self, record: bytes, everywhere: bool) -> None:
        """pax records (`<length> <key>=<value>\\n`): `path` and `size` are the ones an index needs."""
        while record:
            length, _, rest = record.partition(b" ")
            if not length.isdigit() or int(length) == 0:
                break
            entry, record = rest[:int(length) - len(length) - 2], record[int(length):]
            key, _, value = entry.partition(b"=")
            if key == b"path":
                path = value.decode("utf-8", "surrogateescape")
                if everywhere:
                    self._global_path = path
                else:
                    self._long_name = path
            elif key == b"size" and not everywhere and value.isdigit():
                self._pax_size = int(value)

    def finish(self) -> dict[str, np.ndarray]:
        """The samples whose image and label or mask lie whole within the bytes fed: keys, image offsets and sizes,
        labels (-1: none), mask offsets and sizes (-1: none). Bytes that are no tar file raise tarfile.ReadError."""
        if self.error or not self.fed:
            raise tarfile.ReadError(self.error or "an empty file")
        if not self.ended and not (self._kind == "header" and self._start == self.fed and not self._held):
            log.warning("shard %s ends early (at byte %d): indexing the samples before the cut", self.name, self.fed)
        rows = []
        for key, parts in self.members.items():
            kind = next((ext for ext in IMAGE_EXTENSIONS if ext in parts), None)
            mask = next((parts[ext] for ext in MASK_EXTENSIONS if ext in parts and ext != kind), (-1, -1))
            label = _label(self.label_bytes.get(key, {}))
            if kind is None or (label is None and mask[0] < 0) or max(sum(parts[kind]), sum(mask)) > self.fed:
                continue
            rows.append((key.encode("utf-8", "surrogateescape"), *parts[kind], -1 if label is None else label, *mask))
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(INDEX_KEYS)
        return {name: np.array(column, dtype=np.bytes_ if name == "keys" else np.int64)
                for name, column in zip(INDEX_KEYS, columns, strict=True)}


def index_file(path: os.PathLike) -> dict[str, np.ndarray]:
    """The index of a local tar shard, mapped: only the pages of its headers and labels are read."""
    with open(path, "rb") as f:
        indexer = TarIndexer(str(path))
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                indexer.feed(mapped)
    return indexer.finish()


def holds_masks(index: dict[str, np.ndarray]) -> bool:
    """A shard of (image, mask) samples: some key has a mask and no label (a labelled key's extra PNG is no mask)."""
    return bool(((index["mask_sizes"] >= 0) & (index["labels"] < 0)).any())


def _number(field: bytes) -> int:
    """A header's numeric field: octal text, or base-256 (a leading 0x80 / 0xff byte) as GNU tar writes big sizes."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[:1] == b"\xff" else value
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _name(block: bytes) -> str:
    name = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\x00":  # POSIX ustar: a prefix holds the start of a long path
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _label(parts: dict[str, bytes]) -> int | None:
    """A sample's class: its `.cls` (an integer), else its `.json` ("label" or "cls", or a bare number)."""
    if "cls" in parts:
        return int(parts["cls"].decode().strip())
    if "json" in parts:
        value = json.loads(parts["json"])
        value = value.get("label", value.get("cls")) if isinstance(value, dict) else value
        return None if value is None else int(value)
    return None
