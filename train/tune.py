"""`python -m train.tune -m data.num_workers=0,2,4 ...`: measure the data loader on this machine, one Hydra job per
setting. Each job builds the template's data path and, with tune.with_model=true, its model and step from the job's
config (`measure`); the library times it (loadout/tune/timing.py) and keeps its record (job_record.py), and the
sweep's callback (loadout/tune/callback.py, handed train/config.py's `check_sweep` by conf/tune.yaml) checks every job
first, then writes the report and, with tune.autotune=true, a hardware profile.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from loadout.build import instantiate
from loadout.data.config import drop_worker_knobs
from loadout.data.loader.plan import LoaderPlan
from loadout.data.pipeline import build_data, build_sources
from loadout.device import select_device
from loadout.dist import DistEnv, seed_everything
from loadout.errors import ConfigError, bad_value
from loadout.observe.memory import MemorySampler
from loadout.tune.job_record import begin_record, find_duplicate, precision_dir, run_job, settle_once
from loadout.tune.timing import timed_epochs
from train import CONF
from train.config import register_tune, validate_tune
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import build_task

log = logging.getLogger("train.tune")


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
    record = begin_record(cfg, job, num_workers, pin_memory, notes)
    settings = record["settings"]
    duplicate = find_duplicate(job_dir, record["config"])
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


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="tune")
def main(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
        run_job(cfg, measure)
    except ConfigError as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


register_tune()

if __name__ == "__main__":
    main()
