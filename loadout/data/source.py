"""The contract a dataset (a "source") meets to train with loadout, checked once when the run is built.

A source is a map-style dataset built from the `dataset:` config group with `split="train"` or `"val"`. It must have:

    __len__      the number of samples
    __getitem__  index -> (image, target): the image a PIL image or a uint8 CHW tensor, the target what the task
                 trains on (task=classification: an integer label; segmentation: a uint8 (H, W) mask)
    classes      the class names, the same on both splits: what the task needs (`Task.source_needs`; a task of your
                 own may ask for other names, or none)

and may offer, each for one reason:

    targets      every label as an int array: data.sampler=weighted, and labels without loading an image
    paths        the file of each sample: a bad or stuck sample is named by it in the log
    set_epoch    epoch -> None, told each sample's epoch before it is read: a curriculum

Everything else a run gives every source alike (samples.py): per-sample seeds, the sample cache, the transform, bad
samples skipped, stuck reads named. loadout's own sources offer its loader more (capabilities.py); yours need none.
"""

from __future__ import annotations

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
    """The two methods `isinstance` checks; `classes` and the options are looked up by name (module docstring)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Any, Any]: ...


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
