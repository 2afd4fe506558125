"""The run dir's name (`hydra.run.dir: outputs/${run_dir_name:}`), the same in every process of a run.

Hydra resolves the name in each process, so a timestamp of its own would give each torchrun rank its own dir. A
chosen rendezvous id (`--rdzv-id`, e.g. a Slurm job id: every node and every restart share it) names the dir
`torchrun/<id>`; `--standalone` (a random UUID) names it after the torchrun agent every local rank is a child of:
`torchrun/<agent's start date_time>-<first 8 of the id>`, readable and the same across the agent's restarts.
"""

from __future__ import annotations

import os
import re
from datetime import datetime

import psutil

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def run_dir_name() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    if run_id != "none" and not UUID.fullmatch(run_id):
        return f"torchrun/{run_id}"
    started = datetime.fromtimestamp(psutil.Process(os.getppid()).create_time())  # the agent: one per node
    tag = run_id[:8] if run_id != "none" else f"pid{os.getppid()}"
    return f"torchrun/{started:%Y-%m-%d_%H-%M-%S}-{tag}"
