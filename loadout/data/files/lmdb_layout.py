"""dataset=lmdb's layouts: a split's environments, its keys, labels and class names, found once in the main process
(one handle a process, closed before the workers fork: each opens its own, per_process.py).

    LSUN       torchvision's layout: one environment per class, data.root/<class>_<split>_lmdb (as LSUN ships) or
               data.root/<split>/<class>/; every key an image; the classes are the environments' names, sorted
    labelled   one environment per split, data.root/<split> (a folder holding data.mdb) or data.root/<split>.lmdb (a
               folder, or a file as folder2lmdb scripts write it), its values either
                 image bytes, with `__keys__` (a msgpack list: the keys in sample order) and `__labels__` (a msgpack
                 list of ints) beside them, and optionally `__classes__` (a msgpack list of names); or
                 msgpack records [image bytes, label] (or {"image": ..., "label": ...}), as the msgpack folder2lmdb
                 scripts write them; the keys from `__keys__`, else every key not named `__...__`
A value that is a pickle (what the pickle/pyarrow folder2lmdb scripts write) is refused: unpickling runs code.
Environments open read-only, without locks (nothing writes; a lock file on a network file system is a hazard of its
own) and without readahead (random reads would pull neighbouring pages into the page cache for nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from loadout.data.files.keys import ByteKeys
from loadout.data.files.per_process import PerProcess
from loadout.errors import ConfigError

KEYS, LABELS, CLASSES = b"__keys__", b"__labels__", b"__classes__"
RECORD_STARTS = (0x92, 0x82)  # msgpack's 2-element array and 2-entry map: a record; no image file starts so
CONVERTER = "scripts/convert_dataset.py"


@dataclass(frozen=True)
class Environments:
    """One split: its environments, each sample's environment and key, labels, class names, record values or not."""

    paths: list[str]
    subdirs: list[bool]  # an environment that is a folder (data.mdb inside), else a file
    env_of: np.ndarray  # int32, each sample's environment
    keys: ByteKeys
    targets: np.ndarray  # int64
    classes: list[str]
    records: bool  # values are msgpack records, else image bytes


def open_env(path: str, subdir: bool):
    """This process's handle on the environment at `path`, read-only, without locks or readahead: one a process
    however many sources read it (lmdb refuses to open an environment twice in a process)."""
    handle = _BY_NAME.get((path, subdir))
    if handle is None:  # the one handle of that environment, under whichever name it was first opened
        key = (os.path.realpath(path), subdir)
        handle = _BY_NAME[path, subdir] = _SHARED.setdefault(key, PerProcess(partial(_open, path, subdir), _close))
    return handle.get()


def _open(path: str, subdir: bool):
    import lmdb

    return lmdb.open(path, subdir=subdir, readonly=True, lock=False, readahead=False, meminit=False, max_readers=512)


def _close(env) -> None:
    env.close()


_SHARED: dict[tuple[str, bool], PerProcess] = {}  # by the environment's real path
_BY_NAME: dict[tuple[str, bool], PerProcess] = {}  # by the path a source gave: no file system call a read


def find_environments(root: str, split: str, split_keys) -> Environments:
    """The split's layout at `root`, or one line naming what was looked for."""
    name = str(split_keys.get(split, split) if split_keys else split)
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"data.root={root} does not exist: point it at a folder of LMDB environments (docs/data.md)")
    for single in (base / name, base / f"{name}.lmdb"):
        if (single / "data.mdb").is_file() or single.is_file():
            return _labelled(str(single), single.is_dir())
    classes = sorted(p for p in base.glob(f"*_{name}_lmdb") if p.is_dir()) or sorted(
        p for p in (base / name).glob("*") if (p / "data.mdb").is_file())
    if not classes:
        raise ConfigError(f"data.root={root}: no LMDB environment for the {split} split (looked for {name}/data.mdb, "
                          f"{name}.lmdb, *_{name}_lmdb/ and {name}/<class>/data.mdb; dataset.split_keys.{split} names "
                          "it)")
    return _lsun(classes, name)


def _lsun(folders: list[Path], split: str) -> Environments:
    names = [p.name.removesuffix(f"_{split}_lmdb") for p in folders]
    keys, env_of = [], []
    for number, folder in enumerate(folders):
        with _look(str(folder), True).begin() as txn:
            found = list(txn.cursor().iternext(keys=True, values=False))
            _refuse_pickle(str(folder), txn, found[:1])
        keys += found
        env_of += [number] * len(found)
    env_of = np.array(env_of, dtype=np.int32)
    return Environments([str(p) for p in folders], [True] * len(folders), env_of, ByteKeys(keys),
                        env_of.astype(np.int64), names, records=False)


def _labelled(path: str, subdir: bool) -> Environments:
    with _look(path, subdir).begin(buffers=True) as txn:
        listed = txn.get(KEYS)
        _refuse_pickle(path, txn, [KEYS] if listed is not None else [])
        keys = _unpacked(path, KEYS, listed) if listed is not None else [
            key for key in map(bytes, txn.cursor().iternext(keys=True, values=False)) if not _meta(key)]
        keys = [key.encode() if isinstance(key, str) else bytes(key) for key in keys]
        if not keys:
            raise ConfigError(f"data.root: the LMDB environment {path} holds no samples")
        _refuse_pickle(path, txn, keys[:1])
        first = txn.get(keys[0])
        records = first is not None and len(first) > 0 and first[0] in RECORD_STARTS
        labels = txn.get(LABELS)
        if labels is not None:
            targets = np.asarray(_unpacked(path, LABELS, labels), dtype=np.int64)
        elif records:
            targets = np.array([_scanned_label(path, txn, key) for key in keys], dtype=np.int64)
        else:
            raise ConfigError(f"data.root: the LMDB environment {path} holds image bytes without labels: add "
                              f"`__labels__` (a msgpack list of ints, in `__keys__` order), or write it with "
                              f"`python {CONVERTER} SRC OUT --to lmdb`")
        names = txn.get(CLASSES)
        classes = [_text(n) for n in _unpacked(path, CLASSES, names)] if names is not None else None
    if len(targets) != len(keys):
        raise ConfigError(f"data.root: the LMDB environment {path} has {len(targets)} `__labels__` for {len(keys)} "
                          "keys")
    if len(targets) and targets.min() < 0:
        raise ConfigError(f"data.root: the LMDB environment {path} holds a negative label ({targets.min()})")
    classes = classes or [str(value) for value in range(int(targets.max()) + 1)]
    return Environments([path], [subdir], np.zeros(len(keys), dtype=np.int32), ByteKeys(keys), targets, classes,
                        records)


def record_label(value) -> int:
    """A record's label, read past its image bytes without copying them (a 2-array of bin or str, then the label);
    any other record unpacked whole."""
    import msgpack

    if value[0] == 0x92:
        kind, head = value[1], {0xC4: 1, 0xD9: 1, 0xC5: 2, 0xDA: 2, 0xC6: 4, 0xDB: 4}.get(value[1])
        if head is not None:
            length = int.from_bytes(bytes(value[2:2 + head]), "big")
            return int(msgpack.unpackb(value[2 + head + length:]))
        if 0xA0 <= kind <= 0xBF:  # a fixstr image of under 32 bytes
            return int(msgpack.unpackb(value[2 + (kind & 0x1F):]))
    return split_record(value)[1]


def _scanned_label(path: str, txn, key: bytes) -> int:
    """A record's label at start, or one line naming it: without `__labels__` its label is known from it alone."""
    value = txn.get(key)
    try:
        return record_label(value)
    except (TypeError, ValueError, IndexError) as err:
        why = "no record" if value is None else f"{type(err).__name__}: {err}"
        raise ConfigError(f"data.root: record {key!r} of the LMDB environment {path} gives no label ({why}): "
                          "remove its key, or add `__labels__` (a msgpack list of ints, in key order)") from err


def split_record(value) -> tuple[bytes, int]:
    """(image bytes, label) of a msgpack record: [image, label] or {"image": ..., "label": ...}; ValueError for
    anything else."""
    import msgpack

    try:
        record = msgpack.unpackb(value, raw=True)
    except Exception as err:  # msgpack's errors are not all ValueErrors (OutOfData)
        raise ValueError(f"a record that does not unpack ({type(err).__name__}: {err})") from err
    if isinstance(record, dict):
        record = (record.get(b"image"), record.get(b"label"))
    if not isinstance(record, list | tuple) or len(record) != 2 or not isinstance(record[0], bytes):
        raise ValueError("a record is not [image bytes, label] nor {image, label}")
    return record[0], int(record[1])


def is_pickle(value) -> bool:
    """A pickle of protocol 2 or later: the PROTO opcode first (protocol 0 and 1 pickles are not written today)."""
    return value is not None and len(value) > 1 and value[0] == 0x80 and 2 <= value[1] <= 5


def _refuse_pickle(path: str, txn, keys: list[bytes]) -> None:
    for key in keys:
        if is_pickle(txn.get(key)):
            raise ConfigError(f"data.root: the LMDB environment {path} holds pickled values (key {bytes(key)!r}), "
                              "which can run code when loaded: unpickle them once with the code that wrote them into "
                              f"an ImageFolder, then `python {CONVERTER} FOLDER OUT --to lmdb`")


def _unpacked(path: str, key: bytes, value) -> list:
    import msgpack

    try:
        found = msgpack.unpackb(value, raw=False)
    except Exception as err:  # msgpack's errors are not all ValueErrors
        raise ConfigError(f"data.root: {key.decode()} of the LMDB environment {path} is not a msgpack list "
                          f"({err})") from err
    if not isinstance(found, list | tuple):
        raise ConfigError(f"data.root: {key.decode()} of the LMDB environment {path} is not a msgpack list")
    return list(found)


def _meta(key: bytes) -> bool:
    return key.startswith(b"__") and key.endswith(b"__")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _look(path: str, subdir: bool):
    """The environment for the main process's look (closed before the workers fork); one line naming it when it
    cannot be opened."""
    import lmdb

    try:
        return open_env(path, subdir)
    except lmdb.Error as err:
        raise ConfigError(f"data.root: cannot open the LMDB environment {path} ({err})") from err
