"""One training step: the Trainer, tune's with-model measurement and bench/gpu_prefetch.py all train through
`TrainStep`, so what they time is what training runs; evaluation (evaluate.py) runs its forward, `predict`.

A step is nanoGPT's loop body: forward under autocast, the loss scaled (fp16 only) and divided over the accumulated
batches, backward; on the batch that completes an accumulation the optimizer steps, and the scheduler with it (not
when fp16's GradScaler skipped the step). Under DDP the gradient all-reduce runs only in the backward of the last
micro-batch of the updating batch (`require_backward_grad_sync`, set per call).

Micro-batches (trainer.micro_batch_size): the loader's batch is the optimizer's batch; it may be run through the model
in slices, each slice's loss weighted by its share, so the gradient is the whole batch's. With `auto` a slice that
runs out of GPU memory frees the step's state, halves the slice and runs the same batch again; the ranks agree on
the smallest slice through the loop's control all-reduce (agreement.py). A batch with no readable sample still runs
its (empty) forward and backward under DDP, so every rank takes part in every gradient all-reduce. BatchNorm in
training normalises each slice by the slice's own statistics: exact only without it, noisier the smaller the slice.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from loadout.build import instantiate
from loadout.data.loader.batch import Batch
from loadout.dist import DistEnv
from loadout.errors import Diverged
from loadout.runtime import precision
from loadout.runtime.compiled import CompiledModel
from loadout.runtime.micro_batch import MicroBatch, is_out_of_memory
from loadout.runtime.nonfinite import SCALE_FLOOR, NonFiniteWatch
from train.loop.config import TrainerConfig
from train.task import Classification, Task

log = logging.getLogger(__name__)


Optimizer = Callable[..., torch.optim.Optimizer]  # optimizer.* built with _partial_: parameters -> optimizer
Schedule = Callable[..., torch.optim.lr_scheduler.LRScheduler]  # scheduler.*: (optimizer, total_steps, last_epoch)
BatchMixer = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (images, targets, epoch, batch): the task's batch mix


BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def has_batch_norm(model: torch.nn.Module) -> bool:
    """BatchNorm in training needs two samples a channel (deeplabv3's after its global pool): no slice of one."""
    return any(isinstance(module, BATCH_NORMS) for module in model.modules())


class TrainStep:
    """The model (DDP-wrapped under torchrun, compiled with trainer.compile), its optimizer, LR schedule over
    `total_steps`, precision and GradScaler, from the `trainer:` section `tc`; the `task` (train/task/) gives the
    loss and the evaluation sums, `mix` its batch mix. Its Stateful parts (`stateful()`) go into every checkpoint.
    `batch_size` is the optimizer's batch; `input_shape` (C, H, W) shapes the empty forward of a batch with no
    readable sample."""

    def __init__(self, tc: TrainerConfig, env: DistEnv, device: torch.device, model: torch.nn.Module, *,
                 optimizer: Optimizer, schedule: Schedule, batch_size: int, total_steps: int,
                 input_shape: tuple[int, int, int], mix: BatchMixer | None = None, task: Task | None = None):
        self.device, self.model, self.total_steps, self.mix = device, model, max(total_steps, 1), mix
        self.task = task or Classification()
        self.input_shape = input_shape
        self.distributed = env.distributed
        self.auto = precision.RunPrecision(tc.precision, device)
        self.channels_last = tc.channels_last
        if self.precision == "fp32":
            precision.allow_tf32(device)
        # broadcast_buffers=False: no BatchNorm buffer broadcast before every forward (rank 0's are checkpointed);
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, no copy in and out.
        self.ddp = model
        if env.distributed:
            with warnings.catch_warnings():  # torch 2.14 deprecates the name; its successor still syncs at init
                warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
                self.ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                   broadcast_buffers=False, gradient_as_bucket_view=True)
        self.compiled = CompiledModel(self.ddp, tc.compile_mode) if tc.compile else None
        self.optimizer = optimizer(model.parameters())
        self.make_scheduler = schedule
        self.scheduler = self.plan_schedule(0)
        self.lr = self.optimizer.param_groups[0]["lr"]  # the last optimizer step's (the scheduler is one step on)
        self.scaler = precision.grad_scaler(device, self.precision)
        self._scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self.accum = tc.grad_accum_steps
        self.micro = 0  # batches since the last optimizer step
        self.micro_batch = MicroBatch(tc.micro_batch_size, batch_size, smallest=2 if has_batch_norm(model) else 1)
        # trainer.on_nonfinite: stop = watch the losses without a sync (the loop acts on `watch`); skip = check the
        # all-reduced gradients before each update (one sync a step) and drop a non-finite step
        self.skip_nonfinite, self.max_skips = tc.on_nonfinite == "skip", tc.nonfinite_skips
        self.watch = NonFiniteWatch(device)
        self.skipped = self.skipped_in_row = 0  # non-finite steps skipped (fp16: steps the GradScaler skipped)
        self._syncing = False  # in the backward that all-reduces gradients: running out of memory there is final
        self.grad_clip = tc.grad_clip
        self.grad_norm = torch.zeros((), device=device)  # the last optimizer step's, before clipping (not synced)

    @classmethod
    def from_config(cls, cfg, env: DistEnv, device: torch.device, model: torch.nn.Module, total_steps: int, *,
                    task: Task, mix: BatchMixer | None = None) -> TrainStep:
        """Built from a composed config's trainer, optimizer, scheduler and data sections, for the run's `task`."""
        size = cfg.data.image_size
        return cls(cfg.trainer, env, device, model, optimizer=instantiate("optimizer", cfg.optimizer),
                   schedule=instantiate("scheduler", cfg.scheduler), batch_size=cfg.data.batch_size,
                   total_steps=total_steps, input_shape=(3, size, size), mix=mix, task=task)

    @property
    def precision(self) -> str:
        """The resolved precision: bf16 | fp16 | fp32."""
        return self.auto.value

    def plan_schedule(self, step: int) -> torch.optim.lr_scheduler.LRScheduler:
        """The schedule over `total_steps`, positioned at `step` (0: a new run; else the optimizer was restored)."""
        return self.make_scheduler(self.optimizer, total_steps=self.total_steps, last_epoch=step - 1)

    def stateful(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler,
                "micro_batch": self.micro_batch, "precision": self.auto}

    def load_scaler(self, state: dict) -> None:
        """A GradScaler state from any run (precision.load_scaler)."""
        precision.load_scaler(self.scaler, state, self.precision)
        self._scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def _forward(self, images: torch.Tensor):
        """The model's outputs under the run's autocast (the loss or the sums after it run outside): the compiled
        model for full slices, the eager one for shorter ones (a batch with unreadable samples, the last validation
        batch): one graph for training and one for evaluation, never one per shape."""
        with precision.autocast(self.device, self.precision):
            if self.compiled is not None and images.shape[0] == self.micro_batch.size:
                return self.compiled(images)
            return self.ddp(images)

    def _loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs = self._forward(images)
        if images.shape[0] == 0:  # no readable sample: a zero loss whose backward still syncs every gradient
            return self.task.zero_loss(outputs)
        return self.task.loss(outputs, targets)

    def _slices(self, images: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if images.shape[0] == 0:
            shape = (0, *self.input_shape)
            return [(images.new_zeros(shape, dtype=torch.float32, device=self.device), targets)]
        size, count = self.micro_batch.size, images.shape[0]
        starts = list(range(0, count, size))
        if len(starts) > 1 and count - starts[-1] < self.micro_batch.smallest:  # BatchNorm: no 1-sample slice
            starts.pop()
        ends = [*starts[1:], count]
        return [(images[i:j], targets[i:j]) for i, j in zip(starts, ends, strict=True)]

    def __call__(self, batch: Batch, where: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, bool]:
        """Train on one batch, `where` = (epoch, batch in epoch) seeds the batch mix; returns its mean loss
        (detached, not synced) and whether the optimizer stepped."""
        if not len(batch) and not self.distributed:  # no readable sample, no other rank to keep in step
            return torch.zeros((), device=self.device), False
        self.micro += 1
        update = self.micro == self.accum
        images, targets = batch.images, batch.targets
        if self.mix is not None and len(batch):
            images, targets = self.mix(images, targets, *where)
        while True:
            try:
                loss = self._forward_backward(images, targets, update)
                break
            except RuntimeError as err:  # handled outside the except block: the failed step's tensors can go
                if not is_out_of_memory(err):  # torch's OutOfMemoryError, cuDNN's or cuBLAS's failed allocation
                    raise
            mid_sync, self._syncing = self._syncing, False
            self.micro_batch.recover(self.device, len(batch), self.optimizer, mid_sync)
        # fp16: an overflow is the GradScaler's to skip; skip: the update checks its gradients
        self.watch.note(loss, flag=self.precision != "fp16" and not self.skip_nonfinite)
        if update:
            self._optimizer_step()
        return loss, update

    def _forward_backward(self, images: torch.Tensor, targets: torch.Tensor, update: bool) -> torch.Tensor:
        slices = self._slices(images, targets)
        total = max(images.shape[0], 1)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(slices):
            sync = update and i == len(slices) - 1
            if self.distributed:  # all-reduce gradients only in the last backward before the optimizer steps
                self.ddp.require_backward_grad_sync = sync
            loss = self._loss(x, y)
            self._syncing = sync and self.distributed
            self.scaler.scale(loss * (x.shape[0] / total / self.accum)).backward()
            self._syncing = False
            loss_sum += loss.detach() * x.shape[0]
        return loss_sum / total

    def _optimizer_step(self) -> None:
        self.grad_norm = self._clip()
        if self.scaler.is_enabled():  # fp16: step reads found-inf on the host; the scale shrinks on a skipped step
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale, self._scale = self._scale, self.scaler.get_scale()
            stepped = self._scale >= scale
        elif self.skip_nonfinite and not bool(torch.isfinite(self.grad_norm)):  # read on the host: a sync
            stepped = False
        else:
            self.optimizer.step()
            stepped = True
        self.lr = self.optimizer.param_groups[0]["lr"]  # before the scheduler moves it on to the next step's
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:  # a skipped step (non-finite gradients) leaves the learning rate where it was
            self.scheduler.step()
        self.micro = 0
        self.skipped += not stepped
        self.skipped_in_row = 0 if stepped else self.skipped_in_row + 1
        if self.skip_nonfinite and self.skipped_in_row >= self.max_skips:
            raise Diverged(f"{self.skipped_in_row} steps in a row had non-finite gradients and were skipped "
                           f"(trainer.nonfinite_skips={self.max_skips})")
        if self.scaler.is_enabled() and self._scale < SCALE_FLOOR:
            raise Diverged(f"fp16's loss scale fell to {self._scale:g}: the gradients overflow even unscaled")

    def _clip(self) -> torch.Tensor:
        """The gradients' total norm (a device tensor, not read here: no sync), clipped to trainer.grad_clip. After
        DDP's all-reduce every rank has the same gradients, so the same norm. fp16's gradients are unscaled first
        (scaler.step then does not unscale them again)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        return norm.detach()

    def drop_partial(self) -> None:
        """At an epoch's end, batches short of a whole accumulation are dropped, as drop_last drops a short
        batch: their gradients never reach the next epoch's first step."""
        if self.micro:
            self.optimizer.zero_grad(set_to_none=True)
            self.micro = 0

    def predict(self, images: torch.Tensor, targets: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        """The model's outputs on a (non-empty) batch slice by slice, each with its slice of `targets`: evaluation
        runs the forward training runs (precision, compiled graph, the micro-batch size that fit)."""
        for x, y in self._slices(images, targets):
            yield self._forward(x), y
