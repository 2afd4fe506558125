"""The command line checked before Hydra runs: its composition errors, several lines long and ending with advice that
struct mode rejects, become one line naming the key and the fix. The template hands in its schema (`Schema`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from loadout.errors import ConfigError
from loadout.run.resume_run import MOVED_KEYS

# How a schema type reads in an error: `data.batch_size=abc: takes an integer`.
TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


@dataclass(frozen=True)
class Schema:
    """What a command line is checked against: the config's root dataclass, the groups whose `_target_` may name a
    class of your own (their keys are free-form), what registers the schema and resolvers with Hydra, and the
    template's config folder (conf/: config.yaml and a folder per group)."""

    root: type
    swappable: tuple[str, ...]
    register: Callable[[], None]
    conf: Path

    def options(self, group: str) -> list[str]:
        """The options of a config group: conf/<group>/*.yaml."""
        return sorted(path.stem for path in (self.conf / group).glob("*.yaml"))


def check_command_line(overrides: list[str], schema: Schema, config_name: str = "config") -> DictConfig:
    """Compose the config as `python -m train` will and return it, turning Hydra's composition errors into one line
    naming the key and the fix: a typo names the closest real key, an unknown group option the closest ones there
    are (also in the `optional` groups, which Hydra would silently leave out), a wrong type what the key takes."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException

    schema.register()
    searched = _search_dirs(overrides)
    for override in overrides:
        _check_group_option(override, searched, schema)
    with initialize_config_dir(config_dir=str(schema.conf), version_base="1.3"):
        try:
            return compose(config_name=config_name, overrides=overrides)
        except MissingConfigException as err:
            raise ConfigError(_missing_option(err, schema)) from None
        except HydraException as err:
            cause = err.__cause__
            if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
                raise ConfigError(wrong_type(cause.full_key, overrides, schema.root)) from None
            text = f"{err} {cause or ''}"
            match = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", text)
            if match is None:
                raise ConfigError(str(err).strip().splitlines()[0]) from None
            key = match.group(1) or match.group(2)
            groups = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")]
            known = _dotted_keys(OmegaConf.to_container(compose(config_name=config_name, overrides=groups)))
            moved = f"did you mean {MOVED_KEYS[key]}?" if key in MOVED_KEYS else None
            raise ConfigError(f"{key}: {moved or _closest(key, known, schema.swappable)}") from None


def _closest(key: str, known: list[str], swappable: tuple[str, ...]) -> str:
    """The fix for an unknown key: the closest real one (whole, else by its last part)."""
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    leaf = key.rsplit(".", 1)[-1]
    close = [by_leaf[leaf]] if leaf in by_leaf else difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        close = [by_leaf[near[0]]] if near else []
    hint = f"did you mean {close[0]}?" if close else "no such key (`python -m train --cfg job` lists them)"
    if key.split(".", 1)[0] in swappable:  # free-form sections: a key of your own is welcome with a +
        hint += f" A new argument for your own class takes a leading +: +{key}=..."
    return hint


def _search_dirs(overrides: list[str]) -> list[Path] | None:
    """The `file://` folders a `hydra.searchpath=[...]` override adds (their groups' options count too); None when
    it adds one that is not a folder (`pkg://`), whose options cannot be listed here."""
    dirs: list[Path] = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") != "hydra.searchpath":
            continue
        for entry in filter(None, (part.strip().strip("'\"") for part in value.strip().strip("[]").split(","))):
            if not entry.startswith("file://"):
                return None
            dirs.append(Path(entry.removeprefix("file://")))
    return dirs


def _check_group_option(override: str, searched: list[Path] | None, schema: Schema) -> None:
    """`debug=fast`, `logger=[tensorboard,wandbb]`: every option named must be a conf/<group>/<option>.yaml, or one
    in a folder `hydra.searchpath` adds."""
    key, sep, value = override.partition("=")
    group = key.lstrip("+~").split("@", 1)[0]
    if not sep or "." in group or not (schema.conf / group).is_dir() or searched is None:
        return
    for name in filter(None, (part.strip() for part in value.strip().strip("[]").split(","))):
        if name != "null" and name not in schema.options(group) and not any(
                (folder / group / f"{name}.yaml").is_file() for folder in searched):
            raise ConfigError(_unknown_option(group, name, schema))


def _unknown_option(group: str, name: str, schema: Schema) -> str:
    """One line: the closest options and all of them."""
    known = schema.options(group)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    own = f" (or point {group}._target_ at a class of your own)" if group in schema.swappable else ""
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return f"{group}={name}: no conf/{group}/{name}.yaml; choose one of {', '.join(known)}{own}{hint}"


def _missing_option(err, schema: Schema) -> str:
    """A group option Hydra could not load (one `_check_group_option` did not see, e.g. a nested group)."""
    missing = getattr(err, "missing_cfg_file", "") or ""
    group, _, name = missing.rpartition("/")
    if not group:
        return str(err).strip().splitlines()[0]
    return _unknown_option(group, name, schema)


def wrong_type(key: str, overrides: list[str], root: type) -> str:
    """`data.batch_size=abc`: the key, what it takes (from the schema's `root` dataclass) and the value given."""
    given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+~") == key), "?")
    node: Any = root
    for part in key.split("."):
        node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
    if node is None or node is Any:
        return f"{key}={given}: a value of the wrong type for {key}"
    kinds = typing.get_args(node) or (node,)
    words = [f"one of {', '.join(kind)}" if issubclass(kind, Enum) else TYPE_WORDS.get(kind.__name__, kind.__name__)
             for kind in kinds if kind is not type(None)]
    null = " or null" if type(None) in kinds else ""
    return f"{key}={given}: {key} takes {' or '.join(words)}{null}, not {given!r}"


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """The leaf keys of a config, dotted."""
    if not isinstance(node, dict):
        return [prefix] if prefix else []
    keys = []
    for key, value in node.items():
        keys += _dotted_keys(value, f"{prefix}.{key}" if prefix else str(key))
    return keys
