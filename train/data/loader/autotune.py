"""data.autotune: between epochs, the loader moves toward the measured best, from the doctor's diagnosis.

An epoch whose loop waited on the worker stages (read, decode, augment, collate) with cores free gets the worker
count the doctor says would feed the step's pace, within the cores' share (plan.worker_share) and the memory left;
with the workers at that share, a deeper prefetch. A compute-bound epoch, or one the loader keeps up with, changes
nothing. When RAM or /dev/shm nears its limit it takes a worker away instead. Only between epochs: the training
stream is rebuilt at its position, and a sample is a function of (seed, epoch, index) alone, so the order and the
pixels stay those of a run without autotune. Under DDP every rank applies the smallest of the ranks' choices (one
all-reduce), and the choice is a Stateful part of the checkpoint, so a resume starts with it.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, replace

import psutil

from train.data.loader.plan import LoaderPlan, worker_share
from train.data.loader.shm import SHM_PATH, check_shm
from train.dist import DistEnv, any_rank
from train.observe.doctor import WAITS, Finding
from train.observe.memory import MemorySampler

log = logging.getLogger(__name__)

MAX_PREFETCH = 8  # batches per worker: deeper only smooths jitter further
RESERVE = 0.10  # back off when RAM or /dev/shm has less than this share free


@dataclass(frozen=True)
class Change:
    num_workers: int
    prefetch_factor: int
    why: str


def memory_pressure(shm_path: str = SHM_PATH) -> str | None:
    """Why memory is near its limit (RAM or /dev/shm under RESERVE free), or None."""
    ram = psutil.virtual_memory()
    if ram.available < RESERVE * ram.total:
        return f"{ram.available >> 20} MiB of {ram.total >> 20} MiB RAM free"
    try:
        shm = shutil.disk_usage(shm_path)
    except OSError:
        return None
    if shm.total and shm.free < RESERVE * shm.total:
        return f"{shm.free >> 20} MiB of {shm.total >> 20} MiB /dev/shm free"
    return None


def worker_bytes(sampler: MemorySampler | None) -> int:
    """What one more worker is expected to cost: the mean PSS of the running ones, else the main process's USS."""
    sample = sampler.latest if sampler is not None else None
    if sample is None:
        return psutil.Process().memory_full_info().uss
    workers = list(sample.workers.values())
    return sum(w.pss for w in workers) // len(workers) if workers else sample.main.uss


def decide(finding: Finding | None, plan: LoaderPlan, cap: int, pressure: str | None,
           extra_bytes: int) -> Change | None:
    """The next plan's workers and prefetch, or None to keep `plan`. `cap`: the most workers the cores allow;
    `pressure`: memory near its limit; `extra_bytes`: RAM one more worker costs."""
    workers, prefetch = plan.num_workers, plan.prefetch_factor
    if pressure is not None:
        return Change(workers - 1, prefetch, f"memory near its limit: {pressure}") if workers > 0 else None
    if finding is None or finding.feeder != "workers" or finding.wait_frac <= WAITS:
        return None
    if workers < cap:
        wanted = min(cap, max(workers + 1, math.ceil(finding.worker_s / max(finding.step_s, 1e-9))))
        wanted = min(wanted, workers + max(psutil.virtual_memory().available // max(extra_bytes, 1) - 1, 0))
        grown = replace(plan, num_workers=wanted)
        if wanted > workers and check_shm(grown.shm_bytes - plan.shm_bytes) is None:
            free = cap - workers
            return Change(wanted, prefetch, f"{finding.bound}-bound, {'a core' if free == 1 else f'{free} cores'} "
                                            "free")
        return None
    if workers > 0 and prefetch < MAX_PREFETCH:
        deeper = min(2 * prefetch, MAX_PREFETCH)
        if check_shm(replace(plan, prefetch_factor=deeper).shm_bytes - plan.shm_bytes) is None:
            return Change(workers, deeper, f"{finding.bound}-bound, the workers at the cores' share of {cap}")
    return None


class Autotune:
    """The loader's plan, tuned after each epoch (`after_epoch`); a Stateful part of the checkpoint."""

    def __init__(self, data, env: DistEnv, sampler: MemorySampler | None = None, cores: int | None = None):
        self.data, self.env, self.sampler = data, env, sampler  # data: the DataPipeline
        self.cap = worker_share(env.local_world_size, cores)

    def after_epoch(self, finding: Finding | None) -> Change | None:
        """Collective under DDP: every rank calls it after the same epoch and applies the same change."""
        plan = self.data.plan
        change = decide(finding, plan, self.cap, memory_pressure(), worker_bytes(self.sampler))
        workers, prefetch = (change.num_workers, change.prefetch_factor) if change else \
            (plan.num_workers, plan.prefetch_factor)
        workers, prefetch = -any_rank(-workers), -any_rank(-prefetch)  # the smallest over the ranks
        if (workers, prefetch) == (plan.num_workers, plan.prefetch_factor):
            return None
        why = change.why if change is not None else "another rank's choice"
        self.apply(workers, prefetch, why)
        return Change(workers, prefetch, why)

    def apply(self, workers: int, prefetch: int, why: str) -> None:
        plan = self.data.plan
        if self.env.is_main:
            said = [f"data.{key} {old} -> {new}" for key, old, new in
                    (("num_workers", plan.num_workers, workers), ("prefetch_factor", plan.prefetch_factor, prefetch))
                    if old != new]
            log.info("autotune: %s (%s)", ", ".join(said), why)
        self.data.replan(replace(plan, num_workers=workers, prefetch_factor=prefetch))

    def state_dict(self) -> dict:
        return {"num_workers": self.data.plan.num_workers, "prefetch_factor": self.data.plan.prefetch_factor}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's choice, within this machine's cores."""
        workers = min(int(state["num_workers"]), max(self.cap, self.data.plan.num_workers))
        prefetch = int(state["prefetch_factor"])
        if (workers, prefetch) != (self.data.plan.num_workers, self.data.plan.prefetch_factor):
            self.apply(workers, prefetch, "the checkpoint's choice")
