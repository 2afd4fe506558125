"""data.autotune: the loader moves toward the measured best, from the doctor's diagnosis: between epochs, and once
within the first epoch of a long one.

A stretch whose loop waited on the worker stages (read, decode, augment, collate) with cores free gets, in one
change, the worker count the measured pace asks (worker time a sample / the step's time a sample), within the cores
free and the memory left, and at least two batches in flight per worker: each change restarts
the workers, so it goes straight to the target. With the workers at that share, a deeper prefetch only where the
workers keep the step's pace on average and the loop still waited long (over twice WAITS: jitter a deeper queue
absorbs, worth a restart); a loader slower than the step on average gains nothing from it. A compute-bound stretch,
or one the loader keeps up with, changes nothing. When RAM or /dev/shm nears its limit it takes a worker away.
The cores free are this process's share of the cores less what its main process really used over the stretch (its
CPU seconds over the wall seconds, every thread counted; a core counts where a quarter of it is left), and never
fewer than plan.worker_share's 3/4 of the cores:
a main process that mostly waits for its workers leaves its core to them (on 2 cores, 2 workers rather than 1). A
main process without workers loads every sample itself: it is judged by what it keeps once workers load them (the
step, the copy), at the pace the cores then allow, so a decode-bound run goes straight to the cores' worth.
A change is a guess from the diagnosis: the next full stretch on the new plan is measured, and if its samples took
longer than those before the change (by SLOWER), the plan goes back and stays (workers that cost the main process more
in hand-offs than they save it in decoding, on a box whose cores the step already fills).

Within the first epoch this process trains, if it is long enough for a restart to pay off, the loop calls
`during_epoch` after each batch: it measures batches WARMUP..WARMUP+WINDOW (after the start-up) and decides once, at a
batch boundary; the training stream is rebuilt at its position (DataPipeline.replan, as between epochs). A sample is
a function of (seed, epoch, index) alone, so the order and the pixels stay those of a run without autotune. Under
DDP every rank decides at the same batch and applies the smallest of the ranks' choices (one all-reduce each), and
the choice is a Stateful part of the checkpoint, so a resume starts with it.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass, replace

import psutil

from loadout.data.loader.plan import LoaderPlan, usable_cores, worker_share
from loadout.data.loader.shm import SHM_PATH, check_shm
from loadout.data.loader.stages import since
from loadout.dist import DistEnv, any_rank
from loadout.observe.doctor import WAITS, Doctor, Finding
from loadout.observe.memory import MemorySampler

log = logging.getLogger(__name__)

MAX_PREFETCH = 8  # batches per worker: deeper only smooths jitter further
MIN_PREFETCH = 2  # batches per worker when workers are added: one in the main process's hands, one being made
RESERVE = 0.10  # back off when RAM or /dev/shm has less than this share free
WARMUP, WINDOW = 4, 16  # within an epoch: batches skipped (the start-up), then batches measured
LONG = 4  # within an epoch only when at least this many windows' batches follow the measured ones
SLOWER = 1.05  # a change whose plan takes this much longer a sample than the one before it is undone


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


def cores_free(share: int, cores: float, main_cores: float | None) -> int:
    """The most workers: `cores` (this process's share of the machine's) less `main_cores` (what its main process
    used, None before it is measured), a core counted where a quarter of it is free (a worker sharing a core still
    adds to a decode-bound pace; a change that turns out slower is undone), and never fewer than `share`
    (plan.worker_share)."""
    if main_cores is None:
        return share
    return max(share, math.floor(cores - main_cores + 0.75))


def kept_cores(finding: Finding, cores: float) -> float:
    """The cores a main process that loads its own samples would use once workers load them: what it keeps (a
    sample's time less its loading; the step at least) over the pace `cores` then allow."""
    kept = max(finding.sample_s - finding.worker_s, finding.step_s)
    return kept / max(kept, (kept + finding.worker_s) / cores, 1e-9)


def decide(finding: Finding | None, plan: LoaderPlan, cap: int, pressure: str | None,
           extra_bytes: int) -> Change | None:
    """The next plan's workers and prefetch, or None to keep `plan`. `cap`: the most workers the cores allow;
    `pressure`: memory near its limit; `extra_bytes`: RAM one more worker costs."""
    workers, prefetch = plan.num_workers, plan.prefetch_factor
    if pressure is not None:
        return Change(workers - 1, prefetch, f"memory near its limit: {pressure}") if workers > 0 else None
    if finding is None or finding.feeder != "workers" or finding.wait_frac <= WAITS:
        return None
    asked = math.ceil(finding.worker_s / max(finding.step_s, 1e-9))  # the workers that keep the step's pace
    if workers < cap:
        wanted = min(cap, max(workers + 1, asked))
        wanted = min(wanted, workers + max(psutil.virtual_memory().available // max(extra_bytes, 1) - 1, 0))
        grown = replace(plan, num_workers=wanted, prefetch_factor=max(prefetch, MIN_PREFETCH))
        if wanted > workers and check_shm(grown.shm_bytes - plan.shm_bytes) is None:
            free = cap - workers
            return Change(wanted, grown.prefetch_factor,
                          f"{finding.bound}-bound, {'a core' if free == 1 else f'{free} cores'} free")
        return None
    if workers > 0 and asked <= workers and prefetch < MAX_PREFETCH and finding.wait_frac > 2 * WAITS:
        deeper = min(2 * prefetch, MAX_PREFETCH)
        if check_shm(replace(plan, prefetch_factor=deeper).shm_bytes - plan.shm_bytes) is None:
            return Change(workers, deeper, f"{finding.bound}-bound, the workers at the cores' share of {cap} keep "
                                           "the step's pace on average")
    return None


@dataclass(frozen=True)
class Mark:
    """Where a window of an epoch began: the stage sums, the loop's wait, the images, the time."""

    stages: dict[str, float] | None  # None: the loader is not timed
    wait_s: float
    images: int
    at: float
    cpu: float  # the main process's CPU seconds, every thread


def main_cores(mark: Mark | None) -> float | None:
    """The cores the main process used since `mark`: its CPU seconds over the wall seconds."""
    if mark is None:
        return None
    seconds = time.perf_counter() - mark.at
    return (time.process_time() - mark.cpu) / seconds if seconds > 0 else None


class Autotune:
    """The loader's plan, tuned after each epoch (`after_epoch`) and once within a long first epoch
    (`during_epoch`); a Stateful part of the checkpoint."""

    def __init__(self, data, env: DistEnv, sampler: MemorySampler | None = None, cores: int | None = None):
        self.data, self.env, self.sampler = data, env, sampler  # data: the DataPipeline
        self.cap = worker_share(env.local_world_size, cores)
        self.cores = (usable_cores() if cores is None else cores) / max(env.local_world_size, 1)  # this process's
        self._epoch_mark: Mark | None = None  # where the epoch being trained began
        self._first_batch: int | None = None  # the batch this process's first epoch started after
        self._mark: Mark | None = None
        self._within_done = False  # the one within-epoch decision made (or not wanted)
        self._changed_within = False  # this epoch's figures mix two plans: no decision at its end
        self._before: tuple[int, int, float] | None = None  # the last change's plan before it, and its pace
        self.settled = False  # a change was undone: the plan stays (but for memory pressure)

    def epoch_started(self) -> None:
        """Where the main process's CPU use over the epoch is counted from."""
        self._epoch_mark = Mark(None, 0.0, 0, time.perf_counter(), time.process_time())

    def after_epoch(self, finding: Finding | None) -> Change | None:
        """Collective under DDP: every rank calls it after the same epoch and applies the same change."""
        self._within_done = True
        used, self._epoch_mark = main_cores(self._epoch_mark), None
        if self._changed_within:
            self._changed_within = False
            return None
        if self._before is not None:  # the same on every rank: each joins the one all-reduce
            workers, prefetch, before_s = self._before
            self._before = None
            slower = finding is not None and finding.sample_s > SLOWER * before_s
            if any_rank(int(slower)):  # the ranks undo it together
                self.settled = True
                why = (f"{1e3 * finding.sample_s:.2f} ms a sample, {1e3 * before_s:.2f} before the change: undone"
                       if slower else "another rank measured the change slower: undone")
                self.apply(workers, prefetch, why)
                return Change(workers, prefetch, why)
        return self._agree(finding, used)

    def during_epoch(self, batch_in_epoch: int, per_epoch: int, meter, doctor: Doctor) -> Change | None:
        """After each training batch of an epoch (`meter`: its EpochMeter): in the first epoch this process trains,
        if long, the window's diagnosis and the agreed change, applied at this batch boundary; the doctor is told
        the new worker count. Collective at the deciding batch, which is the same on every rank."""
        if self._within_done:
            return None
        if self._first_batch is None:
            self._first_batch = batch_in_epoch - 1
            if per_epoch - self._first_batch < WARMUP + WINDOW * (1 + LONG):
                self._within_done = True
                return None
        done = batch_in_epoch - self._first_batch
        if done >= WARMUP and self._mark is None:
            self._mark = self._mark_now(meter)
        if done < WARMUP + WINDOW:
            return None
        self._within_done = True
        used = main_cores(self._mark)
        now, mark = self._mark_now(meter), self._mark
        seconds = now.at - mark.at
        record = {"images": now.images - mark.images, "epoch_s": seconds,
                  "data_wait_frac": (now.wait_s - mark.wait_s) / seconds if seconds > 0 else 0.0}
        stages = since(now.stages, mark.stages) if now.stages is not None else None
        change = self._agree(doctor.find(stages, record), used)
        if change is not None:
            doctor.retarget(change.num_workers)
            self._changed_within = True
        return change

    def _mark_now(self, meter) -> Mark:
        clocks = getattr(self.data.train, "stages", None)
        return Mark(clocks.snapshot() if clocks is not None else None, meter.data_wait_s, meter.images,
                    time.perf_counter(), time.process_time())

    def _agree(self, finding: Finding | None, used: float | None) -> Change | None:
        """This rank's choice from `finding` (`used`: the cores its main process used meanwhile), the smallest over
        the ranks (one all-reduce each), applied."""
        plan, pressure = self.data.plan, memory_pressure()
        main = used if plan.num_workers else (  # loading every sample itself: what it keeps once workers load them
            kept_cores(finding, self.cores) if finding is not None else None)
        cap = cores_free(self.cap, self.cores, main)
        change = decide(None if self.settled else finding, plan, cap, pressure, worker_bytes(self.sampler))
        workers, prefetch = (change.num_workers, change.prefetch_factor) if change else \
            (plan.num_workers, plan.prefetch_factor)
        workers, prefetch = -any_rank(-workers), -any_rank(-prefetch)  # the smallest over the ranks
        if (workers, prefetch) == (plan.num_workers, plan.prefetch_factor):
            return None
        why = change.why if change is not None else "another rank's choice"
        if not any_rank(int(pressure is not None)):  # a guess (not a memory back-off), measured on the next stretch
            self._before = (plan.num_workers, plan.prefetch_factor, finding.sample_s if finding else math.inf)
        self.apply(workers, prefetch, why)
        return Change(workers, prefetch, why)

    def apply(self, workers: int, prefetch: int, why: str) -> None:
        plan = self.data.plan
        if self.env.is_main:
            said = [f"data.{key} {old} -> {new}" for key, old, new in
                    (("num_workers", plan.num_workers, workers), ("prefetch_factor", plan.prefetch_factor, prefetch))
                    if old != new]
            log.info("autotune: %s (%s)", ", ".join(said), why)
        clocks = getattr(self.data.train, "stages", None)
        self.data.replan(replace(plan, num_workers=workers, prefetch_factor=prefetch))
        if clocks is not None and self.data.train.stages is not None:  # one epoch's sums across the change
            clocks.hand_over(self.data.train.stages)

    def state_dict(self) -> dict:
        return {"num_workers": self.data.plan.num_workers, "prefetch_factor": self.data.plan.prefetch_factor,
                "settled": self.settled, "before": list(self._before) if self._before is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's choice, within this machine's cores."""
        workers = min(int(state["num_workers"]), max(self.cap, math.floor(self.cores), self.data.plan.num_workers))
        prefetch = int(state["prefetch_factor"])
        self.settled = bool(state["settled"])
        before = state["before"]  # a change not yet measured: measured after the resume
        self._before = (int(before[0]), int(before[1]), float(before[2])) if before else None
        if (workers, prefetch) != (self.data.plan.num_workers, self.data.plan.prefetch_factor):
            self.apply(workers, prefetch, "the checkpoint's choice")
