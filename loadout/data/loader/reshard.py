"""A mid-epoch resume at another process count: the interrupted epoch's samples not yet trained, split over the new
ranks, each once; later epochs are the new rank count's own.

An epoch's order at N ranks is a function of (seed, epoch, N) alone, so rebuilding the N-rank sampler for every
rank gives each rank's order, and the checkpoint's per-rank batch counts say how far each rank got. What is left,
merged round robin (for DistributedSampler's interleaved split that is the global order after the trained prefix;
for a contiguous split, each old rank's unread part side by side) and each sample kept once (padding repeats
dropped), is dealt to the M new ranks in turn. Every rank must step as often (DDP): where the shares' sizes would
give some rank a batch less, the rest is padded with its own first samples to a multiple of M (at most M - 1
repeats, as DistributedSampler pads), or with data.drop_last cut to one.

A stop inside such an epoch adds a segment: the next resume replays the splits in order. The batch sampler numbers
the rest as the last batches of an M-rank epoch (`Remainder` puts placeholders first, which it skips), so the loop,
the LR plan and the checkpoint count batches as in any epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from torch.utils.data import BatchSampler, Sampler

from loadout.data.remote.fetch_ahead import FetchAhead

RankSampler = Callable[[int, int], Sampler[int]]  # (rank, world_size) -> that rank's training sampler, unwrapped


def rank_orders(make: RankSampler, world_size: int, epoch: int) -> list[list[int]]:
    """Every rank's training order of `epoch` at `world_size` processes."""
    orders = []
    for rank in range(world_size):
        sampler = make(rank, world_size)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        orders.append([int(i) for i in sampler])
    return orders


def deal(left: list[int], world_size: int, batch_size: int, drop_last: bool) -> list[list[int]]:
    """`left` dealt to `world_size` ranks in turn, so that every rank has as many batches of `batch_size`: with
    drop_last cut to a multiple of `world_size`; else padded with its first samples only where the shorter shares
    would have a batch less (as DistributedSampler pads)."""
    if drop_last:
        left = left[:len(left) // world_size * world_size]
    elif len(left) % world_size and len(left) // world_size % batch_size == 0:
        pad = world_size - len(left) % world_size
        left = left + list(itertools.islice(itertools.cycle(left), pad))
    return [left[rank::world_size] for rank in range(world_size)]


def _untrained(orders: list[list[int]], done: list[int], trained: set[int]) -> list[int]:
    """The samples of `orders` past each rank's `done`, round robin, each once and none of `trained` (which grows by
    the samples done)."""
    for order, count in zip(orders, done, strict=True):
        trained.update(order[:count])
    left, seen = [], set(trained)
    for group in itertools.zip_longest(*(order[count:] for order, count in zip(orders, done, strict=True))):
        for index in group:
            if index is not None and index not in seen:
                seen.add(index)
                left.append(index)
    return left


def untrained(make: RankSampler, epoch: int, segments: list[dict], batch_size: int, drop_last: bool) -> list[int]:
    """The samples of `epoch` that `segments` left untrained. Each segment is one process count's part of the epoch,
    `{"world_size", "done": [samples trained, per rank]}`; the first split is the sampler's own, later ones `deal`'s."""
    trained: set[int] = set()
    first = segments[0]
    left = _untrained(rank_orders(make, first["world_size"], epoch), first["done"], trained)
    for segment in segments[1:]:
        left = _untrained(deal(left, segment["world_size"], batch_size, drop_last), segment["done"], trained)
    return left


class Remainder(Sampler[int]):
    """`sampler`'s order, except in `epoch`: `skip` placeholders (the batches the batch sampler skips, so the rest
    is numbered as the last batches of a whole epoch) then `mine`, this rank's share of the untrained samples."""

    def __init__(self, sampler: Sampler[int], epoch: int, mine: list[int], skip: int):
        self.sampler, self.epoch, self.mine, self.skip = sampler, epoch, mine, skip
        self.current = 0

    def set_epoch(self, epoch: int) -> None:
        self.current = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        if self.current != self.epoch:
            return iter(self.sampler)
        return itertools.chain(itertools.repeat(self.mine[0] if self.mine else 0, self.skip), self.mine)


def install(batches, epoch: int, mine: list[int]) -> int:
    """Make the EpochBatchSampler `batches` draw `mine` as the rest of `epoch`; the batch its first batch is numbered
    after (the batches of a whole epoch less those of `mine`)."""
    per_epoch = batches.batches_per_epoch()
    rest = len(BatchSampler(range(len(mine)), batches.batch_size, batches.drop_last))
    if rest > per_epoch:
        raise ValueError(f"{len(mine)} untrained samples make {rest} batches, more than an epoch's {per_epoch}")
    holder = batches.sampler if isinstance(batches.sampler, FetchAhead) else batches  # shards fetched ahead still
    holder.sampler = Remainder(holder.sampler, epoch, mine, (per_epoch - rest) * batches.batch_size)
    return per_epoch - rest
