"""data.decode=device on a CPU (trainer.device=cpu runs the same code as CUDA, with torchcodec's CPU decoder): workers
ship encoded files through the shared-memory ring, the batch is decoded where it trains, the boxes are those of a
CPU-decoded run of the same seed, refused files fall back to the CPU (counted), bad ones are skipped, resume is
exact."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import compose_config, read_metrics, run_cli, whole_and_resumed
from train.config import ConfigError, validate
from train.data import data_from_config
from train.data.transforms import MEAN, STD
from train.dist import DistEnv

CPU = torch.device("cpu")


def config(root: Path, *extra: str):
    return compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                           "trainer.epochs=2", *extra])


def epoch(cfg, epoch_index: int = 0, limit: int | None = None) -> tuple[list, list, object]:
    """(training batches, validation images, the training collate) of one epoch."""
    with data_from_config(cfg, DistEnv(), CPU) as data:
        data.set_epoch(epoch_index)
        train = [(b.images.clone(), b.targets.clone(), b.bad, b.decode_fallbacks)
                 for b in itertools.islice(data.train, limit)]
        val = [b.images.clone() for b in data.val]
        return train, val, data.train.loader.collate_fn


def pixels(images: torch.Tensor) -> torch.Tensor:
    """Normalized device images back to 0-255."""
    return images * torch.tensor(STD).view(1, 3, 1, 1) * 255 + torch.tensor(MEAN).view(1, 3, 1, 1) * 255


@pytest.mark.parametrize("recipe", ["crop_flip", "imagenet"])
def test_device_decode_gives_the_pixels_of_a_cpu_decoded_run_through_the_ring(tiny_dataset, recipe):
    """No DCT scaling at these sizes, and torchcodec's CPU decoder is libjpeg-turbo too: the same boxes give the
    same pixels, bit for bit, training and validation, whatever the workers."""
    cpu, cpu_val, _ = epoch(config(tiny_dataset, f"augment={recipe}", "data.num_workers=0"))
    device, device_val, ring = epoch(config(tiny_dataset, f"augment={recipe}", "data.num_workers=2",
                                            "data.decode=device"))
    assert len(cpu) == len(device) == 15
    for (a, labels_a, _, _), (b, labels_b, _, fallbacks) in zip(cpu, device, strict=True):
        assert torch.equal(a, b) and torch.equal(labels_a, labels_b) and fallbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(cpu_val, device_val, strict=True))
    assert ring.buffers.dtype == torch.uint8 and ring.buffers.dim() == 3  # encoded files, not images, in the slots
    assert int(ring.overruns) == 0 and int(ring.received.max()) > 0, "every batch went through the ring"


def test_dct_scaled_photos_crop_the_same_boxes(tmp_path):
    """640 x 480 photos at a 37 px resize: the CPU path decodes at 1/8 and crops there; the device decodes whole and
    resizes to the same size first, so the boxes match and the pixels nearly."""
    root = make_synthetic_imagefolder(tmp_path / "photos", train_per_class=2, val_per_class=1, photo=(640, 480))
    common = ("data.num_workers=0", "data.batch_size=4")
    for recipe in ("crop_flip", "imagenet"):
        cpu, _, _ = epoch(config(root, f"augment={recipe}", *common), limit=3)
        device, _, _ = epoch(config(root, f"augment={recipe}", "data.decode=device", *common), limit=3)
        for (a, _, _, _), (b, _, _, _) in zip(cpu, device, strict=True):
            error = (pixels(a) - pixels(b)).abs()
            assert float(error.mean()) < 6, recipe  # another crop would differ by tens of levels
            mse = float((error**2).mean())
            assert 10 * np.log10(255**2 / mse) >= 26, recipe


def test_refused_files_fall_back_to_the_cpu_counted_and_broken_ones_are_skipped(tiny_dataset, tmp_path):
    root = tmp_path / "mixed"
    shutil.copytree(tiny_dataset, root)
    folder = root / "train" / "circle"
    Image.open(folder / "00000.jpg").save(folder / "00000.png")  # not a JPEG: the device decoder refuses it
    (folder / "00000.jpg").unlink()
    (folder / "00001.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")  # no header: skipped in the worker
    whole = (folder / "00002.jpg").read_bytes()
    (folder / "00002.jpg").write_bytes(whole[:len(whole) * 3 // 5])  # a whole header, a cut body: skipped after both
    cfg = config(root, "data.num_workers=2", "data.decode=device", "data.sampler=sequential", "data.drop_last=false")
    train, _, _ = epoch(cfg)
    assert sum(b[2] for b in train) == 2, "both broken files skipped and counted"
    assert sum(b[3] for b in train) == 1, "the PNG decoded on the CPU, counted"
    assert sum(len(b[1]) for b in train) == 238 and all(len(b[0]) == len(b[1]) for b in train)


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(tiny_dataset):
    whole, rest = whole_and_resumed(config(tiny_dataset, "data.num_workers=2", "data.decode=device"), 1, taken=4)
    assert len(whole) == 15 and len(rest) == 11
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, whole[4:], strict=True))


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.decode=gpu"], "data.decode='gpu': choose cpu"),
    (["data.decode=device", "data.device_transforms=false"], "set data.device_transforms=true"),
    (["data.decode=device", "data.cache_bytes=1000"], "data.cache_bytes=1000: the sample cache holds CPU-decoded"),
])
def test_settings_that_cannot_decode_on_the_device_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_config(overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("extra", "message"), [
    (["augment=strong"], "data.decode=device: the device runs [Resize ->] RandomCrop"),
    (["dataset=cifar10"], "data.decode=device: Cifar10Dataset offers no `read_encoded`"),
])
def test_sources_and_recipes_it_cannot_run_fail_before_any_worker(tiny_dataset, cifar_root, extra, message):
    root = cifar_root if "dataset=cifar10" in extra else tiny_dataset
    with pytest.raises(ConfigError) as err:
        data_from_config(config(root, "data.decode=device", "data.num_workers=2", *extra), DistEnv(), CPU)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_run_trains_with_device_decode(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "data.num_workers=2", "data.decode=device", "trainer.epochs=2",
                      "trainer.max_steps=20"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2 and records[-1]["decode_fallbacks"] == 0 and records[-1]["val_samples"] == 80
