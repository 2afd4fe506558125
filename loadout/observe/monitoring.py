"""Live loader health, the sinks of loadout/observe/metrics.py: rank 0's experiment trackers (the `logger` group,
loadout/observe/trackers/) and a Prometheus endpoint (each rank: port + LOCAL_RANK).

The engine calls `Monitor.on_step` after every step and `Monitor.on_epoch` after every epoch. Per step that
is a clock read until `interval_s` has passed, then one flush of windowed figures (loss, images/s, data-wait
fraction, lr, gradient norm) and, for the trackers, the memory sampler's thread's figures when it sampled within the
window (the loop itself samples only at an epoch's end). Prometheus reads memory at scrape time through a
collector, so worker memory stays live while the loop waits on data or evaluates.
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

from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.observe.memory import MemorySampler
from loadout.observe.meter import EpochMeter
from loadout.observe.metrics import EPOCH, MEMORY, TOTALS, WINDOW, WORKER_MEMORY, memory_figures
from loadout.observe.trackers import FINISHED, Trackers

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
    lr: float | None = None
    grad_norm: float | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def data_wait_frac(self) -> float:
        return min(self.data_wait_s / self.elapsed_s, 1.0) if self.elapsed_s > 0 else 0.0

    def figures(self) -> dict[str, float | None]:
        """The `WINDOW` figures (None: none this window, e.g. no loss when every sample was unreadable)."""
        return {"step": self.step, "loss": self.loss if self.images else None, "images_per_s": self.images_per_s,
                "data_wait_frac": self.data_wait_frac, "first_batch_s": self.first_batch_s, "lr": self.lr,
                "grad_norm": self.grad_norm}


class _WindowTracker:
    """An EpochMeter's running totals as per-window deltas; a new meter (a new epoch) restarts the window."""

    def __init__(self) -> None:
        self._meter: EpochMeter | None = None
        self._images = self._wait = self._loss = self._bad = self._updates = self._norms = 0.0
        self._t = self._last_t = 0.0
        self._last_step = 0

    def note(self, step: int, meter: EpochMeter, now: float, interval_s: float) -> bool:
        """Record a finished step; True when a window is due (interval passed, or an epoch's first step)."""
        fresh = meter is not self._meter
        if fresh:
            self._meter, self._t = meter, meter.start
            self._images = self._wait = self._loss = self._bad = self._updates = self._norms = 0.0
        self._last_step, self._last_t = step, now
        return fresh or now - self._t >= interval_s

    def take(self) -> StepWindow | None:
        """The window up to the last noted step (None when nothing happened since the last take)."""
        meter = self._meter
        if meter is None or self._last_t <= self._t:
            return None
        images, updates, norms = meter.images - self._images, meter.updates - self._updates, meter.grad_norm_sum
        window = StepWindow(
            step=self._last_step, loss=(meter.loss_sum - self._loss) / images if images else math.nan,
            images=int(images), elapsed_s=self._last_t - self._t, data_wait_s=meter.data_wait_s - self._wait,
            bad_samples=int(meter.bad_samples - self._bad), first_batch_s=meter.first_batch_s, lr=meter.lr,
            grad_norm=(norms - self._norms) / updates if updates else None)
        self._images, self._wait, self._updates, self._norms = meter.images, meter.data_wait_s, meter.updates, norms
        self._loss, self._bad = meter.loss_sum, meter.bad_samples
        self._t = self._last_t
        return window


# -- sinks ---------------------------------------------------------------------------------------------------
class _MemoryCollector:
    """Memory read at scrape time: live even while the loop is stalled on data or evaluating (a prometheus_client
    Collector, a Protocol: prometheus_client is imported only by runs that serve metrics)."""

    def __init__(self, sampler: MemorySampler, rank: str):
        self.sampler, self.rank = sampler, rank

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        sample = self.sampler.sample()
        for key, value in memory_figures(self.sampler, sample).items():
            metric = MEMORY[key]
            if metric.prometheus and value is not None:
                family = GaugeMetricFamily(metric.prometheus, metric.doc, labels=["rank"])
                family.add_metric([self.rank], value)
                yield family
        for kind, metric in WORKER_MEMORY.items():
            workers = GaugeMetricFamily(metric.prometheus, metric.doc, labels=["rank", "pid"])
            for pid, memory in sorted(sample.workers.items()):
                workers.add_metric([self.rank, str(pid)], getattr(memory, kind))
            yield workers


class PrometheusSink:
    """An HTTP /metrics endpoint on its own registry; raises ConfigError at start when the port is taken."""

    def __init__(self, port: int, host: str, env: DistEnv, sampler: MemorySampler):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.port = port + env.local_rank
        if self.port > 65535:
            raise ConfigError(f"trainer.metrics_port={port}: port + LOCAL_RANK ({env.local_rank}) exceeds "
                              f"65535; use a base port <= {65535 - env.local_world_size + 1}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.rank = rank = str(env.rank)
        # a gauge's rank child appears on its first set: no fake zeros before the first window
        self.gauges = {key: Gauge(metric.prometheus, metric.doc, labelnames=["rank"], registry=self.registry)
                       for key, metric in (*WINDOW.items(), *EPOCH.items()) if metric.prometheus}
        self.counters = {key: Counter(metric.prometheus, metric.doc, labelnames=["rank"],
                                      registry=self.registry).labels(rank) for key, metric in TOTALS.items()}
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
        for key, value in w.figures().items():
            if value is not None:
                self._set(key, value)
        for key in TOTALS:
            self.counters[key].inc(max(getattr(w, key), 0))

    def write_epoch(self, record: dict) -> None:
        for key, metric in EPOCH.items():
            if metric.prometheus and key in record:
                self._set(key, record[key])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- the interface the engine sees ---------------------------------------------------------------------------
class Monitor:
    """What the engine calls; a Monitor with no sinks does nothing (the default in Trainer)."""

    def __init__(self, trackers: Trackers | None = None, prometheus: PrometheusSink | None = None,
                 sampler: MemorySampler | None = None, interval_s: float = 2.0):
        self.trackers, self.prometheus = trackers or Trackers(), prometheus
        self.sampler = sampler or MemorySampler()
        self.interval_s = interval_s
        self._window = _WindowTracker()

    @classmethod
    def from_config(cls, cfg, env: DistEnv, device: torch.device, run_dir: Path) -> Monitor:
        """From a composed config: the `logger:` section's trackers on rank 0; Prometheus on every rank if
        trainer.metrics_port."""
        sampler = MemorySampler(device)
        tc = cfg.trainer
        prom = PrometheusSink(tc.metrics_port, tc.metrics_host, env, sampler) if tc.metrics_port is not None \
            else None
        return cls(Trackers.from_config(cfg, run_dir, env.is_main), prom, sampler)

    @property
    def enabled(self) -> bool:
        return bool(self.trackers) or self.prometheus is not None

    def on_step(self, step: int, meter: EpochMeter) -> None:
        """After each training step; flushes at most every `interval_s` (and at an epoch's first step)."""
        if self.enabled and self._window.note(step, meter, time.perf_counter(), self.interval_s):
            self._flush(self._window.take(), sample=False)

    def _flush(self, window: StepWindow | None, sample: bool = True) -> None:
        """The window's figures to the sinks; memory as the sampler's thread found it within the window, else (with
        `sample`: once an epoch) sampled now. Reading every process's page tables costs tens of ms: not a step's."""
        if window is None:
            return
        if self.prometheus is not None:
            self.prometheus.write(window)
        if self.trackers:
            scalars = {f"train/{key}": value for key, value in window.figures().items() if key != "step"}
            mem = self.sampler.latest
            if mem is None or mem.taken < time.perf_counter() - window.elapsed_s:  # from before this window
                mem = self.sampler.sample() if sample else None
            if mem is not None:
                scalars.update((f"memory/{key}", value) for key, value in memory_figures(self.sampler, mem).items())
            self.trackers.log_window(window.step, scalars)

    def on_epoch(self, step: int, record: dict) -> None:
        """After each epoch with its (rank-reduced) record: the epoch's last window, then every numeric field
        of the record as `epoch/<key>`."""
        if self.enabled:
            self._flush(self._window.take())
        if self.prometheus is not None:
            self.prometheus.write_epoch(record)
        if self.trackers:
            self.trackers.log_epoch(step, record)

    def close(self, status: str = FINISHED) -> None:
        """After the run: `status` (loadout/observe/trackers: FINISHED, STOPPED, FAILED) closes the trackers' runs."""
        self.sampler.stop()
        self.trackers.finish(status)
        if self.prometheus is not None:
            self.prometheus.close()
