"""`python -m train.tune -m data.num_workers=0,2,4 ...`: measure the data loader on this machine, one job per setting.

Each job builds the real data path (train.data.build_data), runs `tune.repeats` epochs of it and writes result.json
into its job dir: steady-state images/s (warm-up excluded; median and spread over the epochs), the first-batch
latency of every epoch, peak RSS of the main process plus workers, peak /dev/shm use and, with tune.with_model=true,
the data-stall fraction of real training steps. The sweep's callback (train/tune_callback.py) gathers them.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from train.config import ConfigError, _fail
from train.data.shm import SHM_PATH
from train.dist import DistEnv, seed_everything, select_device
from train.meters import process_tree_rss_mb
from train.tune_config import normalize_worker_knobs, register_tune, validate_tune

log = logging.getLogger("train.tune")
register_tune()

RESULT_FILE = "result.json"
PROFILE_KEYS = {
    "data": ("batch_size", "image_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers",
             "in_order", "multiprocessing_context", "device_transforms"),
    "model": ("name",),
    "trainer": ("device", "amp", "channels_last"),
}
Step = Callable[[torch.Tensor, torch.Tensor], None]


def _shm_used_mb() -> float:
    try:
        return shutil.disk_usage(SHM_PATH).used / 2**20
    except OSError:  # no /dev/shm (macOS, Windows): batches do not pass through it
        return 0.0


class PeakSampler(threading.Thread):
    """Samples RSS of the process tree and /dev/shm use in the background; keeps the peaks."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.shm_base_mb = _shm_used_mb()
        self.peak_rss_mb = process_tree_rss_mb()
        self.peak_shm_mb = 0.0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        self.peak_rss_mb = max(self.peak_rss_mb, process_tree_rss_mb())
        self.peak_shm_mb = max(self.peak_shm_mb, _shm_used_mb() - self.shm_base_mb)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


def training_step(cfg: DictConfig, env: DistEnv, device: torch.device, pipeline, run_dir: Path) -> Step:
    """One real optimizer step with the engine's model, loss, optimizer, precision and scaler."""
    from train.engine import Trainer
    from train.model import build_model

    model = build_model(cfg.model.name, pipeline.num_classes, device, channels_last=cfg.trainer.channels_last)
    trainer = Trainer(cfg, env, device, pipeline, model, run_dir)
    trainer.ddp.train()

    def step(images: torch.Tensor, targets: torch.Tensor) -> None:
        with trainer.autocast():
            loss = trainer.criterion(trainer.forward(images), targets)
        trainer.scaler.scale(loss).backward()
        trainer.scaler.step(trainer.optimizer)
        trainer.scaler.update()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.item()  # waits for the device, so the step's time is real

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epoch(batches, device: torch.device, warmup: int, limit: int | None, step: Step | None, bar) -> dict:
    """Iterate one epoch (or `warmup + limit` batches of it); time the batches after the warm-up."""
    start = time.perf_counter()
    first_batch_s = None
    window_start = start if warmup == 0 else None
    mark = start
    images = wait_s = 0.0
    iterator = iter(batches)
    try:
        for index, (x, y, _bad) in enumerate(iterator):
            arrived = time.perf_counter()
            if first_batch_s is None:
                first_batch_s = arrived - start
            if index >= warmup:
                wait_s += arrived - mark
                images += x.shape[0]
            if step is not None and x.numel():
                step(x, y)
            else:
                _sync(device)
            mark = time.perf_counter()
            bar.update(1)
            if index == warmup - 1:
                window_start = mark
            if limit is not None and index + 1 >= warmup + limit:
                break
    finally:
        iterator.close()  # ends this epoch's worker processes unless they are persistent
    elapsed = mark - window_start if window_start is not None else 0.0
    return {"first_batch_s": first_batch_s, "images": images, "elapsed_s": elapsed,
            "images_per_s": images / elapsed if elapsed > 0 else 0.0,
            "data_stall_frac": wait_s / elapsed if elapsed > 0 else 0.0}


def spread(samples: list[float]) -> float:
    """(max - min) / median: how much the repetitions disagree."""
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else 0.0


def effective_settings(cfg: DictConfig, num_workers: int, pin_memory: bool) -> dict:
    """The knobs a hardware profile keeps, as the job applied them (resolved workers, pinning as the loader applies
    it), with the dataset and the measuring window: what the report and the written profile show."""
    settings = {section: {key: cfg[section][key] for key in keys} for section, keys in PROFILE_KEYS.items()}
    settings["data"].update(num_workers=num_workers, pin_memory=pin_memory, dataset=cfg.data.dataset,
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


def measure(cfg: DictConfig, job_dir: Path, job: int) -> dict:
    """Build the data path from cfg and measure it; returns the job's result record."""
    from train.data import build_data
    from train.data.loader import effective_pin_memory, resolve_num_workers

    notes = normalize_worker_knobs(cfg)
    validate_tune(cfg)
    env = DistEnv()
    device = select_device(cfg.trainer.device, env)
    num_workers = resolve_num_workers(cfg.data.num_workers, env.local_world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pin_memory = effective_pin_memory(cfg.data.pin_memory, device)
    settings = effective_settings(cfg, num_workers, pin_memory)
    config = measured_config(cfg, num_workers, pin_memory)
    record = {"job": job, "overrides": list(HydraConfig.get().overrides.task), "settings": settings,
              "config": config, "notes": [f"{key} off: num_workers=0" for key in notes]}
    duplicate = find_duplicate(job_dir, config)
    if duplicate is not None:
        log.info("job %d measures the same settings as job %d: skipped", job, duplicate)
        return {**record, "status": "duplicate", "duplicate_of": duplicate}

    tune = cfg.tune
    with open_dict(cfg):
        cfg.trainer.epochs = tune.repeats  # the training path is built for exactly the epochs measured
    seed_everything(cfg.trainer.seed, env)
    sampler = PeakSampler(tune.rss_interval_s)
    pipeline = build_data(cfg, env, device)
    loader = pipeline.train_loader
    if len(loader) <= tune.warmup_batches:
        _fail("tune.warmup_batches", tune.warmup_batches,
              f"the train loader has only {len(loader)} batches per epoch: lower it, or data.batch_size")
    dataset = {"name": cfg.data.dataset, "root": cfg.data.root, "batches_per_epoch": len(loader),
               "images_per_epoch": len(loader) * cfg.data.batch_size}
    step = training_step(cfg, env, device, pipeline, job_dir) if tune.with_model else None
    per_epoch = min(len(loader), tune.warmup_batches + (tune.batches or len(loader)))
    desc = f"job {job}: workers={num_workers} pin={pin_memory} persistent={cfg.data.persistent_workers}"
    bar = tqdm(total=tune.repeats * per_epoch, desc=desc, leave=False, disable=not cfg.trainer.progress,
               dynamic_ncols=True)
    epochs = []
    sampler.start()
    try:
        for epoch in range(tune.repeats):
            pipeline.set_epoch(epoch)
            epochs.append(time_epoch(pipeline.on_device(loader), device, tune.warmup_batches, tune.batches, step,
                                     bar))
            sampler.sample()
    finally:
        sampler.stop()
        bar.close()
        pipeline.close()  # persistent workers end here, before the next job's start
    throughput = [e["images_per_s"] for e in epochs]
    record.update(
        status="ok",
        dataset=dataset,
        images_per_s=statistics.median(throughput),
        images_per_s_min=min(throughput),
        images_per_s_max=max(throughput),
        images_per_s_spread=spread(throughput),
        images_per_s_samples=throughput,
        first_batch_s=[e["first_batch_s"] for e in epochs],
        peak_rss_mb=sampler.peak_rss_mb,
        peak_shm_mb=sampler.peak_shm_mb,
        data_stall_frac=statistics.median(e["data_stall_frac"] for e in epochs) if tune.with_model else None,
        timed_batches_per_epoch=per_epoch - tune.warmup_batches,
    )
    return record


def run_job(cfg: DictConfig) -> dict:
    """Measure one configuration and write its result.json into the job dir; a failed run is a result too."""
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    job = OmegaConf.select(hydra_cfg, "job.num", default=0, throw_on_missing=False) or 0
    try:
        record = measure(cfg, job_dir, job)
    except (RuntimeError, OSError) as err:  # a killed worker, /dev/shm full, out of memory: keep sweeping
        from train.data.loader import explain_loader_error

        explained = explain_loader_error(err) or err
        log.error("job %d failed: %s", job, explained)
        record = {"job": job, "overrides": list(hydra_cfg.overrides.task), "status": "failed",
                  "error": str(explained)}
    (job_dir / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


@hydra.main(version_base="1.3", config_path="../conf", config_name="tune")
def main(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
        run_job(cfg)
    except ConfigError as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
