"""One tune job's record around the template's measurement: the settings it applied, the duplicate it can skip, the
CPU precision the sweep's jobs share, and result.json written whatever happened."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from loadout.data.loader.samplers import explain_loader_error
from loadout.runtime.precision import native_bf16
from loadout.tune import cpu_precision

log = logging.getLogger("loadout.tune")

RESULT_FILE = "result.json"
PRECISION_FILE = "precision.json"  # trainer.precision=auto on a CPU: what the sweep's with-model jobs train in
PROFILE_KEYS = {
    "data": ("batch_size", "image_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers",
             "in_order", "multiprocessing_context", "device_transforms"),
    "model": ("name",),
    "trainer": ("device", "precision", "channels_last"),
}


def effective_settings(cfg: DictConfig, num_workers: int, pin_memory: bool) -> dict:
    """The knobs a hardware profile keeps, as the job applied them (resolved workers, pinning as the loader applies
    it), with the dataset and the measuring window: what the report and the written profile show."""
    settings = {section: {key: cfg[section][key] for key in keys if key in cfg[section]}  # a model may have no name
                for section, keys in PROFILE_KEYS.items()}
    settings["data"].update(num_workers=num_workers, pin_memory=pin_memory, dataset=cfg.dataset._target_,
                            root=cfg.data.root)
    settings["tune"] = {key: cfg.tune[key] for key in ("repeats", "warmup_batches", "batches", "with_model")}
    return settings


def measured_config(cfg: DictConfig, num_workers: int, pin_memory: bool) -> dict:
    """The whole config a job measures, as the loader applies it (resolved workers and pinning): two jobs with equal
    ones measure the same thing, whatever else their overrides spelled differently."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config["data"].update(num_workers=num_workers, pin_memory=pin_memory)
    return config


def begin_record(cfg: DictConfig, job: int, num_workers: int, pin_memory: bool, notes: list[str]) -> dict:
    """The job's record before it measures: its overrides, settings, whole config and the knobs dropped."""
    return {"job": job, "overrides": list(HydraConfig.get().overrides.task),
            "settings": effective_settings(cfg, num_workers, pin_memory),
            "config": measured_config(cfg, num_workers, pin_memory),
            "notes": [f"{key} off: num_workers=0" for key in notes]}


def find_duplicate(job_dir: Path, config: dict) -> int | None:
    """The number of an earlier job of this sweep that measured exactly this `measured_config`."""
    for other in sorted(job_dir.parent.glob(f"*/{RESULT_FILE}")):
        if other.parent == job_dir:
            continue
        result = json.loads(other.read_text())
        if result.get("status") == "ok" and result.get("config") == config:
            return result["job"]
    return None


def precision_dir(job_dir: Path) -> Path:
    """Where PRECISION_FILE lives: the sweep's dir for a Hydra multirun (its jobs share it), else the job's own."""
    return job_dir.parent if HydraConfig.get().mode == RunMode.MULTIRUN else job_dir


def read_choices(path: Path) -> dict:
    """PRECISION_FILE's {key: precision}; {} where it is missing, unreadable or cut short (a job killed mid-write
    before writes were atomic, an edit): the next job measures again."""
    try:
        chosen = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return chosen if isinstance(chosen, dict) else {}


def settle_once(cfg: DictConfig, model: torch.nn.Module, device: torch.device, directory: Path,
                num_outputs: int) -> str | None:
    """trainer.precision=auto on a CPU with native bf16: bf16 or fp32 measured once per sweep for each model and
    input (in `directory`'s PRECISION_FILE, by the first job to train it, before its loader's workers start), so every
    job that trains the model trains in it, a job's timing does not include a measurement, and tune.autotune=true
    writes it into hardware=local. None (auto stands) where nothing is to be or could be measured."""
    tc, data = cfg.trainer, cfg.data
    if tc.precision != "auto" or device.type != "cpu" or not native_bf16() or tc.deterministic:
        return None
    micro = data.batch_size if tc.micro_batch_size in (None, "auto") else min(int(tc.micro_batch_size),
                                                                              data.batch_size)
    shape = (min(micro, cpu_precision.PROBE_BATCH), 3, data.image_size, data.image_size)
    path = directory / PRECISION_FILE
    key = json.dumps({"model": OmegaConf.to_container(cfg.model, resolve=True), "outputs": num_outputs,
                      "dataset": cfg.dataset._target_, "input": shape[1:], "micro_batch": micro,
                      "channels_last": tc.channels_last}, sort_keys=True)
    chosen = read_choices(path)
    value = chosen.get(key)
    if value in ("bf16", "fp32"):
        log.info("precision: %s (measured by an earlier job of this sweep)", value)
    else:
        value = cpu_precision.measured(model, shape, tc.channels_last)
        if value is None:
            return None
        chosen[key] = value
        temporary = path.with_name(f".{PRECISION_FILE}.{os.getpid()}")
        temporary.write_text(json.dumps(chosen, indent=2) + "\n")
        os.replace(temporary, path)  # a reader sees the old file or the new one, never half of one
    return value


def run_job(cfg: DictConfig, measure: Callable[[DictConfig, Path, int], dict]) -> dict:
    """`measure(cfg, job_dir, job)` one configuration and write its result.json into the job dir; a failed run is a
    result too."""
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    job = OmegaConf.select(hydra_cfg, "job.num", default=0, throw_on_missing=False) or 0
    try:
        record = measure(cfg, job_dir, job)
    except (RuntimeError, OSError) as err:  # a killed worker, /dev/shm full, out of memory: keep sweeping
        explained = explain_loader_error(err) or err
        log.error("job %d failed: %s", job, explained)
        record = {"job": job, "overrides": list(hydra_cfg.overrides.task), "status": "failed",
                  "error": str(explained)}
    (job_dir / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record
