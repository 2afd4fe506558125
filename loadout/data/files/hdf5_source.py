"""dataset=hdf5: one split of an HDF5 file (hdf5_layout.py: the layouts), a source (loadout/data/source.py) like any.

Encoded images are read as the bytes a file would hold (sliced from the mapped file where h5py's default layout lets
hdf5_rows.py find them) and decoded as an ImageFolder's are (DCT-scaled, crop-aware, data.decode=device, the sample
cache): the same work less the file opens. Pixels are read as stored, square ones a
whole training batch at a time (`read_crops`, as the packed format does). The file is opened read-only by each
process on its first read (per_process.py), without HDF5's file locking (a read-only open needs none, and network
file systems often refuse it); the labels are read once, into a numpy array.
"""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np
import torch

from loadout.build import require_extra
from loadout.data.fast.decode import UNREADABLE, decode_image_file
from loadout.data.fast.packed import crop_batch
from loadout.data.files.hdf5_layout import Keys, Layout, find_layout, split_file
from loadout.data.files.hdf5_rows import HeapRows, Rows
from loadout.data.files.per_process import PerProcess
from loadout.data.masks import decode_mask
from loadout.errors import ConfigError, first_line


def hdf5_source(root: str, split: str = "train", split_keys=None, images: str = "images", labels: str = "labels",
                masks: str | None = "masks", classes: str = "classes", class_names: list[str] | int | None = None,
                channels: str | None = None):
    """The `split` of the HDF5 file(s) at `root`: an HDF5Encoded or HDF5Pixels source by what its images hold."""
    h5py = require_extra("h5py", "hdf5", "dataset=hdf5")
    _plugin_filters()
    path, group = split_file(str(root), split, split_keys)
    try:
        with h5py.File(path, "r", locking=False) as f:
            layout = find_layout(f, path, group, Keys(images, labels, masks, classes), channels, class_names)
    except ConfigError:
        raise
    except (OSError, KeyError, ValueError) as err:
        raise ConfigError(f"data.root={root}: cannot read {path} as HDF5 ({first_line(err)})") from err
    return HDF5Encoded(layout) if layout.encoded else HDF5Pixels(layout)


def _plugin_filters() -> None:
    """The compression filters hdf5plugin registers (Blosc, Zstd, LZ4, ...), where it is installed."""
    with contextlib.suppress(ImportError):
        import hdf5plugin  # noqa: F401


class Reader:
    """This process's open file and the rows of its images and masks (hdf5_rows.py)."""

    def __init__(self, layout: Layout):
        import h5py

        _plugin_filters()
        self.file = h5py.File(layout.path, "r", locking=False)
        self.images = Rows(self.file[layout.images]) if layout.image_spans is None else HeapRows(
            layout.path, layout.image_spans)
        if layout.pixel_offsets is not None:
            self.images.mapped(layout.path, layout.pixel_offsets)
        self.masks = None if not layout.masks else Rows(self.file[layout.masks]) if layout.mask_spans is None \
            else HeapRows(layout.path, layout.mask_spans)

    def close(self) -> None:
        self.file.close()


class SampleNames:
    """`names[i]` = `<file>:<images>[i]`: how a bad or stuck sample is named (source.py)."""

    def __init__(self, layout: Layout):
        self.prefix = f"{layout.path}:{layout.images}"

    def __getitem__(self, index: int) -> str:
        return f"{self.prefix}[{index}]"


class HDF5Split:
    """What both kinds share: `classes`, `targets` (not with masks), `paths`, and the arrays of this process."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.classes = layout.classes
        if layout.labels is not None:  # a split of masks has no labels: data.sampler=weighted is refused
            self.targets = layout.labels
        self.paths = SampleNames(layout)
        self.rows = PerProcess(partial(Reader, layout), Reader.close)

    def __len__(self) -> int:
        return len(self.layout)

    def _mask(self, index: int) -> torch.Tensor:
        masks = self.rows.get().masks
        if not self.layout.masks_encoded:
            return torch.from_numpy(masks[index])
        try:
            return decode_mask(masks[index].tobytes())
        except UNREADABLE as err:  # the log line names the image; say it is the mask
            raise OSError(f"its mask ({self.layout.masks}[{index}]): {err}") from err


class HDF5Encoded(HDF5Split):
    """Encoded images: decoded at the size training needs (`min_side`), or whole beside a mask."""

    def __init__(self, layout: Layout):
        super().__init__(layout)
        self.min_side: int | None = None

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The encoded file and its label (-1 with masks): data.decode=device, the crop-aware decode."""
        data = self.rows.get().images[index]
        return data if isinstance(data, bytes) else data.tobytes(), -1 if self.layout.masks else int(
            self.targets[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        data, label = self.read_encoded(index)
        if self.layout.masks is None:
            return decode_image_file(data, self.min_side), label
        return decode_image_file(data), self._mask(index)  # whole: the mask covers the stored size


class HDF5Pixels(HDF5Split):
    """uint8 pixels, as stored: square ones (`size`) cropped a training batch at a time (`read_crops`)."""

    decoded = True  # nothing for the sample cache to save

    def __init__(self, layout: Layout):
        super().__init__(layout)
        height, width = self._side(layout.shape)
        self.size = height if height == width else None  # the Resize step is skipped where it is the resize size
        self._hwc3 = layout.channels_last and layout.shape[-1] == 3  # batches cropped channels-last, as stored

    def _side(self, shape: tuple[int, ...]) -> tuple[int, int]:
        if len(shape) == 3:
            return shape[1], shape[2]
        return (shape[1], shape[2]) if self.layout.channels_last else (shape[2], shape[3])

    def _chw(self, pixels: np.ndarray) -> np.ndarray:
        """One stored image as 3-channel (C, H, W) (a view of channels-last pixels): gray repeated, alpha dropped."""
        if pixels.ndim == 2:
            pixels = pixels[None]
        elif self.layout.channels_last:
            pixels = pixels.transpose(2, 0, 1)
        return np.repeat(pixels, 3, axis=0) if pixels.shape[0] == 1 else pixels[:3]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | int]:
        image = torch.from_numpy(np.array(self._chw(self.rows.get().images[index])))  # its own copy
        if self.layout.masks is None:
            return image, int(self.targets[index])
        return image, self._mask(index)

    def read_crops(self, indices, tops: list[int], lefts: list[int], height: int, width: int,
                   flips: list[bool]) -> torch.Tensor:
        """uint8 (n, 3, height, width): each box cut and mirrored as the packed format's are, the rows read in index
        order (the file reads forwards)."""
        indices = np.asarray(indices, dtype=np.int64)
        row_of, last = self.rows.get().images.at(indices), self._hwc3
        order = np.argsort(indices, kind="stable").tolist()
        return crop_batch(row_of if last else lambda k: self._chw(row_of(k)), order, tops, lefts, height, width, flips,
                          channels_last=last)
