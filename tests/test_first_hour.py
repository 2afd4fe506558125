"""A new user's first hour with the real CLI (`python -m train` in a subprocess): every mistake gets one true line
before anything is written, a resume keeps the run it continues, and every run says where it wrote and what its
loader ran with."""

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
import yaml

from loadout.run.run_dir import run_dir_name
from loadout.run.run_lock import RunLock
from loadout.run.run_record import profile_settings
from tests.conftest import RECORD_SAMPLES, ROOT, compose_config, read_metrics, run_cli, training_at, wait_for
from train.__main__ import GROUPS, KEYS


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what a refused command must not touch."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize("override, line", [
    ("debug=fast", "debug=fast: no conf/debug/fast.yaml; choose one of default, limit, overfit, profiler; did you "
                   "mean debug=default?"),
    ("experiment=imagenet_resnet", "did you mean experiment=imagenet_resnet50?"),
    ("logger=[tensorboard,wandbb]", "logger=wandbb: no conf/logger/wandbb.yaml; choose one of csv, mlflow, "
                                    "tensorboard, wandb; did you mean logger=wandb?"),
    ("hardware=rtx5090", "hardware=rtx5090: no conf/hardware/rtx5090.yaml"),
    ("data.batch_size=abc", "data.batch_size=abc: data.batch_size takes an integer, not 'abc'"),
    ("trainer.max_steps=2.5", "trainer.max_steps=2.5: trainer.max_steps takes an integer or null, not '2.5'"),
    ("data.pin_memory=maybe", "data.pin_memory takes true or false"),
    ("data.decode=devcie", "data.decode=devcie: data.decode takes one of cpu, device, not 'devcie'"),
    ("trainer.label_smoothing=0.1", "trainer.label_smoothing: did you mean task.label_smoothing?"),
])
@pytest.mark.slow  # one `python -m train` each; test_a_bad_value_keeps_its_credentials_out_of_the_error stays fast
def test_a_bad_option_or_type_fails_in_one_line_before_anything_is_written(override, line, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", override, f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"error: {result.stderr.splitlines()[0][7:]}"] and line in result.stderr
    assert result.stdout == "" and not run_dir.exists()


@pytest.mark.slow
def test_an_option_hint_names_only_what_works():
    result = run_cli(["hardware=rtx5090", "--cfg", "job"])
    assert result.returncode == 2 and "_target_" not in result.stderr, result.stderr  # hardware has no class
    suggested = re.search(r"did you mean (hardware=\w+)\?", result.stderr)[1]
    compose_config([suggested])  # the suggestion composes
    for option in re.search(r"choose one of (.*);", result.stderr)[1].split(", "):
        compose_config([f"hardware={option}"])


@pytest.mark.parametrize("override, message", [
    ("data.root=/no/such/dataset", "data.root='/no/such/dataset' does not exist"),
    ("optimizer._target_=torch.optim.Nope", "optimizer._target_=torch.optim.Nope: cannot import"),
    ("model._target_=nope.Model", "model._target_=nope.Model: cannot import"),
])
@pytest.mark.slow
def test_an_error_after_composition_is_printed_once(override, message, tiny_dataset, tmp_path):
    result = run_cli(["hardware=cpu", f"data.root={tiny_dataset}", "data.num_workers=0", override,
                      f"hydra.run.dir={tmp_path / 'run'}"])
    out = result.stdout + result.stderr
    assert result.returncode == 2
    assert [line for line in out.splitlines() if message in line or "ERROR" in line] == \
        [line for line in result.stderr.splitlines() if line.startswith(f"error: {message}")], out


def test_help_lists_the_groups_and_keys_quickly():
    # quick by what it imports, not by a clock a loaded machine stretches: -X importtime lists every import
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "train", "--help"], cwd=ROOT,
                            capture_output=True, text=True)
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    heavy = {"torch", "hydra", "omegaconf", "numpy"}
    assert "train" in imported and not imported & heavy, f"--help waits for {imported & heavy}"
    assert result.returncode == 0 and len(result.stdout.splitlines()) < 45
    for group in GROUPS:
        assert re.search(rf"^  {group} .*options: ", result.stdout, re.M), group
    cfg = compose_config([])
    for key in KEYS:
        assert re.search(rf"^  {re.escape(key)} ", result.stdout, re.M), key
        if not key.startswith("hydra."):
            assert key.split(".")[-1] in cfg[key.split(".")[0]], f"--help names {key}, which the schema lacks"


@pytest.mark.slow
def test_cfg_job_prints_resolved_values():
    result = run_cli(["--cfg", "job", "hardware=auto"])
    assert result.returncode == 0, result.stderr
    assert "${" not in result.stdout and "image_size: " in result.stdout


@pytest.mark.parametrize("args, printed", [
    (["--config-name", "config", "hardware=cpu", "--cfg", "job"], "image_size: 64"),
    (["hardware=cpu", "--info", "config"], "Config search path"),
    (["hardware=cpu", "-i"], "Installed Hydra Plugins"),
])
@pytest.mark.slow
def test_hydra_flags_keep_their_values(args, printed):
    result = run_cli(args)
    assert result.returncode == 0, result.stderr
    assert printed in result.stdout


def test_a_bad_value_keeps_its_credentials_out_of_the_error():
    result = run_cli(["hardware=cpu", "data.batch_size=https://user:secret@host/x"])
    assert result.returncode == 2
    assert result.stderr == ("error: data.batch_size=https://***@host/x: data.batch_size takes an integer, not "
                             "'https://***@host/x'\n")


@pytest.mark.slow
def test_a_missing_url_root_keeps_its_credentials_out_of_the_error(tmp_path):
    result = run_cli(["hardware=cpu", "data.root=https://user:secret@127.0.0.1:1/data", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2 and "secret" not in result.stdout + result.stderr
    assert "data.root='https://***@127.0.0.1:1/data' does not exist" in result.stderr


def test_torchrun_ranks_share_one_readable_run_dir_name():
    """Each rank resolves the name itself, at its own moment; --standalone's run id is a random UUID."""
    run_id = "3f2a9c1b-0d4e-4c5b-9a8f-1234567890ab"
    code = "from loadout.run.run_dir import run_dir_name; print(run_dir_name())"
    names = []
    for rank in range(2):  # two "ranks" of one agent (this process), a second apart
        time.sleep(1.1 * rank)
        names.append(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                                    env={**os.environ, "TORCHELASTIC_RUN_ID": run_id}).stdout.strip())
    assert names[0] == names[1], names
    assert re.fullmatch(r"torchrun/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d-3f2a9c1b", names[0]), names[0]
    os.environ["TORCHELASTIC_RUN_ID"] = "job-4711"  # a chosen --rdzv-id (a Slurm job id): every node shares it
    try:
        assert run_dir_name() == "torchrun/job-4711"
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]


def test_a_profile_that_changes_the_model_says_so():
    cfg = compose_config(["hardware=rtx4080"])
    profile = ROOT / "conf" / "hardware" / "rtx4080.yaml"
    assert profile_settings(cfg, profile)["model.name"] == "resnet50"
    assert "model.name" not in profile_settings(cfg, profile, typed={"model.name"})


@pytest.fixture(scope="module")
def first_run(tiny_dataset, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 1-epoch run cut at 3 steps with the csv logger, started with trainer.resume=auto in an empty dir."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    result = run_cli(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                      "trainer.progress=false", "trainer.epochs=1", "trainer.max_steps=3", "logger=[csv]",
                      "trainer.resume=auto", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    return run_dir, result


@pytest.mark.slow
def test_a_run_says_where_it_writes_and_records_its_loader_plan(first_run):
    run_dir, result = first_run
    out = result.stdout + result.stderr
    assert f"run dir: {run_dir}" in out.splitlines()[0]
    assert f"trainer.resume=auto: nothing to resume in {run_dir}" in out
    assert f"checkpoints in {run_dir}/checkpoints (last.pt); metrics in {run_dir}/metrics.jsonl" in out
    plan = json.loads((run_dir / "plan.json").read_text())
    assert isinstance(plan["loader"]["num_workers"], int) and plan["loader"]["num_workers_setting"] == "auto"
    assert plan["loader"]["batch_shape"] == [16, 3, 32, 32] and plan["precision"] in ("bf16", "fp32")
    assert plan["hardware"]["profile"] == "cpu" and plan["steps"]["max_steps"] == 3
    assert len(re.findall(r"\] - plan: ", out)) == 1


@pytest.mark.slow
def test_a_refused_resume_writes_nothing(first_run):
    run_dir, _ = first_run
    before = tree(run_dir)
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", "model.name=resnet34"])
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: model.name=resnet34: the run in {run_dir} has model.name=resnet18 "
                                     "and its checkpoints are tied to it; resume it unchanged, or start a new run "
                                     "(another hydra.run.dir) for the change")
    assert tree(run_dir) == before


@pytest.mark.slow
def test_a_resume_keeps_the_run_and_its_record(first_run):
    run_dir, _ = first_run
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", "trainer.max_steps=5"])
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "resumed from" in out and "epoch 1/1" in out, out  # its 1-epoch plan, not the default 3
    assert [row.split(",")[0] for row in (run_dir / "metrics.csv").read_text().splitlines()[1:]] == ["3", "5"]
    assert (run_dir / ".hydra" / "config.yaml").read_text() == config
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides
    resumes = yaml.safe_load((run_dir / ".hydra" / "resumes.yaml").read_text())
    assert resumes[-1]["overrides"] == ["trainer.max_steps=5"]


@pytest.mark.slow
def test_the_continue_command_works_as_typed_in_a_new_shell(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
            "data.num_workers=0", "trainer.epochs=1", RECORD_SAMPLES, "trainer.progress=false",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wait_for(lambda: training_at(run_dir) >= (0, 2), 120, "training to be under way")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    command = re.search(r"continue with: (.*)$", out, re.M)[1]
    shell_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    shell_env["PATH"] = "/usr/bin:/bin"  # a new shell: no venv activated
    resumed = subprocess.run(["bash", "-c", command], cwd=ROOT, env=shell_env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1]


@pytest.mark.slow
def test_a_resume_the_run_refuses_writes_nothing_and_the_next_one_works(first_run, tmp_path):
    """Refused after Hydra starts (another batch size mid-epoch, a run dir in use): no resumes.yaml entry, no new
    plan.json, nothing the next resume replays; the log alone says what was tried."""
    run_dir = Path(shutil.copytree(first_run[0], tmp_path / "run"))  # mid-epoch 1 (another test may resume it)
    log_file, resumes = next(run_dir.glob("*.log")), run_dir / ".hydra" / "resumes.yaml"
    recorded = yaml.safe_load(resumes.read_text()) if resumes.is_file() else []
    refusals = [(["data.batch_size=8"], "stopped mid-epoch with 15 steps an epoch, this run has 30"),
                (["trainer.max_steps=4"], "another run is training in it")]
    for args, message in refusals:
        with RunLock(run_dir) if "another run" in message else contextlib.nullcontext():
            before, logged = tree(run_dir), log_file.read_text()
            result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", *args])
            after = tree(run_dir)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert {k: v for k, v in after.items() if k != log_file.name} == \
            {k: v for k, v in before.items() if k != log_file.name}
        assert log_file.read_text().startswith(logged) and message in log_file.read_text()[len(logged):]
    plain = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}"])
    assert plain.returncode == 0, plain.stderr
    assert [entry["overrides"] for entry in yaml.safe_load(resumes.read_text())[len(recorded):]] == [[]]
