"""The task a run trains (the `task:` config group): train/task/base.py says what a task owns."""

from __future__ import annotations

from omegaconf import OmegaConf

from train.task.base import Task
from train.task.classification import Classification

__all__ = ["Classification", "Task", "build_task"]

REQUIRED = ("loss", "eval_counts", "num_counts", "figures_of")  # what a Task subclass must implement


def build_task(cfg) -> Task:
    """The task of a composed config (`task._target_`; Classification where the config has no task section), its
    figures added to the metric vocabulary (loadout/observe/metrics.py) before any sink reads it."""
    from loadout.build import instantiate
    from loadout.errors import ConfigError
    from loadout.observe.metrics import use_task_figures

    spec = OmegaConf.select(cfg, "task", default=None)
    task = Classification() if spec is None else instantiate("task", spec)
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={spec._target_}: built a {type(task).__name__}, not a train.task.Task "
                          "subclass (train/task/base.py)")
    missing = [name for name in REQUIRED if getattr(type(task), name) is getattr(Task, name)]
    if missing:  # said before training, not at the first validation
        raise ConfigError(f"task._target_={spec._target_}: define {', '.join(missing)} (train/task/base.py says what "
                          "each returns)")
    use_task_figures(task.figures)
    return task

