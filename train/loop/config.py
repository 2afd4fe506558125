"""The `trainer:` section: the loop's settings, typed here beside the loop that reads them, with the checks Hydra
cannot make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from loadout.errors import bad_value

# The closed choices, enforced by OmegaConf as the command line is read; a StrEnum equals its text ("bf16").
Mode = StrEnum("Mode", ["train", "validate"])
Precision = StrEnum("Precision", ["auto", "bf16", "fp16", "fp32"])
CompileMode = StrEnum("CompileMode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
Ddp = StrEnum("Ddp", ["auto", "always"])
OnNonfinite = StrEnum("OnNonfinite", ["stop", "skip"])


@dataclass
class ProfilerConfig:
    """trainer.profiler (debug=profiler; loadout/observe/profiling.py): torch.profiler over `active` steps after `wait`
    + `warmup`."""

    enabled: bool = False
    wait: int = 5  # steps skipped first (start-up, the first batches, compilation)
    warmup: int = 2  # steps traced and thrown away (the profiler's own start-up)
    active: int = 5  # steps recorded
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False  # Python stacks in the trace (larger, slower)
    rows: int = 15  # operators in the log's table


@dataclass
class TrainerConfig:
    mode: Mode = Mode.train  # train | validate (evaluate trainer.resume's checkpoint on the val split, one metrics row)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    epochs: int = 3
    max_steps: int | None = None  # stop after this many optimizer steps in total (smoke runs)
    grad_accum_steps: int = 1
    precision: Precision = Precision.auto  # loop/precision.py: auto = bf16 where native
    # samples per forward/backward; the optimizer still steps once per data.batch_size batch. null = the whole batch;
    # auto = the whole batch, halved on running out of GPU memory (train/loop/step.py)
    micro_batch_size: Any = None
    channels_last: bool = False
    compile: bool = False
    compile_mode: CompileMode = CompileMode.default  # torch.compile's mode (reduce-overhead, max-autotune, ...)
    seed: int = 0
    deterministic: bool = False
    resume: str | None = None  # auto | path to a checkpoint | null; a torchrun restart always continues its run dir
    checkpoint_every_steps: int | None = None  # also saves the data loader's mid-epoch position
    dist_timeout_s: float | None = None  # a collective that waits longer fails; null = max(600, data.timeout + 300)
    ddp: Ddp = Ddp.auto  # auto = DDP when torchrun starts more than one process; always = for a single one too
    keep_checkpoints: int = 2  # last.pt and the ones before it (last.1.pt, ...): resume=auto takes the newest readable
    # a NaN/inf loss: stop (the checkpoints keep the last finite state) | skip the step
    on_nonfinite: OnNonfinite = OnNonfinite.stop
    nonfinite_skips: int = 10  # with skip: steps skipped in a row before the run stops anyway
    grad_clip: float | None = None  # clip the gradients' total norm to this (after fp16's unscale); null = off
    progress: bool = True  # a bar on a terminal; in a log (not a terminal) one line every progress_every_s
    progress_every_s: float = 30.0
    # debug=limit / debug=overfit (lightning-hydra-template's sanity checks): at most this many batches of each split
    # an epoch; or train and validate on the first N training batches, the same ones every epoch (loss falls to ~0)
    limit_batches: int | None = None
    overfit_batches: int = 0
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    metrics_port: int | None = None  # Prometheus /metrics on this port + LOCAL_RANK; null = off
    metrics_host: str = "127.0.0.1"  # address the endpoint binds; 0.0.0.0 in a container Prometheus scrapes


def check_trainer(trainer: Any, data: Any) -> None:
    """Reject `trainer:` settings that are wrong together (or with `data:`), naming the key and the fix."""
    for key in ("epochs", "grad_accum_steps"):
        if getattr(trainer, key) < 1:
            bad_value(f"trainer.{key}", getattr(trainer, key), "use a positive integer")
    if trainer.dist_timeout_s is not None and trainer.dist_timeout_s <= (data.timeout or 0):
        bad_value("trainer.dist_timeout_s", trainer.dist_timeout_s, f"use more than data.timeout ({data.timeout}), so "
                  "a stuck worker's error (naming its file) comes before the collectives' timeout; or null")
    for key in ("keep_checkpoints", "nonfinite_skips"):
        if getattr(trainer, key) < 1:
            bad_value(f"trainer.{key}", getattr(trainer, key), "use a positive integer")
    for key in ("max_steps", "checkpoint_every_steps"):
        value = getattr(trainer, key)
        if value is not None and value < 1:
            bad_value(f"trainer.{key}", value, "use a positive integer or null")
    if trainer.precision == "fp16" and trainer.device == "cpu":
        bad_value("trainer.precision", "fp16",
                  "fp16 (with its GradScaler) is for CUDA; on a CPU use bf16, fp32 or auto")
    if trainer.limit_batches is not None and trainer.limit_batches < 1:
        bad_value("trainer.limit_batches", trainer.limit_batches, "use a positive integer or null")
    if trainer.overfit_batches < 0:
        bad_value("trainer.overfit_batches", trainer.overfit_batches, "use 0 (off) or a positive integer")
    if trainer.overfit_batches and trainer.limit_batches is not None:
        bad_value("trainer.limit_batches", trainer.limit_batches, "trainer.overfit_batches already limits the batches: "
              "set one of them (the other null / 0)")
    if trainer.progress_every_s <= 0:
        bad_value("trainer.progress_every_s", trainer.progress_every_s, "use a positive number of seconds")
    for key in ("wait", "warmup", "active"):
        if getattr(trainer.profiler, key) < (1 if key == "active" else 0):
            bad_value(f"trainer.profiler.{key}", getattr(trainer.profiler, key), "use a step count (active >= 1)")
    if trainer.grad_clip is not None and trainer.grad_clip <= 0:
        bad_value("trainer.grad_clip", trainer.grad_clip, "use a positive norm (e.g. 1.0) or null")
    mbs = trainer.micro_batch_size
    if not (mbs is None or mbs == "auto" or (isinstance(mbs, int) and not isinstance(mbs, bool) and mbs >= 1)):
        bad_value("trainer.micro_batch_size", mbs, "use null (the whole batch), auto, or a positive integer")
    if trainer.mode == "validate" and trainer.resume in (None, "auto"):
        bad_value("trainer.resume", trainer.resume, "trainer.mode=validate evaluates a checkpoint: set trainer.resume "
                  "to its path (e.g. outputs/<run>/checkpoints/best.pt)")
    if trainer.metrics_port is not None and not 1 <= trainer.metrics_port <= 65535:
        bad_value("trainer.metrics_port", trainer.metrics_port, "use a TCP port 1-65535 (e.g. 9400) or null")
    if trainer.device != "auto" and trainer.device != "cpu" and not trainer.device.startswith("cuda"):
        bad_value("trainer.device", trainer.device, "use auto, cpu, cuda or cuda:N")
    if trainer.device.startswith("cuda:") and not trainer.device[5:].isdigit():
        bad_value("trainer.device", trainer.device, "use auto, cpu, cuda or cuda:N")
    if trainer.resume not in (None, "auto") and not Path(trainer.resume).is_file():
        bad_value("trainer.resume", trainer.resume, "no such checkpoint file: use auto, null, or a path to a .pt file")
