"""Two nodes on a real network: two network namespaces joined by a veth pair, one torchrun agent in each
(scripts/launch_multinode.sh, c10d rendezvous on node A's veth address, GLOO_SOCKET_IFNAME naming each node's
interface as docs/distributed.md tells users). Faults from outside: node B's agent and its training process
SIGKILLed and started again (as Slurm or Kubernetes would), and B's link taken down mid-epoch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loadout.runtime import checkpoint
from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import RECORD_SAMPLES, ROOT, assert_each_sample_once, read_metrics, wait_for

TRAIN = 240  # 2 nodes x 120 = 12 batches of 10 each per epoch
A, B = "10.123.7.1", "10.123.7.2"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """Namespaces node_a and node_b, veth interfaces `<name>a` / `<name>b` between them."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"ld{os.getpid() % 100000}"
    ns = {"a": f"{tag}-a", "b": f"{tag}-b"}
    dev = {"a": f"{tag}a", "b": f"{tag}b"}
    if ip("netns", "add", ns["a"]).returncode != 0:
        pytest.skip("cannot make network namespaces here")
    ip("netns", "add", ns["b"])
    ip("link", "add", dev["a"], "type", "veth", "peer", "name", dev["b"])
    for side, address in (("a", A), ("b", B)):
        ip("link", "set", dev[side], "netns", ns[side])
        ip("-n", ns[side], "addr", "add", f"{address}/24", "dev", dev[side])
        ip("-n", ns[side], "link", "set", dev[side], "up")
        ip("-n", ns[side], "link", "set", "lo", "up")
    yield ns, dev
    for name in ns.values():
        ip("netns", "del", name)


@pytest.fixture(scope="module")
def net_dataset(tmp_path_factory) -> Path:
    return make_synthetic_imagefolder(tmp_path_factory.mktemp("net"), train_per_class=24, val_per_class=4, size=40)


def agent(hosts, side: str, root: Path, cwd: Path, rdzv_id: str, *extra: str, max_restarts: int = 0,
          rdzv_conf: str = "join_timeout=120") -> subprocess.Popen:
    """One node's torchrun agent in its namespace."""
    ns, dev = hosts
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNODES": "2", "NODE_RANK": "0" if side == "a" else "1",
           "NPROC_PER_NODE": "1", "MASTER_ADDR": A, "MASTER_PORT": "29531", "RDZV_ID": rdzv_id,
           "MAX_RESTARTS": str(max_restarts), "GLOO_SOCKET_IFNAME": dev[side], "LOCAL_ADDR": A if side == "a" else B,
           # the endpoint's address is node A's veth, which its hostname does not resolve to: say who hosts the store
           "RDZV_CONF": f"{rdzv_conf},is_host={'true' if side == 'a' else 'false'}",
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run --monitor-interval=0.5"}
    args = ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=10", "data.num_workers=1",
            "trainer.epochs=2", "trainer.progress=false", "trainer.checkpoint_every_steps=2", RECORD_SAMPLES,
            "trainer.resume=auto", *extra]
    return subprocess.Popen(["ip", "netns", "exec", ns[side], "bash", str(ROOT / "scripts" / "launch_multinode.sh"),
                             *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL to every process of a node (torchrun starts its training processes in sessions of their own)."""
    processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue


def finish(*agents: subprocess.Popen, timeout: float = 400) -> list[str]:
    outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    for a, out in zip(agents, outputs, strict=True):
        assert a.returncode == 0, out[-4000:]
    return outputs


def mid_epoch_two(run_dir: Path) -> None:
    """Wait until epoch 1 has ended and epoch 2 has a checkpoint of its own."""
    last = checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST
    wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), 300, "epoch 1 to end")
    epoch_end = last.stat().st_mtime_ns
    wait_for(lambda: last.exists() and last.stat().st_mtime_ns != epoch_end, 120, "a checkpoint in epoch 2",
             interval=0.01)


@pytest.mark.slow
def test_a_node_killed_and_started_again_resumes_the_job(hosts, net_dataset, tmp_path):
    node_a = agent(hosts, "a", net_dataset, tmp_path, "net2", max_restarts=2)
    node_b = agent(hosts, "b", net_dataset, tmp_path, "net2", max_restarts=2)
    run_dir = tmp_path / "outputs" / "torchrun" / "net2"
    mid_epoch_two(run_dir)
    kill_node(node_b)  # the node is gone: its agent and its training process at once
    node_b.communicate()
    node_b = agent(hosts, "b", net_dataset, tmp_path, "net2", max_restarts=2)  # the scheduler starts it again
    finish(node_a, node_b)
    assert "resumed from" in next(run_dir.glob("*.log")).read_text()
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert_each_sample_once(run_dir, epochs=2, ranks=2, dataset_size=TRAIN, per_rank=TRAIN // 2)


@pytest.mark.slow
def test_a_link_down_fails_within_the_timeout_naming_the_lost_node_and_a_restart_resumes(hosts, net_dataset,
                                                                                          tmp_path):
    ns, dev = hosts
    timeouts = ("data.timeout=10", "trainer.dist_timeout_s=20")
    conf = "join_timeout=60,read_timeout=20"
    node_a = agent(hosts, "a", net_dataset, tmp_path, "net3", *timeouts, rdzv_conf=conf)
    node_b = agent(hosts, "b", net_dataset, tmp_path, "net3", *timeouts, rdzv_conf=conf)
    run_dir = tmp_path / "outputs" / "torchrun" / "net3"
    try:
        mid_epoch_two(run_dir)
        down = time.monotonic()
        ip("-n", ns["b"], "link", "set", dev["b"], "down")
        out_a = node_a.communicate(timeout=180)[0]
        failed_after = time.monotonic() - down
        try:  # the cut-off node's torchrun agent may wait on the unreachable store: kill it, as srun
            node_b.communicate(timeout=10)  # --kill-on-bad-exit (train.sbatch) or a failed PyTorchJob would
        except subprocess.TimeoutExpired:
            kill_node(node_b)
            node_b.communicate()
    finally:
        ip("-n", ns["b"], "link", "set", dev["b"], "up")
        for node in (node_a, node_b):
            if node.poll() is None:
                kill_node(node)
    assert node_a.returncode != 0 and failed_after < 150, (failed_after, out_a[-3000:])
    lines = [line for line in out_a.splitlines() if line.startswith("error: a collective failed")]
    assert lines and re.search(r"lost rank \d \(host \S+\)", lines[0]) and "Timed out" in lines[0], out_a[-3000:]
    finish(agent(hosts, "a", net_dataset, tmp_path, "net3"), agent(hosts, "b", net_dataset, tmp_path, "net3"))
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert_each_sample_once(run_dir, epochs=2, ranks=2, dataset_size=TRAIN, per_rank=TRAIN // 2)
