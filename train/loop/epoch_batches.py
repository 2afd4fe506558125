"""Which batches an epoch trains and validates on: all of them; at most trainer.limit_batches of each split
(debug=limit); or, with trainer.overfit_batches (debug=overfit), the first N training batches, kept and replayed
every epoch for training and validation alike: a model and loop that work drive that loss toward 0
(lightning-hydra-template's sanity checks)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from loadout.data.loader.batch import Batch
from loadout.data.pipeline import DataPipeline


def batches_per_epoch(train_batches: int, limit: int | None, overfit: int) -> int:
    """Training batches an epoch, of the loader's `train_batches`."""
    cap = overfit or limit
    return min(train_batches, cap) if cap else train_batches


class EpochBatches:
    def __init__(self, data: DataPipeline, limit: int | None = None, overfit: int = 0):
        self.data, self.limit, self.overfit = data, limit, overfit
        self.per_epoch = batches_per_epoch(len(data.train), limit, overfit)
        self.val_batches = self.per_epoch if overfit else min(len(data.val), limit or len(data.val))
        self._kept: list[Batch] | None = None

    def _replayed(self) -> list[Batch]:
        if self._kept is None:
            self._kept = list(self.data.explained(islice(self.data.train, self.overfit)))
        return self._kept

    def train(self, done: int) -> Iterable[Batch]:
        """The rest of an epoch's training batches, `done` of them already trained (the loader resumes there)."""
        if self.overfit:
            return self._replayed()[done:]
        if self.per_epoch == len(self.data.train):
            return self.data.train
        return islice(self.data.train, self.per_epoch - done)

    def val(self) -> Iterable[Batch]:
        if self.overfit:
            return self._replayed()
        return islice(self.data.val, self.val_batches)
