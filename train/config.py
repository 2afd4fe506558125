"""Typed config schema (registered in Hydra's ConfigStore) and the checks Hydra cannot make.

The schema makes typos and wrong types fail at the command line; `validate` catches the combinations that are
wrong together (e.g. prefetch_factor with num_workers=0) before any DataLoader worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from loadout.data.config import DataConfig, check_data
from loadout.errors import bad_value
from loadout.run.overrides import Schema
from loadout.tune import sweep
from train import CONF
from train.loop.config import TrainerConfig, check_trainer

# `_target_` specs (conf/<group>/)
SWAPPABLE_GROUPS = ("task", "dataset", "model", "optimizer", "scheduler", "augment")


@dataclass
class LoadoutConfig:
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The swappable concerns: config groups of `_target_` specs (conf/<group>/*.yaml), built with instantiate.
    task: Any = None  # what is learned: its loss, evaluation figures and best rule (train/task/)
    dataset: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    augment: Any = None
    # name -> {_target_: importable class, its arguments}: objects the Trainer calls back (train/loop/engine.py)
    callbacks: dict[str, Any] = field(default_factory=dict)
    # name -> tracker spec: the `logger` group, a list (logger=[tensorboard,mlflow]); loadout/observe/trackers/
    logger: dict[str, Any] = field(default_factory=dict)


def _if_cuda(on_cuda: Any, otherwise: Any) -> Any:
    import torch  # here: checking a command line composes without torch; resolving this key needs it

    return on_cuda if torch.cuda.is_available() else otherwise


def register() -> None:
    """Register the schema and resolvers; safe to call more than once."""
    ConfigStore.instance().store(name="loadout_schema", node=LoadoutConfig)
    if not OmegaConf.has_resolver("if_cuda"):
        OmegaConf.register_new_resolver("if_cuda", _if_cuda)
    if not OmegaConf.has_resolver("run_dir_name"):
        from loadout.run.run_dir import run_dir_name

        OmegaConf.register_new_resolver("run_dir_name", run_dir_name, use_cache=True)


# What `python -m train`'s command line is checked against (loadout/run/overrides.py), before Hydra runs.
SCHEMA = Schema(LoadoutConfig, SWAPPABLE_GROUPS, register, CONF)


def validate(cfg: Any) -> None:
    """Reject settings that are wrong together, naming the key and the fix. Runs before any worker starts: each
    section's own checks (loadout/data/config.py, train/loop/config.py), then what spans the sections."""
    data, trainer = cfg.data, cfg.trainer
    for group in SWAPPABLE_GROUPS:
        if not OmegaConf.select(cfg, f"{group}._target_"):
            bad_value(f"{group}._target_", None, f"pick a {group} (e.g. {group}=<name of a conf/{group}/*.yaml>) "
                      f"or set {group}._target_=your.module.Class")
    check_data(data)
    check_trainer(trainer, data)
    lr = OmegaConf.select(cfg, "optimizer.lr")
    if lr is not None and lr <= 0:
        bad_value("optimizer.lr", lr, "use a positive learning rate")


def register_tune() -> None:
    """`python -m train.tune`'s: the tune node's schema and the training schema; safe to call more than once."""
    register()
    sweep.register_tune_schema()


def validate_tune(cfg) -> None:
    """The training config's checks plus the tune node's, naming the key and the fix."""
    validate(cfg)
    sweep.check_tune(cfg.tune)


def check_sweep(config_name: str, overrides: list[str]) -> int:
    """Every job of the sweep composed and validated before the first starts; the number of jobs."""
    return sweep.check_sweep(config_name, overrides, validate_tune, LoadoutConfig)
