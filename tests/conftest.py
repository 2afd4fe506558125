"""Shared fixtures: a small real JPEG ImageFolder, Hydra composition, and the CLI run in a subprocess."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from scripts.make_dataset import make_synthetic_imagefolder
from train.config import register

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# installs tests/sample_log.py's callback in a `python -m train` run (PYTHONPATH has the checkout)
RECORD_SAMPLES = "+callbacks.samples._target_=tests.sample_log.SampleLog"


@pytest.fixture
def one_thread_steps():
    """The test's in-process training steps on one torch thread, as the workers run, for tests whose outcome compares
    the loader's pace to the step's: a busy machine stretches single-threaded work (the loader's) and the step alike,
    but a step on two threads ~50x (each op waits at a barrier for its descheduled second thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """10 classes x 24 train / 8 val JPEGs at 40 px: enough to learn, quick to decode."""
    return make_synthetic_imagefolder(tmp_path_factory.mktemp("synthetic"), train_per_class=24, val_per_class=8,
                                      size=40)


@pytest.fixture(scope="session")
def learn_dataset(tmp_path_factory) -> Path:
    """Larger set for the learning test: 10 classes x 60 train / 20 val at 48 px."""
    return make_synthetic_imagefolder(tmp_path_factory.mktemp("learn"), train_per_class=60, val_per_class=20,
                                      size=48)


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    """A folder in CIFAR-10's python-batches format (random pixels, 10 labels)."""
    root = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*[(f"data_batch_{i}", 20) for i in range(1, 6)], ("test_batch", 30)]:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(rng.integers(0, 10, n))}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return root


def compose_config(overrides: list[str] | None = None):
    """The config exactly as `python -m train` would compose it."""
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


def trainer_for(cfg, data, run_dir: Path, model=None, device=None, **parts):
    """`Trainer.from_config` on `device` (the CPU unless given) with its parts built as train/job.py builds them: the
    task and the augment recipe, and the config's model for `data`'s classes unless `model` is given; `parts`: its
    other keywords."""
    import torch

    from loadout.build import instantiate
    from loadout.dist import DistEnv
    from train.loop.engine import Trainer
    from train.loop.model import build_model
    from train.task import build_task

    device = torch.device("cpu") if device is None else device
    model = build_model(cfg.model, data.num_classes, device) if model is None else model
    if "task" not in parts:
        parts["task"] = build_task(cfg)
    if "recipe" not in parts:
        parts["recipe"] = instantiate("augment", cfg.augment)
    return Trainer.from_config(cfg, DistEnv(), device, data, model, run_dir, **parts)


def run_cli(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: float = 600,
            module: str = "train") -> subprocess.CompletedProcess:
    """`python -m train ARGS` in a real subprocess (real Hydra, real workers)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def small_run_args(tiny_dataset, tmp_path) -> list[str]:
    """Overrides for a quick CPU run on the tiny dataset, writing into tmp_path."""
    return ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
            "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll `condition()` until it returns something truthy (returned) or `timeout` s pass (a test failure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def training_at(run_dir: Path, rank: int = 0) -> tuple[int, int]:
    """(epoch, batch in epoch) of the batch `rank` is training, from the SampleLog callback; (-1, -1) before."""
    try:
        epoch, batch = (run_dir / "samples" / f"at_rank{rank}").read_text().split()
        return int(epoch), int(batch)
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return -1, -1


def epoch_samples(run_dir: Path, epoch: int, rank: int) -> list[list[int]]:
    """The batches of sample indices `rank` trained in `epoch` (0-based), from the SampleLog callback's files."""
    return json.loads((run_dir / "samples" / f"epoch{epoch:03d}_rank{rank}.json").read_text())["batches"]


def assert_each_sample_once(run_dir: Path, epochs: int, ranks: int, dataset_size: int, per_rank: int) -> None:
    """Every epoch trained each sample exactly once across the ranks (DistributedSampler shards, no padding)."""
    for epoch in range(epochs):
        trained = [i for rank in range(ranks) for batch in epoch_samples(run_dir, epoch, rank) for i in batch]
        assert len(trained) == ranks * per_rank, (epoch, len(trained))
        assert sorted(trained) == list(range(dataset_size)), f"epoch {epoch + 1} repeated or skipped samples"


def whole_and_resumed(cfg, epoch: int, taken: int) -> tuple[list, list]:
    """(epoch `epoch`'s training batches, the batches of a pipeline resumed from the state after its first `taken`),
    each batch as (images, indices) on the host."""
    import torch

    from loadout.dist import DistEnv
    from train.job import data_from_config

    def host(batches) -> list:
        return [(batch.images.clone(), batch.indices.clone()) for batch in batches]

    cpu = torch.device("cpu")
    with data_from_config(cfg, DistEnv(), cpu) as data:
        data.set_epoch(epoch)
        whole = host(data.train)
    with data_from_config(cfg, DistEnv(), cpu) as data:
        data.set_epoch(epoch)
        stream = iter(data.train)
        for _ in range(taken):
            next(stream)
        state = data.train.state_dict()
    with data_from_config(cfg, DistEnv(), cpu) as data:
        data.train.load_state_dict(state)
        return whole, host(data.train)


@pytest.fixture(scope="session")
def shards(tiny_dataset, tmp_path_factory) -> Path:
    """The tiny ImageFolder as shards of ~23 kB: 240 training samples over tens of shards, the last one shorter.
    Made once for the session: tests read it, and copy it before they damage or serve a copy."""
    out = tmp_path_factory.mktemp("shards")
    subprocess.run([sys.executable, "scripts/make_shards.py", str(tiny_dataset), str(out), "--shard-bytes", "23000"],
                   cwd=ROOT, check=True, capture_output=True)
    return out
