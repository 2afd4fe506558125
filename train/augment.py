"""Augmentation recipes (conf/augment/*.yaml): what each training sample goes through in the workers, and the
optional MixUp / CutMix of whole batches on the device.

Every draw is a function of (seed, epoch, index): the per-sample steps draw from the sample's seeded RNG
(samples.py), the batch mix from a generator seeded by (seed, epoch, batch). Samples stay uint8 to the device
(data.device_transforms). Validation keeps Resize -> CenterCrop (transforms.build_val_transform) whatever the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from loadout.data.seeds import BATCH_MIX, mixed_seed
from loadout.data.transforms import DirectCompose, build_val_transform, resize_steps, to_float_steps
from loadout.errors import ConfigError

AUTO_AUGMENT = {"trivial": v2.TrivialAugmentWide, "randaugment": v2.RandAugment}


@dataclass
class Recipe:
    crop: str = "random"  # random: Resize -> RandomCrop (augment=crop_flip) | resized: RandomResizedCrop (ImageNet)
    scale_min: float = 0.08  # RandomResizedCrop's smallest area fraction
    flip: bool = True
    auto_augment: str | None = None  # null | trivial (TrivialAugmentWide) | randaugment
    mixup_alpha: float = 0.0  # > 0: MixUp on the device with Beta(alpha, alpha)
    cutmix_alpha: float = 0.0  # > 0: CutMix on the device (with MixUp too: one of the two per batch)

    def __post_init__(self) -> None:
        if self.crop not in ("random", "resized"):
            raise ConfigError(f"augment.crop={self.crop!r}: use random or resized")
        if self.auto_augment is not None and self.auto_augment not in AUTO_AUGMENT:
            raise ConfigError(f"augment.auto_augment={self.auto_augment!r}: use null, {' or '.join(AUTO_AUGMENT)}")
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0 or not 0 < self.scale_min <= 1:
            raise ConfigError("augment.mixup_alpha and augment.cutmix_alpha must be >= 0, augment.scale_min in (0, 1]")

    def train_transform(self, data_cfg, input_size: int | None = None) -> DirectCompose:
        """The per-sample pipeline; `input_size`: the side of inputs already square (packed, cached)."""
        if self.crop == "resized":
            steps = [v2.RandomResizedCrop(data_cfg.image_size, scale=(self.scale_min, 1.0), antialias=True)]
        else:
            steps = [*resize_steps(data_cfg, input_size), v2.RandomCrop(data_cfg.image_size)]
        if self.flip:
            steps.append(v2.RandomHorizontalFlip())
        if self.auto_augment is not None:
            steps.append(AUTO_AUGMENT[self.auto_augment]())
        return DirectCompose([*steps, *to_float_steps(data_cfg)])

    def val_transform(self, data_cfg, input_size: int | None = None) -> DirectCompose:
        """Resize -> CenterCrop, whatever the recipe."""
        return build_val_transform(data_cfg, input_size)

    def batch_mix(self, num_classes: int, seed: int) -> BatchMix | None:
        if not (self.mixup_alpha or self.cutmix_alpha):
            return None
        return BatchMix(num_classes, seed, self.mixup_alpha, self.cutmix_alpha)


class BatchMix:
    """torchvision's MixUp / CutMix on a device batch, their draws seeded by (seed, epoch, batch in epoch); the
    targets come back as class probabilities, which CrossEntropyLoss takes as they are. Classification's batch mix
    (train/task/classification.py builds it through `Recipe.batch_mix`); other tasks refuse the alphas."""

    def __init__(self, num_classes: int, seed: int, mixup_alpha: float, cutmix_alpha: float):
        mixes = [mix(alpha=alpha, num_classes=num_classes)
                 for mix, alpha in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if alpha > 0]
        self.mix = mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
        self.seed = seed

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, epoch: int, batch: int):
        channels_last = images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last)
        # Their draws come from the CPU's default generator, seeded here and restored after: torch.manual_seed would
        # also reseed every GPU's generator, alike on every rank (equal dropout masks) and tied to the batch number.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(mixed_seed(self.seed, BATCH_MIX, epoch, batch))
            images, targets = self.mix(images, targets)
        if channels_last:  # the mix returns NCHW; the model was given channels_last
            images = images.contiguous(memory_format=torch.channels_last)
        return images, targets
