"""trainer.profiler (debug=profiler): torch.profiler over a window of training steps after a warm-up, its trace in
`<run dir>/profiler/` (a Chrome trace: https://ui.perfetto.dev or chrome://tracing open it) and the top operators in
the log, one screen long."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from loadout.dist import DistEnv

log = logging.getLogger(__name__)
VIEWERS = "open it in https://ui.perfetto.dev or chrome://tracing"
QUIET_KINETO = "6"  # KINETO_LOG_LEVEL above USDT (5): libkineto prints nothing


def quiet_without_cuda() -> None:
    """Without CUDA, libkineto's only messages are stage markers and an `ERROR ... gpuGetDeviceCount failed` from
    probing for GPUs when the trace is written: it reads KINETO_LOG_LEVEL when the first profiler starts. A level
    set by the user is kept; with CUDA its messages may matter and are left alone."""
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)


class StepProfiler:
    """Started with the training loop, stepped after each optimizer step; every rank writes its own trace (named
    by host and pid), rank 0 logs the table. `pc`: the trainer.profiler section (wait, warmup, active, rows,
    record_shapes, profile_memory, with_stack)."""

    def __init__(self, pc, run_dir: Path, device: torch.device, env: DistEnv):
        self.pc, self.dir, self.env = pc, run_dir / "profiler", env
        self.sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.written = False
        quiet_without_cuda()
        self._profile = profile(activities=activities,
                                schedule=schedule(wait=pc.wait, warmup=pc.warmup, active=pc.active, repeat=1),
                                on_trace_ready=self._ready, record_shapes=pc.record_shapes,
                                profile_memory=pc.profile_memory, with_stack=pc.with_stack)
        self._profile.start()
        self._running = True

    def _ready(self, prof: profile) -> None:
        before = set(self.dir.glob("*.json*"))
        tensorboard_trace_handler(str(self.dir))(prof)
        self.written = True
        if self.env.is_main:
            trace = next(iter(set(self.dir.glob("*.json*")) - before), self.dir)
            table = prof.key_averages().table(sort_by=self.sort, row_limit=self.pc.rows, max_name_column_width=60)
            log.info("profiler: %d steps traced into %s (%s)\n%s", self.pc.active, trace, VIEWERS, table)

    def step(self) -> None:
        if self._running:
            self._profile.step()

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._profile.stop()
        if not self.written and self.env.is_main:
            pc = self.pc
            log.warning("profiler: the run ended before step %d, the end of its window (trainer.profiler.wait %d + "
                        "warmup %d + active %d): nothing traced; lower them or train longer", pc.wait + pc.warmup +
                        pc.active, pc.wait, pc.warmup, pc.active)
