"""The command line of a Hydra entry point before Hydra sees it (the template's `python -m train`): Hydra's own flags
told from the overrides, the overrides checked in one line (overrides.py), a resume's run replayed (resume_run.py),
and the quiet overrides of ranks > 0. Lazy imports: `--help` and a bad override answer before torch loads."""

from __future__ import annotations

import sys

from loadout.run.overrides import Schema, check_command_line

# Hydra's flags and the values each takes (--info's is optional: one of INFO_CHOICES), kept together when the
# overrides are moved before them (argparse takes its positional overrides as one run)
HYDRA_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--config-path": 1, "-cp": 1, "--config-name": 1,
               "-cn": 1, "--config-dir": 1, "-cd": 1, "--experimental-rerun": 1, "--info": "?", "-i": "?",
               "--resolve": 0, "--run": 0, "-r": 0, "--multirun": 0, "-m": 0, "--shell-completion": 0, "-sc": 0,
               "--hydra-help": 0, "--version": 0, "--help": 0, "-h": 0}
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
CHECKED_FLAGS = {"--cfg", "-c", "--package", "-p", "--resolve"}  # with others (-m, --info, ...) Hydra's business


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


def prepare(argv: list[str], schema: Schema) -> list[str]:
    """The arguments Hydra gets: the overrides checked against the template's `schema` (one line and exit 2 on a bad
    one), a resume's run replayed, `--cfg` printing resolved values, and the quiet overrides of ranks > 0."""
    from loadout.credentials import without_credentials
    from loadout.dist_env import DistEnv, hydra_rank_overrides
    from loadout.errors import ConfigError
    from loadout.run.resume_run import check_unchanged, replay, resumed_dir

    schema.register()
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
            cfg = check_command_line(overrides, schema)
            if resumed is not None:
                check_unchanged(resumed, cfg)
        except ConfigError as err:
            print(f"error: {without_credentials(str(err))}", file=sys.stderr)
            sys.exit(2)
        if any(flag.partition("=")[0] in ("--cfg", "-c") for flag in flags) and "--resolve" not in flags:
            flags.append("--resolve")
    return [*overrides, *quiet, *flags]
