"""Live loader health, the sinks of train/metrics.py: TensorBoard scalars (rank 0) and a Prometheus endpoint (each
rank: port + LOCAL_RANK).

The engine calls `Monitor.on_step` after every step and `Monitor.on_epoch` after every epoch. Per step that
is a clock read until `interval_s` has passed, then one flush of windowed figures (loss, images/s, data-wait
fraction) and, for TensorBoard, one memory sample. Prometheus reads memory at scrape time through a collector, so
worker memory stays live while the loop waits on data or evaluates.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from train.config import ConfigError
from train.dist import DistEnv
from train.metrics import MIB, EpochMeter, MemorySampler

log = logging.getLogger(__name__)


# -- windowed step figures -----------------------------------------------------------------------------------
@dataclass
class StepWindow:
    """Figures over the steps since the last flush, from an EpochMeter's running totals."""

    step: int
    loss: float
    images: int
    elapsed_s: float
    data_wait_s: float
    bad_samples: int
    first_batch_s: float | None

    @property
    def images_per_s(self) -> float:
        return self.images / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def data_wait_frac(self) -> float:
        return min(self.data_wait_s / self.elapsed_s, 1.0) if self.elapsed_s > 0 else 0.0


class _WindowTracker:
    """An EpochMeter's running totals as per-window deltas; a new meter (a new epoch) restarts the window."""

    def __init__(self) -> None:
        self._meter: EpochMeter | None = None
        self._images = self._wait = self._loss = self._bad = 0.0
        self._t = self._last_t = 0.0
        self._last_step = 0

    def note(self, step: int, meter: EpochMeter, now: float, interval_s: float) -> bool:
        """Record a finished step; True when a window is due (interval passed, or an epoch's first step)."""
        fresh = meter is not self._meter
        if fresh:
            self._meter, self._t = meter, meter.start
            self._images = self._wait = self._loss = self._bad = 0.0
        self._last_step, self._last_t = step, now
        return fresh or now - self._t >= interval_s

    def take(self) -> StepWindow | None:
        """The window up to the last noted step (None when nothing happened since the last take)."""
        meter = self._meter
        if meter is None or self._last_t <= self._t:
            return None
        images = meter.images - self._images
        window = StepWindow(
            step=self._last_step, loss=(meter.loss_sum - self._loss) / images if images else math.nan,
            images=int(images), elapsed_s=self._last_t - self._t, data_wait_s=meter.data_wait_s - self._wait,
            bad_samples=int(meter.bad_samples - self._bad), first_batch_s=meter.first_batch_s)
        self._images, self._wait = meter.images, meter.data_wait_s
        self._loss, self._bad = meter.loss_sum, meter.bad_samples
        self._t = self._last_t
        return window


# -- sinks ---------------------------------------------------------------------------------------------------
class TensorBoardSink:
    """Scalars in the run dir (one event file per process start; resumed runs purge the steps they redo)."""

    def __init__(self, log_dir: Path, flush_secs: int = 10):
        self.log_dir, self.flush_secs = log_dir, flush_secs
        self._writer = None

    def _w(self, step: int):
        if self._writer is None:  # lazily, so a resumed run knows its step and purges the crashed run's tail
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=self.flush_secs)
        return self._writer

    def write(self, step: int, scalars: dict[str, float]) -> None:
        writer = self._w(step)
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class _MemoryCollector(Collector):
    """Memory read at scrape time: live even while the loop is stalled on data or evaluating."""

    def __init__(self, sampler: MemorySampler, rank: str):
        self.sampler, self.rank = sampler, rank

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.sampler.sample()

        def gauge(name: str, doc: str, value: float | None) -> Iterator[GaugeMetricFamily]:
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["rank"])
                family.add_metric([self.rank], value)
                yield family

        yield from gauge("loadout_main_pss_bytes", "PSS of the training process", s.main.pss)
        yield from gauge("loadout_main_uss_bytes", "USS of the training process", s.main.uss)
        for kind in ("pss", "uss"):
            workers = GaugeMetricFamily(f"loadout_worker_{kind}_bytes", f"{kind.upper()} of each DataLoader worker",
                                        labels=["rank", "pid"])
            for pid, memory in sorted(s.workers.items()):
                workers.add_metric([self.rank, str(pid)], getattr(memory, kind))
            yield workers
        yield from gauge("loadout_workers", "Live DataLoader worker processes", len(s.workers))
        yield from gauge("loadout_peak_pss_bytes", "Peak PSS of main + workers", self.sampler.peak_pss)
        yield from gauge("loadout_shm_used_bytes", "/dev/shm bytes in use", s.shm_used)
        yield from gauge("loadout_shm_size_bytes", "/dev/shm size", s.shm_total)
        yield from gauge("loadout_gpu_memory_allocated_bytes", "CUDA memory in tensors", s.gpu_allocated)
        yield from gauge("loadout_gpu_memory_peak_bytes", "Peak CUDA memory in tensors", s.gpu_peak)
        yield from gauge("loadout_gpu_memory_reserved_bytes", "CUDA memory held by the caching allocator",
                         s.gpu_reserved)
        yield from gauge("loadout_gpu_utilization_ratio", "Share of the last NVML sample period a kernel ran",
                         s.gpu_util / 100 if s.gpu_util is not None else None)


GAUGES = {  # key: (metric name, help)
    "step": ("loadout_step", "Optimizer steps taken"),
    "epoch": ("loadout_epoch", "Epochs completed"),
    "loss": ("loadout_train_loss", "Training loss over the last window"),
    "images_per_s": ("loadout_images_per_second", "Training images/s over the last window"),
    "data_wait": ("loadout_data_wait_ratio", "Share of the last window spent waiting for data"),
    "first_batch": ("loadout_first_batch_seconds", "Latency of this epoch's first batch"),
    "val_acc": ("loadout_val_accuracy", "Validation accuracy after the last epoch"),
    "val_loss": ("loadout_val_loss", "Validation loss after the last epoch"),
}
COUNTERS = {
    "images": ("loadout_images", "Training images processed"),
    "wait": ("loadout_data_wait_seconds", "Seconds the training loop waited for data"),
    "train": ("loadout_train_seconds", "Seconds spent in the training loop"),
    "bad": ("loadout_bad_samples", "Samples skipped as unreadable"),
}


class PrometheusSink:
    """An HTTP /metrics endpoint on its own registry; raises ConfigError at start when the port is taken."""

    def __init__(self, port: int, host: str, env: DistEnv, sampler: MemorySampler):
        self.port = port + env.local_rank
        if self.port > 65535:
            raise ConfigError(f"trainer.metrics_port={port}: port + LOCAL_RANK ({env.local_rank}) exceeds "
                              f"65535; use a base port <= {65535 - env.local_world_size + 1}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.rank = rank = str(env.rank)
        # a gauge's rank child appears on its first set: no fake zeros before the first window
        self.gauges = {key: Gauge(name, doc, labelnames=["rank"], registry=self.registry)
                       for key, (name, doc) in GAUGES.items()}
        self.counters = {key: Counter(name, doc, labelnames=["rank"], registry=self.registry).labels(rank)
                         for key, (name, doc) in COUNTERS.items()}
        self.registry.register(_MemoryCollector(sampler, rank))
        try:
            self._server, self._thread = start_http_server(self.port, addr=host, registry=self.registry)
        except OSError as err:
            where = f"{host}:{self.port} (base + LOCAL_RANK {env.local_rank})"
            if err.errno == errno.EADDRINUSE:
                fix = "is already in use: free it, pick another base port, or set trainer.metrics_port=null"
            else:
                fix = f"cannot be served ({err.strerror}): fix trainer.metrics_host or set metrics_port=null"
            raise ConfigError(f"trainer.metrics_port={port}: {where} {fix}") from err
        log.info("metrics for rank %d on http://%s:%d/metrics", env.rank, host, self.port)

    def _set(self, key: str, value: float) -> None:
        self.gauges[key].labels(self.rank).set(value)

    def write(self, w: StepWindow) -> None:
        self._set("step", w.step)
        if w.images:
            self._set("loss", w.loss)
        self._set("images_per_s", w.images_per_s)
        self._set("data_wait", w.data_wait_frac)
        if w.first_batch_s is not None:
            self._set("first_batch", w.first_batch_s)
        for key, value in (("images", w.images), ("wait", w.data_wait_s), ("train", w.elapsed_s),
                           ("bad", w.bad_samples)):
            self.counters[key].inc(max(value, 0))

    def write_epoch(self, record: dict) -> None:
        self._set("epoch", record["epoch"])
        for key in ("val_acc", "val_loss"):
            if key in record:
                self._set(key, record[key])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- the interface the engine sees ---------------------------------------------------------------------------
class Monitor:
    """What the engine calls; a Monitor with no sinks does nothing (the default in Trainer)."""

    def __init__(self, tensorboard: TensorBoardSink | None = None, prometheus: PrometheusSink | None = None,
                 sampler: MemorySampler | None = None, interval_s: float = 2.0):
        self.tensorboard, self.prometheus = tensorboard, prometheus
        self.sampler = sampler or MemorySampler()
        self.interval_s = interval_s
        self._window = _WindowTracker()

    @classmethod
    def from_config(cls, tc, env: DistEnv, device: torch.device, run_dir: Path) -> Monitor:
        """From the `trainer:` section: TensorBoard on rank 0 if trainer.tensorboard; Prometheus on every rank if
        trainer.metrics_port."""
        sampler = MemorySampler(device)
        tb = TensorBoardSink(run_dir) if tc.tensorboard and env.is_main else None
        prom = PrometheusSink(tc.metrics_port, tc.metrics_host, env, sampler) if tc.metrics_port is not None \
            else None
        return cls(tb, prom, sampler)

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.prometheus is not None

    def on_step(self, step: int, meter: EpochMeter) -> None:
        """After each training step; flushes at most every `interval_s` (and at an epoch's first step)."""
        if self.enabled and self._window.note(step, meter, time.perf_counter(), self.interval_s):
            self._flush(self._window.take())

    def _flush(self, window: StepWindow | None) -> None:
        if window is None:
            return
        if self.prometheus is not None:
            self.prometheus.write(window)
        if self.tensorboard is not None:
            mem = self.sampler.latest or self.sampler.sample()  # the sampler's thread keeps `latest` fresh
            self.tensorboard.write(window.step, {
                "train/loss": window.loss if window.images else None,
                "train/images_per_s": window.images_per_s,
                "train/data_wait_frac": window.data_wait_frac,
                "memory/main_pss_mb": mem.main.pss / MIB,
                "memory/workers_pss_mb": sum(w.pss for w in mem.workers.values()) / MIB,
                "memory/workers_uss_mb": sum(w.uss for w in mem.workers.values()) / MIB,
                "memory/peak_pss_mb": self.sampler.peak_pss / MIB,
                "memory/shm_used_mb": mem.shm_used / MIB if mem.shm_used is not None else None,
                "memory/gpu_allocated_mb": mem.gpu_allocated / MIB if mem.gpu_allocated is not None else None,
                "memory/gpu_peak_mb": mem.gpu_peak / MIB if mem.gpu_peak is not None else None,
                "memory/gpu_reserved_mb": mem.gpu_reserved / MIB if mem.gpu_reserved is not None else None,
                "gpu/utilization": mem.gpu_util / 100 if mem.gpu_util is not None else None,
                "loader/workers": len(mem.workers),
            })

    def on_epoch(self, step: int, record: dict) -> None:
        """After each epoch with its (rank-reduced) record: the epoch's last window, then every numeric field
        of the record as `epoch/<key>`."""
        if self.enabled:
            self._flush(self._window.take())
        if self.prometheus is not None:
            self.prometheus.write_epoch(record)
        if self.tensorboard is not None:
            self.tensorboard.write(step, {f"epoch/{key}": float(value) for key, value in record.items()
                                          if isinstance(value, int | float) and key != "epoch"})

    def close(self) -> None:
        self.sampler.stop()
        for sink in (self.tensorboard, self.prometheus):
            if sink is not None:
                sink.close()
