"""The cluster paths for real: the Slurm job file on a one-node Slurm (tests/infra/slurm_local_cluster.sh), two torchrun
agents as two "nodes" through scripts/launch_multinode.sh, and the Kubernetes PyTorchJob against the operator's CRD.

Faults come from outside, as on a cluster: `scancel --signal=USR1` (what `--signal=B:USR1@<s>` sends before the time
limit) to the batch script, and SIGKILL to one agent's training process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from loadout.runtime import checkpoint
from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import (
    RECORD_SAMPLES,
    ROOT,
    assert_each_sample_once,
    free_port,
    read_metrics,
    training_at,
    wait_for,
)

TRAIN = 240  # 10 classes x 24; 2 ranks x 120 = 12 batches of 10 each per epoch
BATCHES_PER_EPOCH = 12


@pytest.fixture(scope="module")
def cluster_dataset(tmp_path_factory) -> Path:
    return make_synthetic_imagefolder(tmp_path_factory.mktemp("cluster"), train_per_class=24, val_per_class=4, size=40)


def train_args(root: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=10", "data.num_workers=1",
            "trainer.epochs=2", "trainer.deterministic=true", RECORD_SAMPLES, "trainer.progress=false", *extra]


def torchrun_command() -> str:
    return f"{sys.executable} -m torch.distributed.run"


# -- Slurm -----------------------------------------------------------------------------------------------------
def scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for_job_end(job: str, timeout: float) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return wait_for(lambda: (info := scontrol_job(job)).get("JobState") in ended and info, timeout,
                    f"Slurm job {job} to end", interval=0.5)


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm on this machine, started by the script users run; skips (with the reason) where it can't."""
    script = ROOT / "tests" / "infra" / "slurm_local_cluster.sh"
    was_up = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    started = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        pytest.skip(f"no local Slurm here: {started.stderr.strip().splitlines()[-1:]}")
    yield
    if not was_up:
        subprocess.run(["bash", str(script), "stop"], capture_output=True)


def sbatch(args: list[str], cwd: Path) -> str:
    """Submit scripts/slurm/train.sbatch as a user would, with CPU-sized resources and Hydra overrides."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOADOUT_DIR": str(ROOT), "TORCHRUN": torchrun_command(),
           "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}",
           "--time=15", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *args]
    submitted = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return submitted.stdout.strip().split(";")[0]


@pytest.mark.slow
def test_preempted_job_requeues_and_continues_its_run_each_sample_once(slurm, cluster_dataset, tmp_path):
    job = sbatch(train_args(cluster_dataset), tmp_path)
    run_dir = tmp_path / "outputs" / "torchrun" / job
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    # what Slurm sends the batch script before the time limit (#SBATCH --signal=B:USR1@120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: scontrol_job(job).get("Restarts") == "1", 120, "the job file to requeue its job", interval=0.2)
    info = wait_for_job_end(job, timeout=300)  # pending for the credential lifetime, then the second run
    log = (tmp_path / f"slurm-{job}.out").read_text()  # --open-mode=append: both runs of the job
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    stopped = re.search(r"stopped by SIGUSR1 at epoch 2, batch (\d+); continue with", log)
    assert stopped, log[-3000:]
    assert f"resumed from {run_dir}/checkpoints/last.pt at epoch 2, batch {stopped[1]}" in log
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert_each_sample_once(run_dir, epochs=2, ranks=2, dataset_size=TRAIN, per_rank=TRAIN // 2)


# -- two nodes ---------------------------------------------------------------------------------------------------
def start_agents(root: Path, cwd: Path, rdzv_id: str, max_restarts: int) -> list[subprocess.Popen]:
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1: two "nodes"."""
    port = free_port()
    agents = []
    for node_rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NNODES": "2", "NODE_RANK": str(node_rank),
               "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": rdzv_id,
               "MAX_RESTARTS": str(max_restarts), "TORCHRUN": f"{torchrun_command()} --monitor-interval=0.5"}
        command = ["bash", str(ROOT / "scripts" / "launch_multinode.sh"),
                   *train_args(root, "trainer.checkpoint_every_steps=2")]
        agents.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    return agents


def finish(agents: list[subprocess.Popen]) -> list[str]:
    outputs = [agent.communicate(timeout=400)[0] for agent in agents]
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-4000:]
    return outputs


def final_weights(run_dir: Path) -> dict:
    return checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)["model"]


@pytest.fixture(scope="module")
def two_node_run(cluster_dataset, tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("two-nodes")
    finish(start_agents(cluster_dataset, cwd, "twonodes", max_restarts=0))
    return cwd / "outputs" / "torchrun" / "twonodes"


@pytest.mark.slow
def test_two_agents_train_one_run_with_one_run_dir(two_node_run):
    assert [p.name for p in two_node_run.parent.iterdir()] == ["twonodes"]
    records = read_metrics(two_node_run)  # one metrics.jsonl, one row per epoch, images summed over both nodes
    assert [r["epoch"] for r in records] == [1, 2] and all(r["images"] == TRAIN for r in records)
    assert_each_sample_once(two_node_run, epochs=2, ranks=2, dataset_size=TRAIN, per_rank=TRAIN // 2)


@pytest.mark.slow
def test_killed_rank_on_one_node_restarts_the_group_which_resumes_exactly(cluster_dataset, two_node_run, tmp_path):
    agents = start_agents(cluster_dataset, tmp_path, "twonodes", max_restarts=1)
    run_dir = tmp_path / "outputs" / "torchrun" / "twonodes"
    last = checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST
    wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), 300, "epoch 1 to end")
    epoch_end = last.stat().st_mtime_ns
    wait_for(lambda: last.stat().st_mtime_ns != epoch_end, 120, "a mid-epoch checkpoint in epoch 2", interval=0.01)
    rank1 = wait_for(lambda: [p for p in psutil.Process(agents[1].pid).children(recursive=True)
                              if "train" in p.cmdline()], 30, "node 1's training process")[0]
    rank1.send_signal(signal.SIGKILL)
    outputs = finish(agents)
    log = next(run_dir.glob("*.log")).read_text()
    assert "resumed from" in log, outputs[0][-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    for epoch in range(2):
        for rank in range(2):
            got = json.loads((run_dir / "samples" / f"epoch{epoch:03d}_rank{rank}.json").read_text())
            want = json.loads((two_node_run / "samples" / f"epoch{epoch:03d}_rank{rank}.json").read_text())
            assert got == want, (epoch, rank)
    got, want = final_weights(run_dir), final_weights(two_node_run)
    assert [k for k in want if not torch.equal(got[k], want[k])] == [], "weights differ from the uninterrupted run"


# -- Kubernetes --------------------------------------------------------------------------------------------------
def strict(schema):
    """The CRD schema with unknown fields rejected where Kubernetes would prune them (`kubectl --validate=strict`)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


def test_pytorchjob_validates_against_the_training_operator_crd():
    """scripts/k8s/pytorchjob.yaml against the openAPIV3Schema of Kubeflow training-operator's PyTorchJob CRD
    (kubeflow.org_pytorchjobs.yaml, v1), kept under tests/schemas/."""
    import jsonschema

    schema = strict(json.loads((ROOT / "tests" / "schemas" / "pytorchjob-crd-v1.json").read_text()))
    job = yaml.safe_load((ROOT / "scripts" / "k8s" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    jsonschema.validate(job, schema)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"][:1] == ["torchrun"]
    assert "trainer.resume=auto" in container["args"]
    for broken in ({"maxRestarts": "3"}, {"maxRestart": 3}):  # a string for an integer; a misspelt field
        spec = {**job["spec"], "elasticPolicy": {**job["spec"]["elasticPolicy"], **broken}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**job, "spec": spec}, schema)
