"""Typed config schema (registered in Hydra's ConfigStore) and the checks Hydra cannot make.

The schema makes typos and wrong types fail at the command line; `validate` catches the combinations that are
wrong together (e.g. prefetch_factor with num_workers=0) before any DataLoader worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from train.errors import ConfigError

SAMPLERS = ("auto", "random", "sequential", "weighted", "distributed")
MP_CONTEXTS = (None, "fork", "spawn", "forkserver")


# DataLoader knobs that mean something only with workers, and the values that leave each off (the first is set).
WORKER_ONLY_KNOBS: dict[str, tuple] = {
    "prefetch_factor": (None,),
    "persistent_workers": (False,),
    "timeout": (None, 0),
    "multiprocessing_context": (None,),
}


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Keys that were renamed: the old name is refused in one line naming the new one.
RENAMED = {
    "trainer.amp": "trainer.precision (auto | bf16 | fp16 | fp32; auto picks bf16 where the device runs it natively)",
    "trainer.cpu_bf16": "trainer.precision (auto | bf16 | fp32 on a CPU; auto = bf16 where the CPU has it natively)",
    "trainer.tensorboard": "the logger group (a list of trackers: logger=[tensorboard,csv]; logger=[] for none)",
    "data.dataset": "dataset=<name> (the dataset group: conf/dataset/*.yaml)",
    "trainer.label_smoothing": "task.label_smoothing (task=classification's loss)",
}
# Group options that were renamed: `augment=seed` is refused in one line naming the new option.
RENAMED_OPTIONS = {"augment/seed": "augment=crop_flip"}

# `_target_` specs (conf/<group>/)
SWAPPABLE_GROUPS = ("task", "dataset", "model", "optimizer", "scheduler", "augment")


@dataclass
class DataConfig:
    """Where the dataset lives, the image sizes, and every DataLoader knob under DataLoader's own name."""

    root: str = "data/synthetic"
    image_size: int = 64
    resize_size: int | None = None  # default: image_size * 256 / 224 (the ImageNet recipe)
    # DataLoader knobs. batch_size is per process (per GPU) under torchrun.
    batch_size: int = 32
    shuffle: bool = True
    sampler: str = "auto"
    num_workers: Any = "auto"  # an integer, or "auto" = floor(0.75 * usable cores / processes on this node)
    pin_memory: bool = False
    prefetch_factor: int | None = None  # batches per worker; None = DataLoader's default
    persistent_workers: bool = False
    drop_last: bool = True
    timeout: float | None = None  # seconds a worker may take for one batch; null = 600 with workers, 0 = forever
    multiprocessing_context: str | None = None
    in_order: bool = True
    # Host-to-device path.
    non_blocking: bool = True
    device_transforms: bool = True  # uint8 to the device, normalize there
    # Data-path extras.
    scaled_decode: bool = True  # decode large JPEGs at the DCT scale (1/2, 1/4, 1/8) the resize needs, not whole
    cache_bytes: int = 0  # shared-memory cache of decoded training samples (JPEG datasets); 0 = off
    on_bad_sample: str = "warn"  # warn (skip and count) | raise
    # cpu: workers decode | device: workers ship encoded bytes, the batch is decoded on the training device
    # (torchcodec: batched nvJPEG on CUDA; train/data/fast/encoded.py)
    decode: str = "cpu"
    # dataset=shards|parquet: where shards from http(s):// or s3:// are kept on this node (null:
    # ~/.cache/loadout/shards), the cache's bound in bytes (0: none; least recently used shards go), the shards
    # shuffled together (null: sized from their labels, train/data/remote/shard_order.py: 4 where they look shuffled,
    # enough to mix label-sorted ones up to 65,536 samples), and how many shards past the one being read are fetched
    # ahead (0: none)
    shard_cache_dir: str | None = None
    shard_cache_bytes: int = 0
    shuffle_window: int | None = None
    prefetch_shards: int = 8
    # between epochs, more workers (within the cores' share and memory), then a deeper prefetch, where the epoch's
    # diagnosis says the workers are the bound; fewer when memory nears its limit (train/data/loader/autotune.py)
    autotune: bool = False


@dataclass
class ProfilerConfig:
    """trainer.profiler (debug=profiler; train/loop/profiling.py): torch.profiler over `active` steps after `wait` +
    `warmup`."""

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
    mode: str = "train"  # train | validate (evaluate trainer.resume's checkpoint on the val split, one metrics row)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    epochs: int = 3
    max_steps: int | None = None  # stop after this many optimizer steps in total (smoke runs)
    grad_accum_steps: int = 1
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 (train/loop/precision.py: auto = bf16 where native)
    # samples per forward/backward; the optimizer still steps once per data.batch_size batch. null = the whole batch;
    # auto = the whole batch, halved on running out of GPU memory (train/loop/step.py)
    micro_batch_size: Any = None
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune | ...
    seed: int = 0
    deterministic: bool = False
    resume: str | None = None  # auto | path to a checkpoint | null; a torchrun restart always continues its run dir
    checkpoint_every_steps: int | None = None  # also saves the data loader's mid-epoch position
    dist_timeout_s: float | None = None  # a collective that waits longer fails; null = max(600, data.timeout + 300)
    ddp: str = "auto"  # auto = DDP when torchrun starts more than one process; always = for a single one too
    keep_checkpoints: int = 2  # last.pt and the ones before it (last.1.pt, ...): resume=auto takes the newest readable
    on_nonfinite: str = "stop"  # a NaN/inf loss: stop (the checkpoints keep the last finite state) | skip the step
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


@dataclass
class LoadoutConfig:
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The swappable concerns: config groups of `_target_` specs (conf/<group>/*.yaml), built with instantiate.
    task: Any = None  # what is learned: its loss, evaluation figures and best rule (train/task/)
    dataset: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    augment: Any = None
    # name -> {_target_: importable class, its arguments}: objects the Trainer calls back (train/loop/engine.py)
    callbacks: dict[str, Any] = field(default_factory=dict)
    # name -> tracker spec: the `logger` group, a list (logger=[tensorboard,mlflow]); train/observe/trackers/
    logger: dict[str, Any] = field(default_factory=dict)


def _if_cuda(on_cuda: Any, otherwise: Any) -> Any:
    return on_cuda if torch.cuda.is_available() else otherwise


def register() -> None:
    """Register the schema and resolvers; safe to call more than once."""
    ConfigStore.instance().store(name="loadout_schema", node=LoadoutConfig)
    if not OmegaConf.has_resolver("if_cuda"):
        OmegaConf.register_new_resolver("if_cuda", _if_cuda)
    if not OmegaConf.has_resolver("run_dir_name"):
        from train.run.run_dir import run_dir_name

        OmegaConf.register_new_resolver("run_dir_name", run_dir_name, use_cache=True)


def drop_worker_knobs(cfg: Any, typed: set[str] = frozenset()) -> list[str]:
    """With data.num_workers=0 the worker-only knobs mean nothing: those not `typed` on the command line (a
    profile's, a sweep's) are turned off, so `hardware=a100 data.num_workers=0` works. Returns the keys changed."""
    changed = []
    if cfg.data.num_workers != 0:
        return changed
    for key, off in WORKER_ONLY_KNOBS.items():
        if cfg.data[key] not in off and f"data.{key}" not in typed:
            cfg.data[key] = off[0]
            changed.append(f"data.{key}")
    return changed


def shown(value: Any) -> str:
    """A value as it is typed on the command line: null, true, 'text', 2."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _fail(key: str, value: Any, fix: str) -> None:
    raise ConfigError(f"{key}={shown(value)}: {fix}")


def validate(cfg: Any) -> None:
    """Reject settings that are wrong together, naming the key and the fix. Runs before any worker starts."""
    data, trainer = cfg.data, cfg.trainer
    for group in SWAPPABLE_GROUPS:
        if not OmegaConf.select(cfg, f"{group}._target_"):
            _fail(f"{group}._target_", None, f"pick a {group} (e.g. {group}=<name of a conf/{group}/*.yaml>) or set "
                  f"{group}._target_=your.module.Class")
    if data.sampler not in SAMPLERS:
        _fail("data.sampler", data.sampler, f"choose one of {', '.join(SAMPLERS)}")
    if data.multiprocessing_context not in MP_CONTEXTS:
        _fail("data.multiprocessing_context", data.multiprocessing_context, "choose null, fork, spawn or forkserver")
    if data.on_bad_sample not in ("warn", "raise"):
        _fail("data.on_bad_sample", data.on_bad_sample, "choose warn or raise")
    if data.decode not in ("cpu", "device"):
        _fail("data.decode", data.decode, "choose cpu (workers decode) or device (decoded on the training device)")
    if data.decode == "device" and not data.device_transforms:
        _fail("data.decode", data.decode, "decoded on the device, images are normalized there too: set "
              "data.device_transforms=true")
    if data.decode == "device" and data.cache_bytes:
        _fail("data.cache_bytes", data.cache_bytes, "the sample cache holds CPU-decoded pixels: set it to 0 with "
              "data.decode=device")
    nw = data.num_workers
    if not (nw == "auto" or (isinstance(nw, int) and not isinstance(nw, bool))):
        _fail("data.num_workers", nw, "use an integer >= 0 or auto")
    for key in ("batch_size", "image_size"):
        if getattr(data, key) < 1:
            _fail(f"data.{key}", getattr(data, key), "use a positive integer")
    for key in ("timeout", "cache_bytes", "shard_cache_bytes", "prefetch_shards"):
        if (getattr(data, key) or 0) < 0:
            _fail(f"data.{key}", getattr(data, key), "use a number >= 0")
    if data.shuffle_window is not None and data.shuffle_window < 1:
        _fail("data.shuffle_window", data.shuffle_window, "use an integer >= 1, or null to size it from the shards' "
              "labels")
    if data.resize_size is not None and data.resize_size < data.image_size:
        _fail("data.resize_size", data.resize_size, f"use a size >= data.image_size ({data.image_size}) or null")
    if isinstance(nw, int) and nw < 0:
        _fail("data.num_workers", nw, "use an integer >= 0 or auto")
    if data.prefetch_factor is not None and data.prefetch_factor < 1:
        _fail("data.prefetch_factor", data.prefetch_factor, "use an integer >= 1 or null")
    for key, off in WORKER_ONLY_KNOBS.items():
        if nw == 0 and data[key] not in off:
            _fail(f"data.{key}", data[key], f"only valid with data.num_workers > 0: set data.{key}={shown(off[0])} "
                  "or raise data.num_workers")
    for key in ("epochs", "grad_accum_steps"):
        if getattr(trainer, key) < 1:
            _fail(f"trainer.{key}", getattr(trainer, key), "use a positive integer")
    if trainer.dist_timeout_s is not None and trainer.dist_timeout_s <= (data.timeout or 0):
        _fail("trainer.dist_timeout_s", trainer.dist_timeout_s, f"use more than data.timeout ({data.timeout}), so a "
              "stuck worker's error (naming its file) comes before the collectives' timeout; or null")
    if trainer.on_nonfinite not in ("stop", "skip"):
        _fail("trainer.on_nonfinite", trainer.on_nonfinite, "use stop or skip")
    for key in ("keep_checkpoints", "nonfinite_skips"):
        if getattr(trainer, key) < 1:
            _fail(f"trainer.{key}", getattr(trainer, key), "use a positive integer")
    for key in ("max_steps", "checkpoint_every_steps"):
        value = getattr(trainer, key)
        if value is not None and value < 1:
            _fail(f"trainer.{key}", value, "use a positive integer or null")
    if trainer.precision not in ("auto", "bf16", "fp16", "fp32"):
        _fail("trainer.precision", trainer.precision, "use auto, bf16, fp16 or fp32")
    if trainer.precision == "fp16" and trainer.device == "cpu":
        _fail("trainer.precision", "fp16", "fp16 (with its GradScaler) is for CUDA; on a CPU use bf16, fp32 or auto")
    if trainer.limit_batches is not None and trainer.limit_batches < 1:
        _fail("trainer.limit_batches", trainer.limit_batches, "use a positive integer or null")
    if trainer.overfit_batches < 0:
        _fail("trainer.overfit_batches", trainer.overfit_batches, "use 0 (off) or a positive integer")
    if trainer.overfit_batches and trainer.limit_batches is not None:
        _fail("trainer.limit_batches", trainer.limit_batches, "trainer.overfit_batches already limits the batches: "
              "set one of them (the other null / 0)")
    if trainer.progress_every_s <= 0:
        _fail("trainer.progress_every_s", trainer.progress_every_s, "use a positive number of seconds")
    for key in ("wait", "warmup", "active"):
        if getattr(trainer.profiler, key) < (1 if key == "active" else 0):
            _fail(f"trainer.profiler.{key}", getattr(trainer.profiler, key), "use a step count (active >= 1)")
    if trainer.grad_clip is not None and trainer.grad_clip <= 0:
        _fail("trainer.grad_clip", trainer.grad_clip, "use a positive norm (e.g. 1.0) or null")
    mbs = trainer.micro_batch_size
    if not (mbs is None or mbs == "auto" or (isinstance(mbs, int) and not isinstance(mbs, bool) and mbs >= 1)):
        _fail("trainer.micro_batch_size", mbs, "use null (the whole batch), auto, or a positive integer")
    if trainer.compile_mode not in COMPILE_MODES:
        _fail("trainer.compile_mode", trainer.compile_mode, f"choose one of {', '.join(COMPILE_MODES)}")
    lr = OmegaConf.select(cfg, "optimizer.lr")
    if lr is not None and lr <= 0:
        _fail("optimizer.lr", lr, "use a positive learning rate")
    if trainer.mode not in ("train", "validate"):
        _fail("trainer.mode", trainer.mode, "use train or validate")
    if trainer.mode == "validate" and trainer.resume in (None, "auto"):
        _fail("trainer.resume", trainer.resume, "trainer.mode=validate evaluates a checkpoint: set trainer.resume to "
              "its path (e.g. outputs/<run>/checkpoints/best.pt)")
    if trainer.metrics_port is not None and not 1 <= trainer.metrics_port <= 65535:
        _fail("trainer.metrics_port", trainer.metrics_port, "use a TCP port 1-65535 (e.g. 9400) or null")
    if trainer.device != "auto" and trainer.device != "cpu" and not trainer.device.startswith("cuda"):
        _fail("trainer.device", trainer.device, "use auto, cpu, cuda or cuda:N")
    if trainer.device.startswith("cuda:") and not trainer.device[5:].isdigit():
        _fail("trainer.device", trainer.device, "use auto, cpu, cuda or cuda:N")
    if trainer.resume not in (None, "auto") and not Path(trainer.resume).is_file():
        _fail("trainer.resume", trainer.resume, "no such checkpoint file: use auto, null, or a path to a .pt file")
