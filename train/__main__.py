"""`python -m train [overrides]`: compose the config with Hydra, validate it, train.

Under torchrun every rank runs this file; ranks > 0 get quiet Hydra overrides and share rank 0's run dir.
Exit status: 0 done, 2 bad input (one line naming the key), 3 out of memory, 4 diverged (each one line; a retry of the
same config in the same run dir exits at once: train/no_retry.py), 69 a collective failed (a node or link lost: one
line naming the rank), 74 a checkpoint could not be written (make room, then resume), 75 stopped by a signal with a
checkpoint to resume.
"""

from __future__ import annotations

import copy
import faulthandler
import logging
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from train import no_retry
from train.checkpoint import CheckpointWriteError
from train.config import ConfigError, drop_worker_knobs, register, validate
from train.credentials import mask_credentials_in_files, mask_credentials_in_logs, without_credentials
from train.data.loader import LoaderError
from train.dist import DistEnv, hydra_rank_overrides
from train.micro_batch import OutOfMemory
from train.nonfinite import Diverged
from train.overrides import check_command_line
from train.peers import Heartbeat, LostPeer, collective_error, is_collective_failure
from train.stop import (
    CHECKPOINT_WRITE_EXIT,
    CONFIG_EXIT,
    DIVERGED_EXIT,
    LOST_PEER_EXIT,
    OUT_OF_MEMORY_EXIT,
    RESUMABLE_EXIT,
    Stopped,
    StopSignal,
)

log = logging.getLogger("train")
register()


def run(cfg: DictConfig, run_dir: Path, stop: StopSignal | None = None) -> list[dict]:
    """Build everything from a validated config and train; returns the per-epoch records. Raises `Stopped` when
    `stop` (installed by the caller) saw a signal: the checkpoint is written and the workers have ended."""
    from train import dist
    from train.build import instantiate
    from train.data.plan import LoaderPlan
    from train.device import describe, select_device
    from train.run_lock import RunLock

    env = DistEnv.from_env()
    for key in drop_worker_knobs(cfg, typed=command_line_keys()):
        log.info("%s: off, as data.num_workers=0 starts no workers", key)
    validate(cfg)
    dist.seed_everything(cfg.trainer.seed, env, cfg.trainer.deterministic)  # before CUDA starts (cuBLAS reads env)
    device = select_device(cfg.trainer.device, env)
    if env.is_main:
        log.info("device: %s", describe(device))
    plan = LoaderPlan.from_config(cfg.data, env, device, typed_workers="data.num_workers" in command_line_keys())
    callbacks = [instantiate(f"callbacks.{name}", spec) for name, spec in cfg.callbacks.items()]
    with RunLock(run_dir) if env.is_main else nullcontext():  # one run per run dir: a second fails in one line
        return train_in(cfg, run_dir, env, device, plan, stop, callbacks)


def train_in(cfg: DictConfig, run_dir: Path, env: DistEnv, device, plan, stop: StopSignal | None,
             callbacks: list) -> list[dict]:
    """Data, model and Trainer built from their config sections and trained (or validated), with the run dir held
    by this run."""
    from train import checkpoint, dist, trackers
    from train.build import instantiate
    from train.data import build_data, build_sources
    from train.engine import Trainer
    from train.model import build_model
    from train.monitoring import Monitor

    tc = cfg.trainer
    monitor = Monitor.from_config(cfg, env, device, run_dir)  # a taken port, a missing tracker: before any worker
    recipe = instantiate("augment", cfg.augment)
    heartbeat = trainer = None
    ended = trackers.FAILED  # how the trackers' runs are closed
    try:
        with build_data(cfg.data, build_sources(cfg.dataset, cfg.data), recipe, plan, env, device, seed=tc.seed,
                        epochs=tc.epochs, channels_last=tc.channels_last) as data:  # workers end with the run
            dist.init_process_group(env, device, data.val.loader.timeout, tc.dist_timeout_s)
            heartbeat = Heartbeat(env) if env.distributed else None  # names a lost rank if a collective fails
            model = build_model(cfg.model, data.num_classes, device, channels_last=tc.channels_last)
            trainer = Trainer.from_config(cfg, env, device, data, model, run_dir, monitor, stop, callbacks,
                                          recipe=recipe)
            # torchrun restarted the group: continue this run dir. Any rank's count: across nodes only the agent
            # whose process died counts a restart; the others restart theirs for the new rendezvous round.
            restarted = dist.any_rank(env.restart_count) > 0
            resume_path = checkpoint.find_resume_path(tc.resume, run_dir, restarted=restarted)
            if tc.mode == "validate":
                records = [trainer.validate(Path(tc.resume))]
            else:
                if resume_path is not None:
                    trainer.resume(resume_path)
                records = trainer.fit()
        ended = trackers.FINISHED
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    mask_credentials_in_logs()
    if HydraConfig.get().output_subdir:  # null on ranks > 0
        mask_credentials_in_files(run_dir / HydraConfig.get().output_subdir)
    # `kill -USR2 <pid>`: every thread's stack on stderr, for a run that seems stuck (workers inherit it)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        with StopSignal() as stop:
            OmegaConf.resolve(cfg)
            as_given = copy.deepcopy(cfg)  # run() settles some keys (worker knobs); a retry is judged as typed
            no_retry.check(run_dir, as_given)
            run(cfg, run_dir, stop)
    except (ConfigError, LoaderError) as err:
        fail(err, CONFIG_EXIT)
    except no_retry.RetryRefused as err:
        fail(err, err.status)
    except (OutOfMemory, torch.OutOfMemoryError) as err:
        if not isinstance(err, OutOfMemory):  # outside a train step (model, evaluation): torch's first line
            err = f"out of memory: {str(err).splitlines()[0]}; lower data.batch_size or the model's size"
        no_retry.note(run_dir, as_given, OUT_OF_MEMORY_EXIT, str(err))
        fail(err, OUT_OF_MEMORY_EXIT)
    except Diverged as err:
        no_retry.note(run_dir, as_given, DIVERGED_EXIT, str(err))
        fail(err, DIVERGED_EXIT)
    except CheckpointWriteError as err:
        fail(err, CHECKPOINT_WRITE_EXIT)
    except LostPeer as err:
        fail(err, LOST_PEER_EXIT)
    except Stopped as stopped:
        if DistEnv.from_env().is_main:
            log.warning("%s; continue with: %s", stopped, continue_command(run_dir))
        sys.exit(RESUMABLE_EXIT)


def fail(err, status: int) -> None:
    """One line in the log and on stderr (a URL's credentials masked), then exit with `status`."""
    log.error("%s", err)
    print(f"error: {without_credentials(str(err))}", file=sys.stderr)
    sys.exit(status)


def command_line_keys() -> set[str]:
    """The config keys this run's command line set (empty outside a Hydra app, e.g. in tests)."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def continue_command(run_dir: Path) -> str:
    """This run's command line, pointed at its run dir with trainer.resume=auto."""
    kept = [o for o in HydraConfig.get().overrides.task
            if not o.startswith(("hydra.run.dir=", "trainer.resume=", "hydra.output_subdir=", "hydra/"))]
    launcher = "torchrun <same torchrun flags> -m train" if "TORCHELASTIC_RUN_ID" in os.environ else "python -m train"
    return " ".join([launcher, *kept, f"hydra.run.dir={run_dir}", "trainer.resume=auto"])


def check_arguments(argv: list[str]) -> None:
    """Bad overrides fail here in one line (train/overrides.py), before Hydra's multi-line composition error."""
    if any(arg.startswith("-") for arg in argv):  # --help, --cfg, -m ...: Hydra's own business
        return
    try:
        check_command_line(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_arguments(sys.argv[1:])
    sys.argv.extend(hydra_rank_overrides(DistEnv.from_env()))
    main()
