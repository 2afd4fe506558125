"""`trainer.resume=auto hydra.run.dir=<run dir>` continues that run as it was set up, not as this machine's defaults
would set it up now.

The run's own overrides (`.hydra/overrides.yaml`, then those of each resume before, `.hydra/resumes.yaml`) are
replayed first and the command line's apply on top, so `trainer.epochs=5` extends the run and everything else
(a logger, a 1-epoch plan) stays. What cannot change mid-run (the model, the dataset, the optimizer, ...) is refused
in one line before Hydra starts, so a refused resume writes nothing into the run dir; an accepted one leaves
`.hydra/` as the run began and appends its own overrides to `.hydra/resumes.yaml`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from train.config import ConfigError, shown
from train.credentials import without_credentials

RESUMES = "resumes.yaml"
# What a checkpoint's weights, optimizer state and data stream are tied to: changing one is a new run.
FROZEN = ("model", "dataset._target_", "augment._target_", "optimizer._target_", "scheduler._target_",
          "data.image_size")


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def value_of(argv: list[str], key: str) -> str | None:
    """The last value `argv` gives `key`, or None."""
    return next((o.split("=", 1)[1] for o in reversed(argv) if "=" in o and key_of(o) == key), None)


def resumed_dir(argv: list[str]) -> Path | None:
    """The run dir this command continues: trainer.resume=auto and hydra.run.dir naming a dir with the run's saved
    overrides and a checkpoint; None for a new run (also when there is nothing to resume there)."""
    from train.checkpoint import candidates

    run_dir = value_of(argv, "hydra.run.dir")
    if value_of(argv, "trainer.resume") != "auto" or run_dir is None:
        return None
    run_dir = Path(run_dir)
    return run_dir if (run_dir / ".hydra" / "overrides.yaml").is_file() and candidates(run_dir) else None


def saved_overrides(run_dir: Path) -> list[str]:
    """The run's overrides: those it started with, then each accepted resume's."""
    hydra_dir = run_dir / ".hydra"
    overrides = list(yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or [])
    resumes = hydra_dir / RESUMES
    for entry in (yaml.safe_load(resumes.read_text()) or []) if resumes.is_file() else []:
        overrides += entry.get("overrides", [])
    return overrides


def replay(argv: list[str], run_dir: Path) -> list[str]:
    """The run's overrides, then `argv`'s (a key set in both: `argv`'s value), and `.hydra/` left as it is."""
    given = {key_of(o): o for o in argv}
    merged = []
    for override in saved_overrides(run_dir):
        mine = given.get(key_of(override))
        if mine is None:
            merged.append(override)
        elif override.startswith("+") and not mine.startswith("+"):  # a key the run added: still added here
            argv = [f"+{o}" if o is mine else o for o in argv]
    return [*merged, *argv, "hydra.output_subdir=null"]


def check_unchanged(run_dir: Path, cfg: Any) -> None:
    """Refuse in one line a change to what the run's checkpoints are tied to."""
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=False)
    now = OmegaConf.to_container(cfg, resolve=False)
    for key in FROZEN:
        before, after = _flat(_at(saved, key), key), _flat(_at(now, key), key)
        for leaf in sorted(set(before) | set(after)):
            if before.get(leaf) != after.get(leaf):
                raise ConfigError(f"{leaf}={_typed(after.get(leaf))}: the run in {run_dir} has {leaf}="
                                  f"{_typed(before.get(leaf))} and its checkpoints are tied to it; resume it "
                                  "unchanged, or start a new run (another hydra.run.dir) for the change")


def record(run_dir: Path, overrides: list[str]) -> None:
    """Append this resume's overrides (those beyond the run's own; a URL's credentials masked) to
    `.hydra/resumes.yaml`."""
    base = saved_overrides(run_dir)
    entry = {"at": time.strftime("%Y-%m-%d %H:%M:%S"),
             "overrides": [without_credentials(o) for o in overrides if o not in base]}
    with open(run_dir / ".hydra" / RESUMES, "a") as file:
        yaml.safe_dump([entry], file, sort_keys=False)


def _typed(value: Any) -> str:
    """A value as typed after `key=`: resnet18, 224, null."""
    return value if isinstance(value, str) else shown(value)


def _at(node: Any, key: str) -> Any:
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _flat(node: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    return {leaf: value for key, child in node.items() for leaf, value in _flat(child, f"{prefix}.{key}").items()}
