"""The counts of the epoch in progress, kept by a mid-epoch checkpoint (its "meter" entry): a resumed epoch's record
sums and averages its per-batch figures (loss, images, bad samples, optimizer steps, gradient norms, the samples each
source gave) over the whole epoch, as an uninterrupted run's does, at the checkpoint's process count or another. The
meter (meter.py) counts what this process saw; this part carries what the epoch did before the checkpoint.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from loadout.dist import DistEnv, gather_rows
from loadout.observe.meter import COUNTED, EpochMeter

RANKS_OWN = ("images", "bad_samples", "decode_fallbacks", "loss_sum")  # counts()' that differ by rank (and sources)


class EpochCounts:
    """The counts of the epoch in progress (`EpochMeter.counts`), a Stateful part of a mid-epoch checkpoint. `gather`
    (every rank, at the same step, in a save) collects every rank's in one collective; `start` hands them to the
    resumed epoch's meter: each rank its own at the checkpoint's process count, else rank 0 the sums over the saved
    ranks and every rank the figures all ranks share (steps, optimizer steps, gradient norms, lr), so the epoch's
    summary over ranks (`reduce_over_ranks`) is the whole epoch's at any process count."""

    def __init__(self, env: DistEnv, device: torch.device):
        self.env, self.device = env, device
        self.meter: EpochMeter | None = None  # the epoch in progress
        self.saved: list[dict] | None = None  # by rank
        self.resumed: list[dict] | None = None

    def start(self, meter: EpochMeter) -> EpochMeter:
        """`meter` for the epoch in progress, going on from the checkpoint resumed within this epoch, if any."""
        self.meter, resumed, self.resumed = meter, self.resumed, None
        if resumed:
            meter.resume_from(self.share(resumed))
        return meter

    def share(self, ranks: list[dict]) -> dict:
        """This rank's part of the saved ranks' counts."""
        if len(ranks) == self.env.world_size:
            return ranks[self.env.rank]
        if not self.env.is_main:
            return {**ranks[0], **dict.fromkeys(RANKS_OWN, 0), "source_samples": []}
        sources = np.sum([rank["source_samples"] for rank in ranks], axis=0, dtype=np.int64).tolist()
        return {**ranks[0], **{key: sum(rank[key] for rank in ranks) for key in RANKS_OWN}, "source_samples": sources}

    def gather(self, mid_epoch: bool) -> None:
        """Collective: every rank calls it with the same `mid_epoch` (at an epoch's end there is nothing to keep)."""
        if not mid_epoch or self.meter is None:
            self.saved = None
            return
        counts, keys = self.meter.counts(), (*COUNTED, "loss_sum", "grad_norm_sum", "lr")
        row = [*(math.nan if counts[key] is None else counts[key] for key in keys), *counts["source_samples"]]
        self.saved = []
        for values in gather_rows(row, self.device).tolist():  # float64: exact for the counts and float32 sums
            rank = {key: int(value) if key in COUNTED else value for key, value in zip(keys, values, strict=False)}
            rank["lr"] = None if math.isnan(rank["lr"]) else rank["lr"]
            self.saved.append({**rank, "source_samples": [int(value) for value in values[len(keys):]]})

    def state_dict(self) -> list[dict] | None:
        return self.saved

    def load_state_dict(self, state: list[dict] | None) -> None:
        self.resumed = state
