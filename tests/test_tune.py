"""`python -m train.tune`: a real multirun sweep (real workers, real JPEG decoding), its report, the autotuned profile
used for training, and bad sweep values refused before any job runs."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from loadout.errors import ConfigError
from loadout.runtime.precision import native_bf16
from loadout.tune.job_record import RESULT_FILE, find_duplicate, measured_config
from loadout.tune.profile import pick_best
from loadout.tune.report import swept_elsewhere, table
from loadout.tune.sweep import default_sweep, expand_sweep
from tests.conftest import CONF, compose_config, read_metrics, run_cli
from train.config import check_sweep, register_tune

TINY = ["hardware=cpu", "data.image_size=32", "data.batch_size=16", "trainer.progress=false",
        "tune.repeats=3", "tune.warmup_batches=1", "tune.batches=3"]


@pytest.fixture(scope="module")
def sweep(tiny_dataset, tmp_path_factory) -> dict:
    """One sweep for the module: workers 0,1 x pin_memory false,true, with autotune into a tmp config dir."""
    tmp = tmp_path_factory.mktemp("tune")
    conf_dir = tmp / "conf"
    profile = conf_dir / "hardware" / "local.yaml"
    sweep_dir = tmp / "sweep"
    proc = run_cli(["-m", *TINY, f"data.root={tiny_dataset}", "data.num_workers=0,1", "data.pin_memory=false,true",
                    "data.persistent_workers=true", "data.prefetch_factor=2", "tune.autotune=true",
                    f"tune.profile_path={profile}", f"hydra.sweep.dir={sweep_dir}"], module="train.tune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"proc": proc, "dir": sweep_dir, "conf": conf_dir, "profile": profile}


@pytest.mark.slow
def test_sweep_writes_table_csv_json_and_plot(sweep):
    with open(sweep["dir"] / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["num_workers"]) for r in rows] == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    measured = [r for r in rows if r["status"] == "ok"]
    assert {r["num_workers"] for r in measured} == {"0", "1"}
    if not torch.cuda.is_available():  # pin_memory=true is pin_memory=false without CUDA: measured once
        assert [r["status"] for r in rows] == ["ok", "duplicate", "ok", "duplicate"]
    for row in rows:
        assert float(row["images_per_s"]) > 0
        assert len(row["first_batch_s"].split()) == 3  # one latency per epoch
        assert float(row["peak_pss_mb"]) > 0

    report = json.loads((sweep["dir"] / "results.json").read_text())
    assert report["machine"]["usable_cores"] >= 1 and report["machine"]["torch"] == torch.__version__
    assert report["dataset"]["batches_per_epoch"] == 15  # 240 images / 16
    zero = report["results"][0]
    assert zero["settings"]["data"]["persistent_workers"] is False  # worker-only knobs off with no workers
    assert zero["settings"]["data"]["prefetch_factor"] is None
    assert report["results"][2]["settings"]["data"]["persistent_workers"] is True

    assert (sweep["dir"] / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = sweep["proc"].stdout
    assert "img/s" in out and "first batch" in out and f"torch {torch.__version__}" in out


@pytest.mark.slow
def test_autotune_profile_composes_and_trains(sweep, tiny_dataset, tmp_path):
    text = sweep["profile"].read_text()
    assert text.startswith("# @package _global_\n")
    assert "python -m train.tune" in text and "usable cores" in text
    report = json.loads((sweep["dir"] / "results.json").read_text())
    best = report["results"][report["best_job"]]
    profile = yaml.safe_load(text)
    assert profile["data"]["num_workers"] == best["settings"]["data"]["num_workers"]

    run_dir = tmp_path / "run"
    proc = run_cli(["hardware=local", f"hydra.searchpath=[file://{sweep['conf']}]", f"data.root={tiny_dataset}",
                    "trainer.epochs=1", "trainer.max_steps=3", "trainer.progress=false", "logger=[]",
                    f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert resolved["data"]["num_workers"] == profile["data"]["num_workers"]
    assert resolved["data"]["image_size"] == 32
    assert read_metrics(run_dir)[0]["images"] > 0


@pytest.mark.slow
def test_bad_sweep_value_fails_before_any_job(tiny_dataset, tmp_path):
    proc = run_cli(["-m", *TINY, f"data.root={tiny_dataset}", "data.num_workers=0,-1",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], module="train.tune")
    assert proc.returncode == 2
    assert "data.num_workers=-1: use an integer >= 0" in proc.stderr
    assert not (tmp_path / "sweep").exists()  # not even job 0 (a valid one) ran


@pytest.mark.parametrize(("sweep_value", "message"), [
    ("data.num_workers=1,two", "data.num_workers='two': use an integer >= 0"),
    ("tune.repeats=0", "tune.repeats=0: use an integer >= 1"),
    ("tune.batches=4,abc", "tune.batches=abc"),
    ("data.num_workers=0,2 data.persistent_workers=true data.timeout=-1", "data.timeout=-1"),
])
def test_check_sweep_names_the_bad_key(sweep_value, message):
    register_tune()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), \
            pytest.raises(ConfigError, match=re.escape(message)):
        check_sweep("tune", ["hardware=cpu", *sweep_value.split()])


def test_check_sweep_accepts_worker_knobs_with_zero_workers():
    register_tune()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert check_sweep("tune", ["hardware=rtx4080", "data.num_workers=0,2,4"]) == 3


def test_training_rejects_tune_keys():
    with pytest.raises(ConfigCompositionException, match="tune"):
        compose_config(["tune.repeats=3"])


@pytest.mark.slow
def test_with_model_reports_data_stall(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*TINY, f"data.root={tiny_dataset}", "data.num_workers=1", "model.name=mobilenet_v3_small",
                    "tune.repeats=1", "tune.batches=2", "tune.with_model=true", "tune.plot=false",
                    f"hydra.run.dir={run_dir}"], module="train.tune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["images_per_s"] > 0
    assert 0.0 <= result["data_stall_frac"] <= 1.0
    assert (run_dir / "results.csv").is_file()
    # trainer.precision=auto on a CPU with native bf16: measured once, trained in, and what hardware=local would say
    assert result["settings"]["trainer"]["precision"] == (result["precision"] if native_bf16() else "auto")


def _result(job: int, images_per_s: float, rss: float) -> dict:
    return {"job": job, "status": "ok", "images_per_s": images_per_s, "peak_pss_mb": rss}


def test_pick_best_respects_budget_and_prefers_less_memory_when_as_fast():
    results = [_result(0, 100, 500), _result(1, 300, 2000), _result(2, 290, 1200), _result(3, 200, 900),
               {"job": 4, "status": "failed", "error": "killed"}]
    assert pick_best(results, None, 0.0)["job"] == 1
    assert pick_best(results, None, 0.05)["job"] == 2  # 290 is within 5% of 300 and uses less memory
    assert pick_best(results, 1000, 0.05)["job"] == 3
    with pytest.raises(ConfigError, match="tune.memory_budget_mb=100"):
        pick_best(results, 100, 0.05)


def test_default_sweep_follows_the_cores():
    assert default_sweep(cores=2, cuda=False) == \
        "data.num_workers=0,1,2 data.prefetch_factor=2,4 data.pin_memory=false"
    assert default_sweep(cores=16, cuda=True) == \
        "data.num_workers=0,1,2,3,4,6,8,10,12,14,16 data.prefetch_factor=2,4 data.pin_memory=true,false"
    assert default_sweep(cores=7, cuda=False).startswith("data.num_workers=0,1,2,3,4,5,6,7 ")  # 0.75 x 7 = 5
    assert default_sweep(cores=64, cuda=False).startswith("data.num_workers=0,1,2,3,4,12,20,28,36,44,48,52,60,64 ")


def test_jobs_that_differ_outside_the_table_columns_are_measured_and_told_apart(tmp_path):
    """Two jobs are duplicates only when their whole config is (a swept data.device_transforms is not a duplicate),
    and the table shows such keys on each row."""
    def config(device_transforms: bool, workers="auto"):
        cfg = OmegaConf.create({"data": {"num_workers": workers, "pin_memory": True,
                                         "device_transforms": device_transforms}, "trainer": {"amp": False}})
        return measured_config(cfg, num_workers=2, pin_memory=False)

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / RESULT_FILE).write_text(json.dumps({"job": 0, "status": "ok", "config": config(True)}))
    assert find_duplicate(tmp_path / "1", config(False)) is None
    assert find_duplicate(tmp_path / "1", config(True, workers=2)) == 0  # auto resolved to the same 2 workers

    results = [{"job": job, "status": "ok", "overrides": [f"data.num_workers={w}", f"data.device_transforms={d}",
                                                         "trainer.progress=false"]}
               for job, (w, d) in enumerate([(0, "true"), (0, "false"), (2, "true")])]
    assert swept_elsewhere(results) == {0: "data.device_transforms=true", 1: "data.device_transforms=false",
                                        2: "data.device_transforms=true"}
    assert table(results).splitlines()[3].endswith("[data.device_transforms=false]")


def test_expand_sweep_is_the_cartesian_product():
    jobs = expand_sweep(["hardware=cpu", "data.num_workers=0,2", "data.batch_size=8,16,32"])
    assert len(jobs) == 6
    assert ["hardware=cpu", "data.num_workers=2", "data.batch_size=16"] in jobs


def test_profile_path_default_is_in_the_sweeps_config_tree():
    from hydra import compose, initialize_config_dir

    from loadout.tune.profile import default_profile

    register_tune()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("tune", overrides=["hardware=cpu"], return_hydra_config=True)
    assert default_profile(cfg) == Path(__file__).resolve().parents[1] / "conf" / "hardware" / "local.yaml"


@pytest.mark.slow
def test_sweep_in_a_log_is_a_clean_table(tiny_dataset, tmp_path):
    """stderr piped (a log, not a terminal) with the bars on (trainer.progress's default): no bar debris, the
    table's rows, and little else."""
    args = [arg for arg in TINY if arg != "trainer.progress=false" and not arg.startswith("tune.")]
    proc = run_cli(["-m", *args, f"data.root={tiny_dataset}", "data.num_workers=0", "data.prefetch_factor=2,4",
                    "tune.repeats=1", "tune.warmup_batches=1", "tune.batches=2", "tune.plot=false",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], module="train.tune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "\r" not in log and "it/s" not in log and "%|" not in log, log
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+[01]\s+0\s", line)]
    assert len(rows) == 2 and "duplicate (= job 0)" in rows[1], proc.stdout  # prefetch means nothing without workers
    assert len(log.splitlines()) < 20, log
