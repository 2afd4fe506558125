"""Segmentation masks as the data path carries them: uint8 (H, W) class maps, 255 = ignore (Pascal VOC's border).

A mask file is a PNG (no other format) of class indices: mode P (VOC's palette PNGs: the palette only colours the
indices, so the indices are read as they are, never converted to RGB) or L. Every source that gives masks
(dataset=voc, shards, parquet, the packed format) reads them here; samples.py checks each against its image's
size.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F
from zlib_ng import zlib_ng

from loadout.data.geometry import resized_size

try:  # libpng keeps palette indices at about half PIL's cost; deprecated in torchvision 0.29 for TorchCodec, whose
    from torchvision.io import ImageReadMode, decode_image  # decoders expand palettes to RGB: PIL where it is gone
except ImportError:  # pragma: no cover
    decode_image = None

IGNORE_INDEX = 255  # the value a mask gives pixels no class is scored on (borders, "difficult" regions)
MASK_MODES = ("P", "L")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHUNK_HEAD, CRC = struct.Struct(">I4s"), struct.Struct(">I")  # a PNG chunk's length and type; its CRC
IHDR_LENGTH = (13).to_bytes(4, "big")


def decode_mask(data: bytes) -> torch.Tensor:
    """A PNG mask's bytes as a uint8 (H, W) class map; ValueError for a mode that holds no class indices (RGB) and
    for a damaged file. An 8-bit palette or grayscale PNG (IHDR bit depth 8, colour type 3 or 0) has its chunks'
    CRCs checked (`checked_pixel_data`), then its rows are inflated by zlib-ng (`unfiltered`) or, where a row is
    filtered or the image interlaced, decoded by libpng (torchvision's decode_image, unchanged: the palette
    indices); 1-4-bit indices (which libpng stretches to 0-255) and anything else go through PIL."""
    if decode_image is not None and len(data) > 28 and data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" \
            and data[24] == 8 and data[25] in (0, 3):
        pixels = checked_pixel_data(data)
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        if data[8:12] == IHDR_LENGTH and data[26:29] == b"\0\0\0" and width and height:  # deflate, no interlace
            mask = unfiltered(pixels, height, width)
            if mask is not None:
                return mask
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.UNCHANGED)[0]
    with Image.open(io.BytesIO(data), formats=("PNG",)) as image:  # PNG alone: probing formats costs more than it
        if image.mode not in MASK_MODES:
            raise ValueError(f"a mask must be a palette (P) or grayscale (L) PNG of class indices, not mode "
                             f"{image.mode}")
        return torch.from_numpy(np.array(image, dtype=np.uint8))


def unfiltered(pixels: bytes, height: int, width: int) -> torch.Tensor | None:
    """The (height, width) one-byte pixels of a non-interlaced PNG's joined IDAT data, or None when a row is
    filtered (libpng then undoes the filters). PIL writes palette images unfiltered, as libpng advises for them, so
    a mask's rows are its inflated bytes less each row's filter-type byte: libpng and libspng inflate with zlib,
    ~80 % of their 148 us for a 320 px mask, which zlib-ng inflates in ~7 (bench/RESULTS.md). Pixel data that does
    not inflate to the header's size is a damaged file (ValueError), where libpng could kill the process; a header
    over PIL's pixel bound too (its pixels are never allocated)."""
    if Image.MAX_IMAGE_PIXELS and height * width > Image.MAX_IMAGE_PIXELS:  # PIL's bound: a header can claim GBs
        raise ValueError(f"a {width}x{height} mask: over PIL's Image.MAX_IMAGE_PIXELS ({Image.MAX_IMAGE_PIXELS})")
    size = height * (width + 1)
    try:  # at most the header's bytes: a stream that inflates to more is cut there, as libpng cuts it
        raw = zlib_ng.decompressobj().decompress(pixels, size)
    except zlib_ng.error as err:
        raise ValueError(f"a damaged PNG: its pixel data does not inflate ({err})") from err
    if len(raw) < size:
        raise ValueError(f"a damaged PNG: its pixel data holds {len(raw)} bytes, its {width}x{height} header "
                         f"says {size}")
    if raw[::width + 1].count(0) != height:  # each row's filter-type byte (bytes.count: ~10x numpy's any here)
        return None
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).reshape(height, width + 1)[:, 1:].copy())


def checked_pixel_data(data: bytes) -> bytes:
    """A PNG's pixel data (its IDAT chunks joined); ValueError unless every chunk, up to IEND, has the CRC it was
    written with. torchvision 0.29's PNG decode kills the process (a segfault inside libpng's error path) on damaged
    pixel data, where a worker should skip the sample; the format's own CRCs catch a damaged or cut-short file first
    (one without its IEND too, which PIL would read), at ~2 us a mask. A file written damaged with valid CRCs and
    filtered rows can still crash its worker in libpng: the loader then fails the run in one line, never hangs."""
    pos, pixels, view = len(PNG_SIGNATURE), [], memoryview(data)
    while pos + 12 <= len(data):
        length, kind = CHUNK_HEAD.unpack_from(data, pos)
        end = pos + 8 + length
        if end + 4 > len(data):
            raise ValueError(f"a damaged PNG: cut short inside its {ascii(kind)[2:-1]} chunk")
        if zlib.crc32(view[pos + 4:end]) != CRC.unpack_from(data, end)[0]:
            raise ValueError(f"a damaged PNG: its {ascii(kind)[2:-1]} chunk's CRC does not match its data")
        if kind == b"IEND":
            return b"".join(pixels)
        if kind == b"IDAT":
            pixels.append(view[pos + 8:end])
        pos = end + 4
    raise ValueError("a damaged PNG: it ends before its IEND chunk")


def as_mask(target) -> torch.Tensor | None:
    """A sample's target as a uint8 (H, W) mask (a tensor, a numpy array or a PIL P/L image), or None when it is a
    label (an int): one rule for what counts as a mask."""
    if isinstance(target, Image.Image):
        if target.mode not in MASK_MODES:
            raise ValueError(f"a mask must be a P or L image of class indices, not mode {target.mode}")
        target = np.array(target, dtype=np.uint8)
    if isinstance(target, np.ndarray) and target.ndim == 2:
        target = torch.from_numpy(np.ascontiguousarray(target))
    if isinstance(target, torch.Tensor) and target.dim() == 2:
        if target.dtype != torch.uint8:
            raise ValueError(f"a mask must be uint8 class indices (255 = ignore), got {target.dtype}")
        return target
    return None


def check_mask_size(image: torch.Tensor, mask: torch.Tensor) -> None:
    """ValueError (a bad sample) when the mask does not cover the image pixel for pixel."""
    if tuple(mask.shape) != tuple(image.shape[-2:]):
        raise ValueError(f"its mask is {mask.shape[0]}x{mask.shape[1]} but its image {image.shape[-2]}x"
                         f"{image.shape[-1]} (H x W): a mask must match its image's stored size")


def stray_value(mask: torch.Tensor, num_classes: int) -> str | None:
    """What is wrong with a mask holding a value that is neither a class index nor 255, else None: such a value
    reaching the loss on CUDA is a device-side assert, which leaves the process unable to run anything more."""
    stray = (mask != IGNORE_INDEX) & (mask >= num_classes)
    if not stray.any():
        return None
    return (f"its mask has value {int(mask[stray].max())}, neither a class index (0-{num_classes - 1}: the source "
            f"names {num_classes} classes) nor {IGNORE_INDEX} (ignore)")


@functools.lru_cache(maxsize=4096)
def _exact_sources(length: int, out: int) -> np.ndarray:
    """The source index of each of `out` outputs along an axis of `length`, as torch's NEAREST_EXACT kernel picks it
    (asked of the kernel itself: a ramp of indices, high and low byte, resized; its float rounding is its own)."""
    ramp = torch.arange(length)
    probe = torch.stack([ramp // 256, ramp % 256]).to(torch.uint8)[:, :, None]
    picked = F.resize_image(probe, [out, 1], interpolation=F.InterpolationMode.NEAREST_EXACT).long()
    return (picked[0, :, 0] * 256 + picked[1, :, 0]).numpy()


def fit_mask_square(mask: torch.Tensor, size: int) -> torch.Tensor:
    """transforms.fit_square for a mask: the shorter side to `size` (NEAREST_EXACT), then the centre square."""
    scaled = resize_exact(mask, list(resized_size(tuple(mask.shape), size)))
    return F.center_crop(scaled[None], [size, size])[0].contiguous()


def resize_exact(mask: torch.Tensor, size: list[int], box: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """v2's NEAREST_EXACT resize of an (H, W) mask, or of its window `box` (top, left, height, width), to `size`
    (H, W), pixel for pixel, as two numpy takes of cached indices: ~5x faster than the interpolate kernel on one
    channel (tests/test_segmentation_data.py checks both)."""
    pixels = mask.numpy()
    if box is not None:  # a numpy slice: a few times cheaper than a torch one
        top, left, height, width = box
        pixels = pixels[top:top + height, left:left + width]
    rows, cols = _exact_sources(pixels.shape[0], size[0]), _exact_sources(pixels.shape[1], size[1])
    return torch.from_numpy(pixels.take(rows, axis=0).take(cols, axis=1))
