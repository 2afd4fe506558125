"""The `tune:` node of a tune sweep (schema + checks), and the sweep checked as a whole before any job runs.

The schema is stored as `tune_schema` = {tune: TuneConfig}; the template's conf/tune.yaml puts it in front of the
training config, so `python -m train` never sees a `tune` key (a stray `tune.*` override still fails there).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from hydra import compose
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from loadout.data.config import drop_worker_knobs
from loadout.errors import ConfigError, bad_value
from loadout.run.overrides import wrong_type


@dataclass
class TuneConfig:
    """How each configuration of the sweep is measured, and what autotune keeps."""

    repeats: int = 3  # epochs measured per configuration: one throughput sample and one first-batch latency each
    warmup_batches: int = 5  # batches at the start of each epoch left out of the throughput
    batches: int | None = 50  # batches timed per epoch after the warm-up; null = the rest of the epoch
    with_model: bool = False  # run real training steps too and report the data-stall fraction
    autotune: bool = False  # write the fastest configuration within memory_budget_mb as a hardware profile
    memory_budget_mb: float | None = None  # peak PSS (main + workers) allowed; null = no limit
    tolerance: float = 0.05  # within this fraction of the fastest, the configuration using less memory wins
    profile_path: str | None = None  # null = conf/hardware/local.yaml (then usable as hardware=local)
    plot: bool = True
    memory_interval_s: float = 0.1  # how often memory and /dev/shm are sampled while a configuration runs


def register_tune_schema() -> None:
    """Store `tune_schema` (conf/tune.yaml lists it first); safe to call more than once.

    A plain dict around the typed node: a dataclass root would refuse the training schema merged after it."""
    ConfigStore.instance().store(name="tune_schema", node={"tune": TuneConfig})


def check_tune(tune) -> None:
    """The `tune:` node's checks, naming the key and the fix."""
    if tune.repeats < 1:
        bad_value("tune.repeats", tune.repeats, "use an integer >= 1 (3 or more shows persistent workers' effect)")
    if tune.warmup_batches < 0:
        bad_value("tune.warmup_batches", tune.warmup_batches, "use an integer >= 0")
    if tune.batches is not None and tune.batches < 1:
        bad_value("tune.batches", tune.batches, "use a positive integer, or null for the rest of each epoch")
    if tune.memory_budget_mb is not None and tune.memory_budget_mb <= 0:
        bad_value("tune.memory_budget_mb", tune.memory_budget_mb, "use a positive number of MiB, or null for no limit")
    if not 0 <= tune.tolerance < 1:
        bad_value("tune.tolerance", tune.tolerance, "use a fraction in [0, 1), e.g. 0.05")
    if tune.memory_interval_s <= 0:
        bad_value("tune.memory_interval_s", tune.memory_interval_s, "use a positive number of seconds")


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper forms them (the cartesian product of `a=1,2` values)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            axes.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            axes.append([f"{key}={override.get_value_element_as_str()}"])
    return [list(combo) for combo in itertools.product(*axes)]


def check_sweep(config_name: str, overrides: list[str], validate: Callable, schema: type) -> int:
    """Compose every job of the sweep and `validate` its config before the first one starts (a wrong type named
    from the `schema` dataclass); returns the number of jobs."""
    jobs = expand_sweep(overrides)
    for job in jobs:
        try:
            cfg = compose(config_name=config_name, overrides=job)
        except HydraException as err:
            if isinstance(err.__cause__, ValidationError) and getattr(err.__cause__, "full_key", None):
                raise ConfigError(wrong_type(err.__cause__.full_key, job, schema)) from None
            cause = str(err.__cause__ or "").splitlines()[:1]
            raise ConfigError("; ".join([str(err).splitlines()[0], *cause])) from err
        OmegaConf.resolve(cfg)
        drop_worker_knobs(cfg)
        validate(cfg)
    return len(jobs)


def default_sweep(cores: int | None = None, cuda: bool | None = None) -> str:
    """`make tune`'s sweep for this machine: the knobs that move the training stream's throughput. Workers 0..cores
    (every count up to 4, then steps of max(2, cores / 8)), so the 0.75 x cores starting point and the counts above
    it are both measured; prefetch_factor 2 (DataLoader's default) and 4, the batches each worker keeps ready to
    ride out slow samples; pin_memory only with CUDA. Not persistent_workers: one loader iterator spans all
    training epochs (loadout/data/loader/stream.py), so its workers never restart and the knob cannot change what is
    timed."""
    import torch  # here: train/config.py imports this module, and checking a command line loads no torch

    from loadout.data.loader.plan import usable_cores

    cores = usable_cores() if cores is None else cores
    cuda = torch.cuda.is_available() if cuda is None else cuda
    start = max(1, int(0.75 * cores))
    step = max(2, cores // 8)
    workers = sorted({0, *range(1, min(cores, 4) + 1), *range(4, cores + 1, step), start, cores})
    pin = "true,false" if cuda else "false"
    return f"data.num_workers={','.join(map(str, workers))} data.prefetch_factor=2,4 data.pin_memory={pin}"
