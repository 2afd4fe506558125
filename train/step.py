"""One training step and one evaluation step: the Trainer, tune's with-model measurement and bench/gpu_prefetch.py
all train through `TrainStep`, so what they time is what training runs.

A step is nanoGPT's loop body: forward under autocast, the loss scaled for AMP and divided over the accumulated
micro-batches, backward; on the micro-batch that completes an accumulation the optimizer and scheduler step.
Under DDP the gradient all-reduce runs only in that micro-batch's backward (`require_backward_grad_sync`, set per
call, where `no_sync()` would be a context to enter per micro-batch).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel

from train import precision
from train.config import instantiate
from train.data.augment import BatchMix
from train.data.batch import Batch
from train.dist import DistEnv


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


class TrainStep:
    """The model (DDP-wrapped under torchrun, compiled with trainer.compile), its optimizer (optimizer.*), LR
    schedule over `total_steps` (scheduler.*), AMP scaler, loss and the recipe's batch mix (augment.*). Its Stateful
    parts (`stateful()`) go into every checkpoint."""

    def __init__(self, cfg, env: DistEnv, device: torch.device, model: torch.nn.Module, total_steps: int,
                 mix: BatchMix | None = None):
        tc = cfg.trainer
        self.model, self.total_steps, self.mix = model, max(total_steps, 1), mix
        self.distributed = env.distributed
        self.ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
            if env.distributed else model
        self.forward = torch.compile(self.ddp) if tc.compile else self.ddp
        self.optimizer = instantiate("optimizer", cfg.optimizer)(model.parameters())
        self.make_scheduler = instantiate("scheduler", cfg.scheduler)
        self.scheduler = self.plan_schedule(0)
        cpu_bf16 = device.type == "cpu" and precision.use_cpu_bf16(tc.cpu_bf16)
        self.autocast = partial(precision.autocast, device, tc.amp, cpu_bf16)
        self.scaler = torch.amp.GradScaler("cuda", enabled=tc.amp and device.type == "cuda")
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=tc.label_smoothing)
        self.accum = tc.grad_accum_steps
        self.micro = 0  # micro-batches since the last optimizer step

    def plan_schedule(self, step: int) -> torch.optim.lr_scheduler.LRScheduler:
        """The schedule over `total_steps`, positioned at `step` (0: a new run; else the optimizer was restored)."""
        return self.make_scheduler(self.optimizer, total_steps=self.total_steps, last_epoch=step - 1)

    def stateful(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}

    def __call__(self, batch: Batch, where: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, bool]:
        """Train on one micro-batch, `where` = (epoch, batch in epoch) seeds the batch mix; returns its loss
        (detached, not synced) and whether the optimizer stepped."""
        self.micro += 1
        update = self.micro == self.accum
        if self.distributed:  # all-reduce gradients only in the backward of the micro-batch that updates
            self.ddp.require_backward_grad_sync = update
        images, targets = batch.images, batch.targets
        if self.mix is not None:
            images, targets = self.mix(images, targets, *where)
        with self.autocast():
            loss = self.criterion(self.forward(images), targets)
        self.scaler.scale(loss / self.accum).backward()
        if update:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.micro = 0
        return loss.detach(), update

    def drop_partial(self) -> None:
        """At an epoch's end, micro-batches short of a whole accumulation are dropped, as drop_last drops a short
        batch: their gradients never reach the next epoch's first step."""
        if self.micro:
            self.optimizer.zero_grad(set_to_none=True)
            self.micro = 0

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> tuple[float, int]:
        """(summed loss, correct predictions) over one validation batch."""
        with self.autocast():
            logits = self.forward(batch.images)
        loss = self.criterion(logits.float(), batch.targets).item() * batch.targets.numel()
        return loss, int((logits.argmax(1) == batch.targets).sum())
