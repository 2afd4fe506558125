"""Building the swappable parts (`_target_` specs of the config groups) with hydra.utils.instantiate, a failure
in one line naming the key."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from omegaconf import OmegaConf

from loadout.errors import ConfigError

# Modules that moved out of the template (train/) into the library (loadout/): a `_target_` that names the old place
# (a config file or override of yours, an older run's saved config) builds from the new one.
MOVED_MODULES = {"train.data.augment.": "train.augment.", "train.data.": "loadout.data.",
                 "train.observe.": "loadout.observe."}


def current_target(target: Any) -> Any:
    """`target` (a `_target_` value) where its module lives now."""
    if isinstance(target, str):
        for old, new in MOVED_MODULES.items():
            if target.startswith(old):
                return new + target[len(old):]
    return target


def _follow_moves(spec: Any) -> Any:
    """`spec` with its `_target_` at its current place (set in place: a copy would lose its interpolations' root)."""
    target = spec.get("_target_") if hasattr(spec, "get") else None
    if current_target(target) != target:
        spec["_target_"] = current_target(target)
    return spec


def instantiate(key: str, spec: Any, *args: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate(spec, ...), a `_target_` that does not import or build failing in one line naming
    `key`."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(_follow_moves(spec), *args, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):  # the target's own one-line error names its key already
            raise err.__cause__ from None
        target = spec.get("_target_") if hasattr(spec, "get") else spec
        if "Error locating target" in str(err) or isinstance(err.__cause__, ImportError):
            raise import_failure(key, target, err) from err
        reason = str(err.__cause__ or err).strip().splitlines()[-1]
        raise ConfigError(f"{key}._target_={target} failed to build: {reason}") from err


def require_extra(module: str, extra: str, key: str):
    """Import an optional library (a tracker's, timm), or fail in one line naming the pip extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{key}: needs {module}, which is not installed ({err}); pip install 'loadout[{extra}]'") \
            from err


def fitted_spec(key: str, spec: Any, optional: tuple[str, ...]) -> Any:
    """`spec` without the `optional` keys its `_target_` does not take: a group's file passes them to loadout's own
    classes (dataset `root`, model `name`), and `<key>._target_=your.Class` on the command line keeps them."""
    from hydra.utils import get_object

    spec = _follow_moves(spec)
    hydra_log = logging.getLogger("hydra.utils")  # get_object logs a failure in several lines, then raises it
    was_disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        target = get_object(spec._target_)
    except Exception as err:  # ImportError, AttributeError, or Hydra's wrapping of them
        raise import_failure(key, spec._target_, err) from err
    finally:
        hydra_log.disabled = was_disabled
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return spec
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return spec
    names = {p.name for p in params}
    resolved = OmegaConf.to_container(spec, resolve=True)  # interpolations (${data.root}) need the whole config
    return OmegaConf.create({k: v for k, v in resolved.items() if k not in optional or k in names})


def import_failure(key: str, target: str, err: BaseException) -> ConfigError:
    """A `_target_` that does not import, in one line naming the key and the module."""
    cause = err.__cause__ or err
    reason = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    module = target.rpartition(".")[0] or target
    return ConfigError(f"{key}._target_={target}: cannot import {target!r} ({reason}); check that module {module!r} "
                       "is on PYTHONPATH and the name is spelt as in the code")
