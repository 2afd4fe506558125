"""Crop-aware decoding (augment=imagenet): a sample's RandomResizedCrop decoded alone gives the pixels and boxes of a
whole decode + crop + resize, for the same (seed, epoch, index), through the real Samples path."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from loadout.data.datasets import ImageFolderDataset
from loadout.data.fast.decode import decode_crop, decode_image_file, decoded_size
from loadout.data.geometry import BoxPlan
from loadout.data.samples import Samples
from loadout.data.seeds import sample_seeds
from loadout.data.transforms import ResizedCropFirst
from train.augment import Recipe


class DataCfg:
    image_size, resize_size, device_transforms = 224, None, True


def photo_like(width: int, height: int, seed: int) -> bytes:
    """A JPEG with detail at several scales (smooth colour, edges, grain), quality 90."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    pixels = np.stack([128 + 90 * np.sin(6 * x + c + 5 * y * y) for c in range(3)], axis=-1)
    pixels[(x * 13).astype(int) % 3 == 0] *= 0.6
    pixels += rng.normal(0, 6, size=pixels.shape)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.fixture
def folder(tmp_path):
    """An ImageFolder of ImageNet-size JPEGs, a 12 MP-ish one, a portrait one and a PNG."""
    sizes = [(500, 375), (375, 500), (500, 333), (2400, 1800), (1024, 768)]
    for label in range(2):
        (tmp_path / "train" / f"c{label}").mkdir(parents=True)
        for i, (width, height) in enumerate(sizes):
            (tmp_path / "train" / f"c{label}" / f"{i}.JPEG").write_bytes(photo_like(width, height, 10 * label + i))
    Image.new("RGB", (600, 450), (30, 90, 150)).save(tmp_path / "train" / "c0" / "flat.png")
    return tmp_path


def samples(folder, min_side=256, recipe: Recipe | None = None) -> Samples:
    recipe = recipe or Recipe(crop="resized")
    source = ImageFolderDataset(folder, "train", min_side=min_side)
    return Samples(source, recipe.train_transform(DataCfg()), seed=7)


def whole_decode_then_crop(sample_set: Samples, epoch: int, index: int) -> torch.Tensor:
    """What the pipeline gives on the image decoded whole at the source's DCT scale, seeded as Samples seeds."""
    seed = int(sample_seeds(sample_set.seed, np.array([epoch]), np.array([index]))[0] >> np.uint64(1))
    torch.default_generator.manual_seed(seed)
    image = decode_image_file(sample_set.source.read_encoded(index)[0], sample_set.source.min_side)
    return sample_set.transform(image)


def test_imagenet_recipe_takes_the_crop_aware_path_only_where_decode_is_ours(folder):
    assert samples(folder).crop_first is not None
    assert samples(folder, min_side=None).crop_first is None  # data.scaled_decode=false: decoded whole
    assert samples(folder, recipe=Recipe(crop="random")).crop_first is None  # Resize first: not a crop


def test_same_pixels_as_whole_decode_where_no_smaller_scale_applies(folder):
    """ImageNet-size JPEGs and the PNG: the box needs every pixel, so the crop path gives identical bytes."""
    sample_set = samples(folder)
    for epoch in (0, 3):
        for index, path in enumerate(sample_set.source.paths):
            if b"/0." in path or b"/1." in path or b"/2." in path or path.endswith(b".png"):
                image, _, _ = sample_set.__getitems__([(epoch, index)])[0]
                assert torch.equal(image, whole_decode_then_crop(sample_set, epoch, index)), path


def test_large_photos_match_a_full_decode_within_interpolation_tolerance(folder):
    """Large JPEGs: the box drawn as on the DCT-scaled decode, decoded at the largest scale keeping it >= 224 px,
    against the stored image decoded whole, cropped by the same box and resized."""
    sample_set = samples(folder)
    crop_first = sample_set.crop_first
    checked = 0
    for index, path in enumerate(sample_set.source.paths):
        if not (b"/3." in path or b"/4." in path):
            continue
        for epoch in range(4):
            image, _, _ = sample_set.__getitems__([(epoch, index)])[0]
            data = sample_set.source.read_encoded(index)[0]
            full = decode_image_file(data)
            scaled = decode_image_file(data, 256)
            seed = int(sample_seeds(7, np.array([epoch]), np.array([index]))[0] >> np.uint64(1))
            torch.default_generator.manual_seed(seed)
            top, left, height, width = crop_first.box(tuple(scaled.shape[-2:]))
            flip = torch.rand(1).item() < 0.5  # the flip's coin, drawn after the box as the pipeline draws it
            ratio = full.shape[-1] / scaled.shape[-1]
            box = [round(v * ratio) for v in (top, left, height, width)]
            reference = v2.functional.resized_crop(full, *box, [224, 224], antialias=True)
            reference = reference.flip(-1) if flip else reference
            assert image.shape == (3, 224, 224)
            assert (image.float() - reference.float()).abs().mean() < 4, (path, epoch)
            checked += 1
    assert checked == 16


def test_boxes_are_those_the_device_path_draws(folder):
    """data.decode=device draws its boxes with BoxPlan from the header: the same (seed, epoch, index) crops the same
    box here, so a run can switch paths or resume on either."""
    sample_set = samples(folder)
    plan = BoxPlan.of(sample_set.transform)
    for index in range(len(sample_set)):
        data = sample_set.source.read_encoded(index)[0]
        torch.default_generator.manual_seed(index)
        row = plan.draw(Image.open(io.BytesIO(data)).size[::-1], 256)
        torch.default_generator.manual_seed(index)
        assert sample_set.crop_first.box(decoded_size(data, 256)[1]) == tuple(row[6:10])


def test_decode_crop_scales_by_the_box_not_the_image():
    data = photo_like(1600, 1200, 3)
    full = decode_image_file(data)
    small_box = decode_crop(data, (100.0, 200.0, 300.0, 300.0), (224, 224))  # needs every pixel: scale 1
    assert torch.equal(small_box, v2.functional.resized_crop(full, 100, 200, 300, 300, [224, 224], antialias=True))
    big_box = decode_crop(data, (0.0, 0.0, 1200.0, 1600.0), (224, 224))  # 1/4 keeps 300 x 400 >= 224
    reference = v2.functional.resize(full, [224, 224], antialias=True)
    assert (big_box.float() - reference.float()).abs().mean() < 3
    # HWC in memory, as the decoder writes it: the batch is then stacked channels_last, a row copy (loader/batch.py)
    assert small_box.stride() == (1, 224 * 3, 3) and big_box.stride() == (1, 224 * 3, 3)


def test_split_keeps_the_steps_after_the_crop():
    recipe = Recipe(crop="resized", auto_augment="trivial")
    split = ResizedCropFirst.of(recipe.train_transform(DataCfg()))
    assert split is not None and len(split.rest) == 2  # flip, then TrivialAugmentWide


def test_whole_decode_resized_crop_gives_v2s_draws_and_pixels(folder):
    """data.scaled_decode=false (decoded whole): the pipeline's RandomResizedCrop crops + resizes as the crop-aware
    decode does (decode.crop_resize, the box's rows copied into a block), the same pixels and draws as a plain v2
    crop + resize, on the decoder's HWC rows and on CHW-contiguous or float images alike."""
    sample_set = samples(folder, min_side=None)
    assert sample_set.crop_first is None
    plain = v2.Compose(list(sample_set.transform.transforms))  # v2's own steps: F.resized_crop on a strided crop
    decoded = [decode_image_file(sample_set.source.read_encoded(i)[0]) for i in range(len(sample_set))]
    images = [*decoded, decoded[0].contiguous(), torch.randint(0, 256, (1, 300, 400), dtype=torch.uint8),
              decoded[1].float() / 255]
    for seed, image in enumerate(images):
        torch.manual_seed(seed)
        expected, next_draw = plain(image), torch.rand(1)
        torch.manual_seed(seed)
        assert torch.equal(sample_set.transform(image), expected) and torch.equal(torch.rand(1), next_draw), seed
    for index in range(len(sample_set)):  # and through Samples, as a worker runs it
        image, _, _ = sample_set.__getitems__([(2, index)])[0]
        seed = int(sample_seeds(7, np.array([2]), np.array([index]))[0] >> np.uint64(1))
        torch.default_generator.manual_seed(seed)
        assert torch.equal(image, plain(decoded[index])), index
