"""Monitoring: the Prometheus endpoint and TensorBoard scalars from real runs, a real Prometheus server scraping
a real trainer, the compose monitoring files, and a taken port failing at start-up."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from loadout.dist import DistEnv
from loadout.errors import RESUMABLE_EXIT, ConfigError
from loadout.observe.memory import MemorySampler
from loadout.observe.meter import EpochMeter
from loadout.observe.metrics import EPOCH, MEMORY, TOTALS, WINDOW, WORKER_MEMORY, use_task_figures
from loadout.observe.monitoring import Monitor, PrometheusSink
from loadout.observe.trackers import Trackers
from loadout.observe.trackers.tensorboard_events import TensorBoardTracker
from tests.conftest import ROOT, compose_config, run_cli
from tests.test_distributed import finish_or_show_stacks
from train.config import validate
from train.task import Classification

MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "loadout.json"
PROMETHEUS_YML = MONITORING / "prometheus" / "prometheus.yml"
STEP_TAGS = {"train/loss", "train/images_per_s", "train/data_wait_frac", "memory/main_pss_bytes",
             "memory/workers_pss_bytes", "memory/workers_uss_bytes", "memory/peak_pss_bytes", "memory/workers"}
EPOCH_TAGS = {"epoch/train_loss", "epoch/val_acc", "epoch/images_per_s", "epoch/data_wait_frac",
              "epoch/first_batch_s", "epoch/peak_pss_mb"}


@pytest.fixture(autouse=True)
def classification_figures():
    """The vocabulary as a classification run has it (the task adds its figures when it is built)."""
    use_task_figures(Classification().figures)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list]:
    """name -> samples, from a plain HTTP GET of /metrics parsed by prometheus_client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(metrics: dict[str, list], name: str) -> float | None:
    samples = metrics.get(name)
    return samples[0].value if samples else None


def tb_scalars(run_dir: Path) -> dict[str, list]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


# -- fast: config, files, the Monitor in-process with real DataLoader workers ---------------------------------------
@pytest.mark.parametrize("port", [0, -1, 70000])
def test_bad_port_is_a_config_error(port):
    cfg = compose_config(["hardware=cpu", f"trainer.metrics_port={port}"])
    with pytest.raises(ConfigError, match=r"trainer\.metrics_port"):
        validate(cfg)


@pytest.mark.slow
def test_port_in_use_fails_at_start_naming_the_key(small_run_args, tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        result = run_cli([*small_run_args, "trainer.max_steps=2", f"trainer.metrics_port={port}"], timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"trainer.metrics_port={port}" in error[0] and "already in use" in error[0]
    assert "trainer.metrics_port=null" in error[0], "the message names the fix"
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "no training before the port check"


@pytest.mark.slow
def test_monitor_with_real_workers_serves_and_writes(tmp_path):
    """The Monitor driven by a real EpochMeter over a real 2-worker DataLoader: scrape mid-epoch, then read back
    the TensorBoard events; the endpoint is gone after close()."""
    port = free_port()
    sampler = MemorySampler().start(0.05)  # as the engine starts it: the flushes take its samples
    trackers = Trackers({"tensorboard": TensorBoardTracker(tmp_path)})
    monitor = Monitor(trackers, PrometheusSink(port, "127.0.0.1", DistEnv(), sampler), sampler, interval_s=0.0)
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,)))
    loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)
    meter, mid = EpochMeter(memory=sampler), None
    try:
        for step, (images, _) in enumerate(loader, start=1):
            meter.waited()
            meter.stepped(images.shape[0], loss=2.0)
            monitor.on_step(step, meter)
            if step == 4:
                mid = scrape(port)
                loader_pids = {str(w.pid) for w in loader._iterator._workers}
        record = {"epoch": 1, **meter.summary(), "val_acc": 0.25, "val_loss": 1.5}
        monitor.on_epoch(8, record)
        end = scrape(port)
    finally:
        monitor.close()
    # Children of the test process: this loader's 2 workers, plus any an earlier test left behind.
    workers = mid["loadout_worker_pss_bytes"]
    assert value(mid, "loadout_workers") >= 2 and loader_pids <= {s.labels["pid"] for s in workers}
    assert all(s.value > 1e6 for s in workers)
    assert value(mid, "loadout_step") == 4 and value(mid, "loadout_images_total") == 32
    assert value(mid, "loadout_train_loss") == pytest.approx(2.0)
    assert 0.0 <= value(mid, "loadout_data_wait_ratio") <= 1.0
    assert value(mid, "loadout_peak_pss_bytes") >= value(mid, "loadout_main_pss_bytes") > 1e7
    assert value(mid, "loadout_val_accuracy") is None, "no fake zero before the first epoch ends"
    assert value(end, "loadout_images_total") == 64 and value(end, "loadout_val_accuracy") == 0.25
    assert all(s.labels["rank"] == "0" for samples in end.values() for s in samples)
    if os.path.isdir("/dev/shm"):
        assert value(end, "loadout_shm_size_bytes") > 0
    scalars = tb_scalars(tmp_path)
    assert set(scalars) >= STEP_TAGS | EPOCH_TAGS, set(scalars)
    assert [e.step for e in scalars["train/loss"]] == list(range(1, 9))
    assert scalars["epoch/val_acc"][0].value == pytest.approx(0.25)
    with pytest.raises(OSError):
        scrape(port)


@pytest.mark.slow
def test_dashboard_and_prometheus_config_parse_and_name_served_metrics(tmp_path):
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = prom["scrape_configs"]
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert "train:9400" in targets and "train-multi:9401" in targets, "base port + LOCAL_RANK per rank"
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {t.split(":")[0] for t in targets} <= set(services), "every target is a compose service"
    for path in (MONITORING / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1, path
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dash = json.loads(DASHBOARD.read_text())
    assert all(p["datasource"]["uid"] == uid for p in dash["panels"])
    exprs = " ".join(dashboard_exprs())
    for needed in ("rate(loadout_images_total", "loadout_data_wait_seconds_total", "loadout_worker_pss_bytes",
                   "loadout_shm_used_bytes"):
        assert needed in exprs, needed
    # Every loadout_* name the dashboard asks for is one the exporter serves (with a CUDA-only pair allowed).
    sink = PrometheusSink(free_port(), "127.0.0.1", DistEnv(), MemorySampler())
    try:
        meter = EpochMeter()
        meter.waited()
        meter.stepped(4, 1.0)
        mon = Monitor(prometheus=sink, interval_s=0.0)
        mon.on_step(1, meter)
        mon.on_epoch(1, {"epoch": 1, "val_acc": 0.5, "val_loss": 1.0})
        families = list(sink.registry.collect())  # families, so a worker gauge with no worker yet still counts
        served = {f.name for f in families} | {s.name for f in families for s in f.samples}
        served |= {"loadout_gpu_memory_allocated_bytes", "loadout_gpu_memory_peak_bytes"}  # CUDA only
    finally:
        sink.close()
    # ... and every name it serves comes from loadout/observe/metrics.py's vocabulary (a counter adds _total, _created).
    named = {m.prometheus for table in (WINDOW, TOTALS, EPOCH, MEMORY, WORKER_MEMORY) for m in table.values()}
    assert {re.sub(r"_(total|created)$", "", name) for name in served if name.startswith("loadout_")} <= named
    asked = set(re.findall(r"loadout_[a-z_]+", exprs))
    assert asked <= served, asked - served
    promtool = shutil.which("promtool")
    if promtool:
        subprocess.run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS_YML)], check=True,
                       capture_output=True)


# -- slow: a real training run with the endpoint on, a real Prometheus scraping it ----------------------------------
@dataclass
class LiveRun:
    """A training run that goes on until `stop`: its figures are asserted on only once they exist, however slowly a
    loaded machine trains or Prometheus scrapes (a short run could end before a scrape saw its first epoch)."""

    proc: subprocess.Popen
    port: int
    run_dir: Path
    prometheus_port: int | None
    stderr: Path
    _stopped: tuple[bool, str] | None = None  # (stopped cleanly, stderr or why not)

    def query(self, expr: str) -> list:
        """Prometheus's instant query result for `expr`."""
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def panel(self, expr: str) -> list:
        """A dashboard panel's query over the whole run (the rate window spans all of it)."""
        return self.query(f"max_over_time(({expr.replace('$__rate_interval', '1m')})[10m:100ms])")

    def has_an_epoch(self) -> bool:
        """An epoch's record is in metrics.jsonl and, with Prometheus, every CPU panel of the dashboard has data."""
        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.is_file() or '"val_acc"' not in metrics.read_text():
            return False
        try:
            return self.prometheus_port is None or all(self.panel(e) for e in dashboard_exprs() if "gpu" not in e)
        except OSError:  # Prometheus slow to answer: ask again
            return False

    def stop(self, timeout: float = 420) -> str:
        """Once the run has an epoch (`has_an_epoch`): SIGTERM, a clean resumable stop (exit 75); its stderr. A
        second call gives the first one's outcome."""
        if self._stopped is None:
            self._stopped = (False, "stop() did not finish")
            deadline = time.monotonic() + timeout
            while not self.has_an_epoch():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self._stopped = (False, f"no epoch's figures (exit {self.proc.poll()}): "
                                            f"{self.stderr.read_text()[-3000:]}")
                    break
                time.sleep(0.5)
            else:
                self.proc.send_signal(signal.SIGTERM)
                code, err = self.proc.wait(timeout=timeout), self.stderr.read_text()
                self._stopped = (True, err) if code == RESUMABLE_EXIT else (False, f"exit {code}: {err[-3000:]}")
        stopped, text = self._stopped
        assert stopped, text
        return text


def start_prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen, int]:
    """The repo's prometheus.yml with its targets pointed at the local trainer, scraped every second (a scrape's
    timeout is its interval: a trainer on a loaded machine answered later than 100 ms, every time, and no scrape of a
    9-epoch run had data); a rate needs two samples, and the live run goes on until they exist."""
    conf = yaml.safe_load(PROMETHEUS_YML.read_text())
    conf["global"]["scrape_interval"] = "1s"
    conf["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(conf))
    port = free_port()
    proc = subprocess.Popen([shutil.which("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
            return proc, port
        except OSError:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("prometheus did not become ready in 60 s")


@pytest.fixture(scope="module")
def live_run(tiny_dataset, tmp_path_factory):
    """`python -m train` with the endpoint on (2 workers, 15 steps an epoch, until `LiveRun.stop`); Prometheus
    first, when installed."""
    tmp = tmp_path_factory.mktemp("live")
    port = free_port()
    prometheus, prometheus_port = start_prometheus(tmp, port) if shutil.which("prometheus") else (None, None)
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=64", "data.batch_size=16",
            "data.num_workers=2", "trainer.epochs=100", "trainer.progress=false",
            f"trainer.metrics_port={port}", f"hydra.run.dir={tmp / 'run'}"]
    stderr = tmp / "train.err"
    with stderr.open("w") as err:  # a file, not a pipe: nothing reads it until the run stops
        proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, "PYTHONPATH": str(ROOT)})
    yield LiveRun(proc, port, tmp / "run", prometheus_port, stderr)
    for p in (proc, prometheus):
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_endpoint_is_live_while_training(live_run):
    deadline, seen = time.monotonic() + 300, None
    while time.monotonic() < deadline and live_run.proc.poll() is None:
        try:
            metrics = scrape(live_run.port)
        except OSError:  # not up yet (imports), or between polls
            time.sleep(0.2)
            continue
        if (value(metrics, "loadout_step") or 0) >= 1 and value(metrics, "loadout_workers"):
            seen = metrics
            break
        time.sleep(0.1)
    assert seen is not None, "no training figures on the endpoint while the run was alive"
    assert value(seen, "loadout_images_per_second") > 0 and value(seen, "loadout_images_total") >= 16
    assert 0.0 <= value(seen, "loadout_data_wait_ratio") <= 1.0
    assert math.isfinite(value(seen, "loadout_train_loss"))
    assert value(seen, "loadout_first_batch_seconds") > 0
    assert value(seen, "loadout_workers") in (2, 4) and value(seen, "loadout_workers") == len(
        seen["loadout_worker_pss_bytes"])
    assert all(s.value > 1e6 for s in seen["loadout_worker_pss_bytes"])


@pytest.mark.slow
def test_real_prometheus_scrapes_the_trainer_and_dashboard_queries_return_data(live_run):
    if live_run.prometheus_port is None:
        pytest.skip("no `prometheus` binary: run tests/infra/ensure_prometheus.sh (apt-get install prometheus)")
    live_run.stop()
    (scrapes,) = live_run.query("count_over_time(loadout_images_total[10m])")
    assert int(scrapes["value"][1]) >= 2, "fewer than two scrapes while training: no rate can be computed"
    (up,) = live_run.query('max_over_time(up{job="loadout"}[10m])')
    assert float(up["value"][1]) == 1.0
    (images,) = live_run.query("max_over_time(loadout_images_total[10m])")
    assert float(images["value"][1]) >= 16 and images["metric"]["rank"] == "0"
    for expr in dashboard_exprs():  # every panel's query is valid; those a CPU run feeds have finite data
        result = live_run.panel(expr)
        if "gpu" not in expr:
            assert result and all(math.isfinite(float(r["value"][1])) for r in result), expr


@pytest.mark.slow
def test_tensorboard_events_from_the_run(live_run):
    live_run.stop()
    scalars = tb_scalars(live_run.run_dir)
    assert set(scalars) >= STEP_TAGS | EPOCH_TAGS | {"train/lr", "train/grad_norm", "epoch/val_top5"}, set(scalars)
    validated = [e.step for e in scalars["epoch/val_acc"]]
    assert validated and validated == [15 * (k + 1) for k in range(len(validated))], validated  # each epoch's end
    steps = [e.step for e in scalars["train/images_per_s"]]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] >= 15 and all(
        e.value > 0 for e in scalars["train/images_per_s"])
    assert all(0 <= e.value <= 1 for e in scalars["train/data_wait_frac"])
    assert all(e.value in (2, 4) for e in scalars["memory/workers"]), "2 train workers (+2 persistent val workers)"


@pytest.mark.slow
def test_torchrun_ranks_serve_base_port_plus_local_rank(tiny_dataset, tmp_path):
    """Two gloo ranks: rank r answers on base + r with rank="r"; only rank 0 writes TensorBoard events."""
    base = free_port()
    while base >= 65535 or not _free(base + 1):
        base = free_port()
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=64", "data.batch_size=16",
            "data.num_workers=1", "trainer.epochs=1", "trainer.max_steps=12", "trainer.progress=false",
            f"trainer.metrics_port={base}", f"hydra.run.dir={tmp_path / 'run'}"]
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    seen: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 150
        while len(seen) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for rank in set(range(2)) - set(seen):
                try:
                    metrics = scrape(base + rank)
                except OSError:
                    continue
                if value(metrics, "loadout_step"):
                    seen[rank] = metrics
            time.sleep(0.2)
        _, err = finish_or_show_stacks(proc, timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert set(seen) == {0, 1}, "each rank serves its own port while training"
    for rank, metrics in seen.items():
        assert {s.labels["rank"] for samples in metrics.values() for s in samples} == {str(rank)}
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
