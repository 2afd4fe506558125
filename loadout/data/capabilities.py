"""What loadout's own sources offer its loader beyond the `Source` contract (source.py): a private protocol between
the two, free to change with them. A source of your own needs none of it; each is probed with `hasattr`.

    decoding sources (datasets.py's ImageFolder, remote/, files/)
    min_side        a settable attribute: decode a JPEG at the smallest DCT scale that still covers the resize
                    (data.scaled_decode sets it)
    read_encoded    index -> (the encoded file, its label): data.decode=device ships the file, and a RandomResizedCrop
                    decodes only its crop (samples.py)
    stored pixels (fast/packed.py, CIFAR-10)
    decoded         True when samples are pixels already: the sample cache has nothing to save
    size            the side of square stored samples: the Resize step is skipped
    read_crops      (indices, tops, lefts, height, width, flips) -> uint8 batch: crop and flip a whole batch at once
                    (transforms.CropFlipPlan draws the boxes)
    shards and row groups (remote/shards.py, remote/parquet.py)
    shard_starts    the first index of each shard: training reads a window of shards at a time (shard_order.py)
    fetch_shard     shard -> None: bring a shard onto this node ahead of its reads (with shard_starts; a thread of
                    the main process calls it for the shards the order reaches next)
    label_spread    () -> how mixed the shards' labels are: sizes that window when shuffle_window is None
    shuffle_window  the window in shards (dataset.shuffle_window); prefetch_shards: the shards fetched ahead
    a mix (mix.py)
    ordered         True: the index order is the training order already; the sampler only splits it over ranks
    parts, part_of  the names of the sources it draws from, and (epoch, indices) -> each index's part: metrics.jsonl
                    counts the samples each part gave an epoch
    sources, read_part  the parts themselves, and (part, sample) -> that part's sample as the mix gives it:
                    check_sources checks each part's first readable sample and names the part
    check_masks     parts -> None: those parts' samples carry masks; raise ConfigError where they cannot go together
"""

from __future__ import annotations

from dataclasses import dataclass

from loadout.data.source import Source


@dataclass(frozen=True)
class Offers:
    """What one source has beyond `__len__` and `__getitem__` (the contract's options and the capabilities above),
    read once when the run is built."""

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
