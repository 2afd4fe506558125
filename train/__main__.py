"""`python -m train [overrides]`: check the command line, compose the config with Hydra, train (train/job.py).

`--help` answers before torch or Hydra is imported. Bad overrides fail in one line before Hydra starts (so they write
nothing), and `trainer.resume=auto hydra.run.dir=<run dir>` replays that run's own overrides under the command
line's (loadout/run/resume_run.py). Under torchrun every rank runs this file; ranks > 0 get quiet Hydra overrides and
share rank 0's run dir (loadout/run/run_dir.py).
Exit status: 0 done, 2 bad input (one line naming the key), 3 out of memory, 4 diverged (each one line; a retry of the
same config in the same run dir exits at once: loadout/run/no_retry.py), 69 a collective failed (a node or link lost:
one line naming the rank), 74 a checkpoint could not be written (make room, then resume), 75 stopped by a signal with a
checkpoint to resume.
"""

from __future__ import annotations

import gc
import sys

from loadout.run.cli_help import CONF, text, wants_help


def task(cfg) -> None:
    """Hydra's job (imported here, so `--help` never waits for torch)."""
    from train.job import main

    # The ~350 k objects the imports made (torch, torchvision, Hydra) live as long as the process: freezing them keeps
    # every full collection, and the one at exit (over a second), from walking them again, and keeps forked workers
    # from copying their pages (the gc module's documented use before fork). Once: a sweep's later jobs (-m) would
    # freeze what the earlier ones left to the collector.
    if not gc.get_freeze_count():
        gc.freeze()
    main(cfg)


def launch(argv: list[str]) -> None:
    if wants_help(argv):
        print(text())
        return
    import hydra

    from loadout.run.command_line import prepare
    from train.config import SCHEMA

    sys.argv = [sys.argv[0], *prepare(argv, SCHEMA)]
    hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")(task)()


if __name__ == "__main__":
    launch(sys.argv[1:])
