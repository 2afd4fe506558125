"""Preemption: SIGTERM, SIGINT and SIGUSR1 become a request to stop at an optimizer step, on every rank at once.

Slurm (at the time limit, on preemption, `--signal=B:USR1@<s>` forwarded by the job file), Kubernetes and
`docker compose stop` send a signal and kill the job a grace period later. The handler only notes the signal; after
each optimizer step the loop hands the note to the ranks' agreement (agreement.py), an all-reduce over the ranks that
runs while the next step computes and is read one step later, so every rank stops at the same step, saves the same
checkpoint and no rank waits in an all-reduce for one that has left. Later signals (torchrun and srun forward what
the whole process tree already got) change nothing: the save in progress finishes, and the checkpoint on disk is only
ever replaced whole (checkpoint.write_atomic).
"""

from __future__ import annotations

import signal

from loadout.dist import any_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Stopped(Exception):
    """The run stopped on a signal after saving a checkpoint at (epoch, batch): it can be resumed."""

    def __init__(self, signum: int, epoch: int, batch: int):
        self.signum, self.epoch, self.batch = signum, epoch, batch
        super().__init__(f"stopped by {signal.Signals(signum).name} at epoch {epoch + 1}, batch {batch}")


class StopSignal:
    """The first stop signal received, until `restore()` gives the previous handlers back."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignal:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        self.signum = self.signum or signum  # nothing else here: a handler may run between any two bytecodes

    def agreed(self) -> int:
        """The signal to stop on if any rank received one, else 0; a collective when distributed."""
        return any_rank(self.signum)

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()
