"""dataset=lmdb reads environments as other tools write them (torchvision's LSUN layout, one environment per class;
msgpack (image, label) records in a folder2lmdb file) and as scripts/convert_dataset.py writes them, through real
DataLoader workers, each of which opens the environments itself, read-only without locks or readahead; a pickled
value is refused before any worker starts; a missing or broken record is skipped; bad roots are one line."""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from loadout.data.datasets import ImageFolderDataset
from loadout.data.files.lmdb_layout import open_env
from loadout.data.files.lmdb_source import LMDBSource
from loadout.data.samples import Samples
from loadout.errors import ConfigError
from tests.test_hdf5 import first_batches

ROOT = Path(__file__).resolve().parents[1]


def put_all(path: Path, items: list[tuple[bytes, bytes]], subdir: bool = True) -> None:
    """`items` into a new environment, as lmdb's docs write: one write transaction."""
    path.parent.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(path), map_size=64 << 20, subdir=subdir)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.close()


def write_lsun(root: Path, folder: Path, split: str = "train") -> None:
    """LSUN's layout: <class>_<split>_lmdb per class, each image as WebP under its SHA-1 hex key."""
    source = ImageFolderDataset(folder, split)
    for label, name in enumerate(source.classes):
        items = []
        for index in np.flatnonzero(source.targets == label)[:8]:
            out = io.BytesIO()
            Image.open(source.paths[index].decode()).save(out, "WEBP", lossless=True)
            items.append((hashlib.sha1(source.paths[index]).hexdigest().encode(), out.getvalue()))
        put_all(root / f"{name}_{split}_lmdb", items)


def write_records(path: Path, folder: Path, split: str, pack=msgpack.packb) -> ImageFolderDataset:
    """A folder2lmdb file (subdir=False): each sample `pack((image bytes, label))`, `__keys__` and `__len__`."""
    source = ImageFolderDataset(folder, split)
    keys = [f"{index}".encode() for index in range(len(source))]
    items = [(key, pack(source.read_encoded(i))) for i, key in enumerate(keys)]
    put_all(path, [*items, (b"__keys__", msgpack.packb(keys)), (b"__len__", msgpack.packb(len(keys)))],
            subdir=False)
    return source


def test_lsun_layout_one_environment_per_class(tiny_dataset, tmp_path):
    for split in ("train", "val"):
        write_lsun(tmp_path / "lsun", tiny_dataset, split)
    source = LMDBSource(tmp_path / "lsun", "train")
    folder = ImageFolderDataset(tiny_dataset, "train")
    assert source.classes == folder.classes and len(source) == 80
    assert source.targets.tolist() == sorted(source.targets.tolist()) and set(source.targets.tolist()) == set(
        range(10))
    first = np.flatnonzero(folder.targets == 3)[0]
    image, label = source[int(np.flatnonzero(source.targets == 3)[0])]
    assert label == 3 and image.shape == folder[first][0].shape
    assert sum(len(b) for b in first_batches(["dataset=lmdb"], tmp_path / "lsun")) == 80


def test_msgpack_records_in_a_folder2lmdb_file(tiny_dataset, tmp_path):
    (tmp_path / "set").mkdir()
    folders = [write_records(tmp_path / "set" / f"{split}.lmdb", tiny_dataset, split) for split in ("train", "val")]
    source = LMDBSource(tmp_path / "set", "val")
    assert np.array_equal(source.targets, folders[1].targets) and source.classes == [str(i) for i in range(10)]
    assert source.read_encoded(11) == folders[1].read_encoded(11)
    assert torch.equal(source[11][0], folders[1][11][0])
    assert sum(len(b) for b in first_batches(["dataset=lmdb"], tmp_path / "set")) == len(folders[0])


def test_the_converters_environments_read_as_the_folder(tiny_dataset, tmp_path):
    run = subprocess.run([sys.executable, "scripts/convert_dataset.py", str(tiny_dataset), str(tmp_path / "set"),
                          "--to", "lmdb"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    folder, source = ImageFolderDataset(tiny_dataset, "train"), LMDBSource(tmp_path / "set", "train")
    assert source.classes == folder.classes and np.array_equal(source.targets, folder.targets)
    assert source.read_encoded(100) == folder.read_encoded(100)
    assert "set/train key b'" in source.paths[100]
    cached = first_batches(["dataset=lmdb", "data.cache_bytes=8000000"], tmp_path / "set")
    mixed = first_batches(["dataset=mix", "dataset.sources.main._target_=loadout.data.files.lmdb_source.LMDBSource",
                           f"dataset.sources.main.root={tmp_path / 'set'}"], tiny_dataset)
    assert sum(len(b) for b in cached) == sum(len(b) for b in mixed) == len(folder)


def test_each_worker_opens_its_own_environment_read_only_without_locks_or_readahead(tiny_dataset, tmp_path):
    (tmp_path / "set").mkdir()
    write_records(tmp_path / "set" / "train.lmdb", tiny_dataset, "train")
    source = LMDBSource(tmp_path / "set", "train")
    source[0]
    opened = open_env(*source.found.paths, *source.found.subdirs)

    def flags(batch):
        import os
        env = open_env(*source.found.paths, *source.found.subdirs)
        return os.getpid(), env is not opened, tuple(sorted(env.flags().items()))

    seen = set(DataLoader(source, batch_size=40, num_workers=2, collate_fn=flags))
    with pytest.raises(lmdb.Error):  # closed in the main process just before the workers forked
        opened.stat()
    assert len({pid for pid, _, _ in seen}) == 2 and {fresh for _, fresh, _ in seen} == {True}
    for _, _, found in seen:
        found = dict(found)
        assert found["readonly"] and not found["lock"] and not found["readahead"]


def test_a_pickled_value_is_refused_before_any_worker_starts(tiny_dataset, tmp_path):
    (tmp_path / "set").mkdir()
    write_records(tmp_path / "set" / "train.lmdb", tiny_dataset, "train", pack=pickle.dumps)
    with pytest.raises(ConfigError, match="pickled values .* scripts/convert_dataset.py") as err:
        LMDBSource(tmp_path / "set", "train")
    assert "\n" not in str(err.value)


def test_a_missing_or_broken_record_is_skipped_and_named(tiny_dataset, tmp_path, caplog):
    (tmp_path / "set").mkdir()
    source = ImageFolderDataset(tiny_dataset, "train")
    keys = [f"k{i}".encode() for i in range(4)]
    values = [source.read_encoded(i)[0] for i in range(4)]
    values[1] = values[1][:50]  # a truncated JPEG
    put_all(tmp_path / "set" / "train", [*zip(keys[:3], values[:3], strict=True),  # k3 listed, never written
                                         (b"__keys__", msgpack.packb(keys)), (b"__labels__", msgpack.packb([0] * 4))])
    samples = Samples(LMDBSource(tmp_path / "set", "train"), lambda image: image, seed=0)
    with caplog.at_level(logging.WARNING):
        assert samples[0] is not None and samples[1] is None and samples[3] is None
    assert "key b'k3'" in caplog.text and "key b'k1'" in caplog.text


def test_roots_that_do_not_fit_are_one_line(tiny_dataset, tmp_path):
    source = ImageFolderDataset(tiny_dataset, "train")
    put_all(tmp_path / "bare" / "train", [(b"a", source.read_encoded(0)[0])])
    cases = [(tmp_path / "nothing", "does not exist"), (tmp_path, "no LMDB environment for the train split"),
             (tmp_path / "bare", "image bytes without labels")]
    for root, said in cases:
        with pytest.raises(ConfigError, match="^data.root") as err:
            LMDBSource(root, "train")
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
