"""One tune job: the real data path (loadout.data.build_data) and, with tune.with_model=true, the model and step of
python -m train (train/loop/step.py), built from the job's config and timed by loadout/tune/timing.py: the result
record of the job."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from loadout.build import instantiate
from loadout.data import build_data, build_sources
from loadout.data.config import drop_worker_knobs
from loadout.data.loader.plan import LoaderPlan
from loadout.device import select_device
from loadout.dist import DistEnv, seed_everything
from loadout.errors import bad_value
from loadout.observe.memory import MemorySampler
from loadout.runtime.precision import native_bf16
from loadout.tune import cpu_precision
from loadout.tune.timing import timed_epochs
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task
from train.tune.config import validate_tune

log = logging.getLogger("train.tune")

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


def measure(cfg: DictConfig, job_dir: Path, job: int) -> dict:
    """Build the data path from cfg and measure it; returns the job's result record."""
    notes = drop_worker_knobs(cfg)
    validate_tune(cfg)
    env = DistEnv()
    device = select_device(cfg.trainer.device, env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = LoaderPlan.from_config(cfg.data, env, device)
    num_workers, pin_memory = plan.num_workers, plan.pin_memory
    settings = effective_settings(cfg, num_workers, pin_memory)
    config = measured_config(cfg, num_workers, pin_memory)
    record = {"job": job, "overrides": list(HydraConfig.get().overrides.task), "settings": settings,
              "config": config, "notes": [f"{key} off: num_workers=0" for key in notes]}
    duplicate = find_duplicate(job_dir, config)
    if duplicate is not None:
        log.info("job %d measures the same settings as job %d: skipped", job, duplicate)
        return {**record, "status": "duplicate", "duplicate_of": duplicate}

    tune = cfg.tune
    seed_everything(cfg.trainer.seed, env)
    sampler = MemorySampler()  # before the loaders: its /dev/shm figure counts their ring
    recipe = instantiate("augment", cfg.augment)
    task = build_task(cfg)
    pipeline = build_data(cfg.data, build_sources(cfg.dataset, cfg.data, task), recipe, plan.for_task(task), env,
                          device, seed=cfg.trainer.seed, epochs=tune.repeats,  # exactly the epochs measured
                          channels_last=cfg.trainer.channels_last)
    loader = pipeline.train
    if len(loader) <= tune.warmup_batches:
        bad_value("tune.warmup_batches", tune.warmup_batches,
              f"the train loader has only {len(loader)} batches per epoch: lower it, or data.batch_size")
    dataset = {"name": cfg.dataset._target_.rsplit(".", 1)[-1], "root": cfg.data.root, "batches_per_epoch": len(loader),
               "images_per_epoch": len(loader) * cfg.data.batch_size}
    step = None
    if tune.with_model:  # real training steps: the model, optimizer, precision and scaler of python -m train
        outputs = task.num_outputs(pipeline.source)
        model = build_model(cfg.model, outputs, device, channels_last=cfg.trainer.channels_last)
        chosen = settle_once(cfg, model, device, precision_dir(job_dir), outputs)
        if chosen is not None:  # trained in, and written into hardware=local by tune.autotune=true
            cfg.trainer.precision = settings["trainer"]["precision"] = chosen
        step = TrainStep.from_config(cfg, env, device, model, total_steps=tune.repeats * len(loader), task=task)
        step.ddp.train()
        record["precision"] = step.precision
    desc = f"job {job}: workers={num_workers} pin={pin_memory} persistent={cfg.data.persistent_workers}"
    figures = timed_epochs(pipeline, device, sampler, repeats=tune.repeats, warmup=tune.warmup_batches,
                           batches=tune.batches, step=step, desc=desc, show=cfg.trainer.progress,
                           memory_interval_s=tune.memory_interval_s)
    record.update(status="ok", dataset=dataset, **figures)
    return record
