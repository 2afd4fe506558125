"""task=segmentation through the other stores: a VOC folder (real JPEG images, real palette-PNG masks) written into
WebDataset shards by scripts/make_shards.py, into parquet (an image and a mask column, written with pyarrow) and
packed by scripts/pack_dataset.py; read through the real Samples path and DataLoader workers, the masks arrive uint8
and aligned with their images after the joint geometry; a broken mask or one of another size is skipped and
counted; `python -m train task=segmentation` trains an epoch from shards over HTTP (nginx) and from parquet."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from loadout.data.fast.packed import PackedDataset
from loadout.data.remote.parquet import ParquetSource
from loadout.data.remote.shards import ShardSource
from loadout.data.samples import Samples
from loadout.data.seg_augment import SegmentationRecipe
from loadout.errors import ConfigError
from tests.conftest import read_metrics, run_cli
from tests.test_segmentation_data import DataCfg, agreement, loader, write_voc
from tests.test_shards import nginx_serving

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ["background", "red", "green", "blue"]  # write_voc's COLOURS
COUNT = 24  # samples a split (write_voc lists every id in train.txt and val.txt)


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    root = write_voc(tmp_path_factory.mktemp("seg") / "voc", count=COUNT)
    (root / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    return root


def script(*args: str) -> None:
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def voc_shards(voc, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seg") / "shards"
    script("scripts/make_shards.py", str(voc), str(out), "--shard-bytes", "12000")
    return out


def aligned_batches(source, workers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Two epochs of `source` through the training recipe (scale, crop, flip) in worker processes."""
    samples = Samples(source, SegmentationRecipe(crop="scale").train_transform(DataCfg()), seed=5)
    batches = list(loader(samples, [(epoch, i) for epoch in range(2) for i in range(len(source))], workers=workers))
    return torch.cat([batch.images for batch in batches]), torch.cat([batch.targets for batch in batches])


def check_aligned(images: torch.Tensor, masks: torch.Tensor) -> None:
    assert images.dtype == torch.uint8 and masks.dtype == torch.uint8 and masks.shape == (2 * COUNT, 32, 32)
    assert (masks == 255).any()  # write_voc's ignored top row
    assert agreement(images, masks) > 0.99  # each scored mask pixel's class is its image pixel's colour
    assert agreement(images, masks.flip(-1)) < 0.65  # a geometry applied to one side only would show


# -- shards ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_shards_made_from_a_voc_folder_carry_aligned_uint8_masks(voc_shards, tmp_path):
    info = json.loads((voc_shards / "_info.json").read_text())
    assert info["masks"] is True and info["classes"] == CLASSES
    assert "labels_per_shard" not in info["splits"]["train"]  # no label to size the shard window by
    assert len(info["splits"]["train"]["filenames"]) > 2
    with tarfile.open(voc_shards / info["splits"]["train"]["filenames"][0]) as tar:
        assert {name.rsplit(".", 1)[1] for name in tar.getnames()} == {"jpg", "png"}
    source = ShardSource(str(voc_shards), "train", cache_dir=str(tmp_path / "cache"))
    assert source.masks and source.classes == CLASSES and len(source) == COUNT
    assert source.label_spread() is None  # the shard order's default window: masks are no labels to mix by
    check_aligned(*aligned_batches(source))


def write_shard(root: Path, members: list[tuple[str, bytes]], said: dict | None = None) -> None:
    """One shard of `members` and an _info.json with its count, CLASSES and `said` (default: masks)."""
    (root / "train").mkdir(parents=True)
    with tarfile.open(root / "train" / "shard-000000.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    count = len({name.split(".")[0] for name, _ in members})
    split = {"filenames": ["train/shard-000000.tar"], "shard_lengths": [count]}
    (root / "_info.json").write_text(json.dumps({"classes": CLASSES, **({"masks": True} if said is None else said),
                                                 "splits": {"train": split, "val": split}}))


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, "L").save(out, "PNG")
    return out.getvalue()


def test_a_broken_mask_member_and_a_mask_of_another_size_are_skipped_and_counted(voc, tmp_path, caplog):
    """A webdataset-style shard written by hand (`<key>.jpg` + `<key>.mask.png`): sample 1's mask is no PNG, sample 3's
    is 24x24 beside a 48x80 image; both are skipped, counted and named, the other four arrive."""
    members = []
    for i in range(6):
        mask = (voc / "SegmentationClass" / f"s{i:03d}.png").read_bytes()
        mask = b"not a png" if i == 1 else png(np.zeros((24, 24), dtype=np.uint8)) if i == 3 else mask
        members += [(f"k{i}.jpg", (voc / "JPEGImages" / f"s{i:03d}.jpg").read_bytes()), (f"k{i}.mask.png", mask)]
    write_shard(tmp_path / "shards", members)
    source = ShardSource(str(tmp_path / "shards"), "train", cache_dir=str(tmp_path / "cache"))
    samples = Samples(source, SegmentationRecipe().train_transform(DataCfg()), seed=0)
    with caplog.at_level(logging.WARNING):
        batches = list(loader(samples, [(0, i) for i in range(6)], workers=0))
    assert sum(batch.bad for batch in batches) == 2 and sum(len(batch) for batch in batches) == 4
    assert "shard-000000.tar#1" in caplog.text and "its .png mask" in caplog.text
    assert "shard-000000.tar#3" in caplog.text and "24x24" in caplog.text and "48x80" in caplog.text


def test_whether_shards_hold_masks_is_told_by_their_keys_where_info_json_is_silent(voc, tmp_path):
    """A key with a mask and no label is a segmentation sample; a labelled key's extra PNG is no mask (classification
    shards keep their labels); nothing is read to tell until a sample is."""
    image, mask = (voc / "JPEGImages" / "s000.jpg").read_bytes(), (voc / "SegmentationClass" / "s000.png").read_bytes()
    write_shard(tmp_path / "pairs", [("k.jpg", image), ("k.png", mask)], said={})
    write_shard(tmp_path / "labelled", [("k.jpg", image), ("k.png", mask), ("k.cls", b"2")], said={})
    pairs = ShardSource(str(tmp_path / "pairs"), "train", cache_dir=str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("*.index.npz"))
    assert pairs.masks and pairs[0][1].shape == (48, 80) and pairs[0][1].dtype == torch.uint8
    labelled = ShardSource(str(tmp_path / "labelled"), "train", cache_dir=str(tmp_path / "cache"))
    assert not labelled.masks and labelled[0][1] == 2


@pytest.mark.slow
def test_mask_shards_without_class_names_fail_in_one_line(voc_shards, tmp_path):
    info = json.loads((voc_shards / "_info.json").read_text())
    del info["classes"]
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "_info.json").write_text(json.dumps(info))
    (tmp_path / "shards" / "train").symlink_to(voc_shards / "train")
    with pytest.raises(ConfigError, match=r"^data.root=.*mask shards name no classes.*make_shards.py"):
        ShardSource(str(tmp_path / "shards"), "train", cache_dir=str(tmp_path / "cache"))


# -- parquet ---------------------------------------------------------------------------------------------------
def write_parquet(voc: Path, out: Path, broken: dict[int, bytes | None] | None = None) -> Path:
    """The VOC folder as parquet in the Hub's layout: `image` a struct of bytes and path (as `datasets` writes an
    Image feature), `annotation` the PNG mask's bytes; `broken` replaces some rows' masks; two row groups."""
    images, masks = [], []
    for i in range(COUNT):
        images.append({"bytes": (voc / "JPEGImages" / f"s{i:03d}.jpg").read_bytes(), "path": f"s{i:03d}.jpg"})
        masks.append((broken or {}).get(i, (voc / "SegmentationClass" / f"s{i:03d}.png").read_bytes()))
    table = pa.table({"image": images, "annotation": pa.array(masks, pa.binary())})
    (out / "data").mkdir(parents=True)
    for split in ("train", "validation"):
        pq.write_table(table, out / "data" / f"{split}-00000-of-00001.parquet", row_group_size=COUNT // 2)
    return out


def test_parquet_image_and_mask_columns_give_aligned_uint8_masks(voc, tmp_path):
    root = write_parquet(voc, tmp_path / "parquet")
    source = ParquetSource(str(root), "train", cache_dir=str(tmp_path / "cache"), mask_column="annotation",
                           classes=CLASSES)
    assert source.classes == CLASSES and len(source) == COUNT and len(source.shard_starts) == 3
    assert not hasattr(source, "targets")  # no labels: data.sampler=weighted has nothing to weigh
    assert ParquetSource(str(root), "val", mask_column="annotation", classes=4).classes == ["0", "1", "2", "3"]
    check_aligned(*aligned_batches(source))


def test_parquet_rows_with_a_broken_missing_or_wrong_sized_mask_are_skipped_and_counted(voc, tmp_path, caplog):
    broken = {2: b"not a png", 5: None, 9: png(np.zeros((24, 24), dtype=np.uint8))}
    root = write_parquet(voc, tmp_path / "parquet", broken)
    source = ParquetSource(str(root), "train", cache_dir=str(tmp_path / "cache"), mask_column="annotation",
                           classes=CLASSES)
    samples = Samples(source, SegmentationRecipe().val_transform(DataCfg()), seed=0)
    with caplog.at_level(logging.WARNING):
        batches = list(loader(samples, list(range(COUNT)), workers=0))
    assert sum(batch.bad for batch in batches) == 3 and sum(len(batch) for batch in batches) == COUNT - 3
    assert caplog.text.count("its mask (column `annotation`)") == 2 and "24x24" in caplog.text


def test_parquet_masks_without_classes_or_column_fail_in_one_line(voc, tmp_path):
    root = write_parquet(voc, tmp_path / "parquet")
    with pytest.raises(ConfigError, match=r"^dataset.mask_column=annotation: masks name no classes: set "
                                          r"dataset.classes"):
        ParquetSource(str(root), "train", mask_column="annotation")
    with pytest.raises(ConfigError, match=r"^dataset.mask_column=masks: .* has no such column \(its columns: "
                                          r"image, annotation\)"):
        ParquetSource(str(root), "train", mask_column="masks", classes=CLASSES)


# -- packed ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_packed_voc_folder_keeps_a_mask_plane_aligned_with_its_images(voc, tmp_path):
    script("scripts/pack_dataset.py", str(voc), str(tmp_path / "packed"), "--size", "48", "--workers", "0")
    source = PackedDataset(tmp_path / "packed", "train")
    assert source.has_masks and not hasattr(source, "targets") and source.classes == CLASSES
    image, mask = source[0]
    assert image.shape == (3, 48, 48) and mask.shape == (48, 48) and mask.dtype == torch.uint8
    check_aligned(*aligned_batches(source))


# -- end to end ------------------------------------------------------------------------------------------------
def segmentation_run(run_dir: Path, *overrides: str) -> list[dict]:
    result = run_cli(["hardware=cpu", "task=segmentation", "data.image_size=32", "data.batch_size=8",
                      "data.num_workers=2", "trainer.epochs=1", "trainer.progress=false",
                      f"hydra.run.dir={run_dir}", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


@pytest.mark.slow  # two training runs and nginx
def test_task_segmentation_trains_from_shards_over_http_and_from_parquet(voc, voc_shards, tmp_path):
    """`python -m train task=segmentation` with real workers: shards served by nginx, and parquet whose one broken
    mask is skipped and counted in metrics.jsonl, not fatal."""
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    with nginx_serving(voc_shards, prefix) as url:
        records = segmentation_run(tmp_path / "shards-run", "dataset=shards", f"data.root={url}",
                                   f"dataset.cache_dir={tmp_path / 'cache'}")
    assert records[-1]["images"] == COUNT and records[-1]["bad_samples"] == 0
    assert 0 <= records[-1]["val_miou"] <= 1 and records[-1]["val_pixel_acc"] > 0
    root = write_parquet(voc, tmp_path / "parquet", {4: b"not a png"})
    records = segmentation_run(tmp_path / "parquet-run", "dataset=parquet", f"data.root={root}",
                               "dataset.mask_column=annotation", f"dataset.classes={CLASSES}".replace("'", ""))
    assert records[-1]["bad_samples"] == 1 and records[-1]["images"] == COUNT - 1
    assert "val_miou" in records[-1]
