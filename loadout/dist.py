"""torchrun's environment -> process group, device, rank-0 helpers, seeds. Never a launcher of our own."""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as torch_dist

from loadout.dist_env import DDP_MODES as DDP_MODES
from loadout.dist_env import DistEnv as DistEnv
from loadout.dist_env import hydra_rank_overrides as hydra_rank_overrides

log = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 600  # torch's default for NCCL
GROUP_TIMEOUT_MARGIN_S = 300


def restart_store(env: DistEnv) -> torch_dist.Store | None:
    """The store for a process group that torchrun restarted, or None for torch's default (env://).

    torchrun's agent keeps one shared TCPStore across restarts (TORCHELASTIC_USE_AGENT_STORE), so a restarted
    group reads the dead group's addresses and fails to connect (pytorch/pytorch#135712). On one node every rank
    agrees on TORCHELASTIC_RESTART_COUNT, so the keys are scoped by it; across nodes the counts can differ, and the
    launchers set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per restart) instead.
    """
    if env.restart_count == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.world_size != env.local_world_size:
        log.warning("torchrun restarted a multi-node group on its shared TCPStore; if the group fails to connect, "
                    "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (scripts/launch_multinode.sh does)")
        return None
    store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                                is_master=False)
    return torch_dist.PrefixStore(f"loadout/restart_{env.restart_count}", store)


_control_group: torch_dist.ProcessGroup | None = None


def group_timeout(data_timeout_s: float | None, setting_s: float | None = None) -> timedelta:
    """The collectives' timeout (trainer.dist_timeout_s, else longer than a DataLoader batch may take, data.timeout),
    so a stuck worker's error, which names the file it is stuck on, comes before the NCCL watchdog's."""
    if setting_s is not None:
        return timedelta(seconds=setting_s)
    return timedelta(seconds=max(DEFAULT_GROUP_TIMEOUT_S, (data_timeout_s or 0) + GROUP_TIMEOUT_MARGIN_S))


def init_process_group(env: DistEnv, device: torch.device, data_timeout_s: float | None = None,
                       timeout_s: float | None = None) -> None:
    """nccl on CUDA, gloo on CPU; a no-op for a single process. A gloo group beside it carries the loop's control
    flags (`any_rank`, RankAgreement), so asking "did any rank get a stop signal?" never waits for the GPU
    nor interleaves with the gradient all-reduces."""
    global _control_group
    if env.distributed and not torch_dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        store = restart_store(env)
        if store is not None:
            kwargs["store"] = store
        timeout = group_timeout(data_timeout_s, timeout_s)
        torch_dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                      **kwargs)
        _control_group = torch_dist.new_group(backend="gloo", timeout=timeout)
        if env.is_main:
            log.info("process group: %s, %d process(es)%s", backend, env.world_size,
                     " (trainer.ddp=always: DDP for a single process)" if env.world_size == 1 else "")


def control_group() -> torch_dist.ProcessGroup | None:
    return _control_group


def destroy_process_group() -> None:
    global _control_group
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _control_group = None


def any_rank(flag: int) -> int:
    """The largest `flag` over all ranks (`flag` itself for one process): a small all-reduce on the CPU."""
    if not torch_dist.is_initialized():
        return flag
    tensor = torch.tensor([flag], dtype=torch.int64)
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX, group=_control_group)
    return int(tensor.item())


class RankAgreement:
    """A few small integers agreed by every rank (their maximum), asked after each optimizer step without waiting:
    the all-reduce runs on the CPU control group while the next step computes, and its answer is read at the next
    call. Every rank calls `ask` at the same steps, so every rank acts on the same answer at the same step."""

    def __init__(self) -> None:
        self._pending: tuple[torch_dist.Work, torch.Tensor] | None = None

    def ask(self, values: list[int]) -> list[int] | None:
        """Start agreeing on `values`; returns the answer to the previous call (None at the first). One process:
        `values` at once."""
        if not torch_dist.is_initialized():
            return list(values)
        answer = self.answer()
        tensor = torch.tensor(values, dtype=torch.int64)
        work = torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX, group=control_group(), async_op=True)
        self._pending = (work, tensor)
        return answer

    def answer(self) -> list[int] | None:
        """Wait for the question in flight, if any (at an epoch's end, before a blocking collective)."""
        if self._pending is None:
            return None
        (work, tensor), self._pending = self._pending, None
        work.wait()
        return tensor.tolist()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks (identity for one process)."""
    if not torch_dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    if not torch_dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor.item()


def gather_rows(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's `values` as one row of a (world size, len(values)) float64 tensor on the host: one collective
    for figures some of which are summed and some maximised."""
    row = torch.tensor(values, dtype=torch.float64, device=device)
    if not torch_dist.is_initialized():
        return row.unsqueeze(0).cpu()
    rows = [torch.empty_like(row) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(rows, row)
    return torch.stack(rows).cpu()


def all_gather(obj) -> list:
    """Every rank's `obj`, by rank (`[obj]` for one process)."""
    if not torch_dist.is_initialized():
        return [obj]
    gathered = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def seed_everything(seed: int, env: DistEnv, deterministic: bool = False) -> None:
    """The same model init on every rank (DDP also broadcasts it). Data order comes from the sampler, each
    sample's augmentation from (seed, epoch, index) (loadout/data/samples.py)."""
    if deterministic:  # cuBLAS reads it when CUDA starts: before any CUDA call of this process
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
