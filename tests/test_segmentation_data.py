"""Segmentation's data path: a VOC-layout folder (real JPEG images, real palette-PNG masks) through the real Samples
path and a real DataLoader with worker processes and the shared-memory ring; masks move with their images through
one geometric draw, are a function of (seed, epoch, index), bad ones are skipped and counted."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.io import encode_png
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.ring import build_collate
from loadout.data.masks import decode_mask, resize_exact
from loadout.data.samples import Samples
from loadout.data.seg_augment import RandomResizedCrop, Resize, ScaledCrop, SegmentationRecipe, joint
from loadout.data.voc import VOC_CLASSES, VOCSegmentation
from loadout.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
COLOURS = np.array([(0, 0, 0), (230, 20, 20), (20, 230, 20), (20, 20, 230)], dtype=np.uint8)  # class -> colour


class DataCfg:
    image_size, resize_size, device_transforms = 32, None, True


def block_mask(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Classes 0-3 in 16 x 16 blocks (asymmetric: a flip of the image alone shows), a 255 border row at the top."""
    mask = np.kron(rng.integers(0, 4, size=(height // 16, width // 16)), np.ones((16, 16), dtype=np.int64))
    mask = mask.astype(np.uint8)
    mask[0] = 255
    return mask


def write_voc(root: Path, count: int = 12, size: tuple[int, int] = (48, 80), seed: int = 0) -> Path:
    """A VOC folder whose image colour encodes each pixel's class (COLOURS), all ids in train.txt."""
    rng = np.random.default_rng(seed)
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    ids = [f"s{i:03d}" for i in range(count)]
    for name in ids:
        mask = block_mask(rng, *size)
        Image.fromarray(COLOURS[np.where(mask == 255, 0, mask)]).save(root / "JPEGImages" / f"{name}.jpg", quality=95,
                                                                  subsampling=0)
        png = Image.fromarray(mask, "P")
        png.putpalette([v for i in range(256) for v in (i, 255 - i, i // 2)])
        png.save(root / "SegmentationClass" / f"{name}.png")
    for split in ("train", "val"):
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


@pytest.fixture
def voc(tmp_path) -> Path:
    return write_voc(tmp_path / "voc")


def loader(samples: Samples, keys: list, workers: int = 2, batch_size: int = 4) -> DataLoader:
    plan = LoaderPlan(num_workers=workers, batch_size=batch_size, prefetch_factor=2, pin_memory=False,
                      image_size=DataCfg.image_size, dtype=torch.uint8)
    return DataLoader(samples, sampler=keys, batch_size=batch_size, num_workers=workers,
                      collate_fn=build_collate(plan))


def agreement(images: torch.Tensor, masks: torch.Tensor) -> float:
    """The share of scored mask pixels whose image pixel is nearest their class's colour."""
    distance = ((images.permute(0, 2, 3, 1)[..., None, :].float() - torch.from_numpy(COLOURS).float()) ** 2).sum(-1)
    nearest = distance.argmin(-1)
    scored = masks != 255
    return float((nearest[scored] == masks[scored].long()).float().mean())


@pytest.mark.parametrize("recipe", [SegmentationRecipe(crop="scale", scale_min=0.5, scale_max=2.0),
                                    SegmentationRecipe(crop="resized", scale_min=0.2, scale_max=1.0)])
def test_masks_move_with_their_images_through_crop_scale_and_flip(voc, recipe):
    """Every scored mask pixel's class matches its image pixel's colour after the joint geometry (but where the
    image's bilinear resize blends two blocks), in worker processes; the same check against the mask flipped alone
    fails, so a geometry applied to one side only would show."""
    samples = Samples(VOCSegmentation(voc), recipe.train_transform(DataCfg()), seed=3)
    batches = list(loader(samples, [(epoch, i) for epoch in range(3) for i in range(12)]))
    images = torch.cat([batch.images for batch in batches])
    masks = torch.cat([batch.targets for batch in batches])
    assert images.shape == (36, 3, 32, 32) and images.dtype == torch.uint8
    assert masks.shape == (36, 32, 32) and masks.dtype == torch.uint8
    assert (masks == 255).any()  # the border row (and a small scale's padding) are ignored, never class 0
    assert agreement(images, masks) > 0.99  # NEAREST_EXACT masks: v2's NEAREST gives 0.95 here
    assert agreement(images, masks.flip(-1)) < 0.65


def test_validation_resizes_image_and_mask_to_one_size_with_nearest(voc):
    recipe = SegmentationRecipe()
    samples = Samples(VOCSegmentation(voc, "val"), recipe.val_transform(DataCfg()), seed=3)
    (batch,) = list(loader(samples, list(range(12)), batch_size=12))
    assert batch.images.shape == (12, 3, 32, 32) and batch.targets.shape == (12, 32, 32)
    assert set(batch.targets.unique().tolist()) <= {0, 1, 2, 3, 255}  # NEAREST: no class invented between two
    assert agreement(batch.images, batch.targets) > 0.99  # NEAREST_EXACT: v2's NEAREST gives 0.93 here


def test_same_seed_epoch_and_index_give_the_same_image_and_mask(voc):
    """Whatever the workers and the batch a sample lands in; another epoch draws another geometry."""
    recipe = SegmentationRecipe(color_jitter=0.3)
    samples = Samples(VOCSegmentation(voc), recipe.train_transform(DataCfg()), seed=11)
    keys = [(2, i) for i in range(12)]
    first = list(loader(samples, keys, workers=2, batch_size=4))
    again = list(loader(samples, keys[::-1], workers=1, batch_size=3))
    order = {i: k for k, i in enumerate(range(12))}
    images = torch.cat([b.images for b in first])
    masks = torch.cat([b.targets for b in first])
    again_images = torch.cat([b.images for b in again]).flip(0)
    again_masks = torch.cat([b.targets for b in again]).flip(0)
    assert torch.equal(images, again_images) and torch.equal(masks, again_masks)
    other = torch.cat([b.targets for b in loader(samples, [(3, i) for i in order], workers=0)])
    assert not torch.equal(masks, other)


class FloatCfg(DataCfg):
    device_transforms = False  # ToDtype and Normalize in the pipeline: image only


@pytest.mark.parametrize("cfg", [DataCfg, FloatCfg])
@pytest.mark.parametrize("recipe", [SegmentationRecipe(color_jitter=0.3),
                                    SegmentationRecipe(crop="resized", scale_min=0.2, scale_max=1.0)])
def test_the_plain_pair_path_gives_v2s_pixels_and_draws(voc, recipe, cfg):
    """Samples' path (`joint`: plain tensors, no v2 dispatch) against v2.Compose of the same steps on (Image, Mask),
    seeded alike; the images also against stock v2 steps (Resize, RandomResizedCrop), whose masks would be NEAREST."""
    source = VOCSegmentation(voc)
    for pipeline in (recipe.train_transform(cfg()), recipe.val_transform(cfg())):
        stock = v2.Compose([stock_step(step) for step in pipeline.transforms])
        for index in range(len(source)):
            image, mask = source[index]
            torch.manual_seed(index)
            got = joint(pipeline)(image, mask)
            torch.manual_seed(index)
            want = v2.Compose(pipeline.transforms)(tv_tensors.Image(image), tv_tensors.Mask(mask))
            torch.manual_seed(index)
            stock_image = stock(tv_tensors.Image(image))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[0], stock_image)
            assert got[1].dtype == torch.uint8 and type(got[0]) is torch.Tensor and type(got[1]) is torch.Tensor


def stock_step(step):
    """torchvision's own step where seg_augment subclasses one (its image pixels are the subclass's)."""
    if type(step) is Resize:
        return v2.Resize(step.size, antialias=True)
    if type(step) is RandomResizedCrop:
        return v2.RandomResizedCrop(step.size, scale=step.scale, ratio=step.ratio, antialias=True)
    return step


def test_resize_exact_is_v2s_nearest_exact_pixel_for_pixel():
    """Masks over 256 px (both bytes of the index probe), up- and downscaled, from a strided window (sliced, or
    given as the box of the whole mask)."""
    mask = torch.randint(0, 256, (600, 300), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for height, width in [(1, 1), (7, 300), (600, 13), (333, 64)]:
        top = 5 if height < 600 else 0
        window = mask[top:top + height, :width]
        for size in ([64, 64], [1, 5], [601, 97], [129, 450]):
            expected = F.resize_mask(window, size, interpolation=F.InterpolationMode.NEAREST_EXACT)
            assert torch.equal(resize_exact(window, size), expected)
            assert torch.equal(resize_exact(mask, size, (top, 0, height, width)), expected)


@pytest.mark.parametrize("kind", ["P", "P+transparency", "P 4-bit", "P 1-bit", "L"])
def test_a_mask_png_decodes_to_its_indices_whatever_its_palette_and_bit_depth(tmp_path, kind):
    """The indices PIL reads from the file, never colours: palettes with transparency and packed 1- and 4-bit
    indices included (a decoder that expands them to 8-bit grey would scale them up)."""
    levels = {"P 4-bit": 16, "P 1-bit": 2}.get(kind, 256)
    indices = np.random.default_rng(0).integers(0, min(levels, 21), (24, 40)).astype(np.uint8)
    indices[0] = 255 if levels == 256 else 0
    image = Image.fromarray(indices, "L" if kind == "L" else "P")
    if kind != "L":
        image.putpalette([v for i in range(min(levels, 256)) for v in (i, 255 - i, i // 2)])
    options = {"P+transparency": {"transparency": 0}, "P 4-bit": {"bits": 4}, "P 1-bit": {"bits": 1}}
    image.save(tmp_path / "mask.png", **options.get(kind, {}))
    assert np.array(Image.open(tmp_path / "mask.png")).tolist() == indices.tolist()  # the file holds the indices
    mask = decode_mask((tmp_path / "mask.png").read_bytes())
    assert mask.dtype == torch.uint8 and mask.shape == (24, 40) and mask.tolist() == indices.tolist()


def test_a_damaged_mask_png_is_an_error_naming_it_never_a_dead_process():
    """A flipped byte in the pixel data (where torchvision's decode_png, libpng, would kill the process) or a file cut
    short: a ValueError the loader counts as a bad sample."""
    indices = np.random.default_rng(1).integers(0, 256, (20, 33)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(indices, "L").save(buffer, format="PNG")  # 8-bit: the libpng path
    data = buffer.getvalue()
    assert decode_mask(data).tolist() == indices.tolist()
    at = data.index(b"IDAT") + 8
    for damaged, named in ((data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:], "its IDAT chunk's CRC"),
                           (data[:len(data) // 2], "")):
        with pytest.raises(ValueError, match=f"a damaged PNG: {named}"):
            decode_mask(damaged)


def rewritten_chunk(data: bytes, kind: bytes, payload: bytes) -> bytes:
    """`data` with its first `kind` chunk's payload replaced and a CRC that matches it: damage the CRCs miss."""
    at = data.index(kind) - 4
    end = at + 12 + int.from_bytes(data[at:at + 4], "big")
    chunk = kind + payload
    return data[:at] + len(payload).to_bytes(4, "big") + chunk + zlib.crc32(chunk).to_bytes(4, "big") + data[end:]


def test_damaged_pixel_data_behind_valid_crcs_is_an_error_never_a_dead_process():
    """A mask written damaged (its CRCs computed over the damage): pixel data that does not inflate, or inflates to
    fewer rows than its header says, is a ValueError (libpng could kill the worker on either)."""
    indices = np.random.default_rng(2).integers(0, 21, (30, 17)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(indices, "L").save(buffer, format="PNG")  # 8-bit, unfiltered
    assert decode_mask(buffer.getvalue()).tolist() == indices.tolist()
    data = buffer.getvalue()
    at = data.index(b"IDAT")
    pixels = data[at + 4:at + 4 + int.from_bytes(data[at - 4:at], "big")]
    not_deflate = rewritten_chunk(data, b"IDAT", pixels[:2] + bytes(b ^ 0x5A for b in pixels[2:]))
    with pytest.raises(ValueError, match="a damaged PNG: its pixel data does not inflate"):
        decode_mask(not_deflate)
    ihdr = data[data.index(b"IHDR") + 4:data.index(b"IHDR") + 17]
    taller = rewritten_chunk(data, b"IHDR", ihdr[:4] + (40).to_bytes(4, "big") + ihdr[8:])
    with pytest.raises(ValueError, match="holds 540 bytes, its 17x40 header says 720"):
        decode_mask(taller)


def png(indices: np.ndarray) -> bytes:
    """A palette mask as PIL writes one (8-bit, every row unfiltered; PIL filters L images' rows)."""
    image = Image.fromarray(indices, "P")
    image.putpalette([v for i in range(256) for v in (i, 255 - i, i // 2)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    at = data.index(b"IDAT")
    rows = zlib.decompress(data[at + 4:at + 4 + int.from_bytes(data[at - 4:at], "big")])
    assert data[24] == 8 and not any(rows[::indices.shape[1] + 1]), "PIL filtered a palette mask: nothing tested"
    return data


def test_unfiltered_masks_never_reach_libpng_and_odd_files_are_read_as_libpng_reads_them(monkeypatch):
    """The zlib-ng path alone for an unfiltered mask (libpng, replaced by a callback that fails, is never called);
    pixel data split over several IDAT chunks (one empty) or inflating to more rows than the header's (libpng keeps
    the header's) reads the same; a header claiming more pixels than PIL's bound is a ValueError before anything is
    allocated; a zero width goes to libpng, which refuses it."""
    indices = np.random.default_rng(4).integers(0, 21, (30, 17)).astype(np.uint8)
    data = png(indices)
    at = data.index(b"IDAT")
    pixels = data[at + 4:at + 4 + int.from_bytes(data[at - 4:at], "big")]
    split = rewritten_chunk(data, b"IDAT", pixels[:5])
    end = split.index(b"IEND") - 4
    for payload in (b"", pixels[5:]):
        chunk = b"IDAT" + payload
        split = split[:end] + len(payload).to_bytes(4, "big") + chunk + zlib.crc32(chunk).to_bytes(4, "big") \
            + split[end:]
        end += 12 + len(payload)
    longer = png(np.concatenate([indices, indices[:5]]))
    ihdr = longer[longer.index(b"IHDR") + 4:longer.index(b"IHDR") + 17]
    cut = rewritten_chunk(longer, b"IHDR", ihdr[:4] + (30).to_bytes(4, "big") + ihdr[8:])  # 35 rows stored, 30 said

    def libpng(*args):
        raise AssertionError("an unfiltered mask reached libpng")

    monkeypatch.setattr("loadout.data.masks.decode_image", libpng)
    for each in (data, split, cut):
        assert decode_mask(each).tolist() == indices.tolist()
    monkeypatch.undo()
    huge = rewritten_chunk(data, b"IHDR", (100_000).to_bytes(4, "big") * 2 + ihdr[8:])
    with pytest.raises(ValueError, match="MAX_IMAGE_PIXELS"):
        decode_mask(huge)
    with pytest.raises((ValueError, RuntimeError)):
        decode_mask(rewritten_chunk(data, b"IHDR", bytes(4) + ihdr[4:]))


def test_a_mask_with_filtered_rows_decodes_through_libpng_to_the_same_indices():
    """PIL writes masks unfiltered (inflated rows are the pixels); libpng, writing a grey PNG, filters its rows
    (torchvision's encode_png): those go through libpng's decode, and give the same indices."""
    indices = torch.from_numpy(np.random.default_rng(3).integers(0, 21, (25, 31)).astype(np.uint8))
    indices[:, 10:] = indices[:, :1]  # runs a Sub filter shrinks: libpng's heuristic picks filters for rows
    data = encode_png(indices[None]).numpy().tobytes()
    at = data.index(b"IDAT")
    rows = zlib.decompress(data[at + 4:at + 4 + int.from_bytes(data[at - 4:at], "big")])
    assert any(rows[row * 32] for row in range(25)), "libpng left every row unfiltered: nothing tested"
    assert torch.equal(decode_mask(data), indices)


def test_scaled_crop_takes_the_windows_of_scale_then_crop():
    """Seeded alike, ScaledCrop (resize only the window) and v2.RandomResize -> v2.RandomCrop(pad_if_needed) (resize
    all, then crop) pad the same pixels and agree on the rest but where rounding the window to whole stored pixels
    moves a border by a pixel; another seed's window agrees on about a quarter."""
    rng = np.random.default_rng(0)
    mask = tv_tensors.Mask(torch.from_numpy(np.kron(rng.integers(0, 4, (6, 10)), np.ones((8, 8), dtype=np.int64))
                                            .astype(np.uint8)))
    stock = v2.Compose([v2.RandomResize(16, 97, interpolation=F.InterpolationMode.NEAREST_EXACT),
                        v2.RandomCrop(32, pad_if_needed=True, fill=255)])
    same, other = [], []
    for seed in range(100):
        torch.manual_seed(seed)
        expected = stock(mask)
        torch.manual_seed(seed)
        got = ScaledCrop(16, 97, 32)(mask)
        torch.manual_seed(seed + 1000)
        shifted = ScaledCrop(16, 97, 32)(mask)
        assert torch.equal(got == 255, expected == 255)
        same.append(float((got == expected).float().mean()))
        other.append(float((shifted == expected).float().mean()))
    assert np.mean(same) > 0.93 and min(same) > 0.8 and np.mean(other) < 0.5


def test_a_broken_mask_and_a_mask_of_another_size_are_skipped_and_counted(voc, caplog):
    (voc / "SegmentationClass" / "s002.png").write_bytes(b"not a png")
    Image.fromarray(np.zeros((24, 24), dtype=np.uint8), "L").save(voc / "SegmentationClass" / "s005.png")
    (voc / "SegmentationClass" / "s007.png").unlink()
    damaged = voc / "SegmentationClass" / "s009.png"  # a flipped byte in its pixels (libpng would kill the process)
    data = damaged.read_bytes()
    at = data.index(b"IDAT") + 8
    damaged.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    samples = Samples(VOCSegmentation(voc), SegmentationRecipe().train_transform(DataCfg()), seed=0)
    with caplog.at_level(logging.WARNING):
        batches = list(loader(samples, [(0, i) for i in range(12)], workers=0))
    assert sum(batch.bad for batch in batches) == 4
    assert sum(len(batch) for batch in batches) == 8
    logged = caplog.text
    assert "s002.png" in logged and "s007.png" in logged and "s009.png: a damaged PNG" in logged
    assert "s005.jpg" in logged and "24x24" in logged and "48x80" in logged


def test_an_rgb_mask_is_a_bad_sample_naming_the_mode(voc, caplog):
    Image.new("RGB", (80, 48)).save(voc / "SegmentationClass" / "s001.png")
    samples = Samples(VOCSegmentation(voc), SegmentationRecipe().val_transform(DataCfg()), seed=0)
    with caplog.at_level(logging.WARNING):
        assert samples[1] is None
    assert "s001.png" in caplog.text and "mode RGB" in caplog.text


def test_a_mask_value_naming_no_class_is_a_bad_sample_naming_the_file_and_the_value(voc, caplog):
    """Four classes (classes.txt): a 7 in one mask would be a device-side assert in the loss on CUDA; 255 is not."""
    (voc / "classes.txt").write_text("background\na\nb\nc\n")
    path = voc / "SegmentationClass" / "s004.png"
    with Image.open(path) as png:
        mask = np.array(png)
        palette = png.getpalette()
    mask[20:40, 30:50] = 7  # inside what validation's resize keeps
    png = Image.fromarray(mask, "P")
    png.putpalette(palette)
    png.save(path)
    samples = Samples(VOCSegmentation(voc), SegmentationRecipe().val_transform(DataCfg()), seed=0)
    with caplog.at_level(logging.WARNING):
        assert samples[4] is None
        kept = [samples[i] for i in range(12) if i != 4]
    assert all(sample is not None and sample[1].max() == 255 for sample in kept)  # borders of 255 stay scored out
    (line,) = caplog.text.splitlines()
    assert "s004.jpg" in line and "value 7" in line and "0-3" in line


def test_classes_come_from_classes_txt_or_are_vocs(voc):
    assert VOCSegmentation(voc).classes == list(VOC_CLASSES) and len(VOC_CLASSES) == 21
    (voc / "classes.txt").write_text("background\ncircle\n")
    assert VOCSegmentation(voc).classes == ["background", "circle"]


def test_a_folder_without_the_layout_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.root=.*ImageSets/Segmentation.*make dataset"):
        VOCSegmentation(tmp_path)


def test_recipe_refuses_bad_values_in_one_line():
    with pytest.raises(ConfigError, match="augment.crop"):
        SegmentationRecipe(crop="random")
    with pytest.raises(ConfigError, match="augment.scale_min"):
        SegmentationRecipe(crop="resized", scale_max=2.0)


@pytest.mark.slow
def test_the_synthetic_set_is_deterministic_voc_layout(tmp_path):
    """`make_dataset.py --task segmentation`: the same bytes twice; palette masks of its classes and 255 borders."""
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dataset.py"), "--task", "segmentation",
                        "--out", str(tmp_path / out), "--train-per-class", "6", "--val-per-class", "2"], check=True,
                       capture_output=True)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    source = VOCSegmentation(tmp_path / "a", "val")
    assert len(source) == 2 and source.classes[0] == "background"
    image, mask = source[0]
    assert image.shape[-2:] == mask.shape and mask.dtype == torch.uint8
    assert set(mask.unique().tolist()) <= {*range(len(source.classes)), 255} and (mask == 255).any()
