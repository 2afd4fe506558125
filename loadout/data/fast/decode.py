"""Image files to uint8 CHW tensors, JPEGs decoded at the size training needs.

A 12 MP camera photo trained at 224 px is decoded whole and then shrunk about 14x: nearly all of its decode time
goes into pixels the resize throws away. libjpeg-turbo can decode at 1/2, 1/4 or 1/8 scale in the DCT domain,
skipping most of that work. `decode_image_file(data, min_side)` picks the smallest such scale whose shorter side is
still >= `min_side` (the size the transforms resize the shorter side to), so the resize after it still shrinks and
the result is as sharp as the full decode's. JPEGs go through simplejpeg (libjpeg-turbo's TurboJPEG API; bench/decode.py
compares it with torchvision's decoder); what it cannot convert to RGB (CMYK) and other formats go through PIL.

Neither applies EXIF orientation: pixels come as stored (tests/test_decode.py pins it), as torchvision's and timm's
PIL loaders give them, so a model trains on what the usual pipelines (and published ImageNet recipes) feed it, and
the packed format, the sample cache and the DCT-scaled sizes all hold one geometry: the header's. torchcodec, which
data.decode=device uses, turns each JPEG upright by its tag with no switch to stop it; `exif_orientation` reads the
tag so that path can undo the turn (encoded.py) and give a CPU-decoded run's pixels.
"""

from __future__ import annotations

import io
import math
import platform
from collections.abc import Sequence

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

JPEG_MAGIC = b"\xff\xd8\xff"
UNREADABLE = (OSError, ValueError, RuntimeError)  # what decoding a broken file raises (PIL, libjpeg-turbo, torch)
EXIF_ORIENTATION = 0x0112  # the EXIF tag: 1 as stored, 2-8 the mirrorings and quarter turns that display it upright
SCALES = (8, 4, 2)  # the power-of-two DCT scalings; libjpeg's other M/8 factors decode slower than whole


def dct_scale(width: int, height: int, min_side: int | None) -> int:
    """The largest reduction in SCALES whose decoded shorter side (libjpeg rounds up) is >= min_side; 1 if none."""
    shorter = min(width, height)
    return next((s for s in SCALES if min_side and math.ceil(shorter / s) >= min_side), 1)


def decode_image_file(data: bytes, min_side: int | None = None) -> torch.Tensor:
    """A file's bytes as a uint8 RGB image (C, H, W), laid out HWC in memory as the JPEG decoder writes it. With
    `min_side`, a JPEG is decoded at the smallest DCT scale that keeps its shorter side >= min_side."""
    return _decode(data, lambda height, width: dct_scale(width, height, min_side))[0]


def decode_crop(data: bytes, box: tuple[float, float, float, float], out: tuple[int, int],
                interpolation=F.InterpolationMode.BILINEAR, antialias: bool = True) -> torch.Tensor:
    """The `box` (top, left, height, width, in the stored image's pixels) of an image file resized to `out` (H, W),
    as a whole decode + crop + resize gives it, but a JPEG decoded at the largest DCT reduction that keeps the box
    >= `out` (RandomResizedCrop: a small crop of a large photo needs a fraction of its pixels)."""
    image, stored = decode_for_box(data, box, out)
    return crop_resize(image, decoded_box(image, stored, box), out, interpolation, antialias)


def decode_for_box(data: bytes, box: tuple[float, float, float, float],
                   out: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(the image decoded at the largest DCT reduction that keeps `box` >= `out`, the stored (H, W))."""
    height, width = box[2:]
    return _decode(data, lambda stored_h, stored_w: next(
        (s for s in SCALES if round(height / s) >= out[0] and round(width / s) >= out[1]), 1))


def decoded_box(image: torch.Tensor, stored: tuple[int, int],
                box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """`box` (in stored pixels) in the pixels of `image` (C, H, W), decoded at a DCT scale of `stored`."""
    ratio_h, ratio_w = image.shape[-2] / stored[0], image.shape[-1] / stored[1]
    return (round(box[0] * ratio_h), round(box[1] * ratio_w), max(1, round(box[2] * ratio_h)),
            max(1, round(box[3] * ratio_w)))


# torchvision's own test for its native uint8 bilinear resize (v2 resize_image): AVX2 / AVX512 x86, or ARM
NATIVE_UINT8_BILINEAR = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
    or platform.machine() in ("aarch64", "arm64")


def crop_block(image: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
    """`box` (top, left, height, width) of `image` (C, H, W) copied into its own HWC block (C, H, W as a view):
    torchvision's uint8 resize runs its SIMD kernel on a channels-last block as it is, but repacks a strided view
    (or a CHW one) pixel by pixel first, which costs more than the copy (bench/sample_path.py)."""
    top, left, height, width = box
    return image.permute(1, 2, 0)[top:top + height, left:left + width].contiguous().permute(2, 0, 1)


def crop_resize(image: torch.Tensor, box: tuple[int, int, int, int], out: Sequence[int],
                interpolation=F.InterpolationMode.BILINEAR, antialias: bool = True) -> torch.Tensor:
    """F.resized_crop(image, *box, out, ...) for a uint8 (C, H, W) image, the same pixels, through `crop_block`:
    the crop-aware decode and the whole-decode RandomResizedCrop (transforms.py) both crop + resize here. Bilinear
    calls the kernel F.resize would call without its dispatch, a third of the time on a 64 px crop, where F.resize
    resizes uint8 natively (NATIVE_UINT8_BILINEAR; elsewhere it goes through float, so F.resize it is)."""
    block = crop_block(image, box)
    if NATIVE_UINT8_BILINEAR and interpolation == F.InterpolationMode.BILINEAR and list(out) != list(block.shape[-2:]):
        batch = block.permute(1, 2, 0)[None].permute(0, 3, 1, 2)  # a view whose batch stride lets the output stay HWC
        return torch.nn.functional.interpolate(batch, list(out), mode="bilinear", align_corners=False,
                                               antialias=antialias)[0]
    return F.resize(block, list(out), interpolation=interpolation, antialias=antialias)


def _decode(data: bytes, pick_scale) -> tuple[torch.Tensor, tuple[int, int]]:
    """The image (C, H, W; HWC in memory) at the DCT scale `pick_scale(stored_h, stored_w)` picks for a JPEG, whole
    for other formats, and the stored (H, W)."""
    if data[:3] == JPEG_MAGIC:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            scale = pick_scale(height, width)
            # asked for exactly 1/scale's size: TurboJPEG takes the smallest M/8 scaling at least that large, and
            # would otherwise pick a slow one in between (3/8, 5/8)
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(height / scale),
                                            min_width=math.ceil(width / scale))
            return torch.from_numpy(pixels).permute(2, 0, 1), (height, width)
        except ValueError:
            pass  # not decodable to RGB by TurboJPEG (CMYK, damaged): PIL decides
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.array(image.convert("RGB"))  # writable: transforms may write in place
    return torch.from_numpy(pixels).permute(2, 0, 1), pixels.shape[:2]  # HWC in memory, as the JPEG path


def decoded_size(data: bytes, min_side: int | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(stored (H, W), the (H, W) `decode_image_file(data, min_side)` gives) from the header alone."""
    if data[:3] == JPEG_MAGIC:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace not in ("CMYK", "YCCK"):  # those go through PIL, whole
                scale = dct_scale(width, height, min_side)
                return (height, width), (math.ceil(height / scale), math.ceil(width / scale))
        except ValueError:
            pass
    stored = image_size(data)
    return stored, stored


def image_size(data: bytes) -> tuple[int, int]:
    """(H, W) of an encoded image from its header alone (a JPEG's through libjpeg-turbo, others' through PIL)."""
    if data[:3] == JPEG_MAGIC:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return height, width
        except ValueError:
            pass
    with Image.open(io.BytesIO(data)) as image:
        return image.height, image.width


def exif_orientation(data: bytes) -> int:
    """A JPEG's EXIF orientation (2-8), read from its header through PIL as torchcodec reads it; 1 for one as stored,
    without a valid tag, or not a JPEG (torchcodec decodes JPEGs alone)."""
    if data[:3] != JPEG_MAGIC:
        return 1
    try:
        with Image.open(io.BytesIO(data)) as image:
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    except UNREADABLE:
        return 1
    return int(orientation) if orientation in range(1, 9) else 1
