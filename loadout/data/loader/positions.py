"""Every rank's training-stream position, gathered for a checkpoint and loaded back at the same or another process
count: the stream (stream.py) knows one rank's position; a checkpoint needs all of them, and a resume at another
process count needs this rank's share of the samples the interrupted epoch has not trained yet (reshard.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from loadout.data.loader.reshard import deal, install, untrained
from loadout.dist import DistEnv, all_gather
from loadout.errors import ConfigError

if TYPE_CHECKING:
    from loadout.data.loader.stream import TrainStream

log = logging.getLogger(__name__)


class LoaderPositions:
    """Every rank's training-stream position, a Stateful part of the checkpoint: `gather` (on every rank, at the
    same step) collects them with the per-rank batch size; loading takes this rank's, or at another process count
    this rank's share of the interrupted epoch's untrained samples (reshard.py), said in one line.

    The per-rank batch is kept across process counts (the global batch scales with them): another data.batch_size
    mid-epoch fails in one line."""

    def __init__(self, stream: TrainStream, env: DistEnv):
        self.stream, self.env = stream, env
        self.saved: dict | None = None
        self.resumed: dict | None = None  # {"epoch", "segments", "offset"}: an epoch begun at other process counts
        self.batch_in_epoch: int | None = None  # at another process count: the batch the epoch goes on after

    def gather(self, mid_epoch: bool) -> None:
        """Collective: every rank calls it with the same `mid_epoch` (at an epoch's end there is no position)."""
        if not mid_epoch:
            self.saved = None
            return
        self.saved = {"ranks": all_gather(self.stream.state_dict()), "batch_size": self.stream.batches.batch_size}
        if self.resumed is not None and self.resumed["epoch"] == self.stream.epoch:
            self.saved.update(segments=self.resumed["segments"], offset=self.resumed["offset"])

    def state_dict(self) -> dict | None:
        return self.saved

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        ranks, batches = state["ranks"], self.stream.batches
        epoch, offset, segments = ranks[0]["epoch"], state.get("offset", 0), list(state.get("segments", []))
        mine = ranks[self.env.rank] if len(ranks) == self.env.world_size else None
        if mine is None and ranks[0]["batch"] == 0:  # saved after the epoch's last batch: only validation is left
            self.batch_in_epoch = batches.batches_per_epoch()
            return
        if mine is None:
            saved_batch = state.get("batch_size", batches.batch_size)
            if saved_batch != batches.batch_size:
                raise ConfigError(f"data.batch_size={batches.batch_size}: the checkpoint stopped mid-epoch at "
                                  f"{len(ranks)} processes with data.batch_size={saved_batch}; a resume at another "
                                  f"process count keeps the per-rank batch: use data.batch_size={saved_batch}")
            segments.append({"world_size": len(ranks), "done": [(r["batch"] - offset) * saved_batch for r in ranks]})
        if not segments:
            self.stream.load_state_dict(mine)
            return
        left = untrained(self.stream.rank_sampler, epoch, segments, batches.batch_size, batches.drop_last)
        share = deal(left, self.env.world_size, batches.batch_size, batches.drop_last)[self.env.rank]
        start = install(batches, epoch, share)
        self.resumed = {"epoch": epoch, "segments": segments, "offset": start}
        if mine is not None:  # the same process count as the checkpoint's, in an epoch begun at another
            self.stream.load_state_dict(mine)
            return
        self.batch_in_epoch = start
        world, size = self.env.world_size, batches.batch_size
        log.info("resumed mid-epoch at %d processes from a checkpoint of %d: the %d samples of epoch %d not yet "
                 "trained are dealt to the %d ranks (%d batches each); the per-rank batch stays %d, so the global "
                 "batch is %d (was %d), optimizer.lr is not scaled and the LR schedule is re-planned over the new "
                 "steps", world, len(ranks), len(left), epoch + 1, world, batches.batches_per_epoch() - start, size,
                 size * world, size * len(ranks))
        self.stream.load_state_dict({"epoch": epoch, "batch": start})
