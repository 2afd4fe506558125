"""Checkpoints: one dict of Stateful parts, versioned, written atomically (temporary file + fsync + rename), found
again for trainer.resume=auto.

The Trainer hands over its parts by name (model, optimizer, scheduler, scaler, progress, loader: every rank's
StatefulDataLoader position), as torchtitan's checkpointer keeps one dict of Stateful objects; the file holds
each part's `state_dict()` and the format version, and a file of another format is refused in one line.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

import torch

from train.config import ConfigError

LAST = "last.pt"
BEST = "best.pt"  # the epoch with the highest val_acc so far
FORMAT = 2  # 2: Stateful parts by name + "format"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


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


def save(parts: dict[str, Stateful], path: Path) -> None:
    """Each part's state_dict() with the format version, through torch.save, never half a file."""
    state = {"format": FORMAT, **{name: part.state_dict() for name, part in parts.items()}}
    write_atomic(path, lambda f: torch.save(state, f))


def copy_atomic(source: Path, path: Path) -> None:
    """A copy of the file `source` at `path`, never half a file (best.pt from the last.pt just written)."""
    with open(source, "rb") as f:
        write_atomic(path, lambda out: shutil.copyfileobj(f, out, 2**22))


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
    """The saved states by part name; a file that is not a loadout checkpoint of this format fails in one line."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # a truncated or foreign file: torch raises several types
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"trainer.resume: {path} is not a readable checkpoint ({reason}): point it at a last.pt "
                          "or best.pt, or use trainer.resume=null to start over") from err
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT:
        raise ConfigError(f"trainer.resume: {path} has checkpoint format {found}, this loadout reads format "
                          f"{FORMAT}: finish that run with the loadout that wrote it, or use trainer.resume=null")
    return state
