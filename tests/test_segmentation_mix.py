"""dataset=mix with task=segmentation: a VOC folder (make_dataset.py's segmentation set: real JPEG images,
real palette-PNG masks) and shards written from it by scripts/make_shards.py, mixed 3:1 through the real Samples
path and DataLoader workers: every mask in a batch is its own sample's, as its source gives it; a source without
masks, one with other classes (or the same in another order) and one with a transform of its own are each named in
one line at build, and a source whose first JPEG is truncated is skipped past (or named, when none of its first
samples reads); `python -m train` trains an epoch of the mix and counts each source's samples."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from loadout.data.mix import MixSource
from loadout.data.pipeline import build_sources
from loadout.data.samples import Samples
from loadout.data.seg_augment import SegmentationRecipe, joint
from loadout.errors import ConfigError
from scripts import make_shards
from scripts.make_dataset import make_synthetic_voc
from tests.conftest import compose_config, read_metrics, run_cli
from tests.test_segmentation_data import DataCfg, loader
from train.task.classification import Classification
from train.task.segmentation import Segmentation

PER_EPOCH, BATCH, SIZE = 24, 4, DataCfg.image_size


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    return make_synthetic_voc(tmp_path_factory.mktemp("segmix") / "voc", train=8, val=4, size=48)


@pytest.fixture(scope="module")
def voc_shards(voc, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("segmix") / "shards"
    with pytest.MonkeyPatch.context() as patch:  # the script's own main, in this process (a Python start saved)
        patch.setattr(sys, "argv", ["make_shards.py", str(voc), str(out), "--shard-bytes", "8000"])
        make_shards.main()
    return out


def sources(voc: Path, shards: Path, cache: Path, **extra) -> dict:
    return {"folder": {"_target_": "loadout.data.voc.VOCSegmentation", "root": str(voc), "weight": 3},
            "shards": {"_target_": "loadout.data.remote.shards.ShardSource", "root": str(shards), "weight": 1,
                       "cache_dir": str(cache)}, **extra}


def test_a_mix_of_a_voc_folder_and_its_shards_gives_each_sample_its_own_mask_in_worker_batches(
        voc, voc_shards, tmp_path):
    mix = MixSource(sources(voc, voc_shards, tmp_path / "cache"), "train", seed=3, samples_per_epoch=PER_EPOCH)
    assert mix.classes == ["background", "circle", "square", "triangle", "cross"]
    transform = SegmentationRecipe().val_transform(DataCfg())  # deterministic: the direct read gives the same
    keys = [(epoch, i) for epoch in range(2) for i in range(PER_EPOCH)]
    batches = list(loader(Samples(mix, transform, seed=3), keys, workers=2, batch_size=BATCH))
    masks, images = torch.cat([b.targets for b in batches]), torch.cat([b.images for b in batches])
    assert masks.dtype == torch.uint8 and masks.shape == (2 * PER_EPOCH, SIZE, SIZE)
    parts = []
    for row, (epoch, position) in enumerate(keys):
        part, sample = mix.locate(position, epoch)
        image, mask = joint(transform)(*mix.sources[part][sample])  # the source read directly
        assert torch.equal(masks[row], mask), (epoch, position, mix.names[part], sample)
        assert torch.equal(images[row], image), (epoch, position, mix.names[part], sample)
        parts.append(part)
    assert parts.count(0) == 3 * parts.count(1) == 36  # 3:1, both sources read
    assert len({m.numpy().tobytes() for m in masks}) == len(mix.sources[0]) == 8  # every sample's own mask


def built(cfg_sources: dict, tmp_path: Path, task=None):
    cfg = compose_config(["hardware=cpu", "task=segmentation", "dataset=mix", f"data.root={tmp_path}"])
    cfg.dataset.sources = cfg_sources
    return build_sources(cfg.dataset, cfg.data, task or Segmentation())


def one_line_error(cfg_sources: dict, tmp_path: Path, task=None) -> str:
    with pytest.raises(ConfigError) as err:
        built(cfg_sources, tmp_path, task)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_source_without_masks_other_classes_or_its_own_transform_are_named_in_one_line(
        voc, voc_shards, tiny_dataset, tmp_path):
    cache = tmp_path / "cache"
    folder = {"_target_": "loadout.data.datasets.ImageFolderDataset", "root": str(tiny_dataset), "weight": 1}
    message = one_line_error(sources(voc, voc_shards, cache, photos=folder), tmp_path)
    assert message.startswith("dataset.sources.photos: ") and "not a mask" in message and "dataset=voc" in message

    other = make_synthetic_voc(tmp_path / "other", train=1, val=1, size=48)
    (other / "classes.txt").write_text("background\nshape\n")
    other_voc = {"_target_": "loadout.data.voc.VOCSegmentation", "root": str(other), "weight": 1}
    message = one_line_error(sources(voc, voc_shards, cache, other=other_voc), tmp_path)
    assert message.startswith("dataset.sources.other: its classes [background, shape] (2)") and \
        "same classes in the same order" in message

    flip = {"_target_": "torchvision.transforms.v2.RandomHorizontalFlip"}
    message = one_line_error(sources(voc, voc_shards, cache, other={**other_voc, "root": str(voc), "transform": flip}),
                             tmp_path)
    assert message.startswith("dataset.sources.other.transform: its samples carry masks")
    # the task's own check comes first: masks where labels are trained on is what is wrong, not the transform
    message = one_line_error({"other": {**other_voc, "root": str(voc), "transform": flip}}, tmp_path, Classification())
    assert message.startswith("dataset.sources.other: its sample 0 must be (image, label)"), message


def test_mask_sources_with_the_same_classes_in_another_order_fail_at_build_for_both_splits(voc, voc_shards, tmp_path):
    """A mask's values are class indices: the same names in another order would train one class as another."""
    swapped = make_synthetic_voc(tmp_path / "swapped", train=1, val=1, size=48)
    (swapped / "classes.txt").write_text("background\nsquare\ncircle\ntriangle\ncross\n")
    cfg_sources = sources(voc, voc_shards, tmp_path / "cache", swapped={
        "_target_": "loadout.data.voc.VOCSegmentation", "root": str(swapped), "weight": 1})
    message = one_line_error(cfg_sources, tmp_path)
    assert message.startswith("dataset.sources.swapped: its classes [background, square, circle, triangle, cross] "
                              "(5) are not dataset.sources.folder's [background, circle, square,"), message
    for split in ("train", "val"):  # the check reads no sample: the val split's mix is checked alike
        with pytest.raises(ConfigError, match=r"^dataset\.sources\.swapped: its classes"):
            MixSource(cfg_sources, split, samples_per_epoch=PER_EPOCH).check_masks([0, 1, 2])


def test_a_truncated_first_jpeg_is_skipped_at_build_and_a_source_with_none_readable_is_named(voc, voc_shards,
                                                                                           tmp_path):
    """data.on_bad_sample=warn skips an unreadable sample in training: the build check reads past it too."""
    broken = make_synthetic_voc(tmp_path / "broken", train=3, val=1, size=48)
    first = broken / "JPEGImages" / "train_00000.jpg"
    first.write_bytes(first.read_bytes()[:100])  # a truncated JPEG at the source's position 0
    entry = {"_target_": "loadout.data.voc.VOCSegmentation", "root": str(broken), "weight": 1}
    train, _ = built(sources(voc, voc_shards, tmp_path / "cache", broken=entry), tmp_path)
    assert train.names == ("folder", "shards", "broken")
    with pytest.raises(OSError):
        train.read_part(2, 0)  # it is unreadable: the check got past it
    plain = compose_config(["hardware=cpu", "task=segmentation", "dataset=voc", f"data.root={broken}"])
    assert len(build_sources(plain.dataset, plain.data, Segmentation())[0]) == 3  # a source alone, alike

    for name in ("train_00001", "train_00002"):  # now none of its samples reads
        path = broken / "JPEGImages" / f"{name}.jpg"
        path.write_bytes(path.read_bytes()[:100])
    message = one_line_error(sources(voc, voc_shards, tmp_path / "cache", broken=entry), tmp_path)
    assert message.startswith(f"dataset.sources.broken: none of its first 3 samples reads (the first, {first} "
                              "(sample 0): "), message
    assert "a broken file, or the dataset's own reading" in message
    with pytest.raises(ConfigError, match=rf"^dataset\._target_=loadout\.data\.voc\.VOCSegmentation: none of its first "
                                          rf"3 samples reads \(the first, {re.escape(str(first))} "):
        build_sources(plain.dataset, plain.data, Segmentation())


@pytest.mark.slow  # a training run
def test_python_m_train_trains_a_mix_of_mask_sources_and_counts_each(voc, voc_shards, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", "task=segmentation", "dataset=mix", f"data.root={voc}", "data.image_size=32",
                      f"data.batch_size={BATCH}", "data.num_workers=2", "trainer.epochs=1", "trainer.progress=false",
                      "model._target_=tests.test_segmentation_faults.TinySegNet", "~model.name", "logger=[]",
                      f"dataset.samples_per_epoch={PER_EPOCH}", "dataset.sources.main.weight=3",
                      "dataset.sources.main._target_=loadout.data.voc.VOCSegmentation",
                      "+dataset.sources.shards={_target_: loadout.data.remote.shards.ShardSource, "
                      f"root: '{voc_shards}', cache_dir: '{tmp_path / 'cache'}', weight: 1}}",
                      f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    record = read_metrics(run_dir)[-1]
    assert record["source_samples"] == {"main": 18, "shards": 6} and record["bad_samples"] == 0
    assert record["val_samples"] == 2 * 4 and 0 <= record["val_miou"] <= 1 and record["val_pixel_acc"] > 0
