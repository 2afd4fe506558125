"""One training step and one evaluation step: the Trainer, tune's with-model measurement and bench/gpu_prefetch.py
all train through `TrainStep`, so what they time is what training runs.

A step is nanoGPT's loop body: forward under autocast, the loss scaled for AMP and divided over the accumulated
micro-batches, backward; on the micro-batch that completes an accumulation the optimizer and scheduler step.
Under DDP the gradient all-reduce runs only in that micro-batch's backward (`require_backward_grad_sync`, set per
call, where `no_sync()` would be a context to enter per micro-batch).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel

from train import precision
from train.data.batch import Batch
from train.dist import DistEnv


class TrainStep:
    """The model (DDP-wrapped under torchrun, compiled with trainer.compile), its optimizer, OneCycle schedule over
    `total_steps`, AMP scaler and loss. Its Stateful parts (`stateful()`) go into every checkpoint."""

    def __init__(self, cfg, env: DistEnv, device: torch.device, model: torch.nn.Module, total_steps: int):
        tc = cfg.trainer
        self.model, self.lr, self.total_steps = model, tc.lr, max(total_steps, 1)
        self.distributed = env.distributed
        self.ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
            if env.distributed else model
        self.forward = torch.compile(self.ddp) if tc.compile else self.ddp
        self.optimizer = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum,
                                         weight_decay=tc.weight_decay, nesterov=True)
        self.scheduler = self.plan_schedule(0)
        cpu_bf16 = device.type == "cpu" and precision.use_cpu_bf16(tc.cpu_bf16)
        self.autocast = partial(precision.autocast, device, tc.amp, cpu_bf16)
        self.scaler = torch.amp.GradScaler("cuda", enabled=tc.amp and device.type == "cuda")
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=tc.label_smoothing)
        self.accum = tc.grad_accum_steps
        self.micro = 0  # micro-batches since the last optimizer step

    def plan_schedule(self, step: int) -> torch.optim.lr_scheduler.LRScheduler:
        """OneCycle over `total_steps`, positioned at `step` (0: a new run; else the optimizer was restored)."""
        return torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=self.lr, total_steps=self.total_steps,
                                                   pct_start=0.15, last_epoch=step - 1)

    def stateful(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, bool]:
        """Train on one micro-batch; returns its loss (detached, not synced) and whether the optimizer stepped."""
        self.micro += 1
        update = self.micro == self.accum
        if self.distributed:  # all-reduce gradients only in the backward of the micro-batch that updates
            self.ddp.require_backward_grad_sync = update
        with self.autocast():
            loss = self.criterion(self.forward(batch.images), batch.targets)
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
