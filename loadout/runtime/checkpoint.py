"""Checkpoints: one dict of Stateful parts, versioned, written atomically (temporary file + fsync + rename), the
previous ones kept beside the last (trainer.keep_checkpoints), found again for trainer.resume=auto.

The Trainer hands over its parts by name (model, optimizer, scheduler, scaler, micro-batch size, the precision the
run trains in, progress, the trackers' run ids, loader: every rank's StatefulDataLoader position, meter: every rank's
training counts of the epoch in progress), as torchtitan's checkpointer keeps one dict of Stateful objects; the file
holds each part's `state_dict()` and the format version, and a file of another format is refused in one line. What
changed within the format is mended in one place, `_current` on load: a part added since (`ADDED_PARTS`) is simply
absent from an older file, which resumes without it.
Every file is read with weights_only=True: tensors and plain containers, never code. A write that fails (a full
disk, a quota, a read-only mount) leaves the previous checkpoints as they were and says so in one line.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

import torch

from loadout.errors import MIB, CheckpointWriteError, ConfigError, first_line

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"  # the epoch with the task's best figure so far (val_acc for task=classification)
FORMAT = 2  # 2: Stateful parts by name + "format"
ADDED_PARTS = ("micro_batch", "trackers", "autotune", "meter", "precision")  # parts format 2 gained later


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def older(path: Path, age: int) -> Path:
    """The checkpoint `age` saves before `path`: last.pt, last.1.pt, last.2.pt, ..."""
    return path if age == 0 else path.with_name(f"{path.stem}.{age}{path.suffix}")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], keep: int = 1) -> None:
    """`write(file)` into a temporary file beside `path`, then rename: readers see the old or the new file. With
    `keep` > 1 the file it replaces becomes `<stem>.1<suffix>` (and so on, the oldest dropped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        for age in range(keep - 1, 1, -1):
            if older(path, age - 1).exists():
                os.replace(older(path, age - 1), older(path, age))
        if keep > 1 and path.exists():  # a hard link keeps `path` in place until the rename replaces it
            older(path, 1).unlink(missing_ok=True)
            try:
                os.link(path, older(path, 1))
            except OSError:  # a file system without hard links
                os.replace(path, older(path, 1))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_bytes(state) -> int:
    """The bytes of every tensor in a nested state: about the size of its checkpoint."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(value) for value in state)
    return 0


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_failure(path: Path, size: int, err: BaseException) -> CheckpointWriteError:
    """One line: where, what it needed, what was free, and why (torch reports a full disk as an 'unexpected pos')."""
    free = free_bytes(path.parent)
    code = getattr(err, "errno", None)
    if code == errno.EROFS:
        why = "the file system is read-only"
    elif code in (errno.EACCES, errno.EPERM):
        why = "no permission to write there"
    elif code == errno.EDQUOT:
        why = "the disk quota is used up"
    elif code == errno.ENOSPC or (free is not None and free < size):
        why = "no space left"
    else:
        why = first_line(err)
    left = f"{free / MIB:.0f} MiB free" if free is not None else "free space unknown"
    return CheckpointWriteError(f"cannot write checkpoint {path}: {why} (it needs about {size / MIB:.0f} MiB, {left}); "
                                "the previous checkpoints are intact: make room (or point hydra.run.dir elsewhere) "
                                "and resume with trainer.resume=auto")


def save(parts: dict[str, Stateful], path: str | Path, keep: int = 1) -> None:
    """Each part's state_dict() with the format version, through torch.save, never half a file; `keep` checkpoints
    in all (this one and the ones before it)."""
    path = Path(path)  # a plain loop hands its --checkpoint string (loadout.save_checkpoint)
    state = {"format": FORMAT, **{name: part.state_dict() for name, part in parts.items()}}
    try:
        write_atomic(path, lambda f: torch.save(state, f), keep=keep)
    except (OSError, RuntimeError) as err:  # torch's writer raises RuntimeError when the disk fills
        raise write_failure(path, tensor_bytes(state), err) from err


def copy_atomic(source: Path, path: Path) -> None:
    """A copy of the file `source` at `path`, never half a file (best.pt from the last.pt just written)."""
    try:
        with open(source, "rb") as f:
            write_atomic(path, lambda out: shutil.copyfileobj(f, out, 2**22))
    except OSError as err:
        raise write_failure(path, source.stat().st_size, err) from err


def warn_if_little_room(run_dir: Path, state_bytes: int, keep: int) -> None:
    """At start: one warning line when the run dir's disk cannot hold `keep` checkpoints of about `state_bytes`."""
    free = free_bytes(run_dir if run_dir.exists() else run_dir.parent)
    need = max(keep, 2) * state_bytes
    if free is not None and free < need:
        log.warning("%s has %.0f MiB free, less than %d checkpoints of about %.0f MiB each: a save may fail (it "
                    "then stops the run, keeping the previous checkpoint)", run_dir, free / MIB, max(keep, 2),
                    state_bytes / MIB)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def candidates(run_dir: Path) -> list[Path]:
    """This run dir's checkpoints: last.pt, the ones kept before it (last.1.pt, ...), best.pt."""
    folder = checkpoint_dir(run_dir)
    return sorted(path for path in folder.glob("*.pt") if re.fullmatch(r"last(\.\d+)?\.pt|best\.pt", path.name))


def newest_readable(run_dir: Path) -> Path | None:
    """The checkpoint of `run_dir` furthest into the run that reads whole (last.pt before best.pt when they hold the
    same step); each one skipped is said in one line (a node lost mid-copy, a quota that cut a file short)."""
    readable = []
    for path in candidates(run_dir):
        try:
            state = read_weights_only(path, "trainer.resume", mmap=True)  # the one chosen is read once, later
        except ConfigError as err:
            log.warning("trainer.resume=auto: skipped %s: %s", path, str(err).split(": ", 1)[-1])
            continue
        if not (isinstance(state, dict) and state.get("format") == FORMAT):
            log.warning("trainer.resume=auto: skipped %s: not a loadout checkpoint of format %d", path, FORMAT)
            continue
        progress = state.get("progress", {})
        reached = (progress.get("step", 0), progress.get("epoch", 0), progress.get("batch_in_epoch", 0))
        readable.append((reached, path.name.startswith("last"), path))
    if not readable:
        return None
    return max(readable, key=lambda found: found[:2])[2]


def find_resume_path(resume: str | None, run_dir: Path, restarted: bool = False) -> Path | None:
    """trainer.resume: auto = this run dir's newest readable checkpoint if there is one; a path = that file; null =
    none.

    After a torchrun restart (`restarted`) the run dir's own newest checkpoint wins whatever trainer.resume
    says: the restarted group continues this run rather than starting it over.
    """
    if resume == "auto" or (restarted and candidates(run_dir)):
        return newest_readable(run_dir)
    if resume is None:
        return None
    return Path(resume)


class UnsafeFile(ConfigError):
    """A file whose unpickling would import and call something other than tensors and plain containers."""


def read_weights_only(path: Path, key: str, mmap: bool = False):
    """torch.load onto the CPU with weights_only=True: tensors, numbers, strings and containers only, so a downloaded
    file cannot run code. A file that needs anything else is refused in one line naming `key`, the file and what it
    would load; any other unreadable file raises `ConfigError` with torch's reason in one line. `mmap`: map the
    tensors' bytes instead of reading them (a probe of the file's structure)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))  # a pickle that imports something: the way code runs on load
        if found is None:
            raise ConfigError(f"{key}={str(path)!r}: not a readable checkpoint (not a torch.save file)") from err
        what = found.group(1)
        raise UnsafeFile(f"{key}={str(path)!r}: refused: loading it would import and run {what}; loadout loads "
                         "tensors and plain containers only (weights_only=True). Re-save it as a state dict "
                         "(torch.save(model.state_dict(), ...)) where it came from, if you trust that source") from None
    except Exception as err:  # a truncated or foreign file: torch raises several types
        raise ConfigError(f"{key}={str(path)!r}: not a readable checkpoint ({unreadable_reason(err)})") from err


def unreadable_reason(err: BaseException) -> str:
    """Torch's first line, without its internal paragraph (a truncated zip names miniz and its central directory)."""
    text = str(err).strip()
    if "central directory" in text or "zip archive" in text or "unexpected pos" in text:
        return "truncated or not a complete file"
    return first_line(err)


def load(path: Path) -> dict:
    """The saved states by part name, on the CPU; a file that is not a loadout checkpoint of this format fails in one
    line. Never onto the GPU: `load_state_dict` copies the weights into the model and moves the optimizer's moments
    to their parameters' device, while Adam's `step` counters stay on the CPU, where torch keeps them (read onto the
    GPU they cost one host sync per parameter every step: pytorch/pytorch#128208), and no second copy of the
    checkpoint sits beside the live model in GPU memory."""
    try:
        state = read_weights_only(path, "trainer.resume")
    except UnsafeFile:
        raise
    except ConfigError as err:
        raise ConfigError(f"{err}: point it at a last.pt or best.pt, or use trainer.resume=null to start over") \
            from err.__cause__
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT:
        raise ConfigError(f"trainer.resume: {path} has checkpoint format {found}, this loadout reads format "
                          f"{FORMAT}: finish that run with the loadout that wrote it, or use trainer.resume=null")
    return _current(state)


def _current(state: dict) -> dict:
    """A format-2 file as this loadout writes one: the one place where an older file's parts are mended."""
    progress = state.get("progress", {})
    if "best_val_acc" in progress:  # before tasks: the best figure was the top-1 accuracy, -1 when none yet
        old = progress.pop("best_val_acc")
        progress.setdefault("best", None if old < 0 else old)
    if "autotune" in state:  # before undoing a change and measuring it after a resume
        state["autotune"].setdefault("settled", False)
        state["autotune"].setdefault("before", None)
    return state


def load_model(model: torch.nn.Module, state: dict, path: Path, name: str) -> None:
    """`state`'s weights (a checkpoint's, from `load`) copied into `model` on its device; a checkpoint of another
    model than `name` fails in one line."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ConfigError(f"trainer.resume: {path} holds another model than {name} ({str(err).splitlines()[0]})") \
            from err
