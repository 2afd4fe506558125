"""dataset=hdf5's layouts: where a split's arrays are in a file and what they hold, found once in the main process
(which then closes the file: workers open their own, per_process.py).

    the split    data.root a file with a group per split (dataset.split_keys: split -> group), or a folder with a
                 file per split (<group>.h5 / .hdf5 / .hdf)
    images       a 1-D variable-length uint8 dataset of encoded files (JPEG, PNG, WebP; h5py's vlen_dtype(uint8)),
                 or uint8 pixels N x H x W x C or N x C x H x W (dataset.channels, or found from the shape; C 1, 3
                 or 4) or N x H x W (grayscale), chunked and compressed as the writer chose
    labels       integers, one a sample (classification)
    masks        uint8 N x H x W class maps, or vlen uint8 PNG files (task=segmentation); used instead of labels
                 where the split has them (dataset.masks=null: never)
    classes      a `classes` dataset (strings) in the split's group or the file's root, or a `classes` attribute
                 of the group, the images or the file; else dataset.class_names; else the label values 0..max
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadout.data.files.hdf5_rows import heap_spans, pixel_offsets
from loadout.errors import ConfigError

SUFFIXES = (".h5", ".hdf5", ".hdf")
CHANNEL_COUNTS = (1, 3, 4)


@dataclass(frozen=True)
class Keys:
    """The settings that name a split's arrays (conf/dataset/hdf5.yaml)."""

    images: str = "images"
    labels: str = "labels"
    masks: str | None = "masks"
    classes: str = "classes"


@dataclass(frozen=True)
class Layout:
    """One split as found: the file, the split's group, and what its arrays hold."""

    path: str
    group: str
    images: str  # the images' path in the file
    encoded: bool  # encoded files (else pixels)
    channels_last: bool  # pixels stored N x H x W x C (else N x C x H x W; N x H x W has one channel)
    shape: tuple[int, ...]  # the images' dataset shape
    labels: np.ndarray | None  # int64, one a sample; None with masks
    masks: str | None  # the masks' path in the file
    masks_encoded: bool
    classes: list[str]
    pixel_offsets: np.ndarray | None  # each image's byte offset, where pixels are stored whole (hdf5_rows.py)
    image_spans: np.ndarray | None  # each encoded image's (offset, length) in the file, where found (hdf5_rows.py)
    mask_spans: np.ndarray | None  # the same for encoded masks

    def __len__(self) -> int:
        return self.shape[0]


def split_file(root: str, split: str, split_keys) -> tuple[Path, str]:
    """(the file, the group) holding `split`: a file's group, or a folder's file at its root."""
    key = split_keys.get(split, split) if split_keys else split
    path = Path(root)
    if path.is_file():
        return path, str(key)
    if path.is_dir():
        for suffix in SUFFIXES:
            if (path / f"{key}{suffix}").is_file():
                return path / f"{key}{suffix}", "/"
        raise ConfigError(f"data.root={root}: no HDF5 file for the {split} split (looked for {key}.h5, {key}.hdf5 "
                          f"and {key}.hdf; dataset.split_keys.{split} names it)")
    raise ConfigError(f"data.root={root} does not exist: point it at an HDF5 file (a group per split) or a folder of "
                      "<split>.h5 files")


def find_layout(f, path: Path, group: str, keys: Keys, channels: str | None,
                class_names: list[str] | int | None) -> Layout:
    """The split's layout in the open h5py file `f`, or one line naming the file, the setting and the keys it has."""
    import h5py

    if group not in f:
        raise ConfigError(f"data.root={path}: no group `{group}` for this split (dataset.split_keys); the file has "
                          f"{listing(f)}")
    node = f[group]
    images = _dataset(node, keys.images, path, group, "images", "the encoded images or their pixels")
    encoded = images.ndim == 1 and _is_bytes(images.dtype, h5py)
    if not encoded and (images.dtype != np.uint8 or images.ndim not in (3, 4)):
        raise ConfigError(f"dataset.images={keys.images}: {path}:{images.name} is {images.dtype} {images.shape}: "
                          "it must hold encoded files (1-D variable-length uint8) or uint8 pixels (N x H x W x C, "
                          "N x C x H x W or N x H x W)")
    last = not encoded and images.ndim == 4 and _channels_last(images.shape, channels, f"{path}:{images.name}")
    masks = node.get(keys.masks) if keys.masks else None
    masks_encoded = False
    if masks is not None:
        masks_encoded = masks.ndim == 1 and _is_bytes(masks.dtype, h5py)
        if not masks_encoded and (masks.dtype != np.uint8 or masks.ndim != 3):
            raise ConfigError(f"dataset.masks={keys.masks}: {path}:{masks.name} is {masks.dtype} {masks.shape}: "
                              "masks are uint8 N x H x W class maps or 1-D variable-length uint8 PNG files "
                              "(dataset.masks=null to leave them out)")
        _same_length(masks, images, path)
        labels = None
    else:
        labels = _labels(_dataset(node, keys.labels, path, group, "labels", "one integer label a sample"), path)
        _same_length(labels, images, path)
    names = _class_names(f, node, images, keys.classes, class_names)
    if names is None and labels is not None:
        names = [str(value) for value in range(int(labels.max()) + 1 if len(labels) else 0)]
    if not names:
        raise ConfigError(f"dataset.class_names: {path} names no classes for its masks: add a `{keys.classes}` "
                          "dataset or attribute, or set dataset.class_names to their names ([background, ...]) or "
                          "their count")
    return Layout(str(path), group, images.name, encoded, last, tuple(images.shape), labels,
                  masks.name if masks is not None else None, masks_encoded, names,
                  None if encoded else pixel_offsets(images), heap_spans(f, images) if encoded else None,
                  heap_spans(f, masks) if masks_encoded else None)


def listing(node) -> str:
    """A group's members in one line: `name (shape) dtype` each, groups as `name/`."""
    import h5py

    parts = [f"{name}/" if isinstance(item, h5py.Group) else f"{name} {item.shape} {item.dtype}"
             for name, item in node.items()]
    return ", ".join(parts) or "nothing"


def _dataset(node, key: str, path: Path, group: str, setting: str, holds: str):
    import h5py

    item = node.get(key)
    if not isinstance(item, h5py.Dataset):
        raise ConfigError(f"dataset.{setting}={key}: {path} has no `{key}` in {group} ({holds}); it has "
                          f"{listing(node)}: set dataset.{setting} to the key that holds them")
    return item


def _is_bytes(dtype, h5py) -> bool:
    """A variable-length uint8 (h5py's vlen_dtype) or bytes dtype: one encoded file a row."""
    base = h5py.check_vlen_dtype(dtype)
    return base == np.uint8 or (h5py.check_string_dtype(dtype) is not None and dtype.kind == "O")


def _channels_last(shape: tuple[int, ...], channels: str | None, where: str) -> bool:
    """Whether N x ? x ? x ? pixels keep their channels last: dataset.channels, or the one axis of 1, 3 or 4."""
    if channels is not None:
        if channels not in ("last", "first"):
            raise ConfigError(f"dataset.channels={channels}: use last (N x H x W x C), first (N x C x H x W) or null "
                              "(found from the shape)")
        return channels == "last"
    last, first = shape[3] in CHANNEL_COUNTS, shape[1] in CHANNEL_COUNTS
    if last == first:
        raise ConfigError(f"dataset.channels=null: {where} is {shape}: set dataset.channels to last (N x H x W x C) "
                          "or first (N x C x H x W)")
    return last


def _labels(labels, path: Path) -> np.ndarray:
    if labels.dtype.kind not in "iu" or labels.ndim not in (1, 2) or (labels.ndim == 2 and labels.shape[1] != 1):
        raise ConfigError(f"dataset.labels: {path}:{labels.name} is {labels.dtype} {labels.shape}: labels are "
                          "integers, one a sample")
    values = labels[()].reshape(-1).astype(np.int64)
    if len(values) and values.min() < 0:
        raise ConfigError(f"dataset.labels: {path}:{labels.name} holds a negative label ({values.min()}): labels "
                          "are class indices from 0")
    return values


def _same_length(array, images, path: Path) -> None:
    if len(array) != images.shape[0]:
        name = getattr(array, "name", "labels")
        raise ConfigError(f"data.root={path}: {name} has {len(array)} entries for {images.shape[0]} images in "
                          f"{images.name}")


def _class_names(f, node, images, key: str, given: list[str] | int | None) -> list[str] | None:
    """dataset.class_names, else the file's `classes` (a dataset, or an attribute), else None."""
    if given is not None:
        return [str(i) for i in range(given)] if isinstance(given, int) else [str(name) for name in given]
    for place in (node, f):
        if key in place and hasattr(place[key], "dtype"):
            return _strings(place[key][()])
    for holder in (node, images, f):
        if key in holder.attrs:
            return _strings(holder.attrs[key])
    return None


def _strings(values) -> list[str]:
    return [value.decode() if isinstance(value, bytes) else str(value) for value in np.atleast_1d(values).tolist()]
