"""Checkpoints written atomically (temporary file + fsync + rename) and found again for trainer.resume=auto."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

LAST = "last.pt"


def save_atomic(state: dict, path: Path) -> None:
    """A reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def find_resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """trainer.resume: auto = this run dir's last checkpoint if there is one; a path = that file; null = none."""
    if resume is None:
        return None
    if resume == "auto":
        path = checkpoint_dir(run_dir) / LAST
        return path if path.is_file() else None
    return Path(resume)


def load(path: Path, device: torch.device) -> dict:
    return torch.load(path, map_location=device, weights_only=False)
