"""Image files to uint8 CHW tensors, JPEGs decoded at the size training needs.

A 12 MP camera photo trained at 224 px is decoded whole and then shrunk about 14x: nearly all of its decode time
goes into pixels the resize throws away. libjpeg-turbo can decode at 1/2, 1/4 or 1/8 scale in the DCT domain,
skipping most of that work; Pillow's `Image.draft` asks it to. `decode_image_file(data, min_side)` picks the
smallest such scale whose shorter side is still >= `min_side` (the size the transforms resize the shorter side to),
so the resize after it still shrinks, and the result is as sharp as the full decode's. Images that no scale leaves
large enough (ImageNet-sized JPEGs at 224 px, anything not a JPEG) are decoded whole by torchvision, as before.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

JPEG_MAGIC = b"\xff\xd8\xff"
SCALES = (8, 4, 2)  # libjpeg-turbo's power-of-two DCT scalings, largest reduction first


def dct_scale(width: int, height: int, min_side: int) -> int:
    """The largest reduction in SCALES whose decoded shorter side (libjpeg rounds up) is >= min_side; 1 if none."""
    shorter = min(width, height)
    return next((s for s in SCALES if math.ceil(shorter / s) >= min_side), 1)


def decode_image_file(data: bytes, min_side: int | None = None) -> torch.Tensor:
    """A file's bytes as a uint8 RGB image (C, H, W), laid out HWC in memory as the JPEG decoder writes it. With
    `min_side`, a JPEG is decoded at the smallest DCT scale that keeps its shorter side >= min_side."""
    if min_side and data[:3] == JPEG_MAGIC:
        with Image.open(io.BytesIO(data)) as image:
            scale = dct_scale(*image.size, min_side)
            if scale > 1:
                image.draft("RGB", (image.width // scale, image.height // scale))  # Pillow picks `scale` for this
                pixels = np.array(image.convert("RGB"))  # a writable copy for torch
                return torch.from_numpy(pixels).permute(2, 0, 1)
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
