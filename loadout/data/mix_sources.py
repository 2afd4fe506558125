"""dataset=mix's sources from `dataset.sources`: each entry checked (a `_target_` spec, a weight > 0, an optional
`transform`), built for the split, and its labels mapped onto the union of the sources' class names, the first
source's in its order, then each later source's new names; sources of masks checked for going together
(`check_mask_parts`). Every error is one line naming `dataset.sources.<name>`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig, OmegaConf

from loadout.build import instantiate
from loadout.data.remote.shard_order import shard_window
from loadout.data.source import Source
from loadout.errors import ConfigError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class MixParts:
    """The sources of a mix, in `dataset.sources` order."""

    names: tuple[str, ...]
    weights: np.ndarray
    sources: list[Source]
    transforms: list  # each source's own transform (on its uint8 image, before the run's), or None
    classes: list[str]  # the union of the sources' class names
    label_maps: list[np.ndarray]  # each source's label -> its place in `classes`


def build_parts(sources, split: str) -> MixParts:
    """Every entry of `sources` checked, then each built for `split`, then their classes joined."""
    entries = _entries(sources)
    names = tuple(name for name, _, _, _ in entries)
    built = [_build(name, spec, split) for name, _, spec, _ in entries]
    transforms = [None if spec is None else instantiate(f"dataset.sources.{name}.transform", spec)
                  for name, _, _, spec in entries]
    classes, label_maps = _union_of_classes(names, built)
    return MixParts(names, np.array([weight for _, weight, _, _ in entries]), built, transforms, classes, label_maps)


def _entries(sources) -> list[tuple[str, float, dict, dict | None]]:
    """(name, weight, `_target_` spec, transform spec) of each source, or one line naming what is wrong."""
    if isinstance(sources, DictConfig):
        sources = OmegaConf.to_container(sources, resolve=True)
    if not isinstance(sources, Mapping) or not sources:
        raise ConfigError("dataset.sources: name at least one source, e.g. dataset.sources.photos={_target_: "
                          "loadout.data.datasets.ImageFolderDataset, root: /data/photos, weight: 3} (conf/dataset/"
                          "mix.yaml)")
    entries = []
    for name, entry in sources.items():
        key = f"dataset.sources.{name}"
        if not isinstance(entry, Mapping) or "_target_" not in entry:
            raise ConfigError(f"{key}: needs a _target_ (a dataset class such as loadout.data.datasets."
                              "ImageFolderDataset) and its keys, and a weight")
        spec = dict(entry)
        weight = spec.pop("weight", None)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not np.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{key}.weight={weight!r}: give each source a weight > 0 (its share of an epoch is "
                              "its weight over the sum of the weights)")
        entries.append((str(name), float(weight), spec, spec.pop("transform", None)))
    return entries


def _build(name: str, spec: dict, split: str) -> Source:
    """One source's `split` from its spec; its errors name it."""
    key = f"dataset.sources.{name}"
    try:
        source = instantiate(key, OmegaConf.create(spec), split=split)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(key) else f"{key}: {message}") from err
    if not isinstance(source, Source):
        raise ConfigError(f"{key}._target_={spec['_target_']}: needs `classes`, `__len__` and `__getitem__`: a "
                          "map-style dataset (loadout/data/source.py)")
    if len(source) == 0:
        raise ConfigError(f"{key}: the {split} split is empty")
    return source


def _union_of_classes(names: tuple[str, ...], sources: list[Source]) -> tuple[list[str], list[np.ndarray]]:
    """The union of the sources' class names (the first source's first) and each source's label -> union label."""
    classes: dict[str, int] = {}
    maps = []
    for name, source in zip(names, sources, strict=True):
        own = [str(c) for c in source.classes]
        if len(set(own)) != len(own):
            twice = sorted({c for c in own if own.count(c) > 1})
            raise ConfigError(f"dataset.sources.{name}: class names {twice} appear more than once; labels map by "
                              "name across the sources, so each must be unique")
        new = [c for c in own if c not in classes]
        if classes and new:
            log.info("dataset.sources.%s adds %d classes not in the sources before it: %s", name, len(new),
                     ", ".join(new[:10]) + (" ..." if len(new) > 10 else ""))
        for c in new:
            classes[c] = len(classes)
        maps.append(np.array([classes[c] for c in own], dtype=np.int64))
    return list(classes), maps


def check_mask_parts(names: tuple[str, ...], sources: list[Source], transforms: list, parts: list[int]) -> None:
    """The sources `parts` give masks (check_sources read them, for a task that trains on masks): a mask's values are
    class indices, which a mix cannot map by name, so each must name the first one's classes in its order; and none
    may have a transform of its own (it would move the image without its mask)."""
    first = [str(c) for c in sources[parts[0]].classes] if parts else []
    for part in parts:
        name, own = names[part], [str(c) for c in sources[part].classes]
        if transforms[part] is not None:
            raise ConfigError(f"dataset.sources.{name}.transform: its samples carry masks, and a source's own "
                              "transform changes the image alone: drop it (augment= moves images and masks together)")
        if own != first:
            raise ConfigError(f"dataset.sources.{name}: its classes {short(own)} are not dataset.sources."
                              f"{names[parts[0]]}'s {short(first)}: masks hold class indices, so every source of "
                              "masks must name the same classes in the same order (a VOC folder's classes.txt, the "
                              f"shards' _info.json, dataset.sources.{name}.classes for parquet)")


def short(names: list[str], most: int = 6) -> str:
    """A class list for a one-line error: its first `most` names and how many in all."""
    return f"[{', '.join(names[:most])}{', ...' if len(names) > most else ''}] ({len(names)})"


def pass_window(source: Source, window: int | None) -> int:
    """The shards a sharded source's passes shuffle together (dataset.shuffle_window, or sized from its labels)."""
    starts = getattr(source, "shard_starts", None)
    if starts is None:
        return 1
    window = window if window is not None else getattr(source, "shuffle_window", None)  # the mix's, else its own
    return shard_window(starts, window, getattr(source, "label_spread", None), announce=False)
