"""The command line checked before Hydra runs: its composition errors, several lines long and ending with advice that
struct mode rejects, become one line naming the key and the fix."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from train.config import RENAMED, RENAMED_OPTIONS, SWAPPABLE_GROUPS, ConfigError, register


def check_command_line(overrides: list[str], config_name: str = "config") -> None:
    """Compose the config as `python -m train` will, and turn Hydra's composition errors into one line naming the
    key and the fix: a typo names the closest real key, an unknown group option lists the ones there are."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException

    register()
    conf_dir = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        try:
            compose(config_name=config_name, overrides=overrides)
        except MissingConfigException as err:
            raise ConfigError(_missing_option(err)) from None
        except HydraException as err:
            text = f"{err} {err.__cause__ or ''}"
            match = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", text)
            if match is None:
                raise ConfigError(str(err).strip().splitlines()[0]) from None
            key = match.group(1) or match.group(2)
            renamed = next((new for old, new in RENAMED.items() if key in (old, old.rsplit(".", 1)[-1])), None)
            if renamed is not None:
                raise ConfigError(f"{key}: renamed; use {renamed}") from None
            groups = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")]
            known = _dotted_keys(OmegaConf.to_container(compose(config_name=config_name, overrides=groups)))
            raise ConfigError(f"{key}: {_closest(key, known)}") from None


def _closest(key: str, known: list[str]) -> str:
    """The fix for an unknown key: the closest real one (whole, else by its last part)."""
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    leaf = key.rsplit(".", 1)[-1]
    close = [by_leaf[leaf]] if leaf in by_leaf else difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        close = [by_leaf[near[0]]] if near else []
    hint = f"did you mean {close[0]}?" if close else "no such key (`python -m train --cfg job` lists them)"
    if key.split(".", 1)[0] in SWAPPABLE_GROUPS:  # free-form sections: a key of your own is welcome with a +
        hint += f" A new argument for your own class takes a leading +: +{key}=..."
    return hint


def _missing_option(err) -> str:
    """`dataset=imagenet` when conf/dataset/imagenet.yaml does not exist: the options there are."""
    missing = getattr(err, "missing_cfg_file", "") or ""
    group, _, name = missing.rpartition("/")
    options = ", ".join(getattr(err, "options", None) or [])
    if not group:
        return str(err).strip().splitlines()[0]
    if missing in RENAMED_OPTIONS:
        return f"{group}={name}: renamed; use {RENAMED_OPTIONS[missing]}"
    return (f"{group}={name}: no conf/{group}/{name}.yaml; choose one of {options} (or point {group}._target_ at a "
            "class of your own)")


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """The leaf keys of a config, dotted."""
    if not isinstance(node, dict):
        return [prefix] if prefix else []
    keys = []
    for key, value in node.items():
        keys += _dotted_keys(value, f"{prefix}.{key}" if prefix else str(key))
    return keys
