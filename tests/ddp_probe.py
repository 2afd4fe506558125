"""`python -m train` with a probe around it, for torchrun in tests/test_distributed.py.

It installs, from outside the training code, a DDP communication hook that notes every gradient all-reduce, a forward
pre-hook that notes every training forward, and a global optimizer-step hook that gathers every rank's parameters and
notes whether they are identical; each rank writes its notes to $PROBE_DIR/rank<R>.json when it exits.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

events: list[str] = []


def counting_allreduce(state, bucket):
    events.append("allreduce")
    return allreduce_hook(state, bucket)


def note_forward(module, inputs) -> None:
    if module.training:
        events.append("forward")


def probed_init(self, *args, **kwargs) -> None:
    original_init(self, *args, **kwargs)
    self.register_comm_hook(None, counting_allreduce)
    self.register_forward_pre_hook(note_forward)


def compare_weights(optimizer, args, kwargs) -> None:
    flat = torch.cat([p.detach().reshape(-1) for group in optimizer.param_groups for p in group["params"]])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    events.append("step: identical" if all(torch.equal(w, every[0]) for w in every) else "step: DIFFERENT")


original_init = DistributedDataParallel.__init__
DistributedDataParallel.__init__ = probed_init
register_optimizer_step_post_hook(compare_weights)
atexit.register(lambda: Path(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(events)))
runpy.run_module("train", run_name="__main__", alter_sys=True)
