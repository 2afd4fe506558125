"""The `logger` group with real trackers: an MLflow tracking server started here (SQLite backend) queried through
MLflow's client after a run, a SIGTERM and its resume; W&B in offline mode, its run files read back; the CSV table;
a tracker whose library is missing; and the figures every record carries (lr, grad_norm, val_top5) with
trainer.grad_clip."""

from __future__ import annotations

import csv
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

import pytest
import torch

from loadout.data.loader.batch import Batch
from loadout.dist import DistEnv
from tests.conftest import RECORD_SAMPLES, ROOT, free_port, read_metrics, run_cli, training_at, wait_for
from train.loop.config import TrainerConfig
from train.loop.schedule import warmup_cosine
from train.loop.step import TrainStep

STEPS_PER_EPOCH = 15  # tiny_dataset: 240 training images / batch 16


def args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "data.num_workers=1",
            "trainer.epochs=2", "trainer.progress=false", RECORD_SAMPLES, f"hydra.run.dir={run_dir}", *extra]


@contextmanager
def serving_mlflow(home: Path):
    """`mlflow server` on 127.0.0.1 with a SQLite backend in `home`, as a team runs it; yields (its URL, process)."""
    port = free_port()
    with open(home / "server.log", "w") as log:
        server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                                   "--port", str(port), "--workers", "1", "--backend-store-uri",
                                   f"sqlite:///{home / 'mlflow.db'}", "--default-artifact-root",
                                   str(home / "artifacts")], stdout=log, stderr=subprocess.STDOUT, cwd=home,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, (home / "server.log").read_text()[-2000:]
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, 120, "the MLflow server", interval=0.5)
        yield url, server
    finally:
        with suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with serving_mlflow(tmp_path_factory.mktemp("mlflow")) as (url, _):
        yield url


def mlflow_runs(url: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def steps_of(url: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(url).get_metric_history(run_id, key))


@pytest.mark.slow
def test_mlflow_keeps_one_run_through_a_sigterm_and_its_resume(mlflow_server, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": mlflow_server}
    cmd = args(tiny_dataset, run_dir, "logger=[mlflow,csv]", "logger.mlflow.experiment=preempted")
    proc = subprocess.Popen([sys.executable, "-m", "train", *cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]

    (stopped,) = mlflow_runs(mlflow_server, "preempted")
    assert stopped.info.status == "KILLED"
    params = stopped.data.params
    assert params["data.batch_size"] == "16" and params["trainer.epochs"] == "2"
    assert params["logger.mlflow._target_"] == "loadout.observe.trackers.mlflow_run.MLflowTracker"
    assert steps_of(mlflow_server, stopped.info.run_id, "epoch/val_acc") == [STEPS_PER_EPOCH]

    resumed = run_cli([*cmd, "trainer.resume=auto"], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = mlflow_runs(mlflow_server, "preempted")  # the same run, continued: never a second one
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert steps_of(mlflow_server, run.info.run_id, "epoch/val_acc") == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    for key in ("epoch/val_top5", "epoch/lr", "epoch/grad_norm", "train/loss", "train/lr", "train/grad_norm",
                "train/images_per_s", "memory/main_pss_bytes"):
        assert key in run.data.metrics, key
    assert run.data.metrics["epoch/val_acc"] == read_metrics(run_dir)[-1]["val_acc"]

    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["epoch"], row["step"]) for row in rows] == [("1", "15"), ("2", "30")]
    assert float(rows[-1]["val_top5"]) == pytest.approx(read_metrics(run_dir)[-1]["val_top5"])


@pytest.mark.slow
def test_an_mlflow_server_that_dies_mid_run_costs_its_figures_not_the_run(tiny_dataset, tmp_path):
    """The tracking server is killed in epoch 2 of 3, where MLflow's client retries each request for minutes: the
    run trains on at its pace, finishes (every figure in metrics.jsonl) and exits CLOSE_S at most after its last
    epoch (however long training took on this machine), saying the trackers' last calls did not arrive."""
    from loadout.observe.trackers.delivery import CLOSE_S

    run_dir = tmp_path / "run"
    with serving_mlflow(tmp_path) as (url, server):
        cmd = args(tiny_dataset, run_dir, "logger=[mlflow]", "trainer.epochs=3")
        proc = subprocess.Popen([sys.executable, "-m", "train", *cmd], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url})
        wait_for(lambda: proc.poll() is not None or training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
        os.killpg(server.pid, signal.SIGKILL)
        out = proc.communicate(timeout=600)[0]
        took = time.time() - (run_dir / "metrics.jsonl").stat().st_mtime  # the last epoch's record was its last write
    assert proc.returncode == 0, out[-3000:]
    assert [record["epoch"] for record in read_metrics(run_dir)] == [1, 2, 3]
    assert took < CLOSE_S + 60, f"{took:.0f} s from the last epoch's record to the run's exit"
    assert "the trackers did not deliver their last" in out, out[-3000:]


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (`run-<id>.wandb`): LevelDB's log format (32 KiB blocks, a 7-byte
    header per chunk) after W&B's 7-byte file header."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == length == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_a_tracker_that_fails_is_warned_about_once_and_used_again_when_it_answers(caplog):
    """A tracker of the user's own whose server goes away for two windows and comes back: the training thread never
    sees its error, one warning says so, and the figures after its return arrive, in order, by finish."""
    from loadout.observe.trackers import FINISHED, Tracker, Trackers

    class Flaky(Tracker):
        def __init__(self):
            self.down, self.got, self.ended = False, [], None

        def log(self, step, scalars):
            if self.down:
                raise ConnectionError("connection refused\nsecond line")
            self.got.append(step)

        def finish(self, status):
            self.ended = status

    flaky = Flaky()
    trackers = Trackers({"flaky": flaky})
    with caplog.at_level("INFO", logger="loadout.observe.trackers.delivery"):
        trackers.log_window(1, {"train/loss": 2.0})
        wait_for(lambda: flaky.got == [1], 10, "the first window")
        flaky.down = True
        trackers.log_window(2, {"train/loss": 1.9})
        trackers.log_window(3, {"train/loss": 1.8})
        wait_for(lambda: "connection refused" in caplog.text, 10, "the warning")
        time.sleep(0.2)
        flaky.down = False
        for step in (4, 5):
            trackers.log_window(step, {"train/loss": 1.7})
        trackers.finish(FINISHED)
    assert flaky.got == [1, 4, 5] and flaky.ended == FINISHED
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["logger.flaky: ConnectionError: connection refused (its figures are dropped until it answers "
                        "again; the run goes on)"]
    assert "logger.flaky answers again" in caplog.text


@pytest.mark.slow
def test_an_mlflow_server_not_there_fails_at_start_in_one_line_without_its_credentials(tiny_dataset, tmp_path):
    """Nothing listens at MLFLOW_TRACKING_URI: one line before any worker (not minutes of MLflow's retries and then
    a traceback mid-epoch), its password masked."""
    uri = f"http://alice:s3cret@127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_cli(args(tiny_dataset, tmp_path / "run", "logger=[mlflow]"), cwd=tmp_path,
                     env={"MLFLOW_TRACKING_URI": uri}, timeout=300)
    assert result.returncode == 2 and time.monotonic() - started < 120, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: logger.mlflow.tracking_uri=http://***@127.0.0.1:") and "MLFLOW_TRACKING_URI" in line
    assert "s3cret" not in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_trackers_copy_of_the_config_masks_a_urls_credentials():
    from omegaconf import OmegaConf

    from loadout.observe.trackers import flat_params

    cfg = OmegaConf.create({"logger": {"mlflow": {"tracking_uri": "https://alice:s3cret@mlflow.example:5000"}},
                            "data": {"root": "s3://bucket/shards"}})
    assert flat_params(cfg) == {"logger.mlflow.tracking_uri": "https://***@mlflow.example:5000",
                                "data.root": "s3://bucket/shards"}


@pytest.mark.slow
def test_wandb_offline_run_is_continued_by_a_resume(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = run_cli(args(tiny_dataset, run_dir, "logger=[wandb]", "trainer.max_steps=5"), cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    # the resume keeps the run's saved config, max_steps=5 included: lifted here to finish the run
    second = run_cli(args(tiny_dataset, run_dir, "logger=[wandb]", "trainer.resume=auto", "trainer.max_steps=null"),
                     cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name, files  # one W&B run id, written by both processes
    runs, steps, config = [], [], {}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run.run_id)
                config.update({item.key: item.value_json for item in record.run.config.update})
            elif kind == "history":
                keys = {"/".join(item.nested_key) or item.key for item in record.history.item}
                if "epoch/val_acc" in keys:
                    steps.append(record.history.step.num)
    assert len(set(runs)) == 1 and files[0].name == f"run-{runs[0]}.wandb"
    assert steps == [5, STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]  # max_steps cut epoch 1 at 5; the resume finished it
    assert config["data.batch_size"] == '"16"'


@pytest.mark.slow
def test_a_tracker_whose_library_is_missing_fails_in_one_line_naming_the_extra(tiny_dataset, tmp_path):
    shadow = tmp_path / "shadow" / "mlflow"  # an import of mlflow that fails, as where it was never installed
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named mlflow')\n")
    result = run_cli(args(tiny_dataset, tmp_path / "run", "logger=[tensorboard,mlflow]"), cwd=tmp_path,
                     env={"PYTHONPATH": f"{shadow.parent}:{ROOT}"})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "logger=mlflow" in errors[0] and "pip install 'loadout[mlflow]'" in errors[0], \
        result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_grad_clip_bounds_the_update_and_grad_norm_is_the_norm_before_clipping():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    batch = Batch(torch.rand(4, 3, 8, 8) * 50, torch.arange(4))

    def one_step(clip: float | None) -> tuple[float, float]:
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
        net.load_state_dict(model.state_dict())
        step = TrainStep(TrainerConfig(precision="fp32", grad_clip=clip), DistEnv(), torch.device("cpu"), net,
                         optimizer=partial(torch.optim.SGD, lr=1.0), schedule=warmup_cosine,
                         batch_size=4, total_steps=10, input_shape=(3, 8, 8))
        before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
        step(batch)
        after = torch.cat([p.detach().flatten() for p in net.parameters()])
        return float(step.grad_norm), float(torch.linalg.vector_norm(after - before))

    norm, moved = one_step(None)
    assert norm > 1 and moved == pytest.approx(norm, rel=1e-4)  # SGD at lr 1 moves by the gradient
    clipped_norm, clipped_moved = one_step(0.5)
    assert clipped_norm == pytest.approx(norm, rel=1e-5) and clipped_moved == pytest.approx(0.5, rel=1e-3)


@pytest.mark.slow
def test_a_run_records_lr_grad_norm_and_top5(small_run_args):
    result = run_cli([*small_run_args, "trainer.epochs=1", "trainer.max_steps=4", "logger=[]"])
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = read_metrics(Path(small_run_args[-1].split("=", 1)[1]))
    assert record["val_acc"] <= record["val_top5"] <= 1 and record["grad_norm"] > 0 and record["lr"] > 0
    assert "top5 " in result.stdout and "grad_norm " in result.stdout  # the epoch line


def without_tracker_env(home: Path) -> dict:
    """This environment with no W&B or MLflow setting in it and HOME at `home` (no ~/.netrc, no settings files)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "MLFLOW_"))}
    return {**env, "HOME": str(home), "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_wandb_without_a_key_or_mode_fails_at_start_in_one_line_and_never_prompts(tiny_dataset, tmp_path):
    """On a terminal (stdin, stdout and stderr a pty) W&B would ask "Enter your choice" mid-epoch; the run refuses
    at start instead, saying what to set, before any figure."""
    import pty

    home = tmp_path / "home"
    home.mkdir()
    main, side = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "train", *args(tiny_dataset, tmp_path / "run", "logger=[wandb]")],
                            cwd=tmp_path, env=without_tracker_env(home), stdin=side, stdout=side, stderr=side)
    os.close(side)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the pty's other side closed: the process ended
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=30) == 2
    text = out.decode(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "WANDB_API_KEY" in errors[0] and "WANDB_MODE=offline" in errors[0], text
    assert "Enter your choice" not in text and "Traceback" not in text, text
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "wandb").exists()


@pytest.mark.slow
def test_mlflow_without_a_tracking_uri_keeps_its_store_in_the_run_dir(tiny_dataset, tmp_path):
    """MLflow's own default is mlflow.db (and mlruns/) in the working directory; here it is the run dir's."""
    from mlflow import MlflowClient

    run_dir, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    result = subprocess.run([sys.executable, "-m", "train", *args(tiny_dataset, run_dir, "logger=[mlflow]",
                                                                  "trainer.epochs=1", "trainer.max_steps=3")],
                            cwd=cwd, env=without_tracker_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in cwd.iterdir()) == []  # no mlflow.db, mlruns/ or mlartifacts/ where it started
    store = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    log = result.stdout + result.stderr
    assert log.count(store) == 1 and "INFO mlflow" not in log, log  # said once, with how to look at it
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("loadout").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epoch/val_acc")] == [3]


@pytest.mark.slow
def test_tensorboard_gets_the_config_text_at_the_first_logged_step(tiny_dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    result = run_cli(args(tiny_dataset, run_dir, "logger=[tensorboard]", "trainer.epochs=1", "trainer.max_steps=3"),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    first = min(event.step for tag in events.Tags()["scalars"] for event in events.Scalars(tag))
    (config,) = events.Tensors("config/text_summary")
    assert config.step == first > 0
    assert "data.batch_size: 16" in config.tensor_proto.string_val[0].decode()


def test_a_resumed_csv_table_keeps_the_columns_it_was_written_with(tmp_path):
    """A run resumed under a loadout that knows more figures appends rows under the file's own header, each value
    in its column (the new figures are left out of that file)."""
    from loadout.observe.trackers.csv_file import CsvTracker

    (tmp_path / "metrics.csv").write_text("step,epoch,train_loss\n10,1,0.5\n")
    CsvTracker(tmp_path).log_epoch(20, {"epoch": 2, "train_loss": 0.25, "read_share": 0.3, "val_acc": 0.9})
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "epoch", "train_loss"], ["10", "1", "0.5"], ["20", "2", "0.25"]]
