"""The loader explains itself: at each epoch's end, where a sample's time went (a table in the log, the shares in the
epoch record) and one line naming the bound and the change that would help on this machine and data.

The stage sums come from loadout/data/loader/stages.py (worker stages: read, decode, augment, collate; main: hand-off,
copy) and the loop's wait and compute from loadout/observe/metrics.py's EpochMeter. Worker stages run on `num_workers`
processes at once, so the loader feeds a sample every (worker time a sample / workers); the main process's
hand-off and copy are serial. When the loop waits little the bound is the step itself ("compute") or, with little
room to spare, the loader "keeps up"; otherwise the slowest feeder is the bound, and its largest stage names it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from loadout.data.capabilities import Offers
from loadout.data.loader.plan import usable_cores
from loadout.data.loader.samplers import shards_ahead
from loadout.data.loader.stages import WORKER_STAGES

log = logging.getLogger(__name__)

STAGES = ("read", "decode", "augment", "collate", "handoff", "copy", "wait", "compute")

BOUND_OF = {"read": "read/fetch", "decode": "decode", "augment": "augment", "collate": "hand-off",
            "handoff": "hand-off", "copy": "copy"}
WAITS = 0.10  # the loop waiting longer than this share of the epoch: the loader is the bound
HEADROOM = 2.0  # the loader feeding this many times the step's pace: the step is the bound ("compute")
FETCH_AHEAD = "dataset.prefetch_shards"  # the key of the shards fetched ahead (a shard or store source's own)


@dataclass(frozen=True)
class Machine:
    """What the fixes depend on: this machine, this loader, this source."""

    device: str = "cpu"
    cores: int = 1
    num_workers: int = 0
    pin_memory: bool = False
    device_transforms: bool = True
    decode: str = "cpu"
    cache_bytes: int = 0
    scaled_decode: bool = True
    prefetch_shards: int = 0
    image_size: int = 224
    store: bool = False  # shards or a store the loader fetches from (FETCH_AHEAD applies)
    stored_pixels: bool = False  # packed or decoded samples: nothing to decode
    faster_step: tuple[str, ...] = ("a larger data.batch_size",)  # what a compute-bound run could still change

    @classmethod
    def of(cls, data, plan, source, device: torch.device, trainer=None) -> Machine:
        offers = Offers.of(source)
        return cls(device.type, usable_cores(), plan.num_workers, plan.pin_memory, bool(data.device_transforms),
                   str(data.decode), int(data.cache_bytes), bool(data.scaled_decode), shards_ahead(source),
                   plan.image_size, offers.fetch_shard, offers.decoded or offers.read_crops, faster_step(trainer))


def faster_step(trainer) -> tuple[str, ...]:
    """The step's settings not yet at their faster choice (`trainer`: the trainer section), then the batch size."""
    options = []
    if trainer is not None:
        if str(trainer.precision) == "fp32":
            options.append("trainer.precision=auto (bf16 where it is native and faster)")
        if not trainer.compile:
            options.append("trainer.compile=true")
        if not trainer.channels_last:
            options.append("trainer.channels_last=true")
    return (*options, "a larger data.batch_size")


def per_sample(stages: dict[str, float], record: dict) -> dict[str, float] | None:
    """Seconds a sample spends in each stage, from an epoch's stage sums and its (this rank's) record; None when
    nothing was measured (a replayed overfit epoch)."""
    samples, images = stages.get("samples", 0), record.get("images", 0)
    if samples <= 0 or images <= 0:
        return None
    wait = record["data_wait_frac"] * record["epoch_s"]
    times = {name: stages[name] / samples for name in WORKER_STAGES}
    times.update(handoff=stages["handoff"] / images, copy=stages["copy"] / images, wait=wait / images,
                 compute=(record["epoch_s"] - wait) / images)
    return times


def shares(times: dict[str, float]) -> dict[str, float]:
    """Each stage's share of a sample's time (the figures metrics.jsonl keeps as `<stage>_share`)."""
    total = sum(times.values()) or 1.0
    return {f"{name}_share": times[name] / total for name in STAGES}


def table(times: dict[str, float], machine: Machine) -> str:
    """The stage table of the log: ms a sample and its share, where each stage runs."""
    where = {**dict.fromkeys(WORKER_STAGES, f"{machine.num_workers} workers" if machine.num_workers else "main"),
             "handoff": "main", "copy": "main", "wait": "loop", "compute": "loop"}
    total = sum(times.values()) or 1.0
    rows = [f"  {name:<8} {times[name] * 1e3:9.3f} {times[name] / total:7.1%}  {where[name]}" for name in STAGES]
    return "\n".join(["  stage    ms/sample   share  runs in", *rows])


def _workers_needed(worker_s: float, step_s: float, machine: Machine) -> int | None:
    """The worker count that would feed the step's pace, within the cores (one kept for the main process); None
    when no more fit."""
    most = max(machine.cores - 1, 1)
    if machine.num_workers >= most:
        return None
    return min(most, max(machine.num_workers + 1, math.ceil(worker_s / max(step_s, 1e-9))))


def fixes(stage: str, machine: Machine, worker_s: float, step_s: float) -> list[str]:
    """The changes that would help a loader bound at `stage`, most effective first."""
    out = []
    if stage in WORKER_STAGES:
        workers = _workers_needed(worker_s, step_s, machine)
        if workers is not None:
            out.append(f"data.num_workers={workers} ({machine.cores} cores, {machine.num_workers} workers in use)")
    if stage == "decode":
        if machine.device == "cuda" and machine.decode != "device":
            out.append("data.decode=device (nvJPEG on the GPU)")
        if not machine.cache_bytes and not machine.stored_pixels:
            out.append("the sample cache (data.cache_bytes) or the packed format (dataset=packed) to decode once")
        if not machine.scaled_decode:
            out.append("data.scaled_decode=true")
        out.append(f"a smaller image (data.image_size={machine.image_size} now)")
    elif stage == "read":
        if machine.store:
            out.append(f"{FETCH_AHEAD}={max(2 * machine.prefetch_shards, 4)} (now {machine.prefetch_shards}) "
                       "to fetch further ahead of the workers")
        else:
            out.append("a faster disk (local NVMe), or fewer bytes to read: the sample cache (data.cache_bytes) or "
                       "the packed format (dataset=packed)")
    elif stage == "augment":
        out.append("a cheaper recipe (augment=crop_flip; drop auto_augment)")
    elif stage in ("collate", "handoff"):
        if not machine.device_transforms:
            out.append("data.device_transforms=true (uint8 batches, 4x fewer bytes to hand over)")
        if machine.device == "cuda" and not machine.pin_memory:
            out.append("data.pin_memory=true (batches received on a side thread)")
        out.append(f"a smaller image (data.image_size={machine.image_size} now)")
    elif stage == "copy":
        if machine.device == "cuda" and not machine.pin_memory:
            out.append("data.pin_memory=true (pinned memory copies asynchronously, at full bus speed)")
        if not machine.device_transforms:
            out.append("data.device_transforms=true (uint8 to the device, 4x fewer bytes)")
        out.append(f"a smaller image (data.image_size={machine.image_size} now)")
    return out


def feeders(times: dict[str, float], machine: Machine) -> dict[str, float]:
    """Seconds a sample of each serial feeder of the loop: the workers together (without workers the worker stages
    run in the main process, one sample after another), the hand-off, the copy."""
    worker_s = sum(times[name] for name in WORKER_STAGES)
    return {"workers": worker_s / max(machine.num_workers, 1), "handoff": times["handoff"], "copy": times["copy"]}


def diagnose(times: dict[str, float], wait_frac: float, machine: Machine) -> tuple[str, str]:
    """(the bound, the one line that names it and the fix)."""
    worker_s = sum(times[name] for name in WORKER_STAGES)
    feeders_s = feeders(times, machine)
    step_s = times["compute"]
    slowest = max(feeders_s, key=feeders_s.get)
    if wait_frac < WAITS:
        headroom = step_s / max(feeders_s[slowest], 1e-9)
        if headroom >= HEADROOM:
            return "compute", (f"compute-bound: the step takes {step_s * 1e3:.2f} ms a sample and the loader could "
                               f"feed {headroom:.1f}x that pace (waited {wait_frac:.0%}): a faster step helps "
                               f"({', '.join(machine.faster_step)}); the loader needs no change")
        return "keeps up", (f"the loader keeps up (waited {wait_frac:.0%}, {headroom:.1f}x the step's pace): "
                            "nothing to change")
    stage = max(WORKER_STAGES, key=times.get) if slowest == "workers" else slowest
    bound = BOUND_OF[stage]
    cost = (f"{stage} {times[stage] * 1e3:.2f} ms of {worker_s * 1e3:.2f} ms a sample in "
            f"{machine.num_workers or 'no'} workers" if stage in WORKER_STAGES
            else f"{stage} {times[stage] * 1e3:.2f} ms a sample in the main process")
    fix = "; then ".join(fixes(stage, machine, worker_s, step_s))
    return bound, (f"{bound}-bound: {cost}, the step {step_s * 1e3:.2f} ms; the loop waited {wait_frac:.0%}. "
                   f"Fix: {fix}")


@dataclass(frozen=True)
class Finding:
    """An epoch's diagnosis as figures, for data.autotune (loadout/data/loader/autotune.py)."""

    bound: str
    feeder: str  # the slowest feeder: "workers", "handoff" or "copy"
    wait_frac: float
    worker_s: float  # seconds a sample spends in the worker stages, over all of them
    step_s: float  # the loop's compute a sample
    sample_s: float = 0.0  # the loop's time a sample, waiting included: the pace autotune compares plans by


class Doctor:
    """Per epoch: the stage figures for the record, the table and the diagnosis for the log; `finding` keeps the last
    epoch's for data.autotune."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.finding: Finding | None = None

    def retarget(self, num_workers: int) -> None:
        """The loader now runs `num_workers` (data.autotune changed it)."""
        self.machine = replace(self.machine, num_workers=num_workers)

    def find(self, stages: dict[str, float] | None, record: dict) -> Finding | None:
        """The diagnosis of a stretch of training as figures (an epoch, or data.autotune's window of one), from its
        stage sums and its record ({"images", "data_wait_frac", "epoch_s"}); None when nothing was measured."""
        times = per_sample(stages, record) if stages is not None else None
        return None if times is None else self._finding(times, record["data_wait_frac"])

    def _finding(self, times: dict[str, float], wait_frac: float) -> Finding:
        feeders_s = feeders(times, self.machine)
        return Finding(diagnose(times, wait_frac, self.machine)[0], max(feeders_s, key=feeders_s.get), wait_frac,
                       sum(times[name] for name in WORKER_STAGES), times["compute"], times["wait"] + times["compute"])

    def examine(self, stages: dict[str, float] | None, record: dict, log_it: bool = True) -> dict:
        """The epoch's stage shares and bound (into the record), logged as a table and one line; {} when nothing
        was measured."""
        times = per_sample(stages, record) if stages is not None else None
        self.finding = None
        if times is None:
            return {}
        bound, line = diagnose(times, record["data_wait_frac"], self.machine)
        self.finding = self._finding(times, record["data_wait_frac"])
        if log_it:
            self._log(times, line)
        return {**shares(times), "bound": bound}

    def _log(self, times: dict[str, float], line: str) -> None:
        log.info("where a sample's time went (%d workers):\n%s", self.machine.num_workers, table(times, self.machine))
        log.info("doctor: %s", line)
