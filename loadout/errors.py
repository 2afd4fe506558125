"""The ways a run fails, in one place: each failure carries its exit status, and its message is the one line the
run ends with (train/job.py turns any `Failure` into that line and status). Modules that only raise import this,
not the config schema.

Exit statuses: 0 done, 2 bad input, 3 out of memory, 4 diverged, 69 a collective failed, 74 a checkpoint could not
be written, 75 stopped by a signal (resume to continue).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

CONFIG_EXIT = 2  # bad input: one line naming the key and the fix
OUT_OF_MEMORY_EXIT = 3  # out of device memory: the same command would run out again (loadout/run/no_retry.py)
DIVERGED_EXIT = 4  # a non-finite loss: the same command would diverge again (loadout/run/no_retry.py)
LOST_PEER_EXIT = 69  # EX_UNAVAILABLE: a collective failed (a node or link lost); torchrun's restart resumes
CHECKPOINT_WRITE_EXIT = 74  # EX_IOERR: a checkpoint could not be written; make room, then resume
RESUMABLE_EXIT = 75  # EX_TEMPFAIL (sysexits.h): stopped cleanly, resume to continue

MIB = 2**20  # the unit of every size a message or a figure gives (MiB, "_mb")


class Failure(Exception):
    """A run that cannot go on: `status` is its exit status; `repeats` when the same config in the same run dir
    would fail the same way again, so a retry is refused at once (loadout/run/no_retry.py)."""

    status = 1
    repeats = False


class ConfigError(Failure, ValueError):
    """A bad setting: the message names the key and the fix."""

    status = CONFIG_EXIT


class LoaderError(Failure, RuntimeError):
    """A DataLoader worker died or timed out; the message names the likely cause and the fix."""

    status = CONFIG_EXIT


class OutOfDeviceMemory(Failure):
    """The run ran out of device memory and could not go on (micro_batch.OutOfMemory says where and the sizes)."""

    status, repeats = OUT_OF_MEMORY_EXIT, True


class Diverged(Failure):
    """Training produced non-finite losses (or fp16's loss scale collapsed); the checkpoints keep the last finite
    state."""

    status, repeats = DIVERGED_EXIT, True


class CheckpointWriteError(Failure):
    """A checkpoint could not be written (no space, a quota, a read-only mount); the previous ones are intact."""

    status = CHECKPOINT_WRITE_EXIT


class LostPeer(Failure):
    """A collective failed; the message names the ranks that stopped beating."""

    status = LOST_PEER_EXIT


class RetryRefused(Failure):
    """The same config failed in this run dir already, in a way it would fail again."""

    def __init__(self, status: int, message: str, path: Path):
        self.status = status
        super().__init__(f"{message} (a retry of the same config, refused; {path} says so: change the config to "
                         "try again)")


def first_line(err: BaseException, limit: int = 300) -> str:
    """An error's first line (its type's name when it has no text): how a one-line message quotes its cause."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def shown(value) -> str:
    """A value as it is typed on the command line: null, true, 'text', 2 (a choice's Enum as its text)."""
    if isinstance(value, Enum):
        value = value.value
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def bad_value(key: str, value, fix: str) -> None:
    """Raise the one line for a bad setting: `key=value: fix`."""
    raise ConfigError(f"{key}={shown(value)}: {fix}")
