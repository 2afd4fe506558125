"""The epoch loop: train steps (train/loop/step.py), evaluation (evaluate.py), checkpoints (last.pt, and best.pt by
the task's best figure), the ranks' agreement on stopping (agreement.py), one metrics row an epoch;
trainer.mode=validate evaluates a checkpoint instead (`Trainer.validate`).

What watches or tunes the loop (trackers, Prometheus, progress lines, the profiler, data.autotune, the `callbacks:`
config group) attaches through hooks (hooks.py), never inline: what stays in the loop is the step, the ranks'
agreement, evaluation, the doctor's reading of the epoch and checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from loadout.data.loader.autotune import Autotune
from loadout.data.loader.batch import Batch
from loadout.data.loader.stages import since
from loadout.data.pipeline import DataPipeline
from loadout.dist import DistEnv, any_rank, barrier
from loadout.errors import Diverged
from loadout.observe.console import Console
from loadout.observe.doctor import Doctor, Machine
from loadout.observe.epoch_counts import EpochCounts
from loadout.observe.meter import EpochMeter, SourceTally, append_jsonl, reduce_over_ranks
from loadout.observe.metrics import epoch_line
from loadout.observe.monitoring import Monitor
from loadout.observe.profiling import StepProfiler
from loadout.runtime import checkpoint
from loadout.runtime.micro_batch import said_in_one_line
from loadout.runtime.stop import StopSignal
from train.augment import Recipe
from train.loop.agreement import StepAgreement
from train.loop.config import TrainerConfig
from train.loop.epoch_batches import EpochBatches, batches_per_epoch
from train.loop.evaluate import Evaluation
from train.loop.hooks import Autotuning, Hooks, Profiling, ProgressLines, Tracking
from train.loop.progress import Progress, RunLength
from train.loop.step import TrainStep
from train.task import Task

log = logging.getLogger(__name__)

MEMORY_INTERVAL_S = 2.0  # how often main + workers PSS is sampled (a sample reads every process's page tables)


class Trainer:
    """The loop over `data` with `step`, from the `trainer:` section `tc`; `model_name` names the model in the error
    of a checkpoint that holds another."""

    def __init__(self, tc: TrainerConfig, env: DistEnv, device: torch.device, data: DataPipeline, step: TrainStep,
                 plan: RunLength, run_dir: Path, monitor: Monitor | None = None, stop: StopSignal | None = None,
                 callbacks: Sequence = (), model_name: str = "the model", doctor: Doctor | None = None,
                 autotune: bool = False):
        self.tc, self.env, self.device, self.data, self.run_dir = tc, env, device, data, run_dir
        # where each epoch's time went and what bound it (loadout/observe/doctor.py)
        self.doctor = doctor or Doctor(Machine(device.type, num_workers=data.plan.num_workers,
                                               pin_memory=data.plan.pin_memory, image_size=data.plan.image_size))
        self.step, self.plan, self.model_name = step, plan, model_name
        self.monitor = monitor or Monitor()  # trackers / Prometheus; closed by whoever built it
        self.memory = self.monitor.sampler.start(MEMORY_INTERVAL_S)  # each epoch's peak PSS, off the step loop
        # data.autotune: the loader's plan moved between epochs toward the doctor's measured best
        self.autotune = Autotune(data, env, self.memory) if autotune else None
        self.stop = stop or StopSignal()  # installed by whoever built it (python -m train); asked after each step
        # the stop signal, a non-finite loss and the micro-batch size, agreed by the ranks one step later
        self.agreement = StepAgreement(self.stop, step, lambda: self.progress, self.save)
        self.evaluation = Evaluation(step.ddp, step.predict, step.task, device)
        self.progress = Progress()
        self.batches = EpochBatches(data, tc.limit_batches, tc.overfit_batches)  # all, debug=limit or overfit
        self.console = Console(tc.progress and env.is_main, tc.progress_every_s)  # a bar, or lines in a log
        built_in = [Tracking(self.monitor)] if self.monitor.enabled else []
        if self.console.show and not self.console.interactive:
            built_in.append(ProgressLines(self.console))
        if tc.profiler.enabled:
            built_in.append(Profiling(partial(StepProfiler, tc.profiler, run_dir, device, env)))
        if self.autotune is not None:
            built_in.append(Autotuning(self.autotune))
        self.hooks = Hooks([*built_in, *callbacks])
        self.positions = data.positions(env)
        self.counts = EpochCounts(env, device)  # the epoch's training sums, kept by a mid-epoch checkpoint
        self.metrics_path = run_dir / "metrics.jsonl"
        self.checkpoint_path = checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST
        self.best_path = checkpoint.checkpoint_dir(run_dir) / checkpoint.BEST
        if env.is_main:
            checkpoint.warn_if_little_room(run_dir, 3 * checkpoint.tensor_bytes(step.model.state_dict()),
                                           tc.keep_checkpoints)

    @classmethod
    def from_config(cls, cfg, env: DistEnv, device: torch.device, data: DataPipeline, model: torch.nn.Module,
                    run_dir: Path, monitor: Monitor | None = None, stop: StopSignal | None = None,
                    callbacks: Sequence = (), *, recipe: Recipe, task: Task) -> Trainer:
        """The TrainStep and RunLength built from a composed config's sections, then the Trainer over them; the
        parts the data path was built with (`recipe`, `task`) are handed in, never built a second time."""
        tc = cfg.trainer
        per_epoch = batches_per_epoch(len(data.train), tc.limit_batches, tc.overfit_batches)
        plan = RunLength.for_run(tc.epochs, per_epoch, tc.grad_accum_steps, env.world_size)
        step = TrainStep.from_config(cfg, env, device, model, plan.total_steps, task=task,
                                     mix=task.batch_mix(recipe, data.source, tc.seed))
        name = OmegaConf.select(cfg, "model.name", default=None)
        return cls(tc, env, device, data, step, plan, run_dir, monitor, stop, callbacks,
                   model_name=f"model.name={name}" if name else f"model._target_={cfg.model._target_}",
                   doctor=Doctor(Machine.of(cfg.data, data.plan, data.source, device, cfg.trainer)),
                   autotune=bool(cfg.data.get("autotune", False)))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def parts(self) -> dict[str, checkpoint.Stateful]:
        tuned = {"autotune": self.autotune} if self.autotune is not None else {}  # before "loader": its workers
        return {**self.step.stateful(), "progress": self.progress, "plan": self.plan, **tuned,
                "loader": self.positions, "meter": self.counts, "trackers": self.monitor.trackers}

    def save(self, best: bool = False) -> None:
        """Called by every rank at the same step; rank 0 writes last.pt (and best.pt when `best`). The barrier
        after it keeps every rank from moving on (or dying) before the file on disk is whole, so a restarted group
        resumes from one checkpoint."""
        if any_rank(int(not self.step.watch.confirm(self.step.model))):  # never a non-finite state over a finite one
            self.agreement.diverge("a non-finite loss or weight")
        self.hooks("on_save", self)
        self.positions.gather(mid_epoch=self.progress.batch_in_epoch > 0)
        self.counts.gather(mid_epoch=self.progress.batch_in_epoch > 0)
        if self.env.is_main:
            checkpoint.save(self.parts(), self.checkpoint_path, keep=self.tc.keep_checkpoints)
            if best:
                checkpoint.copy_atomic(self.checkpoint_path, self.best_path)
        barrier()
        self.agreement.saved_step = self.progress.step

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint at `path`: its parts loaded by name, the loader's position, the LR schedule
        re-planned when the epochs or steps an epoch changed; what cannot be honoured (another batch size mid-epoch,
        another model) fails here, in one line, before any worker starts."""
        state = checkpoint.load(path)  # on the CPU: load_state_dict moves what belongs on the device
        progress, saved, tc = Progress.from_state(state["progress"]), RunLength(**state["plan"]), self.tc
        self.plan.check_continues(saved, progress, path)
        parts = self.parts()
        del parts["plan"], parts["scaler"]  # this run's plan stands (checked above); the scaler loads from any device
        checkpoint.load_model(parts.pop("model"), state, path, self.model_name)
        self.step.load_scaler(state.get("scaler", {}))
        for name in checkpoint.ADDED_PARTS:  # an older checkpoint resumes without them
            if name not in state:
                parts.pop(name, None)
        if progress.batch_in_epoch >= self.batches.per_epoch or tc.overfit_batches:  # no position to go on from
            del parts["loader"]
        for name, part in parts.items():
            part.load_state_dict(state[name])
        if self.positions.batch_in_epoch is not None:  # another process count: the rest numbered as the last batches
            self.progress.batch_in_epoch = self.positions.batch_in_epoch
        self.plan.follow(saved, self.progress, self.batches.per_epoch, tc.grad_accum_steps)
        if {saved.total_steps, self.step.total_steps} != {self.plan.total_steps}:  # epochs or steps an epoch changed
            self.step.total_steps = max(self.plan.total_steps, 1)
            self.step.scheduler = self.step.plan_schedule(progress.step)
            log.info("trainer.epochs=%d: the LR schedule is re-planned over %d steps (was %d), continuing at step %d "
                     "with lr %.4g", tc.epochs, self.step.total_steps, saved.total_steps, progress.step,
                     self.step.scheduler.get_last_lr()[0])
        self.data.set_epoch(progress.epoch)
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, progress.epoch + 1,
                 progress.batch_in_epoch, progress.step)
        if progress.epoch >= tc.epochs:
            log.info("the run in %s is complete (trainer.epochs=%d): raise trainer.epochs to train it further",
                     path, tc.epochs)

    # -- loop ------------------------------------------------------------------------------------------------
    def done(self) -> bool:
        return self.progress.step >= self.plan.last_step(self.tc.max_steps)

    def fit(self) -> list[dict]:
        try:
            return self._epochs()
        finally:
            self.hooks("on_fit_end", self)

    def _epochs(self) -> list[dict]:
        tc = self.tc
        records = []
        while self.progress.epoch < tc.epochs and not self.done():
            record = {"epoch": self.progress.epoch + 1, **self.train_epoch(), **self.evaluate()}
            record["epoch_complete"] = complete = self.progress.batch_in_epoch >= self.batches.per_epoch
            records.append(record)
            figure = self.step.task.best[0]
            best = complete and self.step.task.better(record[figure], self.progress.best)
            if complete:  # else cut short by trainer.max_steps: resume finishes this epoch
                self.progress = Progress(epoch=self.progress.epoch + 1, step=self.progress.step,
                                         best=record[figure] if best else self.progress.best)
            self.hooks("on_epoch_record", self, record)
            self.save(best=best)
            self.hooks("on_epoch_end", self, record)
            if self.env.is_main:
                append_jsonl(self.metrics_path, record)
                log.info("%s", epoch_line(record, tc.epochs, tc.max_steps))
            if self.progress.epoch < tc.epochs and not self.done():
                self.agreement.stop_if_asked()  # a signal during validation: stop before the next epoch starts
        return records

    def _batches(self, batches: Iterable[Batch], meter: EpochMeter, desc: str, total: int) -> Iterator[Batch]:
        """Batches on the device, timed by `meter`, a dead or stuck worker an error naming it (`data.explained`),
        running out of memory on the way (the prefetcher's copy, decode, conversion) a step's one line."""
        with said_in_one_line(self.step.micro_batch, self.device, " preparing a batch on the device"):
            for batch in self.console.track(self.data.explained(batches), desc, total):
                meter.waited()
                yield batch

    def train_epoch(self) -> dict:
        tc = self.tc
        self.step.ddp.train()
        self.data.set_epoch(self.progress.epoch)
        self.doctor.retarget(self.data.plan.num_workers)  # data.autotune may have changed it
        self.hooks("on_epoch_start", self)
        meter = self.counts.start(EpochMeter(self.device, self.memory, self.source_tally()))
        remaining = self.batches.per_epoch - self.progress.batch_in_epoch
        desc = f"epoch {self.progress.epoch + 1}/{tc.epochs}"
        # remaining == 0: resumed from a checkpoint taken after the epoch's last batch, before its validation
        batches = self.batches.train(self.progress.batch_in_epoch) if remaining > 0 else ()  # no loader started
        clocks = getattr(self.data.train, "stages", None)
        before = clocks.snapshot() if clocks is not None else None
        shown = self.plan.batches_left(self.progress, self.batches.per_epoch, tc.grad_accum_steps, tc.max_steps)
        for batch in self._batches(batches, meter, desc, shown):  # the bar counts to max_steps where it comes first
            self.progress.batch_in_epoch += 1
            self.hooks("on_train_batch", self, batch)
            # a batch with no readable sample still steps under DDP: every rank joins every gradient all-reduce
            skipped = self.step.skipped
            try:
                loss, updated = self.step(batch, where=(self.progress.epoch, self.progress.batch_in_epoch))
            except Diverged as err:
                self.agreement.diverge(str(err))
            self.progress.step += updated
            # no .item(): the GPU is not synced every step
            meter.stepped(len(batch), loss, batch.bad, batch.decode_fallbacks,
                          *((self.step.grad_norm, self.step.lr) if updated else (None, None)), indices=batch.indices,
                          skipped=self.step.skipped - skipped)
            self.hooks("on_step", self, meter, updated)
            if not updated:
                continue
            self.agreement.agree()
            every = tc.checkpoint_every_steps
            if every and self.progress.step % every == 0:
                self.save()
            if self.done():
                break
        self.step.drop_partial()
        self.agreement.settle()  # the last step's question, answered before the epoch's collectives
        summary = meter.summary()
        stages = since(clocks.snapshot(), before) if clocks is not None and not self.tc.overfit_batches else None
        # this rank's part timed here, before the reduce
        explained = self.doctor.examine(stages, {**summary, "images": meter.images}, log_it=self.env.is_main)
        return {**reduce_over_ranks(summary, self.env, self.device), **explained}

    def source_tally(self) -> SourceTally | None:
        """dataset=mix: the samples each source gives this epoch (overfit replays the first epoch's batches)."""
        names = self.data.part_names
        if names is None:
            return None
        epoch = 0 if self.tc.overfit_batches else self.progress.epoch
        return SourceTally(names, partial(self.data.parts_of, epoch))

    def validate(self, path: Path) -> dict:
        """trainer.mode=validate: the checkpoint's weights evaluated on the val split; rank 0 writes the row."""
        state = checkpoint.load(path)
        checkpoint.load_model(self.step.model, state, path, self.model_name)
        if "precision" in state:  # auto on a bf16 CPU evaluates in the precision the run measured and trained in
            self.step.auto.load_state_dict(state["precision"])
        # the row names the precision it evaluated in: run.json's, written before the checkpoint was read, may differ
        record = {"mode": "validate", "checkpoint": str(path), "epoch": state["progress"]["epoch"],
                  "precision": self.step.precision, **self.evaluate()}
        if self.env.is_main:
            append_jsonl(self.metrics_path, record)
            figure = self.step.task.best[0]
            log.info("validate %s: val_loss %.4f  %s %.3f on %d samples in %s", path, record["val_loss"], figure,
                     record[figure], record["val_samples"], record["precision"])
        return record

    def evaluate(self) -> dict:
        batches = self._batches(self.batches.val(), EpochMeter(self.device), "val", self.batches.val_batches)
        with said_in_one_line(self.step.micro_batch, self.device, " in evaluation"):
            return self.evaluation(batches)
