"""The one path every sample takes, from any source: seed -> note the read -> load (or cache) -> transform -> skip a
bad sample.

The DataLoader hands `Samples.__getitems__` a whole batch of keys: `(epoch, index)` from the training stream
(stream.py), plain indices from the validation sampler. For each sample:
1. seed: torch's CPU generator is seeded from (seed, epoch, index) alone (seeds.py), so the same sample gets the same
   crop and flip whatever the workers, ranks and restarts; transforms must draw from torch's RNG (torchvision's do);
2. note the read: a worker writes (pid, index, start) on the ActivityBoard, so a read that never returns is named
   when data.timeout fires (activity.py);
3. load: `source[index]` as a uint8 CHW tensor and its target, or from the shared sample cache (cache.py); a target
   that is a mask (masks.py: uint8 (H, W), 255 = ignore) must match the image's size, else the sample is bad;
4. transform: the recipe's per-sample pipeline (augment.py, transforms.py); an image with a mask goes through it as
   a pair, so one geometric draw moves both (seg_augment.py: `joint`); a transformed mask with a value that names
   none of the source's `classes` and is not 255 makes the sample bad (on CUDA the loss would assert);
   a pipeline that starts with RandomResizedCrop, on a source that decodes with decode.py (it has `min_side`, set
   by data.scaled_decode) and offers `read_encoded`, takes 3-4 crop first: the box drawn from the header on the
   size the source would decode at (the same draws, so the same boxes as a whole decode and as data.decode=device),
   then only what the crop needs decoded (decode.decode_crop), then the pipeline's other steps;
5. skip a bad sample: an unreadable one becomes None (counted by the collate) or, with data.on_bad_sample=raise,
   an error naming its file; the samples of a shard that cannot be had are one log line, not one each.
A source that crops whole batches (`read_crops`, the packed format) takes steps 3-4 a batch at a time when the
pipeline is a CropFlipPlan, its boxes drawn from the same seeds; if that batch read fails, its samples go one by
one, so the bad one is found and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from loadout.data.capabilities import Offers
from loadout.data.fast.cache import SharedSampleCache
from loadout.data.fast.decode import UNREADABLE, decode_crop, decoded_size, exif_orientation, image_size
from loadout.data.fast.encoded import EncodedSample
from loadout.data.geometry import BoxPlan
from loadout.data.loader.activity import ActivityBoard
from loadout.data.loader.batch import WholeBatch
from loadout.data.loader.stages import AUGMENT, CLOCK, DECODE, READ
from loadout.data.loader.workers import one_torch_thread
from loadout.data.masks import as_mask, check_mask_size, stray_value
from loadout.data.remote.shard_store import ShardError
from loadout.data.seeds import sample_seeds
from loadout.data.seg_augment import joint
from loadout.data.source import Source, as_uint8_tensor, sample_name
from loadout.data.transforms import CropFlipPlan, ResizedCropFirst
from loadout.errors import LoaderError

log = logging.getLogger(__name__)

Transform = Callable[[torch.Tensor], torch.Tensor]


class BadSampleError(LoaderError):
    """An unreadable sample under data.on_bad_sample=raise."""


@contextmanager
def main_process_data_work() -> Iterator[None]:
    """num_workers=0: load samples in the main process as a DataLoader worker would, on one torch intra-op thread
    (workers get `torch.set_num_threads(1)`: per-sample work gains nothing from more, and the idle ones spin), and
    without touching the main process's RNG."""
    with one_torch_thread(), torch.random.fork_rng(devices=[]):
        yield


def split_keys(keys: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(epochs, indices) of a batch of `(epoch, index)` keys, or of plain indices (epoch 0)."""
    array = np.asarray(keys, dtype=np.int64)
    if array.ndim == 1:
        return np.zeros_like(array), array
    return array[:, 0], array[:, 1]


class Samples(Dataset):
    """`source`'s samples ready for a batch: `(image, target, index)` each (the target an int label or a uint8
    (H, W) mask), or None for an unreadable one.

    `board` and `first_slot`: the ActivityBoard rows this loader's workers write (`first_slot` + worker id)."""

    def __init__(self, source: Source, transform: Transform, *, seed: int, on_bad_sample: str = "warn",
                 cache: SharedSampleCache | None = None, board: ActivityBoard | None = None, first_slot: int = 0,
                 encoded: BoxPlan | None = None):
        self.source, self.transform, self.seed, self.encoded = source, transform, seed, encoded
        self.joint = joint(transform)  # the transform of an (image, mask) pair
        self.on_bad_sample, self.cache, self.board, self.first_slot = on_bad_sample, cache, board, first_slot
        self.offers = Offers.of(source)
        classes = getattr(source, "classes", None)
        self.num_classes = None if classes is None else len(classes)  # what a mask's values may index
        batched = self.offers.read_crops and self.offers.size and self.offers.targets
        plan = CropFlipPlan.of(transform) if batched else None
        self.crops = plan if plan is not None and cache is None and encoded is None else None
        decodes_here = self.offers.read_encoded and getattr(source, "min_side", None) is not None
        self.crop_first = ResizedCropFirst.of(transform) if decodes_here and cache is None and encoded is None \
            else None
        self._told: set[str] = set()  # the shards (or stores) whose loss this process has logged

    def __len__(self) -> int:
        return len(self.source)

    @property
    def targets(self):
        """The source's labels where it offers them (samplers read them), else None."""
        return self.source.targets if self.offers.targets else None

    @property
    def shard_starts(self):
        """The first index of each of the source's shards where it has them (the sampler reads them), else None."""
        return self.source.shard_starts if self.offers.shard_starts else None

    @property
    def fetch_shard(self):
        """The source's `fetch_shard` where it has one (the sampler fetches ahead with it), else None."""
        return self.source.fetch_shard if self.offers.fetch_shard else None

    @property
    def label_spread(self):
        """The source's `label_spread` where it has one (the shard order sizes its window by it), else None."""
        return getattr(self.source, "label_spread", None)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence) -> Sequence:
        """The samples of one batch of keys (the DataLoader calls this with each batch)."""
        epochs, indices = split_keys(keys)
        seeds = sample_seeds(self.seed, epochs, indices)
        info = get_worker_info()
        slot = None if info is None or self.board is None else self.first_slot + info.id
        with main_process_data_work() if info is None else nullcontext():
            if self.crops is not None:
                batch = self._crop_batch(indices, seeds, slot)
                if batch is not None:
                    return batch
            return [self._sample(epoch, index, seed, slot) for epoch, index, seed in
                    zip(epochs.tolist(), indices.tolist(), (seeds >> np.uint64(1)).tolist(), strict=True)]

    def _sample(self, epoch: int, index: int, seed: int, slot: int | None):
        if self.offers.set_epoch:  # curricula see each sample's own epoch
            self.source.set_epoch(epoch)
        torch.default_generator.manual_seed(seed)  # the CPU generator only: torch.manual_seed queues a CUDA reseed
        if slot is not None:
            self.board.note(slot, index)
        CLOCK.start()  # stages.py: where this sample's time goes
        try:
            if self.encoded is not None:  # data.decode=device: the file and its box, decoded on the device
                return (*self._encoded(index), index)
            if self.crop_first is not None:  # the crop decoded alone, then the rest of the pipeline
                image, label = self._crop(index)
                CLOCK.lap(DECODE)
                image = self.crop_first.finish(image)
                CLOCK.lap(AUGMENT)
                return image, label_of(label), index
            image, target = self._load(index) if self.cache is None else self.cache.fetch(index, self._load)
            CLOCK.split(READ, DECODE)  # one source call reads and decodes: its CPU time is the decode
        except UNREADABLE as err:
            return self._bad(index, err)
        finally:
            if slot is not None:
                self.board.clear(slot)
        image, target = self._transformed(image, target)
        CLOCK.lap(AUGMENT)
        if self.num_classes is not None and isinstance(target, torch.Tensor) and target.dim() == 2:  # a mask
            stray = stray_value(target, self.num_classes)
            if stray is not None:
                return self._bad(index, ValueError(stray))
        return image, target, index

    def _transformed(self, image: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The transform of an image and its label, or of an image and its mask together (one geometric draw)."""
        if isinstance(target, torch.Tensor) and target.dim() == 2:  # a mask (`_load` made it one)
            return self.joint(image, target)
        return self.transform(image), label_of(target)

    def _encoded(self, index: int) -> tuple[EncodedSample, int]:
        """The encoded file with the box the transform would draw on the image the CPU path decodes (as stored: the
        EXIF orientation rides along for the device decoder to undo), and its label."""
        data, label = self.source.read_encoded(index)
        CLOCK.lap(READ)
        box = self.encoded.draw(image_size(data), getattr(self.source, "min_side", None), exif_orientation(data))
        return EncodedSample(data, box), label_of(label)

    def _crop(self, index: int) -> tuple[torch.Tensor, int]:
        """The RandomResizedCrop of a sample, its box drawn on the size the source decodes at (DCT-scaled), mapped
        to the stored image, decoded at the scale that box needs."""
        data, label = self.source.read_encoded(index)
        CLOCK.lap(READ)
        crop = self.crop_first.crop
        return decode_crop(data, self.stored_box(data), tuple(crop.size), crop.interpolation, crop.antialias), label

    def stored_box(self, data: bytes) -> tuple[float, float, float, float]:
        """The crop's (top, left, height, width) drawn from torch's RNG on the size the source decodes `data` at,
        in the stored image's pixels (bench/sample_path.py times the draw alone)."""
        (height, width), decoded = decoded_size(data, self.source.min_side)
        top, left, box_h, box_w = self.crop_first.box(decoded)
        ratio_h, ratio_w = height / decoded[0], width / decoded[1]
        return top * ratio_h, left * ratio_w, box_h * ratio_h, box_w * ratio_w

    def _load(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        image, target = self.source[index][:2]
        image, mask = as_uint8_tensor(image), as_mask(target)
        if mask is None:
            return image, target
        check_mask_size(image, mask)
        return image, mask

    def _crop_batch(self, indices: np.ndarray, seeds: np.ndarray, slot: int | None) -> WholeBatch | None:
        """The whole batch through the source's `read_crops`; None when that read fails (then one by one)."""
        plan, size = self.crops, self.offers.size
        tops, lefts, flips = plan.draws(seeds, size, size)
        if slot is not None:
            self.board.note(slot, int(indices[0]))
        CLOCK.start()
        try:
            images = self.source.read_crops(indices, tops, lefts, plan.height, plan.width, flips)
            CLOCK.split(READ, AUGMENT)  # stored pixels: waiting is the read, the CPU crops and flips
        except UNREADABLE:
            return None
        finally:
            if slot is not None:
                self.board.clear(slot)
        labels = np.asarray(self.source.targets[indices], dtype=np.int64)
        return WholeBatch(plan.finish(images), torch.from_numpy(labels),
                          torch.from_numpy(np.ascontiguousarray(indices)))

    def _bad(self, index: int, err: BaseException) -> None:
        where = sample_name(self.source, index)
        if self.on_bad_sample == "raise":
            raise BadSampleError(f"cannot read {where}: {err} (data.on_bad_sample=warn skips such samples)") from err
        if isinstance(err, ShardError):  # the whole shard cannot be had: one line for its samples, not one each
            if err.about not in self._told:
                self._told.add(err.about)
                log.warning("skipping the samples of a shard: %s (each counted in bad_samples)", err)
            return None
        log.warning("skipping unreadable sample %s: %s", where, err)
        return None


def label_of(target):
    """A sample's non-mask target: an integer label (a Python or numpy int, a 0-d tensor) as an int, which the
    collate stacks to int64; any other target (a float to regress, a vector of tags) as the source gave it."""
    if isinstance(target, torch.Tensor) and target.dim() == 0:
        target = target.item()
    return int(target) if isinstance(target, int | np.integer) else target
