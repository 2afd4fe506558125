"""Rank 0's buffers on every rank before an evaluation.

DDP runs with broadcast_buffers=False (no broadcast before every forward), so each rank's BatchNorm running
statistics follow its own shard of the data, while the checkpoint holds rank 0's. Broadcasting rank 0's buffers
before each evaluation makes every rank validate the model that is saved (its figures, best.pt), at the cost of one
small broadcast per buffer dtype an epoch.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Every buffer of `module` (running mean/var, batch counts) set to rank 0's, in place; nothing when not
    distributed."""
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for buffers in groups.values():  # one flat tensor per dtype and device: one collective each
        flat = torch.cat([buffer.detach().reshape(-1) for buffer in buffers])
        torch_dist.broadcast(flat, src=0)
        for buffer, part in zip(buffers, flat.split([buffer.numel() for buffer in buffers]), strict=True):
            buffer.detach().copy_(part.view_as(buffer))
