"""JPEGs decoded at the DCT scale the resize needs: the scale chosen, the pixels kept, and everything downstream (the
augmentation's (seed, epoch, index) function, the stream's resume, the sample cache) unchanged."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from loadout.data.datasets import ImageFolderDataset
from loadout.data.fast.decode import dct_scale, decode_image_file, exif_orientation
from loadout.data.fast.packed import PackedDataset
from loadout.data.loader.batch import channels_innermost
from loadout.data.transforms import fit_square
from loadout.dist import DistEnv
from scripts.make_dataset import make_synthetic_imagefolder, render_photo
from tests.conftest import ROOT, compose_config
from train.job import data_from_config

CPU = torch.device("cpu")


def jpeg_bytes(image: Image.Image, quality: int = 92) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return 10 * math.log10(255**2 / mse)


@pytest.mark.parametrize(("size", "min_side", "scale"), [
    ((4032, 3024), 256, 8),   # a 12 MP photo for 224 px crops: 504 x 378
    ((4032, 3024), 512, 4),
    ((3024, 4032), 256, 8),   # portrait: the shorter side decides
    ((1000, 750), 256, 2),    # 375 >= 256
    ((500, 375), 256, 1),     # ImageNet-sized: decoded whole, as before
    ((320, 320), 256, 1),
    ((2049, 2049), 256, 8),   # libjpeg rounds up: ceil(2049 / 8) = 257
    ((2040, 2040), 256, 4),   # ceil(2040 / 8) = 255
])
def test_the_largest_dct_reduction_that_keeps_the_resize_size(size, min_side, scale):
    assert dct_scale(*size, min_side) == scale


@pytest.mark.parametrize(("side", "decoded"), [(2049, 257), (2040, 510), (1000, 500)])
def test_the_decode_is_at_that_scale(side, decoded):
    gray = Image.fromarray(np.full((side, side, 3), 128, dtype=np.uint8))
    assert tuple(decode_image_file(jpeg_bytes(gray), min_side=256).shape) == (3, decoded, decoded)


@pytest.mark.slow
def test_scaled_decode_of_12_mp_photos_matches_a_full_decode_after_the_resize():
    """PSNR >= 30 dB against a full decode + antialiased resize to the same size (the seed recipe: shorter side 256)."""
    rng = np.random.default_rng(0)
    for label in (0, 6):  # a smooth shape and one of many edges
        data = jpeg_bytes(render_photo(label, rng, 4032, 3024))
        scaled = decode_image_file(data, min_side=256)
        full = decode_image_file(data)
        assert tuple(full.shape) == (3, 3024, 4032) and tuple(scaled.shape) == (3, 378, 504)
        assert scaled.dtype == torch.uint8 and channels_innermost(scaled)  # the decoder's HWC layout, as before
        a, b = F.resize(scaled, [256], antialias=True), F.resize(full, [256], antialias=True)
        assert a.shape == b.shape
        assert psnr(a, b) >= 30, psnr(a, b)


def test_small_images_and_other_formats_decode_whole():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8))
    jpeg = jpeg_bytes(image)
    assert torch.equal(decode_image_file(jpeg, min_side=256), decode_image_file(jpeg))  # 300 / 2 < 256: whole
    png = io.BytesIO()
    Image.fromarray(np.zeros((1200, 1600, 3), dtype=np.uint8)).save(png, "PNG")
    assert tuple(decode_image_file(png.getvalue(), min_side=256).shape) == (3, 1200, 1600)


@pytest.mark.parametrize("mode", ["RGB", "CMYK"])
def test_exif_orientation_is_not_applied_on_either_decoder_path(mode):
    """A camera JPEG tagged "rotate 90" (EXIF orientation 6) decodes as stored, W x H, on the libjpeg-turbo path (RGB)
    and on PIL's (CMYK, which TurboJPEG does not convert), each channel as PIL reads the file."""
    stored = Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 64, 3), dtype=np.uint8)).convert(mode)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    data = io.BytesIO()
    stored.save(data, "JPEG", quality=95, exif=exif.tobytes())
    decoded = decode_image_file(data.getvalue())
    assert tuple(decoded.shape) == (3, 48, 64)  # rows x columns as stored, not 64 x 48
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(data.getvalue())).convert("RGB"))).permute(2, 0, 1)
    assert (decoded.int() - reference.int()).abs().max() <= 2  # libjpeg-turbo vs PIL's libjpeg: rounding at most
    assert channels_innermost(decoded)  # HWC in memory on both paths: the ring's channels_last batches


def test_the_exif_orientation_is_read_from_the_header():
    """What data.decode=device undoes after torchcodec applied it: 2-8 from the tag; 1 without a tag, with one out
    of range, or for a format torchcodec does not decode."""
    image = Image.fromarray(np.zeros((8, 16, 3), dtype=np.uint8))

    def tagged(orientation: int | None, fmt: str = "JPEG") -> bytes:
        exif = Image.Exif()
        if orientation is not None:
            exif[0x0112] = orientation
        data = io.BytesIO()
        image.save(data, fmt, exif=exif.tobytes())
        return data.getvalue()

    assert [exif_orientation(tagged(o)) for o in range(1, 9)] == list(range(1, 9))
    assert exif_orientation(tagged(None)) == exif_orientation(tagged(9)) == exif_orientation(tagged(6, "PNG")) == 1
    assert exif_orientation(jpeg_bytes(image)) == 1


def test_unreadable_bytes_raise_what_the_bad_sample_guard_catches():
    from loadout.data.fast.decode import UNREADABLE

    for data in (b"not an image", jpeg_bytes(Image.new("RGB", (32, 32)))[:200]):
        with pytest.raises(UNREADABLE):
            decode_image_file(data)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """10 classes x 2 photo-like JPEGs at 640 x 480: at the cpu profile's 73 px resize they decode at 1/4 scale."""
    return make_synthetic_imagefolder(tmp_path_factory.mktemp("photos"), train_per_class=2, val_per_class=1,
                                      photo=(640, 480))


def pipeline(root: Path, *extra: str):
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=64", "data.batch_size=4",
                          "trainer.epochs=2", *extra])
    return data_from_config(cfg, DistEnv(), CPU)


def batches(data, epoch: int = 1) -> list[torch.Tensor]:
    data.set_epoch(epoch)
    return [batch.images.clone() for batch in data.train]


@pytest.mark.slow
def test_scaled_decode_keeps_augmentation_a_function_of_seed_epoch_index_and_resume_exact(photos):
    dataset = ImageFolderDataset(photos / "train", min_side=73)
    assert tuple(dataset[0][0].shape) == (3, 120, 160)  # 1/4 scale: the resize still shrinks
    whole = batches(pipeline(photos, "data.num_workers=0", "data.persistent_workers=false"))
    workers = batches(pipeline(photos, "data.num_workers=2"))
    assert len(whole) == 5 and all(torch.equal(a, b) for a, b in zip(whole, workers, strict=True))
    full = batches(pipeline(photos, "data.num_workers=0", "data.persistent_workers=false", "data.scaled_decode=false"))
    assert all(psnr(a, b) >= 30 for a, b in zip(whole, full, strict=True))  # the same crops, the same pixels nearly
    first = pipeline(photos, "data.num_workers=2")
    first.set_epoch(1)
    stream = iter(first.train)
    for _ in range(2):
        next(stream)
    state = first.train.state_dict()
    second = pipeline(photos, "data.num_workers=2")
    second.set_epoch(1)
    second.train.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], batches(second), strict=True))


@pytest.mark.slow
def test_the_sample_cache_fills_from_the_scaled_decode(photos):
    data = pipeline(photos, "data.num_workers=0", "data.persistent_workers=false", "data.cache_bytes=10000000")
    batches(data, epoch=0)
    dataset = data.samples[0]  # what the training workers read
    assert len(dataset.cache) == 20
    scaled = ImageFolderDataset(photos / "train", min_side=73)
    for index in (0, 7, 19):
        assert torch.equal(dataset.cache.slab[index], fit_square(scaled[index][0], 73))


@pytest.mark.slow
def test_packing_photos_decodes_at_the_scale_of_the_packed_size(photos, tmp_path):
    """scripts/pack_dataset.py asks for --size: 640 x 480 photos packed at 73 px decode at 1/4 (160 x 120)."""
    for name, extra in (("scaled", []), ("whole", ["--full-decode"])):
        subprocess.run([sys.executable, "scripts/pack_dataset.py", str(photos), str(tmp_path / name), "--size", "73",
                        *extra], cwd=ROOT, check=True, capture_output=True)
    scaled, whole = PackedDataset(tmp_path / "scaled" / "train"), PackedDataset(tmp_path / "whole" / "train")
    source = ImageFolderDataset(photos / "train", min_side=73)
    for index in (0, 9, 19):
        assert torch.equal(scaled[index][0], fit_square(source[index][0], 73))
        assert psnr(scaled[index][0], whole[index][0]) >= 30
