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

# Hydra's flags and the values each takes (--info's is optional: one of INFO_CHOICES), kept together when the
# overrides are moved before them (argparse takes its positional overrides as one run)
HYDRA_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--config-path": 1, "-cp": 1, "--config-name": 1,
               "-cn": 1, "--config-dir": 1, "-cd": 1, "--experimental-rerun": 1, "--info": "?", "-i": "?",
               "--resolve": 0, "--run": 0, "-r": 0, "--multirun": 0, "-m": 0, "--shell-completion": 0, "-sc": 0,
               "--hydra-help": 0, "--version": 0, "--help": 0, "-h": 0}
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
CHECKED_FLAGS = {"--cfg", "-c", "--package", "-p", "--resolve"}  # with others (-m, --info, ...) Hydra's business


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


def split(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """`argv`'s Hydra flags, each with its values, and its overrides; None when a flag is not Hydra's (its own
    usage error then says so)."""
    flags, overrides, at = [], [], 0
    while at < len(argv):
        arg = argv[at]
        at += 1
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        name, inline, _ = arg.partition("=")
        if name not in HYDRA_FLAGS:
            return None
        count = 0 if inline else HYDRA_FLAGS[name]
        if count == "?":
            count = int(at < len(argv) and argv[at] in INFO_CHOICES)
        flags += argv[at - 1:at + count]
        at += count
    return flags, overrides


def prepare(argv: list[str]) -> list[str]:
    """The arguments Hydra gets: the overrides checked (one line and exit 2 on a bad one), a resume's run replayed,
    `--cfg` printing resolved values, and the quiet overrides of ranks > 0."""
    from loadout.credentials import without_credentials
    from loadout.dist import DistEnv, hydra_rank_overrides
    from loadout.errors import ConfigError
    from loadout.run.overrides import check_command_line
    from loadout.run.resume_run import check_unchanged, replay, resumed_dir
    from train.config import SCHEMA, register

    register()
    quiet = hydra_rank_overrides(DistEnv.from_env())
    parts = split(argv)
    if parts is None:
        return [*argv, *quiet]
    flags, overrides = parts
    if {flag.partition("=")[0] for flag in flags if flag.startswith("-")} <= CHECKED_FLAGS:
        try:
            resumed = resumed_dir(overrides)
            if resumed is not None:
                overrides = replay(overrides, resumed)
            cfg = check_command_line(overrides, SCHEMA)
            if resumed is not None:
                check_unchanged(resumed, cfg)
        except ConfigError as err:
            print(f"error: {without_credentials(str(err))}", file=sys.stderr)
            sys.exit(2)
        if any(flag.partition("=")[0] in ("--cfg", "-c") for flag in flags) and "--resolve" not in flags:
            flags.append("--resolve")
    return [*overrides, *quiet, *flags]


def launch(argv: list[str]) -> None:
    if wants_help(argv):
        print(text())
        return
    import hydra

    sys.argv = [sys.argv[0], *prepare(argv)]
    hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")(task)()


if __name__ == "__main__":
    launch(sys.argv[1:])
