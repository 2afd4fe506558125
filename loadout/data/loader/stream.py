"""The training batches of every epoch from one long-lived loader iterator, so workers never idle at an epoch end.

A stock loader starts each epoch by handing the workers new indices and waiting for a whole batch: the first
batch of every epoch is slow, however persistent the workers. Here one batch sampler spans all epochs (as timm's
MultiEpochsDataLoader does), so while the loop finishes epoch e and runs validation the workers already decode
epoch e+1. Each index travels with its epoch, `(epoch, index)`: the inner sampler's `set_epoch` (DistributedSampler)
runs in the main process as that epoch's indices are drawn, and the worker-side dataset sees the right epoch for
every sample even while the main process is still in the previous one (a shared "current epoch" value would be
wrong for exactly the samples prefetched across the boundary).

The loader is torchdata's StatefulDataLoader and its `state_dict()` is what a checkpoint keeps. The batch sampler
follows torchdata's Stateful protocol: its state is the (epoch, batch) position after the last batch its iterator
handed out, which the loader records as each batch's indices go to a worker. The loader's state taken right after
a batch comes out of it is therefore that batch's position, however many batches the workers still hold; the
stream takes it there, before the device prefetcher draws a batch ahead, and keeps the state of the last batch the
loop received. Resuming at (epoch, batch) draws the same order and, with per-sample seeding (samples.py), the
same pixels. Resuming mid-epoch at another process count draws this rank's share of the epoch's untrained samples
instead (reshard.py, through positions.py's `LoaderPositions`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from loadout.data.loader.batch import Batch
from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.reshard import RankSampler
from loadout.data.loader.ring import build_collate
from loadout.data.loader.samplers import build_sampler, rank_sampler
from loadout.data.loader.stages import HANDOFF, MainStages, StageTimes, TimedCollate
from loadout.data.loader.stateful import forget_loaded_state, shutdown_workers, stateful_loader
from loadout.data.seeds import loader_seed
from loadout.dist import DistEnv

log = logging.getLogger(__name__)


def _with_position(loader: StatefulDataLoader, stateful: bool, main: MainStages | None = None) -> Iterator[Batch]:
    """The loader's batches, each with the loader's state as of that batch (the workers' prefetch excluded); with
    workers, the main thread's CPU time receiving each is `main`'s hand-off (waiting for a worker costs none).

    A function of the loader, not a TrainStream method: the stream holds this generator, which must not hold the
    stream back (a reference cycle leaves the workers to the garbage collector, see `shutdown_workers`)."""
    iterator = iter(loader)
    timed = main is not None and loader.num_workers > 0
    while True:
        cpu = time.thread_time_ns() if timed else 0
        try:
            batch = next(iterator)
        except StopIteration:
            return
        if timed:
            main.add(HANDOFF, time.thread_time_ns() - cpu)
        batch.position = loader.state_dict() if stateful else None
        yield batch


class EpochBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of (epoch, index) for epochs `start_epoch`..`epochs - 1`, skipping the first `start_batch` batches
    of the first; a batch never spans two epochs and `drop_last` applies per epoch.

    Stateful in torchdata's sense: `state_dict()` is the position after the last batch the live iterator handed
    out, `{"epoch", "batch"}`; `load_state_dict` makes the next iterator start there (StatefulDataLoader calls both;
    one iterator is live at a time)."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, epochs: int):
        self.sampler, self.batch_size, self.drop_last, self.epochs = sampler, batch_size, drop_last, epochs
        self.start_epoch = self.start_batch = 0
        self.epoch = self.batch = 0  # the live iterator's position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.start_epoch = self.epoch = int(state["epoch"])
        self.start_batch = self.batch = int(state["batch"])

    def batches_per_epoch(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def __len__(self) -> int:
        return max(self.epochs - self.start_epoch, 0) * self.batches_per_epoch() - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        self.epoch, self.batch = self.start_epoch, self.start_batch
        return self._batches(self.start_epoch, self.start_batch)

    def _batches(self, start_epoch: int, start_batch: int) -> Iterator[list[tuple[int, int]]]:
        per_epoch = self.batches_per_epoch()
        for epoch in range(start_epoch, self.epochs):
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            skip = start_batch if epoch == start_epoch else 0
            batches = itertools.islice(BatchSampler(self.sampler, self.batch_size, self.drop_last), skip, None)
            for number, batch in enumerate(batches, start=skip + 1):
                self.epoch, self.batch = (epoch + 1, 0) if number == per_epoch else (epoch, number)
                yield [(epoch, index) for index in batch]


class TrainStream:
    """The training loader as the loop sees it: `len` = batches per epoch, iterating yields the rest of the
    current epoch (on the device), `state_dict`/`load_state_dict` = the position consumed.

    `to_device(batches)` turns the loader's batches into device batches (the DevicePrefetcher); it wraps the
    whole multi-epoch iterator, so its one-batch-ahead copy also crosses epoch boundaries. Each batch carries the
    loader's `state_dict()` taken the moment it left the loader (`Batch.position`); the stream keeps the one of the
    last batch it yielded. So the state counts the batches handed to the loop, never the ones in flight, and a
    checkpoint taken mid-epoch resumes exactly.

    `state_dict()` = `{"epoch", "batch", "num_workers", "loader"}`: the stream's own count, which splits the
    batches into epochs, and the StatefulDataLoader's state that the data position is restored from.
    """

    def __init__(self, loader: StatefulDataLoader, batches: EpochBatchSampler,
                 to_device: Callable[[Iterable], Iterable], stages: StageTimes | None = None):
        self.loader, self.batches, self.to_device = loader, batches, to_device
        self.stages = stages  # the per-stage clocks (stages.py); None: not timed
        self.epoch = self.batch = 0
        self.loader_state: dict | None = None  # loader.state_dict() as of the last batch yielded
        # With in_order=false, batches leave in completion order and torchdata keeps no exact state (it warns on
        # every state_dict()); the position is then the (epoch, batch) count alone, as inexact as the order.
        self.stateful = loader.num_workers == 0 or loader.in_order
        self.rank_sampler: RankSampler | None = None  # how another process count split the order (reshard.py)
        self._iter: Iterator | None = None

    def __len__(self) -> int:
        return self.batches.batches_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch unless the stream is already in it (e.g. resumed mid-epoch)."""
        if epoch != self.epoch:
            self.seek(epoch, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "num_workers": self.loader.num_workers,
                "loader": self.loader_state}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batches `state` counts: through `StatefulDataLoader.load_state_dict` when it holds a
        loader state for this many workers (torchdata restores only the same worker count), otherwise by starting
        the batch sampler at (epoch, batch), which draws the same batches (another data.num_workers, said in one
        line, or in_order=false, whose loader keeps no exact state)."""
        loader_state = state.get("loader")
        if loader_state is not None and state.get("num_workers") != self.loader.num_workers:
            log.info("the checkpoint's loader state is for %s workers, this loader has %d: resuming from its "
                     "(epoch, batch) position", state.get("num_workers"), self.loader.num_workers)
            loader_state = None
        self.seek(int(state["epoch"]), int(state["batch"]), force=True)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
            self.loader_state = loader_state

    def seek(self, epoch: int, batch: int, force: bool = False) -> None:
        """Continue from batch `batch` of `epoch`; the workers' prefetched batches are dropped."""
        if (epoch, batch) == (self.epoch, self.batch) and not force:
            return
        self.close()
        forget_loaded_state(self.loader)  # a state loaded earlier must not override this position
        self.epoch, self.batch, self.loader_state = epoch, batch, None

    def replace_loader(self, loader: StatefulDataLoader, stages: StageTimes | None,
                       to_device: Callable[[Iterable], Iterable]) -> None:
        """Go on from this position with `loader` (another plan, data.autotune's) and its `to_device`: the old
        loader's workers end and the new one starts its batch sampler at (epoch, batch), which draws the same batches,
        as a resume at another data.num_workers does."""
        self.close()
        shutdown_workers(self.loader)
        self.loader, self.stages, self.loader_state, self.to_device = loader, stages, None, to_device
        self.stateful = loader.num_workers == 0 or loader.in_order

    def close(self) -> None:
        """Drop the batches in flight; the workers stay (persistent) until `shutdown_workers(self.loader)`."""
        if self._iter is not None and hasattr(self._iter, "close"):
            self._iter.close()
        self._iter = None

    def __iter__(self) -> Iterator:
        per_epoch = len(self)
        epoch = self.epoch
        if per_epoch == 0 or epoch >= self.batches.epochs:
            return
        while self.epoch == epoch:
            if self._iter is None:  # the epoch's first batch, or the loader was replaced here (data.autotune)
                self.batches.start_epoch, self.batches.start_batch = self.epoch, self.batch
                main = self.stages.main if self.stages is not None else None
                on_device = self.to_device(_with_position(self.loader, self.stateful, main))
                if main is not None and hasattr(on_device, "stages"):  # a DevicePrefetcher times the copy
                    on_device.stages = main
                self._iter = iter(on_device)
            try:
                batch = next(self._iter)
            except BaseException:
                self._iter = None  # a failed iterator is finished; the next pass restarts from the position
                raise
            self.loader_state = batch.position
            self.batch += 1
            if self.batch == per_epoch:
                self.epoch, self.batch = epoch + 1, 0
            yield batch


def train_loader(samples: Dataset, plan: LoaderPlan, data, env: DistEnv, seed: int,
                 batches: EpochBatchSampler) -> tuple[StatefulDataLoader, StageTimes]:
    """A StatefulDataLoader with every data.* knob over `batches`, and its stage clocks."""
    stages = StageTimes.for_workers(plan.num_workers)
    loader = stateful_loader(samples, batch_sampler=batches, collate_fn=TimedCollate(build_collate(plan), stages.board),
                             generator=torch.Generator().manual_seed(loader_seed(seed, env.rank)),
                             **plan.loader_kwargs(data))
    return loader, stages


def build_train_stream(samples: Dataset, plan: LoaderPlan, data, env: DistEnv, *, seed: int, epochs: int,
                       to_device: Callable[[Iterable], Iterable]) -> TrainStream:
    """The training stream: a StatefulDataLoader with every data.* knob, one batch sampler over all `epochs`
    handing `samples` (samples.Samples) its keys `(epoch, index)`."""
    sampler = build_sampler(samples, data, env, train=True, seed=seed)
    batches = EpochBatchSampler(sampler, plan.batch_size, data.drop_last, epochs)
    loader, stages = train_loader(samples, plan, data, env, seed, batches)
    stream = TrainStream(loader, batches, to_device, stages)
    stream.rank_sampler = rank_sampler(samples, data, env, seed)
    return stream

