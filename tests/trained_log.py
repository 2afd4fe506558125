"""A callback the world-size tests install from outside: the sample indices each rank trained, one JSON line a batch
in <run dir>/trained/ws<WORLD_SIZE>_rank<R>.jsonl, so runs at several process counts can share one run dir.

Lines are appended at each checkpoint (`on_save`, before the file is written), so a stopped run's file holds exactly
what its checkpoint counts. It also keeps <run dir>/samples/at_rank<R> as tests.sample_log.SampleLog does, for
`tests.conftest.training_at`.
"""

from __future__ import annotations

import json

from loadout.dist import barrier


class TrainedLog:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch(self, trainer, batch) -> None:
        progress = trainer.progress
        self.rows.append({"epoch": progress.epoch, "batch": progress.batch_in_epoch, "indices": batch.indices.tolist()})
        at = trainer.run_dir / "samples" / f"at_rank{trainer.env.rank}"
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_text(f"{progress.epoch} {progress.batch_in_epoch}")

    def on_save(self, trainer) -> None:
        path = trainer.run_dir / "trained" / f"ws{trainer.env.world_size}_rank{trainer.env.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)
        self.rows = []
        barrier()
