"""A dead, stalled or stuck worker is an error naming the likely cause, never a hang (real DataLoader workers)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from loadout.data.loader.plan import STUCK_WORKER_TIMEOUT_S, LoaderPlan
from loadout.data.loader.samplers import explain_loader_error
from loadout.data.loader.stateful import shutdown_workers
from loadout.dist import DistEnv
from loadout.errors import LoaderError
from tests.conftest import compose_config, run_cli
from train.job import data_from_config


class DiesAt(Dataset):
    """Its worker kills itself (as the OOM killer or a bus error would) at one index."""

    def __init__(self, index: int):
        self.index = index

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == self.index:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(3)


class Stalls(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        time.sleep(600)  # far beyond any wait for the 1 s timeout, however loaded the machine
        return torch.zeros(3)


def first_error(loader) -> BaseException:
    """The error iterating `loader` raises; its workers are ended here, not by a later test's garbage collection
    (which waits out DataLoader's join timeout)."""
    try:
        with pytest.raises(RuntimeError) as err:
            for _ in loader:
                pass
    finally:
        shutdown_workers(loader)
    return err.value


def test_killed_worker_becomes_an_error_naming_shm_and_memory():
    error = first_error(StatefulDataLoader(DiesAt(5), batch_size=4, num_workers=2, persistent_workers=True))
    explained = explain_loader_error(error)
    assert isinstance(explained, LoaderError)
    assert "shm" in str(explained) and "data.num_workers" in str(explained)


@pytest.mark.slow
def test_stalled_worker_times_out_with_the_key_to_raise():
    started = time.monotonic()
    error = first_error(StatefulDataLoader(Stalls(), batch_size=2, num_workers=1, timeout=1.0))
    assert time.monotonic() - started < 300  # the timeout fired; the sleep did not run out
    explained = explain_loader_error(error)
    assert isinstance(explained, LoaderError) and "data.timeout" in str(explained)


def test_other_errors_pass_through():
    assert explain_loader_error(RuntimeError("CUDA out of memory")) is None


def test_default_timeout_bounds_a_stuck_worker():
    """data.timeout=null (the default): workers get a bounded wait, never DataLoader's wait-forever 0."""
    cfg = OmegaConf.create({"batch_size": 2, "in_order": True, "prefetch_factor": None, "persistent_workers": False,
                            "timeout": None, "multiprocessing_context": None})
    plan = LoaderPlan(num_workers=2, batch_size=2, prefetch_factor=2, pin_memory=False, image_size=8,
                      dtype=torch.uint8)
    assert plan.loader_kwargs(cfg)["timeout"] == STUCK_WORKER_TIMEOUT_S <= 600


@pytest.mark.slow
def test_worker_stuck_in_a_read_ends_the_run_naming_the_worker_and_the_file(small_run_args, tiny_dataset, tmp_path):
    """A file whose read never returns (a FIFO nobody writes, as a dead network mount behaves): the run ends with
    one line naming the worker and the file, and leaves no process behind."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    stuck = data / "train" / "circle" / "stuck.jpg"
    os.mkfifo(stuck)
    args = [a for a in small_run_args if not a.startswith("data.root=")]
    # a hang guard: data.timeout=null would wait 600 s (STUCK_WORKER_TIMEOUT_S) for the read, a FIFO forever
    result = run_cli([*args, f"data.root={data}", "data.num_workers=1", "data.timeout=3", "data.shuffle=false"],
                     timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    named = rf"training worker 0 \(pid \d+\) has been reading {re.escape(str(stuck))} \(sample \d+\) for \d+ s"
    assert re.search(named, errors[0]), errors[0]
    assert "data.timeout" in errors[0]
    left = [p for p in psutil.process_iter(["cmdline"]) if str(data) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


@pytest.mark.slow
def test_workers_outlive_stop_signals_from_outside_and_end_with_the_pipeline(tiny_dataset):
    """Slurm signals every process of a job step, Ctrl-C the whole process group: the workers keep loading (the main
    process decides when to stop), and still end when the pipeline closes (DataLoader's SIGTERM from the parent)."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=2", "data.persistent_workers=true"])
    others = {child.pid for child in psutil.Process().children()}  # earlier tests' processes, if any
    data = data_from_config(cfg, DistEnv(), torch.device("cpu"))
    data.set_epoch(0)
    batches = iter(data.train)
    next(batches)
    workers = [child for child in psutil.Process().children() if child.pid not in others]
    assert len(workers) == 2
    for sig in ("TERM", "INT", "USR1"):  # from another process, as slurmstepd or a terminal sends them
        subprocess.run(["kill", f"-{sig}", *(str(worker.pid) for worker in workers)], check=True)
    time.sleep(0.5)
    assert all(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)
    assert len(list(batches)) == len(data.train) - 1  # the rest of the epoch, nothing lost
    data.close()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
