"""Sample transforms with torchvision.transforms.v2: the steps the augmentation recipes (augment.py) compose, the
validation pipeline (Resize -> CenterCrop), and the normalization on the device.

Workers keep images uint8. With data.device_transforms=true the float conversion and Normalize run on the device
(`DeviceNormalize`, used by loadout/data/loader/prefetcher.py), so a quarter of the bytes cross to the GPU; otherwise
they run here in the workers. Inputs that are already square at the resize size (the packed format, the shared sample
cache) skip the Resize step: `fit_square` is the one place that makes them.

The pipelines are `DirectCompose`s: a v2.Compose whose single-tensor path calls each step's own `make_params` and
`transform` directly (RandomCrop, RandomResizedCrop and RandomHorizontalFlip: v2's own draws, then a slice, the
crop-aware decode's crop + resize or a flip), the same RNG draws and pixels as v2 without its per-call input
flattening, checks and dispatch. A source that crops whole batches (`read_crops`, the packed format) gets RandomCrop +
RandomHorizontalFlip as a `CropFlipPlan` instead: the boxes drawn from each sample's 64-bit seed, vectorised.
A pipeline that starts with RandomResizedCrop is split by `ResizedCropFirst` so that samples.py decodes the crop alone
(decode.decode_crop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from loadout.data.fast.decode import crop_resize
from loadout.data.geometry import BATCHABLE, Geometry, check_crop, flip_threshold, random_crop_offsets

# The forward v2's random-apply transforms share (flips, grayscale, solarize, ...): a coin with p, then the transform.
RANDOM_APPLY_FORWARD = v2.RandomVerticalFlip.forward

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _direct(step: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """`step(image)` for one plain tensor without v2's dispatch: the same draws in the same order as its forward
    (a RandomApply transform's coin first, then `make_params`); any other callable is called as it is."""
    if type(step) is v2.RandomCrop and step.padding is None and not step.pad_if_needed:
        return _random_crop(*step.size)
    if type(step) is v2.RandomResizedCrop:
        return _resized_crop(step)
    if type(step) is v2.RandomHorizontalFlip:
        threshold = flip_threshold(step.p)
        return lambda image: image if torch.rand(1).item() >= threshold else image.flip(-1)
    forward = getattr(type(step), "forward", None)
    if forward is v2.Transform.forward:
        return lambda image: step.transform(image, step.make_params([image]))
    if forward is RANDOM_APPLY_FORWARD:
        threshold = flip_threshold(step.p)

        def coin_then_transform(image: torch.Tensor) -> torch.Tensor:
            if torch.rand(1).item() >= threshold:
                return image
            return step.transform(image, step.make_params([image]))
        return coin_then_transform
    return step


def _random_crop(height: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """v2.RandomCrop((height, width)) without padding: its two draws (top, then left, each only where the image is
    larger), its error for a too small image, and its crop (a slice)."""
    def crop(image: torch.Tensor) -> torch.Tensor:
        image_h, image_w = image.shape[-2:]
        check_crop((height, width), (image_h, image_w))
        top, left = random_crop_offsets(image_h, image_w, height, width)
        return image[..., top:top + height, left:left + width]
    return crop


def _resized_crop(step: v2.RandomResizedCrop) -> Callable[[torch.Tensor], torch.Tensor]:
    """v2.RandomResizedCrop: its draws (`make_params`), then for a uint8 (C, H, W) image the crop + resize of the
    crop-aware decode (decode.crop_resize: the same pixels, faster than v2's resize of a strided crop); v2's own for
    anything else."""
    def resized_crop(image: torch.Tensor) -> torch.Tensor:
        params = step.make_params([image])
        if image.dtype != torch.uint8 or image.dim() != 3:
            return step.transform(image, params)
        box = params["top"], params["left"], params["height"], params["width"]
        return crop_resize(image, box, step.size, step.interpolation, step.antialias)
    return resized_crop


class DirectCompose(v2.Compose):
    """v2.Compose; one plain tensor in (a dataset sample) runs the steps directly (`_direct`), anything else
    (tv_tensors, several inputs) goes through v2 as usual.

    Kept because the whole loader measures faster with it on the default path (small images, where v2's per-call
    dispatch is a real share of a sample's cost); on large photos decoding dominates and it is about even
    (bench/compose.py, bench/RESULTS.md)."""

    def __init__(self, transforms: list):
        super().__init__(transforms)
        self.direct_steps = [_direct(step) for step in transforms]  # each step as one plain tensor meets it

    def __reduce__(self):
        """Pickled as its steps (the direct ones are closures, rebuilt on arrival): workers started with
        data.multiprocessing_context=spawn or forkserver get the pipeline by pickle."""
        return type(self), (list(self.transforms),)

    def forward(self, *inputs):
        if len(inputs) != 1 or type(inputs[0]) is not torch.Tensor:
            return super().forward(*inputs)
        image = inputs[0]
        for step in self.direct_steps:
            image = step(image)
        return image


def resize_size(data_cfg) -> int:
    return data_cfg.resize_size or round(data_cfg.image_size * 256 / 224)


def fit_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """Shorter side to `size`, then the centre `size` x `size` square (the packed format and the sample cache)."""
    return F.center_crop(F.resize(image, [size], antialias=True), [size, size])


def resize_steps(data_cfg, input_size: int | None) -> list:
    size = resize_size(data_cfg)
    return [] if input_size == size else [v2.Resize(size, antialias=True)]


def to_float_steps(data_cfg) -> list:
    if data_cfg.device_transforms:
        return []
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def build_val_transform(data_cfg, input_size: int | None = None) -> DirectCompose:
    return DirectCompose([
        *resize_steps(data_cfg, input_size),
        v2.CenterCrop(data_cfg.image_size),
        *to_float_steps(data_cfg),
    ])


CHUNK_BYTES = 256 << 10  # DeviceNormalize's slab a torch thread on a CPU: the fastest of 64 KiB-4 MiB on one thread


class DeviceNormalize:
    """uint8 NCHW -> float32 normalized with MEAN/STD, on whatever device the batch is on.

    A channels_last batch is normalized as rows of pixel lines (N*H rows of W*3 values, the mean and std repeated W
    times): broadcasting a (1, 3, 1, 1) mean over NHWC memory leaves an innermost loop of 3 values, which does not
    vectorize (3.4x the CPU time a batch here). On a CPU the rows go a cache-sized slab (CHUNK_BYTES of floats a
    thread) at a time: cast, subtract and divide while the slab is in cache, where three passes over the whole batch
    each went out to memory (half the CPU time). Each value goes through the same float ops either way, so the result
    is bit for bit the same. Mean and std are built on the host once and copied to the device at the first call, on
    the stream that call runs on (the prefetcher's copy stream), so every later read on that stream is ordered after
    the copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host = (torch.tensor(MEAN).view(1, 3, 1, 1) * 255, torch.tensor(STD).view(1, 3, 1, 1) * 255)
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # width -> the mean and std of a pixel line

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self._on_device is None:
            self._on_device = tuple(t.to(images.device) for t in self._host)
        mean, std = self._on_device
        if images.dtype == torch.uint8 and images.dim() == 4 and not images.is_contiguous() and \
                images.is_contiguous(memory_format=torch.channels_last):
            n, c, h, w = images.shape
            if w not in self._rows:
                self._rows[w] = (mean.view(c).repeat(w), std.view(c).repeat(w))
            line_mean, line_std = self._rows[w]
            lines = images.permute(0, 2, 3, 1).reshape(n * h, w * c)  # a view of the NHWC memory
            if images.device.type != "cpu":
                return torch.sub(lines, line_mean).div_(line_std).view(n, h, w, c).permute(0, 3, 1, 2)
            out = torch.empty(lines.shape, dtype=torch.float32)
            step = max(1, CHUNK_BYTES * torch.get_num_threads() // (4 * w * c))  # a slab a thread
            for start in range(0, n * h, step):
                slab = out[start:start + step]
                slab.copy_(lines[start:start + step])
                slab.sub_(line_mean).div_(line_std)
            return out.view(n, h, w, c).permute(0, 3, 1, 2)
        return images.float().sub_(mean).div_(std)


@dataclass(frozen=True)
class CropFlipPlan:
    """A pipeline RandomCrop (no padding) -> [RandomHorizontalFlip] -> per-pixel steps, run on whole batches: each
    sample's box and coin taken from bits of its 64-bit seed (seeds.sample_seeds) instead of torch's RNG."""

    height: int
    width: int
    flip_p: float
    rest: tuple

    @classmethod
    def of(cls, transform) -> CropFlipPlan | None:
        """The plan of `transform`, or None when it is any other pipeline."""
        geometry = Geometry.of(transform)
        if geometry is None or geometry.resize is not None or type(geometry.crop) is not v2.RandomCrop \
                or not all(type(step) in BATCHABLE for step in geometry.rest):
            return None
        return cls(*geometry.crop.size, geometry.flip_p, geometry.rest)

    def draws(self, seeds: np.ndarray, side_h: int, side_w: int) -> tuple[list[int], list[int], list[bool]]:
        """(tops, lefts, flips) for images of side_h x side_w: 24 bits each for top and left, 16 for the coin."""
        check_crop((self.height, self.width), (side_h, side_w), " Pack at data.image_size or larger.")
        seeds = np.asarray(seeds, dtype=np.uint64)
        top = ((seeds >> np.uint64(40)) * np.uint64(side_h - self.height + 1)) >> np.uint64(24)
        left = (((seeds >> np.uint64(16)) & np.uint64(0xFFFFFF)) * np.uint64(side_w - self.width + 1)) \
            >> np.uint64(24)
        flip = (seeds & np.uint64(0xFFFF)).astype(np.float64) < self.flip_p * 65536
        return top.tolist(), left.tolist(), flip.tolist()

    def finish(self, batch: torch.Tensor) -> torch.Tensor:
        """The per-pixel steps after the crop, on the whole batch."""
        for step in self.rest:
            batch = step(batch)
        return batch


@dataclass(frozen=True)
class ResizedCropFirst:
    """A v2.Compose whose first step is RandomResizedCrop, split so the crop can be decoded alone
    (decode.decode_crop): its box drawn from the image's size (the header's; the RNG draws are the same as on the
    image), then the pipeline's other steps, in order, on the crop."""

    crop: v2.RandomResizedCrop
    rest: tuple

    @classmethod
    def of(cls, transform) -> ResizedCropFirst | None:
        geometry = Geometry.of(transform)
        if not isinstance(transform, v2.Compose) or geometry is None \
                or type(geometry.crop) is not v2.RandomResizedCrop:
            return None
        steps = transform.direct_steps if isinstance(transform, DirectCompose) else transform.transforms
        return cls(transform.transforms[0], tuple(steps[1:]))

    def box(self, size: tuple[int, int]) -> tuple[int, int, int, int]:
        """(top, left, height, width) the crop draws on an image of `size` (H, W)."""
        params = self.crop.make_params([torch.empty(()).expand(3, *size)])  # its draws need the size alone
        return params["top"], params["left"], params["height"], params["width"]

    def finish(self, image: torch.Tensor) -> torch.Tensor:
        for step in self.rest:
            image = step(image)
        return image
