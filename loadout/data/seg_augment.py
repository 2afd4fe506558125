"""The segmentation recipe (conf/augment/segmentation.yaml): one geometric draw per sample moves the image and its
mask alike, photometric steps touch the image only.

The pipelines are torchvision.transforms.v2 steps, each geometric step's one draw applied to the image and its mask
(tv_tensors.Mask to v2), masks padded with 255 (ignore) and left out of ColorJitter, ToDtype and Normalize. Masks
are resized nearest-neighbour (never antialiased: no class is invented at a border), as NEAREST_EXACT: it samples
the pixel centres the image's bilinear resize samples, where v2's default NEAREST takes the top-left neighbour and
shifts a mask off its image by up to half the scale factor (a 2.5x downscale: 7% of the pixels of 16-px blocks land
on the wrong class; tests/test_segmentation_data.py), through masks.resize_exact (the same pixels, a fraction of the
time). samples.py hands a plain (image, mask) pair to `joint(transform)`:
`JointCompose.pair` runs the steps on plain tensors, v2's draws and pixels without its tv_tensors, per-call
flattening and dispatch (bench/segmentation.py). The training recipe is pytorch/vision references/segmentation's
(`presets.SegmentationPresetTrain`): the shorter side scaled to a random size around data.resize_size, a
data.image_size crop (padded where the scaled image is smaller), a flip; `ScaledCrop` draws the crop as that
scale-then-crop does but resizes only the crop's window.
`crop: resized` takes RandomResizedCrop instead (no padding). Validation resizes to image_size x image_size, so a
batch has one size and every pixel of the image is scored. Draws come from torch's RNG, seeded per sample from
(seed, epoch, index) (samples.py), so a resumed run sees the same pixels and masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from loadout.data.fast.decode import crop_resize
from loadout.data.geometry import flip_threshold, resized_size
from loadout.data.masks import IGNORE_INDEX, resize_exact
from loadout.data.transforms import DirectCompose, resize_size, to_float_steps
from loadout.errors import ConfigError

EXACT = F.InterpolationMode.NEAREST_EXACT


class JointGeometry:
    """A geometric step that moves an image and its mask alike: `pair` draws once and moves a plain (image, mask)
    pair (JointCompose); `transform` serves v2's own dispatch (a Mask, an image or a plain tensor). A subclass gives
    `image(image, params)` and `mask(mask, params)` on plain tensors."""

    def pair(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = self.make_params([image])
        return self.image(image, params), self.mask(mask, params)

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            return tv_tensors.wrap(self.mask(inpt.as_subclass(torch.Tensor), params), like=inpt)
        if isinstance(inpt, tv_tensors.Image):
            return tv_tensors.wrap(self.image(inpt.as_subclass(torch.Tensor), params), like=inpt)
        if type(inpt) is torch.Tensor:
            return self.image(inpt, params)
        return super().transform(inpt, params)


class Resize(JointGeometry, v2.Resize):
    """v2.Resize, masks NEAREST_EXACT."""

    def image(self, image: torch.Tensor, params: dict) -> torch.Tensor:
        return F.resize_image(image, self.size, self.interpolation, self.max_size, self.antialias)

    def mask(self, mask: torch.Tensor, params: dict) -> torch.Tensor:
        if len(self.size) == 2:  # a fixed (H, W): the fast exact path
            return resize_exact(mask, list(self.size))
        return F.resize_mask(mask, self.size, interpolation=EXACT, max_size=self.max_size)


class RandomResizedCrop(JointGeometry, v2.RandomResizedCrop):
    """v2.RandomResizedCrop, masks NEAREST_EXACT."""

    def image(self, image: torch.Tensor, params: dict) -> torch.Tensor:
        box = params["top"], params["left"], params["height"], params["width"]
        return crop_resize(image, box, self.size, self.interpolation, self.antialias)

    def mask(self, mask: torch.Tensor, params: dict) -> torch.Tensor:
        box = params["top"], params["left"], params["height"], params["width"]
        return resize_exact(mask, list(self.size), box)


def _window(scaled: int, crop: int, stored: int) -> tuple[int, int, int, int]:
    """One axis of ScaledCrop: the crop's offset in the scaled image drawn as v2.RandomCrop(pad_if_needed) draws it,
    as (source start, source length, output length, padding before)."""
    if scaled >= crop:
        offset = int(torch.randint(0, scaled - crop + 1, ())) if scaled > crop else 0
        length = min(stored, max(1, round(crop * stored / scaled)))
        return min(round(offset * stored / scaled), stored - length), length, crop, 0
    margin = crop - scaled  # v2 pads both sides by the shortfall, then crops: the image lands `margin - offset` in
    offset = int(torch.randint(0, margin + 1, ()))
    return 0, stored, scaled, margin - offset


class ScaledCrop(JointGeometry, v2.Transform):
    """v2.RandomResize(min_size, max_size) then v2.RandomCrop(size, pad_if_needed=True), resizing only the window.

    The same draws in the same order (the scaled shorter side, then the crop's top and left on the scaled size) give
    the same windows; the window is mapped back to the stored image (rounded to whole stored pixels: under half a
    stored pixel of placement) and only it is resized, to at most size x size, where resize-then-crop resizes the
    whole image up to 2x first (up to 4x the pixels; bench/segmentation.py). A scaled image smaller than the crop is
    resized whole and padded as v2 pads it: 0 for the image, 255 (ignore) for the mask. Image and mask take the same
    integer window to the same output size, bilinear and NEAREST_EXACT, so their pixel centres coincide."""

    def __init__(self, min_size: int, max_size: int, size: int):
        super().__init__()
        self.min_size, self.max_size, self.size = min_size, max_size, size

    def make_params(self, flat_inputs: list) -> dict:
        height, width = flat_inputs[0].shape[-2:]  # a tensor's (the pipeline's inputs are)
        shorter = int(torch.randint(self.min_size, self.max_size, ()))  # v2.RandomResize's draw
        scaled = resized_size((height, width), shorter)  # v2's resized size for a shorter side
        top, box_h, out_h, pad_top = _window(scaled[0], self.size, height)
        left, box_w, out_w, pad_left = _window(scaled[1], self.size, width)
        padding = [pad_left, self.size - out_w - pad_left, pad_top, self.size - out_h - pad_top]
        return {"box": (top, left, box_h, box_w), "out": [out_h, out_w], "padding": padding if any(padding) else None}

    def image(self, image: torch.Tensor, params: dict) -> torch.Tensor:
        """The window resized as the classification crops are (decode.crop_resize: copied into a channels-last
        block for the uint8 kernel's vectorised path, HWC in memory, padding too)."""
        out, padding = crop_resize(image, params["box"], params["out"]), params["padding"]
        if padding is None:
            return out
        return torch.nn.functional.pad(out.permute(1, 2, 0), [0, 0, *padding]).permute(2, 0, 1)  # 0, as v2 pads

    def mask(self, mask: torch.Tensor, params: dict) -> torch.Tensor:
        out, padding = resize_exact(mask, params["out"], params["box"]), params["padding"]
        return out if padding is None else torch.nn.functional.pad(out, padding, value=IGNORE_INDEX)


def _flip_pair(step: v2.RandomHorizontalFlip):
    threshold = flip_threshold(step.p)
    return lambda image, mask: (image, mask) if torch.rand(1).item() >= threshold else (image.flip(-1), mask.flip(-1))


def _image_only(direct):
    return lambda image, mask: (direct(image), mask)


def _through_v2(transform, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain (image, mask) pair through a v2 pipeline as (tv_tensors.Image, tv_tensors.Mask), and back."""
    image, mask = transform(image.as_subclass(tv_tensors.Image), mask.as_subclass(tv_tensors.Mask))
    return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)


IMAGE_ONLY = (v2.ColorJitter, v2.Normalize)  # v2 steps that leave a Mask as it is (and ToDtype of one dtype)


class JointCompose(DirectCompose):
    """DirectCompose that also moves an (image, mask) pair: `pair` runs each step on plain tensors, without
    tv_tensors or v2's per-call flattening and dispatch (bench/segmentation.py): a JointGeometry step's one draw
    for both, a flip's coin for both, a photometric step on the image alone (DirectCompose's direct step). The
    draws, their order and the pixels are v2.Compose's on (Image, Mask); a pipeline with any other step goes through
    v2 whole."""

    def __init__(self, transforms: list):
        super().__init__(transforms)
        steps = [_joint_step(step, direct) for step, direct in zip(transforms, self.direct_steps, strict=True)]
        self.pair_steps = None if None in steps else steps

    def pair(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A plain uint8 (C, H, W) image and its (H, W) mask, transformed with one draw per step."""
        if self.pair_steps is None:
            return _through_v2(self, image, mask)  # forward: v2's own
        for step in self.pair_steps:
            image, mask = step(image, mask)
        return image, mask

    def forward(self, *inputs):
        if self.pair_steps is None or len(inputs) != 2 or not isinstance(inputs[1], tv_tensors.Mask):
            return super().forward(*inputs)
        image, mask = self.pair(inputs[0].as_subclass(torch.Tensor), inputs[1].as_subclass(torch.Tensor))
        return tv_tensors.wrap(image, like=inputs[0]), tv_tensors.wrap(mask, like=inputs[1])


def _joint_step(step, direct):
    """`step` as a function of a plain (image, mask) pair, or None where only v2 knows what it does to a mask."""
    if isinstance(step, JointGeometry):
        return step.pair
    if type(step) is v2.RandomHorizontalFlip:
        return _flip_pair(step)
    if type(step) in IMAGE_ONLY or (type(step) is v2.ToDtype and isinstance(step.dtype, torch.dtype)):
        return _image_only(direct)
    return None


def joint(transform):
    """`transform` as a function of a plain (image, mask) pair: JointCompose's `pair`, else v2 on tv_tensors
    (picklable either way: Samples carries it to spawned workers)."""
    if isinstance(transform, JointCompose):
        return transform.pair
    return partial(_through_v2, transform)


@dataclass
class SegmentationRecipe:
    crop: str = "scale"  # scale: RandomResize -> RandomCrop (torchvision's references) | resized: RandomResizedCrop
    scale_min: float = 0.5  # crop=scale: the scaled shorter side's range, in units of data.resize_size
    scale_max: float = 2.0  # (crop=resized: the area fraction's range, scale_max <= 1)
    flip: bool = True
    color_jitter: float = 0.0  # > 0: ColorJitter(brightness, contrast, saturation) of that strength, image only

    def __post_init__(self) -> None:
        if self.crop not in ("scale", "resized"):
            raise ConfigError(f"augment.crop={self.crop!r}: use scale or resized for segmentation")
        if not 0 < self.scale_min <= self.scale_max or (self.crop == "resized" and self.scale_max > 1):
            raise ConfigError(f"augment.scale_min={self.scale_min}, augment.scale_max={self.scale_max}: need 0 < "
                              "scale_min <= scale_max (<= 1 with augment.crop=resized)")
        if self.color_jitter < 0:
            raise ConfigError(f"augment.color_jitter={self.color_jitter}: use 0 (off) or a strength > 0")

    def train_transform(self, data_cfg, input_size: int | None = None) -> JointCompose:
        """The per-sample pipeline for (image, Mask); `input_size` is unused (masks are never stored pre-fitted)."""
        size = data_cfg.image_size
        if self.crop == "resized":
            steps = [RandomResizedCrop(size, scale=(self.scale_min, self.scale_max), antialias=True)]
        else:
            base = resize_size(data_cfg)
            steps = [ScaledCrop(int(self.scale_min * base), int(self.scale_max * base) + 1, size)]
        if self.flip:
            steps.append(v2.RandomHorizontalFlip())
        if self.color_jitter:
            strength = self.color_jitter
            steps.append(v2.ColorJitter(brightness=strength, contrast=strength, saturation=strength))
        return JointCompose([*steps, *to_float_steps(data_cfg)])

    def val_transform(self, data_cfg, input_size: int | None = None) -> JointCompose:
        """Resize to image_size x image_size (masks NEAREST): one size per batch, every pixel scored."""
        size = data_cfg.image_size
        return JointCompose([Resize((size, size), antialias=True), *to_float_steps(data_cfg)])

    def batch_mix(self, num_classes: int, seed: int) -> None:
        """No MixUp / CutMix for masks."""
        return None
