"""Autotune: pick the fastest measured setting within the memory budget and write it as a hardware profile."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from loadout.errors import ConfigError


def pick_best(results: list[dict], memory_budget_mb: float | None, tolerance: float) -> dict:
    """The fastest measured setting whose peak PSS fits the budget; within `tolerance` of it, the least memory wins."""
    measured = [r for r in results if r["status"] == "ok"]
    if not measured:
        raise ConfigError("tune.autotune=true: no setting was measured successfully; see the table for errors")
    fits = [r for r in measured if memory_budget_mb is None or r["peak_pss_mb"] <= memory_budget_mb]
    if not fits:
        least = min(r["peak_pss_mb"] for r in measured)
        raise ConfigError(f"tune.memory_budget_mb={memory_budget_mb:g}: no setting fits (the smallest peaked at "
                          f"{least:.0f} MiB); raise the budget or sweep fewer data.num_workers")
    fastest = max(r["images_per_s"] for r in fits)
    near = [r for r in fits if r["images_per_s"] >= (1 - tolerance) * fastest]
    return min(near, key=lambda r: (r["peak_pss_mb"], -r["images_per_s"]))


def profile_text(best: dict, machine_line: str, dataset: dict | None, budget: float | None) -> str:
    """A `# @package _global_` profile of the chosen setting, with how and when it was measured."""
    settings = {section: dict(values) for section, values in best["settings"].items() if section != "tune"}
    for key in ("dataset", "root"):
        settings["data"].pop(key, None)
    data_line = f"{dataset['name']} at {dataset['root']} ({dataset['images_per_epoch']} images per epoch)" \
        if dataset else "?"
    how = "training steps" if best["settings"]["tune"]["with_model"] else "the data loader alone"
    stall = f", data stall {100 * best['data_stall_frac']:.0f}%" if best.get("data_stall_frac") is not None else ""
    header = [
        "# @package _global_",
        f"# local: written by `python -m train.tune tune.autotune=true` on {datetime.now():%Y-%m-%d %H:%M}.",
        f"# Machine: {machine_line}.",
        f"# Dataset: {data_line}; measured on {how}, median of {best['settings']['tune']['repeats']} epochs.",
        f"# Chosen: job {best['job']}, {best['images_per_s']:.1f} img/s, peak PSS {best['peak_pss_mb']:.0f} MiB"
        f"{stall} (memory budget: {'none' if budget is None else f'{budget:g} MiB'}).",
        "# Re-run `make tune ARGS=tune.autotune=true` after changing the machine, the dataset or the batch size.",
    ]
    return "\n".join(header) + "\n" + OmegaConf.to_yaml(OmegaConf.create(settings))


def default_profile(config) -> Path:
    """hardware/local.yaml in the sweep's own config folder (Hydra's primary config source): `hardware=local`."""
    folders = [source.path for source in config.hydra.runtime.config_sources
               if source.provider == "main" and source.schema == "file"]
    if not folders:
        raise ConfigError("tune.profile_path: the sweep's config is not a folder on disk; set "
                          "tune.profile_path=<file>.yaml")
    return Path(folders[0]) / "hardware" / "local.yaml"


def write_profile(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
