"""Multi-process training under real torchrun (gloo on CPU): sharding, one run dir, resume bit for bit, and
validation on the BatchNorm statistics that are saved.

The torchrun tests share one uninterrupted reference run and compare a run whose rank 1 is SIGKILLed mid-epoch
(torchrun restarts the group) and a run stopped and started again with trainer.resume=auto against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loadout.dist import DistEnv
from loadout.runtime import checkpoint
from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import (
    RECORD_SAMPLES,
    ROOT,
    compose_config,
    free_port,
    read_metrics,
    trainer_for,
    training_at,
    wait_for,
)
from train.job import data_from_config

TRAIN, VAL = 240, 79  # per rank 120 = 6 batches of 20; 79 val images split 40/39, no padding
EPOCHS, STEPS_PER_EPOCH = 2, 6


@pytest.fixture(scope="module")
def dist_dataset(tmp_path_factory) -> Path:
    root = make_synthetic_imagefolder(tmp_path_factory.mktemp("dist"), train_per_class=24, val_per_class=8, size=40)
    next((root / "val" / "circle").iterdir()).unlink()  # 79: an odd count that padding would show up in
    return root


def dist_args(root: Path) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=20", "data.num_workers=1",
            "data.persistent_workers=true", f"trainer.epochs={EPOCHS}", "trainer.checkpoint_every_steps=2",
            "trainer.deterministic=true", RECORD_SAMPLES, "trainer.progress=false",
            "model.name=resnet18"]


def torchrun_command(args: list[str], *, max_restarts: int = 0, nproc: int = 2,
                     entry: tuple[str, ...] = ("-m", "train")) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *entry, *args]


def torchrun(args: list[str], cwd: Path, *, max_restarts: int = 0, env: dict | None = None, nproc: int = 2,
             entry: tuple[str, ...] = ("-m", "train"), timeout: float = 400) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m train ARGS`, for real. A job still running after `timeout` is a
    failure that shows every thread's stack of the agent's children."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(torchrun_command(args, max_restarts=max_restarts, nproc=nproc, entry=entry), cwd=cwd,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = finish_or_show_stacks(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def finish_or_show_stacks(proc: subprocess.Popen, timeout: float) -> tuple[str | None, str | None]:
    """`proc.communicate()` within `timeout`; a torchrun job still running then is a failure that shows every
    thread's stack of the agent's children (SIGUSR2: the trainer's faulthandler), never a silent hang."""
    import psutil

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)
        for child in children:  # one at a time: processes dumping into one pipe at once interleave their lines
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
        for process in [*children, psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        out, err = proc.communicate()
        raise AssertionError(f"torchrun still running after {timeout:.0f} s; its output:\n{(out or '')[-3000:]}\n"
                             f"its stderr, with every thread's stack:\n{(err or '')[-30000:]}") from None


def only_run_dir(cwd: Path) -> Path:
    """The one run dir torchrun's ranks (and restarts) share: outputs/torchrun/<TORCHELASTIC_RUN_ID>."""
    runs = list((cwd / "outputs" / "torchrun").iterdir())
    assert len(runs) == 1, runs
    assert not list((cwd / "outputs").glob("20*")), "a rank fell back to a ${now:} run dir"
    return runs[0]


def samples(run_dir: Path, epoch: int, rank: int) -> list[list[int]]:
    return json.loads((run_dir / "samples" / f"epoch{epoch:03d}_rank{rank}.json").read_text())["batches"]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def final_checkpoint(run_dir: Path) -> dict:
    return checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)


def final_model(run_dir: Path) -> dict:
    return final_checkpoint(run_dir)["model"]


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Per epoch and rank the same samples in the same order, and the same final weights bit for bit."""
    for epoch in range(EPOCHS):
        for rank in (0, 1):
            assert samples(run_dir, epoch, rank) == samples(reference, epoch, rank), (epoch, rank)
    got, want = final_model(run_dir), final_model(reference)
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"
    assert [r["epoch"] for r in read_metrics(run_dir)] == list(range(1, EPOCHS + 1))


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def reference_run(dist_dataset, tmp_path_factory) -> Path:
    """An uninterrupted 2-process run in its own working dir (run dir from TORCHELASTIC_RUN_ID)."""
    cwd = tmp_path_factory.mktemp("reference")
    ok(torchrun(dist_args(dist_dataset), cwd))
    return only_run_dir(cwd)


@pytest.mark.slow
def test_two_ranks_shard_each_epoch_and_share_one_run_dir(reference_run):
    run_dir = reference_run
    orders = []
    for epoch in range(EPOCHS):
        rank0, rank1 = flat(samples(run_dir, epoch, 0)), flat(samples(run_dir, epoch, 1))
        assert len(rank0) == len(rank1) == TRAIN // 2
        assert not set(rank0) & set(rank1), "ranks trained the same sample in one epoch"
        assert sorted(rank0 + rank1) == list(range(TRAIN)), "an epoch skipped or repeated samples"
        orders.append(rank0)
    assert orders[0] != orders[1], "DistributedSampler.set_epoch did not reshuffle"
    metrics = read_metrics(run_dir)
    assert len(metrics) == EPOCHS
    assert all(r["val_samples"] == VAL for r in metrics), "validation must count each sample exactly once"
    assert all(r["images"] == TRAIN for r in metrics), "train images are summed over ranks"
    # only rank 0 writes: one .hydra/, one log whose epoch lines appear once, one metrics.jsonl
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    logs = list(run_dir.glob("*.log"))
    assert len(logs) == 1 and logs[0].read_text().count("epoch 1/") == 1


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_and_resume_auto_matches(dist_dataset, reference_run,
                                                                                   tmp_path):
    """What Kubernetes and Slurm do: SIGTERM to the torchrun agent, which passes it on to both ranks. They agree on
    one step, rank 0 saves every rank's loader position, and trainer.resume=auto trains exactly the rest."""
    run_dir = tmp_path / "run"
    args = [*dist_args(dist_dataset), f"hydra.run.dir={run_dir}"]
    agent = subprocess.Popen(torchrun_command(args), cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: min(training_at(run_dir, rank) for rank in (0, 1)) >= (1, 2), 300, "epoch 2 to be under way")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=120)[0]
    assert agent.returncode != 0, "torchrun reports the signal it got"
    stopped = re.findall(r"stopped by SIGTERM at epoch 2, batch (\d+); continue with", out)
    assert len(stopped) == 1, out[-4000:]  # rank 0 says it once
    assert len(read_metrics(run_dir)) == 1
    batch = int(stopped[0])
    saved = final_checkpoint(run_dir)["loader"]["ranks"]  # each rank's StatefulDataLoader state at the stop
    assert [(r["epoch"], r["batch"], r["num_workers"]) for r in saved] == [(1, batch, 1)] * 2
    for rank in saved:
        assert rank["loader"]["_snapshot"]["_main_snapshot"]["_index_sampler_state"] == {"epoch": 1, "batch": batch}
    assert saved[0]["loader"] != saved[1]["loader"], "each rank's loader (its seeds) is saved, not rank 0's twice"
    ok(torchrun([*args, "trainer.resume=auto"], tmp_path))
    assert_same_training(run_dir, reference_run)


@pytest.mark.slow
def test_gradient_accumulation_all_reduces_only_on_the_updating_micro_batch(dist_dataset, tmp_path):
    """Two real ranks, two micro-batches per step: one all-reduce pass per optimizer step, in the second backward,
    and identical weights on both ranks after every step (hooks installed from outside by tests/ddp_probe.py)."""
    args = [*dist_args(dist_dataset), "trainer.grad_accum_steps=2", "trainer.epochs=1", f"hydra.run.dir={tmp_path}/run"]
    ok(torchrun(args, tmp_path, env={"PROBE_DIR": str(tmp_path)}, entry=(str(ROOT / "tests" / "ddp_probe.py"),)))
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())
        steps = " ".join(events).split(" step: ")  # each optimizer step closes one group of events
        assert len(steps) == 1 + STEPS_PER_EPOCH // 2, events
        assert all(part.startswith("identical") for part in steps[1:]), events
        for step in (part.removeprefix("identical").split() for part in steps[:-1]):
            assert step[:2] == ["forward", "forward"] and step[2:] and set(step[2:]) == {"allreduce"}, step


@pytest.mark.slow
def test_ranks_above_zero_write_nothing(tiny_dataset, tmp_path):
    """A rank > 0 (as torchrun starts it) makes no .hydra/, log, metrics or checkpoint, and prints no epoch lines."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
            "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=1", "trainer.max_steps=2",
            "trainer.checkpoint_every_steps=1", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    ok(proc)
    written = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) if run_dir.exists() else []
    assert written == [], written
    assert "epoch 1/1" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_validation_under_ddp_uses_the_batchnorm_statistics_that_are_saved(dist_dataset, tmp_path):
    """Each rank's BatchNorm statistics follow its own shard (broadcast_buffers=False) and best.pt holds rank 0's:
    the val figures two ranks report must be a single process's evaluation of best.pt."""
    args = ["hardware=cpu", f"data.root={dist_dataset}", "data.image_size=32", "data.batch_size=20",
            "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=1", "trainer.precision=fp32",
            "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet", "logger=[]"]
    ok(torchrun(args, tmp_path, timeout=240))
    run_dir = only_run_dir(tmp_path)
    reported = read_metrics(run_dir)[-1]
    cfg = compose_config(args)
    data = data_from_config(cfg, DistEnv(), torch.device("cpu"))
    alone = trainer_for(cfg, data, tmp_path)
    record = alone.validate(checkpoint.checkpoint_dir(run_dir) / checkpoint.BEST)
    assert record["val_samples"] == reported["val_samples"] == VAL
    assert record["val_acc"] == reported["val_acc"]
    assert record["val_loss"] == pytest.approx(reported["val_loss"], rel=1e-5, abs=0)


def test_restart_resumes_from_the_run_dir(tmp_path):
    last = checkpoint.checkpoint_dir(tmp_path) / checkpoint.LAST
    assert checkpoint.find_resume_path(None, tmp_path, restarted=True) is None
    checkpoint.save({"model": torch.nn.Linear(2, 2)}, last)
    assert checkpoint.find_resume_path(None, tmp_path) is None
    assert checkpoint.find_resume_path(None, tmp_path, restarted=True) == last
    assert checkpoint.find_resume_path("/elsewhere.pt", tmp_path, restarted=True) == last
    assert checkpoint.find_resume_path("auto", tmp_path) == last


def _pipeline(root: Path, workers: int, device: str = "cpu"):
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=8",
                          f"data.num_workers={workers}", f"data.persistent_workers={str(workers > 0).lower()}",
                          RECORD_SAMPLES])
    return data_from_config(cfg, DistEnv(), torch.device(device))


cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here")]


@pytest.mark.parametrize(("workers", "device"), [(0, "cpu"), (2, "cpu"), pytest.param(2, "cuda", marks=cuda)])
def test_training_stream_resumes_mid_epoch_with_the_same_batches(tiny_dataset, workers, device):
    """Position taken after 3 batches, loaded into a fresh pipeline: the rest of the epoch is the same, pixel
    for pixel. On CUDA the prefetcher holds a batch ahead; the position must still be that of the 3 yielded."""
    first = _pipeline(tiny_dataset, workers, device)
    first.set_epoch(1)
    batches = iter(first.train)
    for _ in range(3):
        next(batches)
    state = first.train.state_dict()
    rest = list(batches)
    second = _pipeline(tiny_dataset, workers, device)
    second.set_epoch(1)
    second.train.load_state_dict(state)
    resumed = list(second.train)
    assert len(resumed) == len(rest) == len(first.train) - 3
    for a, b in zip(rest, resumed, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.images, b.images)


def test_augmentation_is_a_function_of_seed_epoch_and_index(tiny_dataset):
    """The same (epoch, index) gives the same pixels in any process and order; another epoch, another crop."""
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32"])
    dataset, _ = data_from_config(cfg, DistEnv(), torch.device("cpu")).samples  # what the workers read
    first = dataset[(0, 5)][0]
    dataset[(0, 6)]
    assert torch.equal(first, dataset[(0, 5)][0])
    assert any(not torch.equal(dataset[(0, i)][0], dataset[(1, i)][0]) for i in range(8))


@pytest.mark.slow
def test_launcher_script_is_valid_bash():
    script = ROOT / "scripts" / "launch_multinode.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)
    missing_id = subprocess.run(["bash", str(script)], env={**os.environ, "NNODES": "2", "RDZV_ID": ""},
                                capture_output=True, text=True)
    assert missing_id.returncode == 2 and "RDZV_ID" in missing_id.stderr


@pytest.mark.slow
def test_launcher_runs_torchrun_with_c10d_rendezvous(tiny_dataset, tmp_path):
    """The multi-node wrapper on one node: torchrun's c10d rendezvous, run dir named by RDZV_ID."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNODES": "1", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RDZV_ID": "job42", "MAX_RESTARTS": "0",
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
            "data.num_workers=0", "data.persistent_workers=false", "trainer.epochs=1", "trainer.max_steps=2",
            "trainer.progress=false"]
    ok(subprocess.run(["bash", str(ROOT / "scripts" / "launch_multinode.sh"), *args], cwd=tmp_path, env=env,
                      capture_output=True, text=True, timeout=300))
    assert only_run_dir(tmp_path).name == "job42"
