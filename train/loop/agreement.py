"""What the ranks agree on between optimizer steps, and what the loop does on the answer: stop on a signal, stop on
a non-finite loss, run smaller micro-batches.

Each rank knows only its own: the signal it received (stop.py), the micro-batch size it shrank to after running out of
memory (micro_batch.py), whether its loss went non-finite (nonfinite.py). A rank that acted on its own would leave
the others waiting in a collective (NCCL matches them by order), so after each optimizer step every rank hands its
values to one small all-reduce and acts on the answer one step later, every rank at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from loadout.dist import RankAgreement
from loadout.errors import Diverged
from loadout.runtime.stop import Stopped, StopSignal
from train.loop.progress import Progress

if TYPE_CHECKING:
    from train.loop.step import TrainStep


class StepAgreement:
    """The loop's side of the agreement: `stop` is this rank's signal, `step` its micro-batch size and loss watch,
    `progress` reads where the run is (for the lines), `save` writes a mid-epoch checkpoint before a stop."""

    def __init__(self, stop: StopSignal, step: TrainStep, progress: Callable[[], Progress],
                 save: Callable[[], None]):
        self.stop, self.step, self.progress, self.save = stop, step, progress, save
        self.ranks = RankAgreement()
        self.saved_step: int | None = None  # the step the checkpoints on disk reached (None: none written yet)

    def agree(self) -> None:
        """After each optimizer step: ask with this rank's stop signal, micro-batch size and non-finite flag, and
        act on the answer to the previous step's question."""
        answer = self.ranks.ask([self.stop.signum, -self.step.micro_batch.size, int(not self.step.watch.poll())])
        if answer is not None:
            self._act_on(answer)

    def settle(self) -> None:
        """Wait for the question in flight, if any, and act on its answer (before the epoch's collectives)."""
        answer = self.ranks.answer()
        if answer is not None:
            self._act_on(answer)

    def stop_if_asked(self) -> None:
        """After an epoch's checkpoint: if any rank got a stop signal, stop (a blocking agreement)."""
        self.settle()
        signum = self.stop.agreed()
        if signum:
            self.stop_now(signum)

    def _act_on(self, answer: list[int]) -> None:
        signum, smallest, nonfinite = answer
        self.step.micro_batch.agree(-smallest)
        if nonfinite:
            self.diverge("a non-finite loss")
        if signum:
            self.stop_now(signum)

    def diverge(self, what: str) -> NoReturn:
        """Stop the run on divergence, in one line; nothing is saved, so the checkpoints keep the last finite state."""
        progress = self.progress()
        lr = self.step.scheduler.get_last_lr()[0]
        last = float(self.step.watch.last_finite_loss)
        kept = f"the checkpoints hold step {self.saved_step}" if self.saved_step is not None else \
            "no checkpoint was written"
        raise Diverged(f"diverged by step {progress.step} (epoch {progress.epoch + 1}, batch "
                       f"{progress.batch_in_epoch}): {what} at lr {lr:.3g} (last finite loss {last:.4g}); {kept}."
                       " Lower optimizer.lr, lengthen the warm-up, or set trainer.on_nonfinite=skip")

    def stop_now(self, signum: int) -> NoReturn:
        """Stop on `signum`; mid-epoch, the checkpoint (with the loader's position) is saved first."""
        progress = self.progress()
        if progress.batch_in_epoch:
            self.save()
        raise Stopped(signum, progress.epoch, progress.batch_in_epoch)
