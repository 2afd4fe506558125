"""Where this process stands in a torchrun group, read from torchrun's environment without importing torch: the
command line is checked (loadout/run/command_line.py) before torch loads. loadout/dist.py builds the group on it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loadout.errors import ConfigError

DDP_MODES = ("auto", "always")  # trainer.ddp


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the torchrun group (a single process: rank 0 of 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: > 0 after the group was restarted
    always_ddp: bool = False  # trainer.ddp=always: a process group and DDP even for a single process

    @classmethod
    def from_env(cls, ddp: str = "auto") -> DistEnv:
        """`ddp` (trainer.ddp): auto = DDP when torchrun starts more than one process; always = DDP for one process
        too, so a one-GPU machine runs the multi-GPU path (no_sync, compile + DDP, the control group, the metric
        all-reduces). It needs torchrun's rendezvous: `torchrun --standalone --nproc_per_node=1 -m train ...`."""
        env = os.environ
        if ddp not in DDP_MODES:
            raise ConfigError(f"trainer.ddp={ddp}: use auto (DDP when torchrun starts more than one process) or "
                              "always (DDP for a single process too, under torchrun)")
        if ddp == "always" and "MASTER_ADDR" not in env:
            raise ConfigError("trainer.ddp=always: not under torchrun (MASTER_ADDR is unset); launch with "
                              "`torchrun --standalone --nproc_per_node=1 -m train ...`")
        return cls(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
                   world_size=int(env.get("WORLD_SIZE", 1)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), always_ddp=ddp == "always")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.always_ddp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def hydra_rank_overrides(env: DistEnv) -> list[str]:
    """Overrides for ranks > 0: no second copy of .hydra/ and no log file or console chatter of their own."""
    if env.is_main:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
