"""Failures a retry would repeat: a run that ran out of memory leaves a note in its run dir, and a retry of the same
config there (torchrun restarting the group, a Slurm requeue, a restarted pod) reads it and exits at once with the
same status and line, instead of loading data and running out of memory again. A changed config (the fix) starts
normally and removes the note.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from loadout.errors import RetryRefused
from loadout.runtime.checkpoint import write_atomic

NOTE = "no_retry.json"
IGNORED = ("trainer.resume",)  # set differently by a retry (train.sbatch adds trainer.resume=auto)


def fingerprint(cfg) -> str:
    container = OmegaConf.to_container(cfg, resolve=True)
    for key in IGNORED:
        section, _, name = key.partition(".")
        container.get(section, {}).pop(name, None)
    return hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()


def note(run_dir: Path, cfg, status: int, message: str) -> None:
    """Leave the note: this config, in this run dir, ends with `status` and `message`."""
    record = {"status": status, "message": message, "config": fingerprint(cfg)}
    write_atomic(run_dir / NOTE, lambda f: f.write(json.dumps(record).encode()))


def check(run_dir: Path, cfg) -> None:
    """Raise `RetryRefused` when this config already failed here for good; remove a note another config left."""
    path = run_dir / NOTE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if record.get("config") == fingerprint(cfg):
        raise RetryRefused(int(record["status"]), record["message"], path)
    path.unlink(missing_ok=True)
