"""A callback the tests install from outside (`RECORD_SAMPLES`): the sample indices each rank trained, per epoch.

Written to <run dir>/samples/epoch<E>_rank<R>.json before every checkpoint (a checkpoint is never newer than the
log), and read back when a resumed run starts mid-epoch, so the files describe exactly what the surviving run
trained, restarts included. It also keeps <run dir>/samples/at_rank<R> = "<epoch> <batch in epoch>" of the batch
being trained, so a test can signal a run at a known point of an epoch (`tests.conftest.training_at`).
"""

from __future__ import annotations

import json
from pathlib import Path

from loadout.dist import barrier
from loadout.runtime.checkpoint import write_atomic


class SampleLog:
    def __init__(self) -> None:
        self.epoch: int | None = None
        self.batches: list[list[int]] = []

    @staticmethod
    def path(run_dir: Path, epoch: int, rank: int) -> Path:
        return run_dir / "samples" / f"epoch{epoch:03d}_rank{rank}.json"

    def on_train_batch(self, trainer, batch) -> None:
        progress = trainer.progress  # batch_in_epoch counts this batch already
        if progress.epoch != self.epoch:
            self.epoch, done = progress.epoch, progress.batch_in_epoch - 1
            self.batches = []
            if done:  # resumed mid-epoch: the batches before the checkpoint, as the run that trained them wrote
                recorded = json.loads(self.path(trainer.run_dir, self.epoch, trainer.env.rank).read_text())
                assert len(recorded["batches"]) >= done, (recorded, done)
                self.batches = recorded["batches"][:done]
        self.batches.append(batch.indices.tolist())
        at = trainer.run_dir / "samples" / f"at_rank{trainer.env.rank}"
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_text(f"{progress.epoch} {progress.batch_in_epoch}")

    def on_save(self, trainer) -> None:
        if self.epoch is not None:
            text = json.dumps({"epoch": self.epoch, "rank": trainer.env.rank, "batches": self.batches}).encode()
            write_atomic(self.path(trainer.run_dir, self.epoch, trainer.env.rank), lambda f: f.write(text))
        barrier()  # every rank's log is on disk before rank 0 writes the checkpoint
