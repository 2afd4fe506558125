"""Hydra callback of a tune sweep (the template's `python -m train.tune`): checks the whole sweep first, shows
progress, writes the report.

on_multirun_start has the template's `check` compose and validate every job before the first starts (a bad value
names its key);
on_multirun_end gathers the jobs' result.json into a table, results.csv/json and tune.png and, with
tune.autotune=true, writes the chosen setting as a hardware profile.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from tqdm import tqdm

from loadout.errors import ConfigError
from loadout.tune.profile import default_profile, pick_best, profile_text, write_profile
from loadout.tune.report import describe_machine, gather, machine_info, table, write_report
from loadout.tune.timing import progress_bar


def _exit(err: ConfigError) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


class TuneCallback(Callback):
    """`check(config_name, overrides)` composes and validates every job, returning how many (conf/tune.yaml hands
    in the template's, as a partial)."""

    def __init__(self, check: Callable[[str, list[str]], int]) -> None:
        self.check = check
        self.bar: tqdm | None = None

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs) -> None:
        searchpath = [o for o in config.hydra.overrides.hydra if o.startswith("hydra.searchpath")]
        try:
            jobs = self.check(config_name or "tune", [*searchpath, *config.hydra.overrides.task])
        except ConfigError as err:
            _exit(err)
        self.bar = progress_bar(jobs, "tune sweep", config.trainer.progress, unit="setting")

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.bar is not None:
            self.bar.close()
        self.report(config, Path(config.hydra.sweep.dir), gather(Path(config.hydra.sweep.dir)))

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        run_dir = Path(config.hydra.run.dir)
        result = run_dir / "result.json"
        if result.is_file():
            self.report(config, run_dir, [json.loads(result.read_text())])

    @staticmethod
    def report(config: DictConfig, out_dir: Path, results: list[dict]) -> None:
        tune = config.tune
        machine = machine_info()
        best, error = None, None
        if tune.autotune:
            try:
                best = pick_best(results, tune.memory_budget_mb, tune.tolerance)
            except ConfigError as err:
                error = err
        extra = {"best_job": best["job"] if best else None}
        paths = write_report(out_dir, results, machine, extra, draw=tune.plot)
        dataset = next((r["dataset"] for r in results if r.get("dataset")), None)
        print(f"\nloadout tune on {describe_machine(machine)}")
        if dataset:
            print(f"dataset {dataset['name']} at {dataset['root']}: {dataset['batches_per_epoch']} batches of "
                  f"{dataset['images_per_epoch'] // dataset['batches_per_epoch']} images per epoch")
        print(table(results, extra["best_job"]))
        print("report: " + ", ".join(str(p) for p in paths.values()))
        if error is not None:
            _exit(error)
        if best is not None:
            text = profile_text(best, describe_machine(machine), dataset, tune.memory_budget_mb)
            path = write_profile(text, Path(tune.profile_path) if tune.profile_path else default_profile(config))
            print(f"autotune: job {best['job']} written to {path} (use it with hardware="
                  f"{path.stem if path.parent.name == 'hardware' else '<its name>'})")
