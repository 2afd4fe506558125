"""The geometry of an augmentation pipeline, recognised in one place: [Resize(shorter side)] -> a crop (RandomCrop
without padding, CenterCrop or RandomResizedCrop) -> [RandomHorizontalFlip] -> the rest. Every fast path reads its
boxes from this description: the packed format's batched crops (transforms.CropFlipPlan), the crop-aware decode
(transforms.ResizedCropFirst) and data.decode=device (`BoxPlan`), each drawing the box the plain per-sample pipeline
would draw, so a run crops the same pixels whichever path it takes. A pipeline it does not recognise takes the plain
path, whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from loadout.data.fast.decode import dct_scale

CROPS = (v2.RandomCrop, v2.CenterCrop, v2.RandomResizedCrop)


# Per-pixel steps that give the same result on a (N, C, H, W) batch as on each image (a CropFlipPlan batches them).
BATCHABLE = (v2.ToDtype, v2.Normalize)


def flip_threshold(p: float) -> float:
    """A RandomApply transform's p as v2 compares it: with a float32 draw, so as float32."""
    return float(torch.tensor(p, dtype=torch.float32))


def check_crop(crop: tuple[int, int], image: tuple[int, int], fix: str = "") -> None:
    """v2.RandomCrop's error for an image smaller than the crop (its own words), with `fix` after them."""
    if image[0] < crop[0] or image[1] < crop[1]:
        raise ValueError(f"Required crop size {tuple(crop)} is larger than input image size {tuple(image)}.{fix}")


def random_crop_offsets(image_h: int, image_w: int, height: int, width: int) -> tuple[int, int]:
    """v2.RandomCrop's two draws from torch's RNG (top, then left, each only where the image is larger)."""
    top = int(torch.randint(0, image_h - height + 1, size=())) if image_h > height else 0
    left = int(torch.randint(0, image_w - width + 1, size=())) if image_w > width else 0
    return top, left


def resized_size(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """(H, W) after v2.Resize(shorter): the shorter side to `shorter`, the longer one scaled and truncated."""
    height, width = size
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


@dataclass(frozen=True)
class Geometry:
    """A pipeline's geometric head and the steps after it (as the pipeline holds them)."""

    resize: int | None  # Resize(shorter side) before the crop, or None
    crop: v2.RandomCrop | v2.CenterCrop | v2.RandomResizedCrop
    flip_p: float  # a RandomHorizontalFlip right after the crop (0: none)
    rest: tuple

    @classmethod
    def of(cls, transform) -> Geometry | None:
        """The geometry of `transform` (a v2.Compose or one step), or None when it starts any other way."""
        steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
        resize = None
        if steps and type(steps[0]) is v2.Resize and len(steps[0].size) == 1 and steps[0].max_size is None:
            resize, steps = steps[0].size[0], steps[1:]
        if not steps or type(steps[0]) not in CROPS:
            return None
        crop, steps = steps[0], steps[1:]
        if type(crop) is v2.RandomCrop and (crop.padding is not None or crop.pad_if_needed):
            return None
        if type(crop) is v2.RandomResizedCrop and resize is not None:
            return None
        flip = 0.0
        if steps and type(steps[0]) is v2.RandomHorizontalFlip:
            flip, steps = float(steps[0].p), steps[1:]
        return cls(resize, crop, flip, tuple(steps))


class BoxPlan:
    """The geometry of a pipeline [Resize] -> RandomCrop | CenterCrop -> [RandomHorizontalFlip], or RandomResizedCrop
    -> [RandomHorizontalFlip]: what data.decode=device can run on the device."""

    def __init__(self, resize: int | None, crop, flip_p: float):
        self.resize, self.crop, self.flip = resize, crop, flip_threshold(flip_p) if flip_p else None

    @classmethod
    def of(cls, transform) -> BoxPlan | None:
        geometry = Geometry.of(transform)
        if geometry is None or geometry.rest:  # the device places the box and flips; nothing else runs there
            return None
        return cls(geometry.resize, geometry.crop, geometry.flip_p)

    def draw(self, stored: tuple[int, int], min_side: int | None, orientation: int = 1) -> tuple[int, ...]:
        """The geometry row of an image stored at `stored` (H, W) with EXIF `orientation`, drawn from torch's RNG as
        the CPU pipeline draws (the caller seeds it)."""
        height, width = stored
        scale = dct_scale(width, height, min_side)
        decoded = (math.ceil(height / scale), math.ceil(width / scale))
        resized = resized_size(decoded, self.resize) if self.resize else decoded
        crop = self.crop
        if type(crop) is v2.RandomResizedCrop:
            params = crop.make_params([torch.empty(()).expand(3, *resized)])  # its draws need the size alone
            box, out = (params["top"], params["left"], params["height"], params["width"]), tuple(crop.size)
        else:
            crop_h, crop_w = crop.size
            check_crop((crop_h, crop_w), resized)
            if type(crop) is v2.RandomCrop:
                top, left = random_crop_offsets(*resized, crop_h, crop_w)
            else:
                top, left = int(round((resized[0] - crop_h) / 2.0)), int(round((resized[1] - crop_w) / 2.0))
            box, out = (top, left, crop_h, crop_w), (crop_h, crop_w)
        flip = self.flip is not None and torch.rand(1).item() < self.flip
        return (*stored, *decoded, *resized, *box, *out, int(flip), int(self.resize is not None), orientation)
