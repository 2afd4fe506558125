"""One run dir, one run: the run holds an exclusive lock on `<run dir>/run.lock` (rank 0 under torchrun) while it
trains. A second process on the same dir (the same command started twice, a requeued job whose first copy still
runs) fails in one line naming the holder. The kernel drops the lock when its holder dies (the DataLoader workers it
forks do not hold it), so a torchrun restart or a Slurm requeue after a crash takes it over, said in one line. The
file goes when the run ends.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from loadout.errors import ConfigError

log = logging.getLogger(__name__)

LOCK = "run.lock"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self._file = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 - held open for the run's lifetime: the open file is the lock
        try:  # a POSIX record lock: DataLoader workers forked later do not inherit it, so it dies with this process
            fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = _describe(_read(file))
            file.close()
            raise ConfigError(f"hydra.run.dir={self.path.parent}: another run is training in it ({holder}); stop it "
                              "first, or give this run its own hydra.run.dir") from None
        before = _read(file)
        if before and before.get("pid") != os.getpid():
            log.warning("run dir lock taken over from %s, which no longer holds it", _describe(before))
        file.seek(0)
        file.truncate()
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")},
                  file)
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiting run then makes a fresh file
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(file) -> dict:
    file.seek(0)
    try:
        return json.loads(file.read() or "{}")
    except ValueError:
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"
