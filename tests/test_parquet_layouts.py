"""dataset=parquet reads every layout `datasets` writes as `datasets` reads it: embedded bytes, path-only rows
(absolute, or relative to the parquet file), `Image(decode=False)`, string paths typed Image, binary images, other
column names found from the features metadata, ClassLabel names; a missing image file is a bad sample; a layout it
cannot read fails in one line; a large remote file is read by row group with range requests (nginx's access log).

`datasets` is not in the lock, so the files are written with pyarrow exactly as `datasets` writes them: the Image
feature's storage struct<bytes: binary, path: string>, and the features as JSON under the schema metadata key
`huggingface` ({"info": {"features": ...}})."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loadout.data.datasets import ImageFolderDataset
from loadout.data.remote.parquet import ParquetSource
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from tests.conftest import compose_config, read_metrics, run_cli
from tests.test_shards import nginx_serving
from train.job import data_from_config

CPU = torch.device("cpu")
IMAGE_STRUCT = pa.struct({"bytes": pa.binary(), "path": pa.string()})


def image_feature(decode: bool = True) -> dict:
    return {"decode": decode, "id": None, "_type": "Image"}


def write(path: Path, columns: dict, features: dict | None, row_group_size: int = 50) -> None:
    """One parquet file as `datasets` writes it: `columns` as arrow arrays, `features` in the schema metadata."""
    table = pa.table(columns)
    if features is not None:
        table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)


def write_split_layout(folder: Path, out: Path, images, image_type=IMAGE_STRUCT, image_name: str = "image",
                       label_name: str = "label", decode: bool = True, typed_image: bool = True) -> Path:
    """The tiny ImageFolder's splits as data/<split>-00000-of-00001.parquet, its image column made by
    `images(split_folder, index, parquet_dir)`, the label a ClassLabel."""
    for split, name in (("train", "train"), ("val", "validation")):
        source = ImageFolderDataset(folder, split)
        parquet = out / "data" / f"{name}-00000-of-00001.parquet"
        features = {image_name: image_feature(decode) if typed_image else {"dtype": "string", "_type": "Value"},
                    label_name: {"names": source.classes, "id": None, "_type": "ClassLabel"}}
        values = [images(source, i, parquet.parent) for i in range(len(source))]
        write(parquet, {image_name: pa.array(values, type=image_type),
                        label_name: pa.array(source.targets, type=pa.int64())}, features)
    return out


def file_of(source: ImageFolderDataset, index: int) -> Path:
    return Path(source.paths[index].decode())


def embedded(source, index, _):
    return {"bytes": source.read_encoded(index)[0], "path": file_of(source, index).name}


def absolute(source, index, _):
    return {"bytes": None, "path": str(file_of(source, index))}


def relative(source, index, parquet_dir):
    return {"bytes": None, "path": os.path.relpath(file_of(source, index), parquet_dir)}


def assert_reads_the_folder(root: Path, folder: Path, tmp_path: Path) -> None:
    source = ParquetSource(str(root), "train", cache_dir=str(tmp_path / "cache"))
    images = ImageFolderDataset(folder, "train")
    assert len(source) == 240 and source.classes == images.classes
    assert np.array_equal(source.targets, images.targets)
    for index in (0, 61, 239):
        assert torch.equal(source[index][0], images[index][0])


@pytest.mark.parametrize("layout", [embedded, absolute, relative], ids=["embedded", "absolute", "relative"])
def test_embedded_and_path_only_rows_read_the_same_images(layout, tiny_dataset, tmp_path):
    root = write_split_layout(tiny_dataset, tmp_path / "set", layout)
    assert_reads_the_folder(root, tiny_dataset, tmp_path)


def test_decode_false_string_and_binary_image_columns_and_other_column_names(tiny_dataset, tmp_path):
    """Image(decode=False) is the same struct; a string column typed Image holds paths and a binary one the bytes,
    as `datasets` casts them; `img` and `fine_label` are found from the features (CIFAR-100's names)."""
    names = {"image_name": "img", "label_name": "fine_label"}
    layouts = {"decode_false": write_split_layout(tiny_dataset, tmp_path / "nodecode", relative, decode=False),
               "string": write_split_layout(tiny_dataset, tmp_path / "string", lambda s, i, _: str(file_of(s, i)),
                                            image_type=pa.string(), **names),
               "binary": write_split_layout(tiny_dataset, tmp_path / "binary", lambda s, i, _: s.read_encoded(i)[0],
                                            image_type=pa.binary(), **names)}
    for name, root in layouts.items():
        assert_reads_the_folder(root, tiny_dataset, tmp_path / name)


@pytest.mark.slow  # a real `python -m train` run
def test_a_dataset_saved_from_image_files_trains(tiny_dataset, tmp_path):
    """Path-only rows relative to the parquet file: the run reads every sample, none bad."""
    root = write_split_layout(tiny_dataset, tmp_path / "set", relative)
    result = run_cli(["hardware=cpu", "dataset=parquet", f"data.root={root}", "data.image_size=32",
                      "data.batch_size=16", "data.num_workers=2", "trainer.max_steps=2", "trainer.progress=false",
                      f"dataset.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert metrics and not any(row.get("bad_samples") for row in metrics)


def test_missing_image_files_are_bad_samples_skipped_and_counted(tiny_dataset, tmp_path):
    copy = tmp_path / "images"
    shutil.copytree(tiny_dataset, copy)
    root = write_split_layout(copy, tmp_path / "set", absolute)
    train = ImageFolderDataset(copy, "train")
    missing = {5, 77, 190}
    for index in missing:
        file_of(train, index).unlink()
    cfg = compose_config(["hardware=cpu", "dataset=parquet", f"data.root={root}", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "data.drop_last=false",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        data.set_epoch(0)
        batches = list(data.train)
    assert sum(b.bad for b in batches) == len(missing) and sum(len(b) for b in batches) == 240 - len(missing)
    seen = {i for b in batches for i in b.indices.tolist()}
    assert seen == set(range(240)) - missing


def unreadable(tmp_path: Path, columns: dict, features: dict | None) -> str:
    for name in ("train", "validation"):
        write(tmp_path / "bad" / "data" / f"{name}-00000-of-00001.parquet", columns, features)
    with pytest.raises(ConfigError) as err:
        ParquetSource(str(tmp_path / "bad"), "train", cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    assert "\n" not in message and "train-00000-of-00001.parquet" in message
    return message


def test_layouts_loadout_cannot_read_fail_in_one_line_naming_the_file_and_column(tmp_path):
    label = pa.array([0, 1], type=pa.int64())
    classes = {"names": ["a", "b"], "_type": "ClassLabel"}
    plain_strings = unreadable(tmp_path / "1", {"image": pa.array(["a.jpg", "b.jpg"]), "label": label},
                               {"image": {"dtype": "string", "_type": "Value"}, "label": classes})
    assert "column `image` is string" in plain_strings
    text_labels = unreadable(tmp_path / "2", {"image": pa.array([b"x", b"y"]), "label": pa.array(["a", "b"])}, None)
    assert "column `label` is string" in text_labels and "integer labels" in text_labels
    unlabelled = unreadable(tmp_path / "3", {"image": pa.array([b"x", b"y"]), "label": pa.array([-1, -1])},
                            {"image": image_feature(), "label": classes})
    assert "column `label` has rows without a label" in unlabelled
    two_images = unreadable(tmp_path / "4", {"a": pa.array([b"x", b"y"]), "b": pa.array([b"x", b"y"]),
                                             "label": label},
                            {"a": image_feature(), "b": image_feature(), "label": classes})
    assert "several: a, b" in two_images
    sequences = unreadable(tmp_path / "5", {"image": pa.array([[b"x"], [b"y"]]), "label": label}, None)
    assert "column `image` is list<" in sequences


# -- a large file over HTTP: read by row group, in place ------------------------------------------------------------
def served_bytes(log: Path, name: str) -> int:
    """The body bytes nginx sent for `name` (the combined log format: `"GET /path HTTP/1.1" status bytes`)."""
    found = re.findall(rf'"GET /[^ ]*{re.escape(name)} HTTP/[0-9.]+" \d+ (\d+)', log.read_text())
    return sum(int(sent) for sent in found)


def padded(jpeg: bytes, rng: np.random.Generator, size: int = 20000) -> bytes:
    """The JPEG with a comment segment of `size` random bytes: the same pixels, a file as large as a photo's."""
    return jpeg[:2] + b"\xff\xfe" + (size + 2).to_bytes(2, "big") + rng.bytes(size) + jpeg[2:]


@pytest.mark.slow  # starts a server
def test_a_large_remote_file_is_read_by_row_group_with_range_requests(tiny_dataset, tmp_path):
    root, rng = tmp_path / "served", np.random.default_rng(0)
    for split, name in (("train", "train"), ("val", "validation")):
        source = ImageFolderDataset(tiny_dataset, split)
        features = {"image": image_feature(), "label": {"names": source.classes, "_type": "ClassLabel"}}
        write(root / "data" / f"{name}-00000-of-00001.parquet",
              {"image": pa.array([padded(source.read_encoded(i)[0], rng) for i in range(len(source))]),
               "label": pa.array(source.targets, type=pa.int64())}, features, row_group_size=20)
    train_file = "train-00000-of-00001.parquet"
    size = (root / "data" / train_file).stat().st_size
    (tmp_path / "nginx").mkdir()
    log = tmp_path / "nginx" / "access.log"
    with nginx_serving(root, tmp_path / "nginx", autoindex=True) as url:
        cache = tmp_path / "cache"
        remote = ParquetSource(url, "train", cache_dir=str(cache), whole_file_bytes=size // 2)
        local = ImageFolderDataset(tiny_dataset, "train")
        assert np.array_equal(remote.targets, local.targets) and len(remote.shard_starts) == 13  # 12 row groups
        at_start = served_bytes(log, train_file)
        assert at_start < size / 20, f"footer and labels only: {at_start} of {size} bytes"
        assert torch.equal(remote[45][0], local[45][0])  # the third row group
        one_group = served_bytes(log, train_file) - at_start
        assert one_group < size / 5, f"one row group of 12: {one_group} of {size} bytes"
        remote.fetch_shard(3)  # the fetch-ahead thread's call: that row group onto the node, not the file
        assert sorted(p.name.split(".")[-3] for p in cache.glob("*.rowgroup*")) == ["rowgroup2", "rowgroup3"]
        assert not list(cache.glob(f"*{train_file}")), "never fetched whole"

        cfg = compose_config(["hardware=cpu", "dataset=parquet", f"data.root={url}", "data.image_size=32",
                              "data.batch_size=16", "data.num_workers=2", "dataset.prefetch_shards=0",
                              f"dataset.whole_file_bytes={size // 2}",
                              f"dataset.cache_dir={cache}"])
        with data_from_config(cfg, DistEnv(), CPU) as data:  # forked workers read, each with its own handle
            data.set_epoch(0)
            batches = list(data.train)
        assert sum(len(b) for b in batches) == 240 and sum(b.bad for b in batches) == 0
        assert not list(cache.glob(f"*{train_file}")), "never fetched whole"
        assert len(list(cache.glob("*.rowgroup*.parquet"))) == 12 and not list(cache.glob("*.part"))
        whole_epoch = served_bytes(log, train_file)
        assert whole_epoch < 1.5 * size, f"each row group read from the store about once: {whole_epoch} of {size}"
        again = ParquetSource(url, "train", cache_dir=str(cache), whole_file_bytes=size // 2)
        assert torch.equal(again[239][0], local[239][0])
        assert served_bytes(log, train_file) - whole_epoch < size / 20, "later epochs read the node's copies"

        bound = 3 * size // 12  # about three row groups' copies: the node cache's bound holds for them too
        bounded = ParquetSource(url, "train", cache_dir=str(tmp_path / "bounded"), cache_bytes=bound,
                                whole_file_bytes=size // 2)
        for index in range(0, 240, 20):  # every row group once
            assert torch.equal(bounded[index][0], local[index][0])
        kept = sum(p.stat().st_size for p in (tmp_path / "bounded").glob("*.rowgroup*.parquet"))
        assert 0 < kept <= bound, f"{kept} bytes of row-group copies kept, the bound is {bound}"
