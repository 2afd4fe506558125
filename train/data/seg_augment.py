"""The segmentation recipe (conf/augment/segmentation.yaml): one geometric draw per sample moves the image and its
mask alike, photometric steps touch the image only.

The pipelines are torchvision.transforms.v2 steps that samples.py calls with (image, tv_tensors.Mask): v2 applies
each geometric step's one draw to both, pads masks with 255 (ignore) and leaves them out of ColorJitter, ToDtype and
Normalize. Masks are resized nearest-neighbour (never antialiased: no class is invented at a border), as
NEAREST_EXACT: it samples the pixel centres the image's bilinear resize samples, where v2's default NEAREST takes
the top-left neighbour and shifts a mask off its image by up to half the scale factor (a 2.5x downscale: 7% of the
pixels of 16-px blocks land on the wrong class; tests/test_segmentation_data.py), through masks.resize_exact (the
same pixels, a fraction of the time). `JointCompose` runs a pair through v2's own steps without v2's per-call
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

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from train.data.geometry import flip_threshold, resized_size
from train.data.masks import IGNORE_INDEX, resize_exact
from train.data.transforms import RANDOM_APPLY_FORWARD, DirectCompose, resize_size, to_float_steps
from train.errors import ConfigError

EXACT = F.InterpolationMode.NEAREST_EXACT


class Resize(v2.Resize):
    """v2.Resize, masks NEAREST_EXACT."""

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            if len(self.size) == 2:  # a fixed (H, W): the fast exact path
                return tv_tensors.wrap(resize_exact(inpt.as_subclass(torch.Tensor), list(self.size)), like=inpt)
            return F.resize(inpt, self.size, interpolation=EXACT, max_size=self.max_size)
        return super().transform(inpt, params)


class RandomResizedCrop(v2.RandomResizedCrop):
    """v2.RandomResizedCrop, masks NEAREST_EXACT."""

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            crop = inpt.as_subclass(torch.Tensor)[params["top"]:params["top"] + params["height"],
                                                  params["left"]:params["left"] + params["width"]]
            return tv_tensors.wrap(resize_exact(crop, list(self.size)), like=inpt)  # F.resized_crop's: NEAREST
        return super().transform(inpt, params)


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


class ScaledCrop(v2.Transform):
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
        height, width = F.get_size(flat_inputs[0])
        shorter = int(torch.randint(self.min_size, self.max_size, ()))  # v2.RandomResize's draw
        scaled = resized_size((height, width), shorter)  # v2's resized size for a shorter side
        top, box_h, out_h, pad_top = _window(scaled[0], self.size, height)
        left, box_w, out_w, pad_left = _window(scaled[1], self.size, width)
        return {"box": (top, left, box_h, box_w), "out": [out_h, out_w],
                "padding": [pad_left, self.size - out_w - pad_left, pad_top, self.size - out_h - pad_top]}

    def transform(self, inpt, params):
        top, left, box_h, box_w = params["box"]
        window = inpt.as_subclass(torch.Tensor)[..., top:top + box_h, left:left + box_w]
        mask = isinstance(inpt, tv_tensors.Mask)
        if mask:
            out = resize_exact(window, params["out"])
        else:  # the window copied channels-innermost first: the resize keeps that layout and runs faster on it
            if window.stride(0) == 1:
                window = window.permute(1, 2, 0).contiguous().permute(2, 0, 1)
            out = F.resize_image(window, params["out"], antialias=True)
        if any(params["padding"]):  # torch's pad: v2's F.pad takes 3-4x as long on the decoder's channels-innermost
            out = torch.nn.functional.pad(out, params["padding"], value=IGNORE_INDEX if mask else 0)
        return tv_tensors.wrap(out, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else out


class JointCompose(DirectCompose):
    """DirectCompose that also runs an (image, Mask) pair step by step: each step's draws once (a random-apply
    step's coin, then `make_params` on the image), then its `transform` on the image and on the mask. The draws, their
    order and the pixels are v2.Compose's; a step with a forward of its own sends the pair through v2 whole."""

    def __init__(self, transforms: list):
        super().__init__(transforms)
        self._pairs_direct = all(type(step).forward in (v2.Transform.forward, RANDOM_APPLY_FORWARD)
                                 for step in transforms)

    def forward(self, *inputs):
        if not self._pairs_direct or len(inputs) != 2 or not isinstance(inputs[1], tv_tensors.Mask):
            return super().forward(*inputs)
        image, mask = inputs[0].as_subclass(torch.Tensor), inputs[1]
        for step in self.transforms:
            if type(step).forward is RANDOM_APPLY_FORWARD and torch.rand(1).item() >= flip_threshold(step.p):
                continue
            params = step.make_params([image])
            image, mask = step.transform(image, params), step.transform(mask, params)
        return image, mask


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
