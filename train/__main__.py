"""`python -m train [overrides]`: check the command line, compose the config with Hydra, train (train/job.py).

`--help` answers before torch or Hydra is imported. Bad overrides fail in one line before Hydra starts (so they write
nothing), and `trainer.resume=auto hydra.run.dir=<run dir>` replays that run's own overrides under the command
line's (train/resume_run.py). Under torchrun every rank runs this file; ranks > 0 get quiet Hydra overrides and share
rank 0's run dir (train/run_dir.py).
Exit status: 0 done, 2 bad input (one line naming the key), 3 out of memory, 4 diverged (each one line; a retry of the
same config in the same run dir exits at once: train/no_retry.py), 69 a collective failed (a node or link lost: one
line naming the rank), 74 a checkpoint could not be written (make room, then resume), 75 stopped by a signal with a
checkpoint to resume.
"""

from __future__ import annotations

import sys

from train.cli_help import text, wants_help

CHECKED_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--resolve": 0}  # flag: values it takes


def task(cfg) -> None:
    """Hydra's job (imported here, so `--help` never waits for torch)."""
    from train.job import main

    main(cfg)


def prepare(argv: list[str]) -> list[str]:
    """The arguments Hydra gets: the overrides checked (one line and exit 2 on a bad one), a resume's run replayed,
    `--cfg` printing resolved values, and the quiet overrides of ranks > 0."""
    from train.config import ConfigError, register
    from train.dist import DistEnv, hydra_rank_overrides
    from train.overrides import check_command_line
    from train.resume_run import check_unchanged, replay, resumed_dir

    register()
    flags, overrides, values = [], [], 0
    for arg in argv:
        if values or arg.startswith("-"):
            flags.append(arg)
            values = 0 if values else CHECKED_FLAGS.get(arg, 0)
        else:
            overrides.append(arg)
    extra = sorted({flag for flag in flags if flag.startswith("-")} - set(CHECKED_FLAGS))
    if not extra:  # -m, --info, --config-name ...: Hydra's own business
        resumed = resumed_dir(overrides)
        if resumed is not None:
            overrides = replay(overrides, resumed)
        try:
            cfg = check_command_line(overrides)
            if resumed is not None:
                check_unchanged(resumed, cfg)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if any(flag in ("--cfg", "-c") for flag in flags) and "--resolve" not in flags:
            flags.append("--resolve")
    return [*flags, *overrides, *hydra_rank_overrides(DistEnv.from_env())]


def launch(argv: list[str]) -> None:
    if wants_help(argv):
        print(text())
        return
    import hydra

    sys.argv = [sys.argv[0], *prepare(argv)]
    hydra.main(version_base="1.3", config_path="../conf", config_name="config")(task)()


if __name__ == "__main__":
    launch(sys.argv[1:])
