"""The segmentation recipe (conf/augment/segmentation.yaml): one geometric draw per sample moves the image and its
mask alike, photometric steps touch the image only.

The pipelines are torchvision.transforms.v2 steps that samples.py calls with (image, tv_tensors.Mask): v2 applies
each geometric step's one draw to both, pads masks with 255 (ignore) and leaves them out of ColorJitter, ToDtype and
Normalize. Masks are resized nearest-neighbour (never antialiased: no class is invented at a border), as
NEAREST_EXACT: it samples the pixel centres the image's bilinear resize samples, where v2's default NEAREST takes
the top-left neighbour and shifts a mask off its image by up to half the scale factor (a 2.5x downscale: 7% of the
pixels of 16-px blocks land on the wrong class; tests/test_segmentation_data.py). `JointCompose` runs a pair
through v2's own steps without v2's per-call flattening and dispatch (bench/segmentation.py). The training
recipe is pytorch/vision references/segmentation's (`presets.SegmentationPresetTrain`): the shorter side scaled to
a random size around data.resize_size, a data.image_size crop (padded where the scaled image is smaller), a flip.
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

from train.config import ConfigError
from train.data.masks import IGNORE_INDEX
from train.data.transforms import RANDOM_APPLY_FORWARD, DirectCompose, flip_threshold, resize_size, to_float_steps

EXACT = F.InterpolationMode.NEAREST_EXACT


class Resize(v2.Resize):
    """v2.Resize, masks NEAREST_EXACT."""

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            return F.resize(inpt, self.size, interpolation=EXACT, max_size=self.max_size)
        return super().transform(inpt, params)


class RandomResize(v2.RandomResize):
    """v2.RandomResize, masks NEAREST_EXACT."""

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            return F.resize(inpt, params["size"], interpolation=EXACT)
        return super().transform(inpt, params)


class RandomResizedCrop(v2.RandomResizedCrop):
    """v2.RandomResizedCrop, masks NEAREST_EXACT."""

    def transform(self, inpt, params):
        if isinstance(inpt, tv_tensors.Mask):
            crop = F.crop(inpt, params["top"], params["left"], params["height"], params["width"])
            return F.resize(crop, self.size, interpolation=EXACT)  # F.resized_crop's mask path takes NEAREST
        return super().transform(inpt, params)


class PaddedCrop(v2.RandomCrop):
    """v2.RandomCrop(size, pad_if_needed=True): an image smaller than the crop padded with 0, its mask with 255 (ignore)
    first, by torch's pad (v2's F.pad takes 3-4x as long on the decoder's channels-innermost layout)."""

    def __init__(self, size: int):
        super().__init__(size, pad_if_needed=True, fill={tv_tensors.Mask: IGNORE_INDEX, "others": 0})

    def transform(self, inpt, params):
        if params["needs_pad"]:
            left, top, right, bottom = params["padding"]
            fill = IGNORE_INDEX if isinstance(inpt, tv_tensors.Mask) else 0
            padded = torch.nn.functional.pad(inpt.as_subclass(torch.Tensor), [left, right, top, bottom], value=fill)
            inpt = tv_tensors.wrap(padded, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else padded
            params = {**params, "needs_pad": False}
        return super().transform(inpt, params)


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
            steps = [RandomResize(int(self.scale_min * base), int(self.scale_max * base) + 1, antialias=True),
                     PaddedCrop(size)]
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
