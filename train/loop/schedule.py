"""Learning-rate schedules of our own (conf/scheduler/); torch's own (OneCycleLR, ...) are named there directly."""

from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.05,
                  min_lr_frac: float = 0.0, last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup_frac` of the steps, then a cosine down to `min_lr_frac` of the optimizer's lr
    (conf/scheduler/cosine.yaml)."""
    warmup = max(1, round(warmup_frac * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=last_epoch)
