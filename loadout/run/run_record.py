"""What a run ran with and where it wrote: the settled loader plan (`num_workers: auto` as the count it became,
prefetch, pinning, batch geometry, ring, precision, device, what the hardware profile set) logged once and saved
as `<run dir>/plan.json`; at the end, one line naming the checkpoints and metrics."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from loadout.dist import DistEnv
from loadout.errors import MIB

log = logging.getLogger("train")

PLAN = "plan.json"


def shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (as a person typed it), else absolute."""
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else relative


def profile_settings(cfg: Any, path: Path | None, typed: set[str] = frozenset()) -> dict[str, Any]:
    """The keys a hardware profile file (conf/hardware/<profile>.yaml) sets and the run kept (not `typed` on the
    command line), with the values the run has."""
    if path is None or not path.is_file():
        return {}
    keys = _leaves(OmegaConf.to_container(OmegaConf.load(path)))
    return {key: OmegaConf.select(cfg, key) for key in keys if key != "defaults" and key not in typed}


def write_plan(cfg: Any, run_dir: Path, env: DistEnv, device, plan, trainer, profile: str | None,
               profile_file: Path | None, typed: set[str] = frozenset()) -> dict:
    """Log the settled plan in one line (and what the hardware `profile`'s file set beyond the loader and trainer),
    save it."""
    data, tc = cfg.data, cfg.trainer
    workers = plan.num_workers
    record = {
        "device": str(device), "processes": env.world_size, "precision": trainer.step.precision,
        "channels_last": tc.channels_last, "compile": tc.compile,
        "loader": {
            "num_workers": workers, "num_workers_setting": data.num_workers,
            "prefetch_factor": plan.prefetch_factor if workers else None,
            "persistent_workers": bool(data.persistent_workers) and workers > 0,
            "pin_memory": plan.pin_memory, "batch_size": plan.batch_size,
            "global_batch_size": plan.batch_size * env.world_size, "batch_shape": list(plan.batch_shape),
            "batch_dtype": str(plan.batch_dtype).removeprefix("torch."), "decode": data.decode,
            "ring_slots_per_worker": plan.ring_slots if workers else 0, "shm_bytes": plan.shm_bytes,
        },
        "steps": {"per_epoch": trainer.plan.steps_per_epoch, "total": trainer.plan.total_steps,
                  "max_steps": tc.max_steps},
        "hardware": {"profile": profile, "sets": profile_settings(cfg, profile_file, typed)},
    }
    path = run_dir / PLAN
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    loader = record["loader"]
    feed = (f"{workers} worker{'s' * (workers != 1)} (data.num_workers={data.num_workers}), prefetch "
            f"{plan.prefetch_factor}, ring {plan.ring_slots} slots each, {plan.shm_bytes / MIB:.1f} MiB /dev/shm"
            if workers
            else "no workers (data.num_workers=0: the main process loads)")
    log.info("plan: %s; pin_memory %s; batch %s %s x %d process(es); %s on %s; saved in %s", feed,
             "on" if plan.pin_memory else "off", "x".join(map(str, plan.batch_shape)), loader["batch_dtype"],
             env.world_size, record["precision"], device, shown_path(path))
    beyond = {k: v for k, v in record["hardware"]["sets"].items() if not k.startswith(("data.", "trainer."))}
    if beyond:
        log.info("hardware=%s also sets %s (set them on the command line to choose otherwise)", profile,
                 ", ".join(f"{key}={value}" for key, value in beyond.items()))
    return record


def where_it_wrote(run_dir: Path, checkpoint_path: Path, metrics_path: Path) -> str:
    """One line for the end of a run: its checkpoints and metrics."""
    folder = checkpoint_path.parent
    saved = sorted(p.name for p in folder.glob("*.pt")) if folder.is_dir() else []
    checkpoints = f"checkpoints in {shown_path(folder)} ({', '.join(saved)})" if saved else "no checkpoint"
    metrics = f"metrics in {shown_path(metrics_path)}" if metrics_path.is_file() else "no metrics"
    return f"run dir {shown_path(run_dir)}: {checkpoints}; {metrics}"


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix]
    return [leaf for key, child in node.items() for leaf in _leaves(child, f"{prefix}.{key}" if prefix else key)]
