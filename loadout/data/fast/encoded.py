"""data.decode=device: workers ship each sample's encoded bytes and its crop box; the main process decodes the whole
batch on the training device (torchcodec: batched nvJPEG on CUDA, libjpeg-turbo on a CPU) and resizes, crops and
flips it there.

The box is drawn in the worker (samples.py) with the same torch RNG calls the CPU pipeline makes on the image it
would decode (transforms.DirectCompose; the DCT-scaled size where data.scaled_decode applies), from the header
alone: a device-decoded run crops the same boxes as a CPU-decoded one of the same seed, and a resumed run the same
pixels. A file the device decoder refuses (not a JPEG, or one nvJPEG cannot decode) is decoded on the CPU instead and
counted (`Batch.decode_fallbacks`), torchcodec's first reason logged once. A device that refuses the JPEGs of its first
call, one of which the CPU then reads, cannot decode at all (an nvJPEG whose backend cannot start): the run fails in
one line rather than train at a fraction of data.decode=cpu's speed.

torchcodec turns every JPEG upright by its EXIF orientation (a phone photo tagged "rotate 90" comes out W x H), while
the CPU path keeps pixels as stored (decode.py says why) and the boxes are drawn on the stored size. The worker reads
the tag with the header; the decoder undoes the turn before anything else, so both paths crop the same pixels.

The batch is placed in a few calls rather than a few per image (each a kernel launch or more on CUDA): the images of
one size bound for one size go through one resize, the crops of one size (RandomResizedCrop) through another, the
flipped crops through one flip. Device memory stays bounded on camera photos (a 12 MP JPEG is 36 MB decoded): files
are decoded DECODE_GROUP at a time, each full-size image is dropped as soon as its resized copy exists, and a resize
group's float32 copy (F.resize casts uint8 to float on CUDA) stays under RESIZE_GROUP_BYTES.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

from loadout.data.capabilities import Offers
from loadout.data.fast.decode import JPEG_MAGIC, UNREADABLE, decode_image_file
from loadout.data.geometry import BoxPlan
from loadout.data.loader.plan import LoaderPlan
from loadout.errors import ConfigError, first_line
from loadout.runtime.micro_batch import gpu_nearly_full, is_out_of_memory

log = logging.getLogger(__name__)
EMPTY_IMAGES = torch.empty(0, dtype=torch.uint8)  # an encoded batch's images, until the device decodes them

# One sample's geometry, an int64 row: the stored size, the size the CPU path decodes at, the size its Resize gives
# (the decoded size without one), the crop box in those coordinates, the output size, the flip, whether the
# pipeline resizes before it crops, and the file's EXIF orientation (1: none).
STORED_H, STORED_W, DECODED_H, DECODED_W, RESIZED_H, RESIZED_W, TOP, LEFT, CROP_H, CROP_W, OUT_H, OUT_W, FLIP, \
    RESIZES, ORIENTATION = range(15)

RESIZE_GROUP = 32  # images resized in one call at most: larger stacks of full-size images fall out of a CPU's caches
RESIZE_GROUP_BYTES = 256 << 20  # a resize group's float32 copy at most (on CUDA F.resize casts uint8 to float)
DECODE_GROUP = 32  # files decoded, and placed, at a time: nvJPEG's batch is efficient there, and few decodes are alive
SLOT_CAP_BYTES = 256 << 20  # a ring slot of encoded files at most: a loader's ring holds workers x slots of them

# What turns an image torchcodec decoded upright by EXIF orientation 2-8 (as PIL's ImageOps.exif_transpose does)
# back to its stored pixels, on (C, H, W): the inverse of each mirroring or quarter turn.
TO_STORED = {
    2: lambda image: image.flip(-1),
    3: lambda image: image.flip(-2, -1),
    4: lambda image: image.flip(-2),
    5: lambda image: image.transpose(-2, -1),
    6: lambda image: image.rot90(1, (-2, -1)),  # shown turned 90 degrees clockwise: turned back
    7: lambda image: image.flip(-2, -1).transpose(-2, -1),
    8: lambda image: image.rot90(-1, (-2, -1)),
}


@dataclass(frozen=True)
class EncodedSample:
    """What a worker hands over for one sample under data.decode=device."""

    data: bytes
    geometry: tuple[int, ...]


@dataclass
class Encoded:
    """A batch's encoded files back to back in `data` (uint8), file i at offsets[i]:offsets[i + 1], and their
    geometry rows (n, 14)."""

    data: torch.Tensor
    offsets: np.ndarray
    geometry: np.ndarray

    @classmethod
    def join(cls, samples: list[EncodedSample], out: torch.Tensor | None = None) -> Encoded:
        """The samples' bytes concatenated (into `out`, a ring slot, when given)."""
        sizes = [len(sample.data) for sample in samples]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        data = torch.empty(int(offsets[-1]), dtype=torch.uint8) if out is None else out[:int(offsets[-1])]
        view = data.numpy()
        for sample, start, stop in zip(samples, offsets[:-1], offsets[1:], strict=True):
            view[start:stop] = np.frombuffer(sample.data, dtype=np.uint8)
        return cls(data, offsets, np.array([sample.geometry for sample in samples], dtype=np.int64))

    def files(self) -> list[torch.Tensor]:
        return [self.data[start:stop] for start, stop in zip(self.offsets[:-1], self.offsets[1:], strict=True)]


class DeviceDecoder:
    """Encoded batches to uint8 (N, 3, H, W) images on `device`, with the number of files decoded on the CPU and
    the positions of those no decoder could read (their header was whole, the rest not): the caller drops them."""

    def __init__(self, device: torch.device):
        from torchcodec.decoders import decode_jpeg  # checked at build time (config: data.decode)

        self.device, self.decode_jpeg = device, decode_jpeg
        self.decoded = False  # any file decoded on the device yet: until then a refusal may be the device's own
        self.refusal: str | None = None  # torchcodec's first reason for refusing a file

    def __call__(self, encoded: Encoded) -> tuple[torch.Tensor, int, list[int]]:
        files, rows = encoded.files(), encoded.geometry
        placed, fallbacks, unreadable = [], 0, []
        for start in range(0, len(files), DECODE_GROUP):
            group = range(start, min(start + DECODE_GROUP, len(files)))
            jpeg = [j for j, i in enumerate(group) if bytes(files[i][:3].numpy()) == JPEG_MAGIC]
            images = self._on_device([files[i] for i in group], rows[group.start:group.stop], jpeg)
            for j, i in enumerate(group):
                if images[j] is None:  # not a JPEG, or refused: libjpeg-turbo / PIL on the host, whole, as stored
                    try:
                        images[j] = decode_image_file(files[i].numpy().tobytes()).to(self.device)
                    except UNREADABLE as err:
                        log.warning("skipping unreadable sample %d of the batch (decode on the device): %s", i, err)
                        unreadable.append(i)
                        continue
                    fallbacks += 1
                    if not self.decoded and j in jpeg:  # a good JPEG, and the device has decoded none yet
                        raise ConfigError(f"data.decode=device cannot decode on {self.device}: {self.refusal}; "
                                          "use data.decode=cpu")
            kept = [j for j, image in enumerate(images) if image is not None]
            images = [images[j] for j in kept]  # the only reference left: place() drops each once resized
            if images:
                placed.append(place(images, rows[group.start:group.stop][kept]))
        if not placed:
            return EMPTY_IMAGES.to(self.device), fallbacks, unreadable
        return (placed[0] if len(placed) == 1 else torch.cat(placed)), fallbacks, unreadable

    def _on_device(self, files: list[torch.Tensor], rows: np.ndarray, jpeg: list[int]) -> list[torch.Tensor | None]:
        """The files at `jpeg` decoded on the device, as stored; None for the others and those the device refused."""
        if not jpeg:
            return [None] * len(files)
        try:
            decoded = self.decode_jpeg([files[j] for j in jpeg], device=self.device)
        except RuntimeError as err:  # one file the batched decoder refuses fails the batch: each on its own
            raise_if_out_of_memory(err, self.device)
            decoded = [self._one(files[j]) for j in jpeg]
        images: list[torch.Tensor | None] = [None] * len(files)
        for j, image in zip(jpeg, decoded, strict=True):
            if image is not None:
                images[j], self.decoded = as_stored(image, rows[j]), True
        return images

    def _one(self, file: torch.Tensor) -> torch.Tensor | None:
        try:
            return self.decode_jpeg(file, device=self.device)
        except RuntimeError as err:
            raise_if_out_of_memory(err, self.device)
            if self.refusal is None:
                self.refusal = first_line(err)
                log.warning("data.decode=device: torchcodec refused a file on %s (%s); such files are decoded on "
                            "the CPU (decode_fallbacks in metrics.jsonl)", self.device, self.refusal)
            return None


def raise_if_out_of_memory(err: RuntimeError, device: torch.device) -> None:
    """`err` from torchcodec as torch.OutOfMemoryError, the run's out-of-memory failure, where it is one. torchcodec is
    built on torch's stable ABI, which hands an allocation's OutOfMemoryError back as a plain RuntimeError ("... API
    call failed at ..."), and nvJPEG's own failed allocations as a status number: on a nearly full GPU a refusal
    counts as out of memory."""
    if isinstance(err, torch.OutOfMemoryError):
        raise err
    if is_out_of_memory(err) or gpu_nearly_full():
        raise torch.OutOfMemoryError(f"out of memory decoding on {device}: {first_line(err)}") from err


def as_stored(image: torch.Tensor, row: np.ndarray) -> torch.Tensor | None:
    """An image torchcodec decoded (upright by its EXIF orientation) as stored; None where that is not the stored
    size (torchcodec read another tag than PIL did): the host decodes that file instead."""
    orientation = int(row[ORIENTATION])
    image = TO_STORED[orientation](image) if orientation in TO_STORED else image
    return image if tuple(image.shape[-2:]) == (row[STORED_H], row[STORED_W]) else None


def stored_box(row: list[int]) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a row's crop in the image it is cut from: the resized one, or the stored one
    where the CPU path crops a DCT-scaled decode (the same box, scaled to the stored size)."""
    top, left, height, width = row[TOP], row[LEFT], row[CROP_H], row[CROP_W]
    if not row[RESIZES] and (row[DECODED_H], row[DECODED_W]) != (row[STORED_H], row[STORED_W]):
        scale_h, scale_w = row[STORED_H] / row[DECODED_H], row[STORED_W] / row[DECODED_W]
        top, left = round(top * scale_h), round(left * scale_w)
        height, width = round(height * scale_h), round(width * scale_w)
    return top, left, height, width


def resize_group(image: torch.Tensor) -> int:
    """How many images of `image`'s size one resize call takes: RESIZE_GROUP, fewer where their float32 copy would
    pass RESIZE_GROUP_BYTES (one at a time for 12 MP photos, whose float copy is 146 MB)."""
    return max(1, min(RESIZE_GROUP, RESIZE_GROUP_BYTES // (4 * image.numel())))


def resize_in_place(images: list[torch.Tensor], sizes: list[tuple[int, int] | None]) -> None:
    """`images` resized to `sizes` (None: kept), antialiased as the CPU path resizes, each replaced in the list as
    soon as its copy exists (a full-size decode is freed there, when the list held its last reference): the images
    of one size bound for one size stacked and resized in one call, `resize_group` at a time."""
    groups: dict[tuple, list[int]] = {}
    for i, (image, size) in enumerate(zip(images, sizes, strict=True)):
        if size is not None and tuple(image.shape[-2:]) != size:
            groups.setdefault((tuple(image.shape), size), []).append(i)
    for (_, size), members in groups.items():
        step = resize_group(images[members[0]])
        for start in range(0, len(members), step):
            chunk = members[start:start + step]
            stacked = torch.stack([images[i] for i in chunk]) if len(chunk) > 1 else images[chunk[0]][None]
            for i, image in zip(chunk, F.resize(stacked, list(size), antialias=True), strict=True):
                images[i] = image
            del stacked


def flipped_together(images: list[torch.Tensor], flips: list[int]) -> list[torch.Tensor]:
    """`images` with those at `flips` mirrored left-right, stacked and flipped in one call (indexing the batch
    instead would copy the indices to the device and wait for it)."""
    out = list(images)
    if flips:
        for i, image in zip(flips, torch.stack([images[i] for i in flips]).flip(-1), strict=True):
            out[i] = image
    return out


def place(images: list[torch.Tensor], rows: np.ndarray) -> torch.Tensor:
    """Decoded images (stored orientation and size) through their geometry rows as the CPU path transforms each:
    resized, cropped, resized to the output size (RandomResizedCrop), flipped; one uint8 batch (N, 3, OUT_H, OUT_W),
    in a few calls per batch rather than a few per image. `images` is used up: each is replaced by its next stage."""
    rows = rows.tolist()
    resize_in_place(images, [(r[RESIZED_H], r[RESIZED_W]) if r[RESIZES] else None for r in rows])
    for i, row in enumerate(rows):
        top, left, height, width = stored_box(row)
        images[i] = images[i][:, top:top + height, left:left + width]
    resize_in_place(images, [(r[OUT_H], r[OUT_W]) for r in rows])
    batch = torch.stack(flipped_together(images, [i for i, r in enumerate(rows) if r[FLIP]]))
    images.clear()  # crops kept at their size are views of a full-size decode
    return batch


def device_decoding(sources: tuple, transforms: tuple, plan: LoaderPlan, device: torch.device) \
        -> tuple[tuple[BoxPlan, BoxPlan], LoaderPlan, DeviceDecoder]:
    """data.decode=device, checked before any worker starts: each split's BoxPlan, the loader plan with room for a
    batch of encoded files in the ring, and the decoder; what cannot run fails in one line."""
    for source in sources:
        if not Offers.of(source).read_encoded:
            raise ConfigError(f"data.decode=device: {type(source).__name__} offers no `read_encoded` "
                              "(loadout/data/capabilities.py), so it has no encoded files to ship; use data.decode=cpu")
    boxes = tuple(BoxPlan.of(transform) for transform in transforms)
    if None in boxes:
        raise ConfigError("data.decode=device: the device runs [Resize ->] RandomCrop or CenterCrop -> flip, or "
                          "RandomResizedCrop -> flip (augment=crop_flip or imagenet); this recipe has other steps: "
                          "use data.decode=cpu")
    try:
        decoder = DeviceDecoder(device)
    except ImportError as err:
        raise ConfigError(f"data.decode=device needs torchcodec ({first_line(err)}): pip install "
                          "'loadout[device-decode]' (it needs torch >= 2.11), or use data.decode=cpu") from err
    except (OSError, RuntimeError) as err:  # its libraries load against torch's: another CUDA major, another ABI
        cuda = torch.version.cuda or "none"
        raise ConfigError(f"data.decode=device: torchcodec does not load ({first_line(err)}); it needs torch >= 2.11 "
                          f"and a torchcodec built for torch's CUDA major (this torch: CUDA {cuda}), from the index "
                          "torch came from; or use data.decode=cpu") from err
    train = sources[0]
    # the first shard alone where the source is sharded: a remote store is not read wholesale at start
    last = int(train.shard_starts[1]) if Offers.of(train).shard_starts else len(train)
    probe = np.linspace(0, last - 1, num=min(last, 64)).astype(int).tolist()
    sizes = [len(train.read_encoded(index)[0]) for index in probe]
    return boxes, dataclasses.replace(plan, encoded_batch_bytes=slot_bytes(sizes, plan.batch_size)), decoder


def slot_bytes(sizes: list[int], batch_size: int) -> int:
    """A ring slot for a batch of encoded files, from the probed files' `sizes`: 1.5 x a batch of the mean file, at
    least the largest file, at most SLOT_CAP_BYTES (the cap wins). A batch that does not fit takes the plain collate
    (ring.py); room for a batch of the largest file would reserve GBs of /dev/shm per worker on camera photos."""
    return min(SLOT_CAP_BYTES, max(int(1.5 * sum(sizes) / len(sizes) * batch_size), max(sizes)))
