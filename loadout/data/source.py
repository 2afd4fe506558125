"""What a dataset (a "source") must have to train with loadout, and what it may offer; checked once, at build time.

A source is a map-style dataset built from the `dataset:` config group with `split="train"` or `"val"`:

    must have   __len__      the number of samples
                __getitem__  (image, target): a PIL image or a uint8 CHW tensor, and what the task trains on
                             (task=classification: an integer label; segmentation: a uint8 (H, W) mask)
                what the task needs: `Task.source_needs`, the same on both splits (classification and
                segmentation: `classes`, the class names)
    may offer   targets      every label as an int array: data.sampler=weighted, and labels without loading
                paths        the file of each sample: names a bad or stuck sample in the log
                min_side     a settable attribute: decode at the smallest size that still covers the resize
                decoded      True when samples are pixels already (the sample cache has nothing to save)
                size         the side of square stored samples (the Resize step is skipped)
                read_crops   (indices, tops, lefts, height, width, flips) -> uint8 batch: crop and flip a whole
                             batch at once (transforms.CropFlipPlan draws the boxes)
                set_epoch    told each sample's epoch before it is read (curricula)
                read_encoded index -> (the encoded file, its label), for data.decode=device
                shard_starts the first index of each shard: training reads a window of shards at a time
                fetch_shard  shard -> None: bring a shard onto this node ahead of its reads (with shard_starts; a
                             thread of the main process calls it for the shards the order reaches next)
                ordered      True when the source's index order is the training order already (dataset=mix): the
                             sampler only splits it over ranks, in contiguous parts
                parts        names of the sources a mix draws from, with part_of(epoch, indices) -> each index's
                             part: metrics.jsonl counts the samples each part gave an epoch (mix.py)
                read_part    (part, sample) -> that part's sample as the mix gives it (with parts and `sources`,
                             the parts themselves): the first readable sample of each part is checked for the task,
                             and an error names the part
                check_masks  parts -> None: those parts' samples carry masks (with read_part); raise ConfigError
                             where they cannot go together

Everything else a run gives every source alike (samples.py): the per-sample seeds, the sample cache, the transform,
bad samples skipped, stuck reads named.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from loadout.data.fast.decode import UNREADABLE
from loadout.data.masks import as_mask
from loadout.errors import ConfigError, first_line

TRIES = 8  # a source's first samples tried for one that reads: training skips a few unreadable ones (samples.py)


@runtime_checkable
class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Any, int]: ...


@dataclass(frozen=True)
class Offers:
    """What one source offers beyond the `Source` protocol, read once when the run is built."""

    targets: bool
    paths: bool
    min_side: bool
    decoded: bool
    size: int | None
    read_crops: bool
    set_epoch: bool
    read_encoded: bool
    shard_starts: bool
    fetch_shard: bool
    ordered: bool = False
    parts: bool = False

    @classmethod
    def of(cls, source: Source) -> Offers:
        return cls(targets=hasattr(source, "targets"), paths=hasattr(source, "paths"),
                   min_side=hasattr(source, "min_side"), decoded=bool(getattr(source, "decoded", False)),
                   size=getattr(source, "size", None), read_crops=hasattr(source, "read_crops"),
                   set_epoch=hasattr(source, "set_epoch"),
                   read_encoded=hasattr(source, "read_encoded"), shard_starts=hasattr(source, "shard_starts"),
                   fetch_shard=hasattr(source, "shard_starts") and hasattr(source, "fetch_shard"),
                   ordered=bool(getattr(source, "ordered", False)),
                   parts=hasattr(source, "parts") and hasattr(source, "part_of"))


def as_uint8_tensor(image) -> torch.Tensor:
    """A source's image as the data path carries it: uint8 CHW (a PIL image is converted, RGB)."""
    if isinstance(image, Image.Image):
        return F.pil_to_tensor(image.convert("RGB"))
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3:
        raise TypeError(f"a dataset image must be a PIL image or a uint8 CHW tensor, got {type(image).__name__}"
                        f"{tuple(image.shape) if isinstance(image, torch.Tensor) else ''}")
    return image


def sample_name(source: Source, index: int) -> str:
    """A sample as a user finds it: its file where the source keeps paths, else its index."""
    paths = getattr(source, "paths", None)
    if paths is not None:
        path = paths[index]
        return f"{path.decode() if isinstance(path, bytes) else path} (sample {index})"
    return f"sample {index}"


def check_sources(target: str, train: Source, val: Source, task) -> None:
    """The `Source` protocol and what `task` (train/task/) needs on both splits, the same on both, and a first
    readable training sample of (image, target): one line naming `dataset._target_` (a mix: `dataset.sources.<name>`
    for each of its sources) and what is missing, before any worker starts."""
    needs = "".join(f"`{name}` ({doc}), " for name, doc in task.source_needs.items())
    for split, source in (("train", train), ("val", val)):
        if not isinstance(source, Source) or not all(hasattr(source, name) for name in task.source_needs):
            raise ConfigError(f"dataset._target_={target}: the {split} split needs {needs}`__len__` and "
                              f"`__getitem__`: a map-style dataset (loadout/data/source.py)")
        if len(source) == 0:
            raise ConfigError(f"dataset._target_={target}: the {split} split is empty")
    for name in task.source_needs:
        if list(getattr(train, name)) != list(getattr(val, name)):
            raise ConfigError(f"dataset._target_={target}: train and val have different {name}")
    if not hasattr(train, "read_part"):
        check_first(f"dataset._target_={target}", train, train.__getitem__, "dataset[{}]", task)
        return
    # a mix (mix.py): each of its sources by name; read_part says an unreadable sample as an OSError (MixReadError),
    # and its other errors are about what the sample is
    masks = [part for part, name in enumerate(train.parts)
             if check_first(f"dataset.sources.{name}", train.sources[part], partial(train.read_part, part),
                            "its sample {}", task, unreadable=OSError)]
    if masks:  # after every target check: a task that trains on masks, and sources of masks that must go together
        for source in (train, val):
            source.check_masks(masks)


def check_first(key: str, source: Source, read, what: str, task, unreadable=UNREADABLE) -> bool:
    """The first sample `read` (index -> sample) can read of `source`'s first TRIES, checked for `task`; whether its
    target is a mask. One line naming `key` when none reads or the sample is not what the task trains on."""
    index = 0
    try:
        index, sample = first_readable(key, source, read, unreadable)
        image, target = sample[:2]
        as_uint8_tensor(image)
        task.check_target(target)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{key}: {what.format(index)} must be (image, {task.target_name}) with a PIL image or "
                          f"a uint8 CHW tensor and {task.target_doc} ({err})") from err
    return as_mask(target) is not None


def first_readable(key: str, source: Source, read, unreadable=UNREADABLE) -> tuple[int, Any]:
    """(index, sample) of the first of `source`'s first TRIES samples that `read` reads (training skips an
    unreadable one too); one line naming `key` and the first failure when none does."""
    tries, why = min(TRIES, len(source)), ""
    for index in range(tries):
        try:
            return index, read(index)
        except ConfigError:  # the source's own one line (a shard that cannot be had)
            raise
        except unreadable as err:
            why = why or f"{sample_name(source, index)}: {first_line(err).removeprefix(f'{key}: ')}"
    raise ConfigError(f"{key}: none of its first {tries} samples reads (the first, {why}): a broken file, or the "
                      "dataset's own reading; fix it, or point the root at the images it should hold")
