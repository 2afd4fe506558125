"""Checkpoints written atomically (temporary file + fsync + rename) and found again for trainer.resume=auto.

A checkpoint holds the model, optimizer, scheduler, scaler, the run's progress and the training loader's
StatefulDataLoader state, so a run resumed mid-epoch trains exactly the batches it had not trained yet.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

LAST = "last.pt"



def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write(file)` into a temporary file beside `path`, then rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_atomic(state: dict, path: Path) -> None:
    """torch.save, never half a file."""
    write_atomic(path, lambda f: torch.save(state, f))


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def find_resume_path(resume: str | None, run_dir: Path, restarted: bool = False) -> Path | None:
    """trainer.resume: auto = this run dir's last checkpoint if there is one; a path = that file; null = none.

    After a torchrun restart (`restarted`) the run dir's own last checkpoint wins whatever trainer.resume
    says: the restarted group continues this run rather than starting it over.
    """
    last = checkpoint_dir(run_dir) / LAST
    if restarted and last.is_file():
        return last
    if resume is None:
        return None
    if resume == "auto":
        return last if last.is_file() else None
    return Path(resume)


def load(path: Path, device: torch.device) -> dict:
    return torch.load(path, map_location=device, weights_only=False)


class SampleLog:
    """Debug hook (trainer.record_samples): the sample indices this rank trained, batch by batch, per epoch.

    Written to samples/epoch<E>_rank<R>.json beside every checkpoint (before it, so a checkpoint is never
    newer than the log) and cut back to the checkpoint's position on resume: the files describe exactly what
    the surviving run trained, restarts included.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.dir = run_dir / "samples"
        self.rank = rank
        self.epoch = 0
        self.batches: list[list[int]] = []

    def path(self, epoch: int) -> Path:
        return self.dir / f"epoch{epoch:03d}_rank{self.rank}.json"

    def start(self, epoch: int, batches_done: int) -> None:
        """Begin `epoch` with its first `batches_done` batches already trained (read back from the file)."""
        self.epoch, self.batches = epoch, []
        if batches_done:
            recorded = json.loads(self.path(epoch).read_text())["batches"]
            if len(recorded) < batches_done:
                raise RuntimeError(f"{self.path(epoch)}: {len(recorded)} batches, checkpoint {batches_done}")
            self.batches = recorded[:batches_done]

    def add(self, indices: torch.Tensor | None) -> None:
        self.batches.append([] if indices is None else indices.tolist())

    def write(self) -> None:
        text = json.dumps({"epoch": self.epoch, "rank": self.rank, "batches": self.batches}).encode()
        write_atomic(self.path(self.epoch), lambda f: f.write(text))
