"""The Hydra job of `python -m train` (train/__main__.py parses the command line first): validate the composed
config, say where the run writes, train, and turn each way a run can end into its exit status and one line."""

from __future__ import annotations

import copy
import faulthandler
import logging
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from loadout.credentials import mask_credentials_in_files, mask_credentials_in_logs, without_credentials
from loadout.data.config import drop_worker_knobs
from loadout.dist import DistEnv
from loadout.errors import RESUMABLE_EXIT, Failure, LostPeer, OutOfDeviceMemory
from loadout.run import no_retry, resume_run
from loadout.run.peers import Heartbeat, collective_error, is_collective_failure
from loadout.run.run_record import shown_path, where_it_wrote, write_plan
from loadout.runtime.micro_batch import is_out_of_memory
from loadout.runtime.stop import Stopped, StopSignal
from train import CONF
from train.config import validate

log = logging.getLogger("train")


def run(cfg: DictConfig, run_dir: Path, stop: StopSignal | None = None) -> list[dict]:
    """Build everything from a validated config and train; returns the per-epoch records. Raises `Stopped` when
    `stop` (installed by the caller) saw a signal: the checkpoint is written and the workers have ended."""
    from loadout import dist
    from loadout.build import instantiate
    from loadout.data.loader.plan import LoaderPlan
    from loadout.device import describe, select_device
    from loadout.run.run_lock import RunLock
    from loadout.runtime.process import keep_large_blocks

    env = DistEnv.from_env(cfg.trainer.ddp)
    for key in drop_worker_knobs(cfg, typed=command_line_keys()):
        log.info("%s: off, as data.num_workers=0 starts no workers", key)
    validate(cfg)
    dist.seed_everything(cfg.trainer.seed, env, cfg.trainer.deterministic)  # before CUDA starts (cuBLAS reads env)
    device = select_device(cfg.trainer.device, env)
    if env.is_main:
        log.info("device: %s", describe(device))
    plan = LoaderPlan.from_config(cfg.data, env, device, typed_workers="data.num_workers" in command_line_keys())
    if device.type == "cpu":  # each step makes a float batch in host memory: its pages reused, not faulted in anew
        keep_large_blocks(4 * plan.batch_size * 3 * plan.image_size**2)  # float32
    callbacks = [instantiate(f"callbacks.{name}", spec) for name, spec in cfg.callbacks.items()]
    with RunLock(run_dir) if env.is_main else nullcontext():  # one run per run dir: a second fails in one line
        return train_in(cfg, run_dir, env, device, plan, stop, callbacks)


def train_in(cfg: DictConfig, run_dir: Path, env: DistEnv, device, plan, stop: StopSignal | None,
             callbacks: list) -> list[dict]:
    """Data, model and Trainer built from their config sections and trained (or validated), with the run dir held
    by this run."""
    from loadout import dist
    from loadout.build import instantiate
    from loadout.data.pipeline import build_data, build_sources
    from loadout.observe import trackers
    from loadout.observe.monitoring import Monitor
    from loadout.runtime import checkpoint
    from train.loop.engine import Trainer
    from train.loop.model import build_model
    from train.task import build_task

    tc = cfg.trainer
    task = build_task(cfg)  # its figures join the metric vocabulary before any sink reads it
    plan = plan.for_task(task)
    monitor = Monitor.from_config(cfg, env, device, run_dir)  # a taken port, a missing tracker: before any worker
    recipe = instantiate("augment", cfg.augment)
    heartbeat = trainer = None
    ended = trackers.FAILED  # how the trackers' runs are closed
    try:
        with build_data(cfg.data, build_sources(cfg.dataset, cfg.data, task), recipe, plan, env, device, seed=tc.seed,
                        epochs=tc.epochs, channels_last=tc.channels_last) as data:  # workers end with the run
            dist.init_process_group(env, device, data.loader_timeout, tc.dist_timeout_s)
            heartbeat = Heartbeat(env) if env.distributed else None  # names a lost rank if a collective fails
            model = build_model(cfg.model, task.num_outputs(data.source), device, channels_last=tc.channels_last)
            trainer = Trainer.from_config(cfg, env, device, data, model, run_dir, monitor, stop, callbacks,
                                          recipe=recipe, task=task)
            # torchrun restarted the group: continue this run dir. Any rank's count: across nodes only the agent
            # whose process died counts a restart; the others restart theirs for the new rendezvous round.
            restarted = dist.any_rank(env.restart_count) > 0
            resume_path = checkpoint.find_resume_path(tc.resume, run_dir, restarted=restarted)
            if resume_path is not None and tc.mode != "validate":
                trainer.resume(resume_path)
            if env.is_main:  # a resume refused above (another batch size mid-epoch) has written nothing
                record_start(cfg, run_dir, env, device, data.plan, trainer, resume_path)  # as build_data settled it
            records = [trainer.validate(Path(tc.resume))] if tc.mode == "validate" else trainer.fit()
        ended = trackers.FINISHED
        if env.is_main:
            log.info("%s", where_it_wrote(run_dir, trainer.checkpoint_path, trainer.metrics_path))
        return records
    except Stopped:
        ended = trackers.STOPPED
        raise
    except RuntimeError as err:
        if heartbeat is None or not is_collective_failure(err):
            raise
        where = f" at epoch {trainer.progress.epoch + 1}, batch {trainer.progress.batch_in_epoch}" if trainer else ""
        raise LostPeer(f"a collective failed{where}: lost {heartbeat.lost()} ({collective_error(err)}); torchrun "
                       "restarts the group from the last checkpoint while --max-restarts allows, else start it again "
                       "with trainer.resume=auto") from err
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        monitor.close(ended)
        dist.destroy_process_group()


def record_start(cfg: DictConfig, run_dir: Path, env: DistEnv, device, plan, trainer,
                 resume_path: Path | None) -> None:
    """Rank 0, with the run dir held and any checkpoint loaded: the plan in plan.json, a resume's overrides in
    `.hydra/resumes.yaml` (what later resumes replay), or that trainer.resume=auto found nothing."""
    profile = hydra_choice("hardware")
    write_plan(cfg, run_dir, env, device, plan, trainer, profile, profile and CONF / "hardware" / f"{profile}.yaml",
               command_line_keys())
    if resume_path is not None and resume_run.resumed_dir(command_line()) is not None:
        resume_run.record(run_dir, list(HydraConfig.get().overrides.task))
    if cfg.trainer.resume == "auto" and resume_path is None:
        log.info("trainer.resume=auto: nothing to resume in %s (no checkpoint there); a new run starts%s",
                 shown_path(run_dir), "" if "hydra.run.dir" in command_line_keys() else
                 " (to continue a run, give its dir: hydra.run.dir=<run dir>)")


def main(cfg: DictConfig) -> None:
    """The job: `cfg` composed by Hydra, which has made the run dir and its logging."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    mask_credentials_in_logs()
    if HydraConfig.get().output_subdir:  # null on ranks > 0 and on a resume (loadout/run/resume_run.py)
        mask_credentials_in_files(run_dir / HydraConfig.get().output_subdir)
    if DistEnv.from_env().is_main:
        log.info("run dir: %s", shown_path(run_dir))
    # `kill -USR2 <pid>`: every thread's stack on stderr, for a run that seems stuck (workers inherit it)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        with StopSignal() as stop:
            OmegaConf.resolve(cfg)
            if HydraConfig.get().output_subdir:  # a new run: what its checkpoints are tied to, as resolved here
                resume_run.pin_frozen(run_dir / HydraConfig.get().output_subdir, cfg)
            as_given = copy.deepcopy(cfg)  # run() settles some keys (worker knobs); a retry is judged as typed
            no_retry.check(run_dir, as_given)
            run(cfg, run_dir, stop)
    except Stopped as stopped:
        if DistEnv.from_env().is_main:
            log.warning("%s; continue with: %s", stopped, continue_command(run_dir))
        sys.exit(RESUMABLE_EXIT)
    except Failure as err:
        failed(err, run_dir, as_given)
    except RuntimeError as err:  # out of memory outside the loop (building the model): torch's first line
        if not is_out_of_memory(err):
            raise
        failed(OutOfDeviceMemory(f"out of memory: {str(err).splitlines()[0]}; lower data.batch_size or the model's "
                                 "size"), run_dir, as_given)


def failed(err: Failure, run_dir: Path, as_given: DictConfig) -> None:
    """A failure's one line and exit status; one the same config would repeat leaves its note for a retry."""
    if err.repeats:
        no_retry.note(run_dir, as_given, err.status, str(err))
    fail(err, err.status)


def fail(err, status: int) -> None:
    """One line on stderr and in the log file (not again on the console; a URL's credentials masked), then exit
    with `status`."""
    message = without_credentials(str(err))
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def command_line() -> list[str]:
    """This run's overrides (a resume's: the run's own, then the command line's) and the hydra.run.dir it was
    given; empty outside a Hydra app (e.g. in tests)."""
    if not HydraConfig.initialized():
        return []
    overrides = HydraConfig.get().overrides
    return [*overrides.task, *(o for o in overrides.hydra if o.startswith("hydra.run.dir="))]


def command_line_keys() -> set[str]:
    return {resume_run.key_of(o) for o in command_line()}


def hydra_choice(group: str) -> str | None:
    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


def continue_command(run_dir: Path) -> str:
    """A command that continues this run, as typed in a new shell: this interpreter (the repo's .venv as
    `.venv/bin/python`), the run dir and trainer.resume=auto; the run's own overrides are replayed from its dir."""
    python = Path(shown_path(Path(sys.executable)))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        torchrun = python.parent / "torchrun" if (Path(sys.executable).parent / "torchrun").exists() else "torchrun"
        launcher = f"{torchrun} <same torchrun flags> -m train"
    else:
        launcher = f"{python} -m train"
    return f"{launcher} trainer.resume=auto hydra.run.dir={shown_path(run_dir)}"


def data_from_config(cfg, env: DistEnv, device, recipe=None, typed_workers: bool = True, task=None):
    """`build_data` with every part built from a composed config (tests, benchmarks) but the `recipe` and `task`
    given, which a Trainer over the data is then handed too."""
    from loadout.build import instantiate
    from loadout.data.loader.plan import LoaderPlan
    from loadout.data.pipeline import build_data, build_sources
    from train.task import build_task

    recipe = recipe or instantiate("augment", cfg.augment)
    task = task or build_task(cfg)
    plan = LoaderPlan.from_config(cfg.data, env, device, typed_workers).for_task(task)
    return build_data(cfg.data, build_sources(cfg.dataset, cfg.data, task), recipe, plan, env, device,
                      seed=cfg.trainer.seed, epochs=cfg.trainer.epochs, channels_last=cfg.trainer.channels_last)
