"""`trainer.resume=auto hydra.run.dir=<run dir>` continues that run as it was set up, not as this machine's defaults
would set it up now.

The run's own overrides (`.hydra/overrides.yaml`, then those of each resume before, `.hydra/resumes.yaml`) are
replayed first and the command line's apply on top, so `trainer.epochs=5` extends the run and everything else
(a logger, a 1-epoch plan) stays. What cannot change mid-run (the model, the dataset, the optimizer, ...) is refused
in one line before Hydra starts; what only the run finds (another batch size mid-epoch, a run dir in use) fails
before rank 0 records anything, so a refused resume leaves the run dir as it was. An accepted one leaves `.hydra/` as
the run began and appends its own overrides to `.hydra/resumes.yaml`. A new run's `.hydra/config.yaml` holds the
frozen keys resolved (`data.image_size: 224` where Hydra saved `${if_cuda:224,64}`): a GPU run resumed on a CPU
box is checked against what it trained with, not what the interpolation gives there.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loadout.build import current_target
from loadout.credentials import without_credentials
from loadout.errors import ConfigError, first_line, shown

RESUMES = "resumes.yaml"
MASKED = "://***@"  # a URL's credentials as loadout/credentials.py leaves them in .hydra/
MOVED_KEYS = {  # keys a run's saved overrides may still use
    "trainer.label_smoothing": "task.label_smoothing",
    # the store's knobs, now the sharded dataset's own (conf/dataset/shards.yaml, parquet.yaml)
    "data.shard_cache_dir": "dataset.cache_dir",
    "data.shard_cache_bytes": "dataset.cache_bytes",
    "data.shuffle_window": "dataset.shuffle_window",
    "data.prefetch_shards": "dataset.prefetch_shards",
}
# What a checkpoint's weights, optimizer state and data stream are tied to: changing one is a new run.
FROZEN = ("model", "task._target_", "dataset._target_", "augment._target_", "optimizer._target_",
          "scheduler._target_", "data.image_size")


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def value_of(argv: list[str], key: str) -> str | None:
    """The last value `argv` gives `key`, or None."""
    return next((o.split("=", 1)[1] for o in reversed(argv) if "=" in o and key_of(o) == key), None)


def resumed_dir(argv: list[str]) -> Path | None:
    """The run dir this command continues: trainer.resume=auto and hydra.run.dir naming a dir with the run's saved
    overrides and a checkpoint; None for a new run (also when there is nothing to resume there)."""
    run_dir = value_of(argv, "hydra.run.dir")
    if value_of(argv, "trainer.resume") != "auto" or run_dir is None:
        return None
    from loadout.runtime.checkpoint import candidates  # torch: only a resume pays for it before Hydra starts

    run_dir = Path(run_dir)
    return run_dir if (run_dir / ".hydra" / "overrides.yaml").is_file() and candidates(run_dir) else None


def saved_overrides(run_dir: Path) -> list[str]:
    """The run's overrides: those it started with, then each accepted resume's."""
    hydra_dir = run_dir / ".hydra"
    overrides = _read_list(hydra_dir / "overrides.yaml")
    resumes = hydra_dir / RESUMES
    for entry in _read_list(resumes) if resumes.is_file() else []:
        found = entry.get("overrides") if isinstance(entry, dict) else None
        if not isinstance(found, list):
            raise ConfigError(f"{resumes}: an entry without a list of overrides ({entry!r}); repair it (each is "
                              "`- at: <time>` with `overrides: [...]`)")
        overrides += found
    return [str(override) for override in overrides]


def replay(argv: list[str], run_dir: Path) -> list[str]:
    """The run's overrides, then `argv`'s (a key set in both: `argv`'s value; a group `argv` chooses again: none of
    the run's keys inside it), and `.hydra/` left as it is. A URL
    whose credentials were masked in `.hydra/` cannot be replayed: it must be given again."""
    given = {key_of(o): o for o in argv}
    regrouped = {key for key in given if "." not in key}  # `dataset=csv` chooses the group's keys afresh
    saved_config = run_dir / ".hydra" / "config.yaml"
    saved = OmegaConf.load(saved_config) if saved_config.is_file() else OmegaConf.create()
    merged = []
    for override in map(partial(_moved_values_inlined, saved), saved_overrides(run_dir)):
        key = key_of(override)
        if key in MOVED_KEYS:  # a run started before the key moved: its value, under the new name
            section, _, leaf = MOVED_KEYS[key].partition(".")
            if saved.get(section) is not None and leaf not in saved[section]:
                continue  # the run's dataset never read it (a folder's data.shuffle_window): nothing to replay
            override, key = override.replace(key, MOVED_KEYS[key], 1), MOVED_KEYS[key]
        mine = given.get(key)
        if "." in key and key.split(".", 1)[0] in regrouped:
            continue
        if mine is None:
            if MASKED in override:
                raise ConfigError(f"{key}: the run's URL had credentials, masked in .hydra/; give {key}=... again "
                                  f"(or {key}='${{oc.env:VAR}}')")
            merged.append(override)
        elif override.startswith("+") and not mine.startswith(("+", "~")):  # a key the run added: still added here
            argv = [f"+{o}" if o is mine else o for o in argv]
    return [*merged, *argv, "hydra.output_subdir=null"]


def _moved_values_inlined(saved: DictConfig, override: str) -> str:
    """`override` with `${data.shard_cache_dir}` (a key that has moved, as an old run's own mix source spec may
    quote it) replaced by the value the run had, which no config holds under that name now."""
    for old in MOVED_KEYS:
        if f"${{{old}}}" in override:
            value = OmegaConf.select(saved, old, default=None, throw_on_resolution_failure=False)
            override = override.replace(f"${{{old}}}", "null" if value is None else str(value))
    return override


def check_unchanged(run_dir: Path, cfg: Any) -> None:
    """Refuse in one line a change to what the run's checkpoints are tied to, comparing resolved values: the saved
    ones as the run resolved them (`pin_frozen`), the new ones as this machine does."""
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    for key in FROZEN:
        if _resolved(saved, key) is None:  # a run from before the key existed (task=): it trained with the default
            continue
        before, after = (_current(_flat(_resolved(config, key), key)) for config in (saved, cfg))
        for leaf in sorted(set(before) | set(after)):
            if before.get(leaf) != after.get(leaf):
                raise ConfigError(f"{leaf}={_typed(after.get(leaf))}: the run in {run_dir} has {leaf}="
                                  f"{_typed(before.get(leaf))} and its checkpoints are tied to it; resume it "
                                  "unchanged, or start a new run (another hydra.run.dir) for the change")


def _current(leaves: dict) -> dict:
    """`leaves` with each `_target_` where its module lives now (an older run may name it where it used to be)."""
    return {leaf: current_target(value) if leaf.endswith("_target_") else value for leaf, value in leaves.items()}


def pin_frozen(hydra_dir: Path, cfg: Any) -> None:
    """Write the frozen keys of a new run's `.hydra/config.yaml` as `cfg` (resolved) has them where Hydra saved an
    interpolation, so a resume elsewhere compares with what this run trained with."""
    path = hydra_dir / "config.yaml"
    saved = OmegaConf.load(path)
    changed = False
    for key in FROZEN:
        value = _resolved(cfg, key)
        if _at(OmegaConf.to_container(saved, resolve=False), key) != value:
            OmegaConf.update(saved, key, value, merge=False, force_add=True)
            changed = True
    if changed:
        path.write_text(without_credentials(OmegaConf.to_yaml(saved)))


def record(run_dir: Path, overrides: list[str]) -> None:
    """Append this resume's overrides (those beyond the run's own) to `.hydra/resumes.yaml`, atomically (another
    node may be reading it). A URL's credentials are masked there, so the next resume asks for it again (`replay`)
    rather than replaying `***`."""
    from loadout.runtime.checkpoint import write_atomic

    path = run_dir / ".hydra" / RESUMES
    base = saved_overrides(run_dir)
    entries = _read_list(path) if path.is_file() else []
    entries.append({"at": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "overrides": [without_credentials(o) for o in overrides if o not in base]})
    text = yaml.safe_dump(entries, sort_keys=False)
    write_atomic(path, lambda file: file.write(text.encode()))


def _read_list(path: Path) -> list:
    """A YAML list from the run's record; an unreadable one is one line naming the file."""
    try:
        found = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: unreadable ({first_line(err)}); repair it, or start a new run (another "
                          "hydra.run.dir)") from None
    if not isinstance(found, list | None):
        raise ConfigError(f"{path}: not a YAML list but {type(found).__name__}; repair it, or start a new run "
                          "(another hydra.run.dir)")
    return found or []


def _resolved(cfg: Any, key: str) -> Any:
    """`key`'s value with its interpolations resolved here (`${if_cuda:224,64}`: 64 on a CPU); as typed where one
    cannot be (an unset ${oc.env:...})."""
    try:
        node = OmegaConf.select(cfg, key)
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    except OmegaConfBaseException:
        return _at(OmegaConf.to_container(cfg, resolve=False), key)


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
