"""The epoch loop: AMP, gradient accumulation, validation, checkpoints, metrics; the meters time it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from train import checkpoint, precision
from train.config import ConfigError
from train.data import DataPipeline
from train.data.loader import explain_loader_error
from train.dist import DistEnv, all_reduce_max, all_reduce_sum, barrier
from train.meters import EpochMeter, append_jsonl
from train.monitoring import Monitor
from train.stop import Stopped, StopSignal

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run is: restored from a checkpoint, saved into the next one."""

    epoch: int = 0  # the epoch in progress (0-based)
    step: int = 0  # optimizer steps taken in total
    batch_in_epoch: int = 0  # batches of `epoch` already trained


class Trainer:
    def __init__(self, cfg, env: DistEnv, device: torch.device, data: DataPipeline, model: torch.nn.Module,
                 run_dir: Path, monitor: Monitor | None = None, stop: StopSignal | None = None):
        self.cfg, self.env, self.device, self.data, self.run_dir = cfg, env, device, data, run_dir
        self.monitor = monitor or Monitor()  # TensorBoard / Prometheus; closed by whoever built it
        self.stop = stop or StopSignal()  # installed by whoever built it (python -m train); asked after each step
        tc = cfg.trainer
        self.model = model
        self.ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None) \
            if env.distributed else model
        self.forward = torch.compile(self.ddp) if tc.compile else self.ddp
        self.optimizer = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum,
                                         weight_decay=tc.weight_decay, nesterov=True)
        self.steps_per_epoch = max(len(data.train_loader) // tc.grad_accum_steps, 1)
        # The schedule spans the configured epochs; trainer.max_steps only cuts a run short (smoke runs), so a
        # run stopped by it and resumed later follows the same schedule.
        self.total_steps = tc.epochs * self.steps_per_epoch
        self.scheduler = self.plan_schedule()
        cpu_bf16 = device.type == "cpu" and precision.use_cpu_bf16(tc.cpu_bf16)
        self.autocast = partial(precision.autocast, device, tc.amp, cpu_bf16)
        self.use_scaler = tc.amp and device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_scaler)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=tc.label_smoothing)
        self.progress = Progress()
        self.metrics_path = run_dir / "metrics.jsonl"
        self.checkpoint_path = checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST
        self.samples = checkpoint.SampleLog(run_dir, env.rank) if tc.record_samples else None
        # Batches on the device; its state_dict() is the loader's position as of the last batch trained.
        self.train_stream = data.on_device(data.train_loader)

    def plan_schedule(self, step: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
        """OneCycle over `total_steps`, positioned at `step` (0: a new run; else the optimizer was restored)."""
        return torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=self.cfg.trainer.lr, total_steps=max(self.total_steps, 1), pct_start=0.15,
            last_epoch=step - 1)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self, loader_state: dict | None) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": vars(self.progress).copy(),
            "plan": {"epochs": self.cfg.trainer.epochs, "steps_per_epoch": self.steps_per_epoch,
                     "world_size": self.env.world_size},
            "loader": loader_state,
        }

    def save(self, loader_state: dict | None) -> None:
        """Called by every rank at the same step. Sample logs go first (a checkpoint is never newer than
        them), then rank 0 writes atomically; the barrier after it keeps every rank from moving on (or dying)
        before the file on disk is whole, so a restarted group resumes from one checkpoint."""
        if self.samples is not None:
            self.samples.write()
            barrier()
        if loader_state is not None:  # None on every rank at once (epoch ends), so the gather is collective
            # every rank's stream state, by rank: the same position, but each loader's own seeds
            ranks = [loader_state]
            if self.env.distributed:
                ranks = [None] * self.env.world_size
                torch.distributed.all_gather_object(ranks, loader_state)
            loader_state = {"ranks": ranks}
        if self.env.is_main:
            checkpoint.save_atomic(self.state_dict(loader_state), self.checkpoint_path)
        barrier()

    def resume(self, path: Path) -> None:
        """Restore a checkpoint; what it cannot honour fails here, in one line, before any worker starts."""
        state = checkpoint.load(path, self.device)
        tc = self.cfg.trainer
        progress = Progress(**state["progress"])
        plan = state.get("plan", {})
        reached = progress.epoch + (progress.batch_in_epoch > 0)  # epochs begun
        if reached > tc.epochs:
            raise ConfigError(f"trainer.epochs={tc.epochs}: {path} has begun epoch {reached} already; use "
                              f"trainer.epochs >= {reached} to continue it, or trainer.resume=null to start over")
        saved_steps = plan.get("steps_per_epoch", self.steps_per_epoch)
        if progress.batch_in_epoch and saved_steps != self.steps_per_epoch:
            raise ConfigError(f"trainer.resume: {path} stopped mid-epoch with {saved_steps} steps an epoch, this run "
                              f"has {self.steps_per_epoch}: resume with its data.batch_size, trainer.grad_accum_steps "
                              "and process count")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as err:
            raise ConfigError(f"trainer.resume: {path} holds another model than model.name={self.cfg.model.name} "
                              f"({str(err).splitlines()[0]})") from err
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"].get("total_steps") == max(self.total_steps, 1):
            self.scheduler.load_state_dict(state["scheduler"])
        else:  # trainer.epochs changed: the same schedule planned over the new length, continuing at this step
            self.scheduler = self.plan_schedule(progress.step)
            log.info("trainer.epochs=%d: the LR schedule is re-planned over %d steps (was %d), continuing at step %d "
                     "with lr %.4g", tc.epochs, self.total_steps, state["scheduler"].get("total_steps", 0),
                     progress.step, self.scheduler.get_last_lr()[0])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = progress
        if state.get("loader") is not None and progress.batch_in_epoch < len(self.data.train_loader):
            ranks = state["loader"]["ranks"]
            mine = ranks[self.env.rank] if len(ranks) == self.env.world_size else {
                "epoch": ranks[0]["epoch"], "batch": ranks[0]["batch"]}  # another world size: the position only
            self.data.set_epoch(progress.epoch)
            self.data.train_loader.load_state_dict(mine)
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, progress.epoch + 1,
                 progress.batch_in_epoch, progress.step)
        if progress.epoch >= tc.epochs:
            log.info("the run in %s is complete (trainer.epochs=%d): raise trainer.epochs to train it further",
                     path, tc.epochs)

    # -- loop ------------------------------------------------------------------------------------------------
    def done(self) -> bool:
        max_steps = self.cfg.trainer.max_steps
        return self.progress.step >= self.total_steps or (max_steps is not None and self.progress.step >= max_steps)

    def fit(self) -> list[dict]:
        tc = self.cfg.trainer
        records = []
        while self.progress.epoch < tc.epochs and not self.done():
            train_stats = self.train_epoch()
            val_stats = self.evaluate()
            complete = self.progress.batch_in_epoch >= len(self.data.train_loader)
            record = {"epoch": self.progress.epoch + 1, "epoch_complete": complete, **train_stats, **val_stats}
            records.append(record)
            self.monitor.on_epoch(self.progress.step, record)
            if not complete:  # cut short by trainer.max_steps: resume finishes this epoch
                self.save(loader_state=self.train_stream.state_dict())
            else:
                self.progress = Progress(epoch=self.progress.epoch + 1, step=self.progress.step)
                self.save(loader_state=None)
            if self.env.is_main:
                append_jsonl(self.metrics_path, record)
                log.info("epoch %d/%d  train_loss %.4f  val_loss %.4f  val_acc %.3f  %.0f img/s  data_wait %.1f%%  "
                         "first_batch %.2fs  epoch %.1fs  peak_rss %.0f MiB%s", record["epoch"], tc.epochs,
                         record["train_loss"], record["val_loss"], record["val_acc"], record["images_per_s"],
                         100 * record["data_wait_frac"], record["first_batch_s"], record["epoch_s"],
                         record["peak_rss_mb"], f"  bad_samples {record['bad_samples']}"
                         if record["bad_samples"] else "")
            if self.progress.epoch < tc.epochs and not self.done():
                self.stop_if_asked()  # a signal during validation: stop before the next epoch starts
        return records

    def stop_if_asked(self) -> None:
        """After an optimizer step or an epoch's checkpoint: if any rank got a stop signal, save and stop."""
        signum = self.stop.agreed()
        if not signum:
            return
        if self.progress.batch_in_epoch:  # mid-epoch: the loader's position goes with the checkpoint
            self.save(loader_state=self.train_stream.state_dict())
        raise Stopped(signum, self.progress.epoch, self.progress.batch_in_epoch)

    def _batches(self, batches, meter: EpochMeter, desc: str, total: int):
        """Batches on the device; a dead worker or a timeout becomes an error naming its cause."""
        show = self.cfg.trainer.progress and self.env.is_main
        bar = tqdm(total=total, desc=desc, leave=False, disable=not show, dynamic_ncols=True)
        iterator = iter(batches)
        try:
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                except RuntimeError as err:
                    explained = explain_loader_error(err, self.data.stuck_read())
                    if explained is None:
                        raise
                    raise explained from err
                meter.waited()
                yield batch
                bar.update(1)
        finally:
            bar.close()

    def train_epoch(self) -> dict:
        tc = self.cfg.trainer
        self.ddp.train()
        self.data.set_epoch(self.progress.epoch)
        meter = EpochMeter()
        accum = tc.grad_accum_steps
        loader = self.data.train_loader
        remaining = len(loader) - self.progress.batch_in_epoch
        if self.samples is not None:
            self.samples.start(self.progress.epoch, self.progress.batch_in_epoch)
        micro = 0
        desc = f"epoch {self.progress.epoch + 1}/{tc.epochs}"
        # remaining == 0: resumed from a checkpoint taken after the epoch's last batch, before its validation
        batches = self._batches(self.train_stream, meter, desc, remaining) if remaining > 0 else ()
        for images, targets, bad, *indices in batches:
            self.progress.batch_in_epoch += 1
            if self.samples is not None:
                self.samples.add(indices[0] if indices else None)
            if images.numel() == 0:
                meter.stepped(0, 0.0, bad)
                continue
            micro += 1
            update = micro % accum == 0
            if self.env.distributed:  # all-reduce gradients only in the backward of the micro-batch that updates
                self.ddp.require_backward_grad_sync = update
            with self.autocast():
                loss = self.criterion(self.forward(images), targets)
            self.scaler.scale(loss / accum).backward()
            if update:
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.progress.step += 1
            meter.stepped(images.shape[0], loss, bad)  # no .item(): the GPU is not synced every step
            self.monitor.on_step(self.progress.step, meter)
            if not update:
                continue
            self.stop_if_asked()
            every = tc.checkpoint_every_steps
            if every and self.progress.step % every == 0:
                self.save(loader_state=self.train_stream.state_dict())
            if self.done():
                break
        if micro % accum:  # micro-batches short of a whole accumulation at the epoch's end: dropped, as drop_last
            self.optimizer.zero_grad(set_to_none=True)  # would; never carried into the next epoch's first step
        return self._reduce_train(meter.summary())

    def _reduce_train(self, stats: dict) -> dict:
        """Sums over ranks for counts and throughput, the slowest rank for latencies and memory."""
        if not self.env.distributed:
            return stats
        loss_sum, images, images_per_s, bad = all_reduce_sum(
            [stats["train_loss"] * stats["images"], stats["images"], stats["images_per_s"], stats["bad_samples"]],
            self.device)
        stats.update(train_loss=loss_sum / max(images, 1), images=int(images), images_per_s=images_per_s,
                     bad_samples=int(bad))
        for key in ("data_wait_frac", "first_batch_s", "epoch_s", "peak_rss_mb"):
            stats[key] = all_reduce_max(stats[key], self.device)
        return stats

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.ddp.eval()
        meter = EpochMeter()
        loss_sum, correct, count = 0.0, 0.0, 0.0
        loader = self.data.val_loader
        for images, targets, *_ in self._batches(self.data.on_device(loader), meter, "val", len(loader)):
            if images.numel() == 0:
                continue
            with self.autocast():
                logits = self.forward(images)
            loss_sum += self.criterion(logits.float(), targets).item() * targets.numel()
            correct += (logits.argmax(1) == targets).sum().item()
            count += targets.numel()
        loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], self.device)
        return {"val_loss": loss_sum / max(count, 1), "val_acc": correct / max(count, 1),
                "val_samples": int(count)}
