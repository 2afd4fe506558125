"""What a resume replays from its run dir (loadout/run/resume_run.py), driven through the real CLI: a URL whose
credentials were masked in `.hydra/` is asked for again, never replayed as `***`; the frozen keys are compared as the
run resolved them; a damaged `.hydra/resumes.yaml` is one line, and it is rewritten whole, never appended in place."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from loadout.errors import ConfigError
from loadout.run.resume_run import RESUMES, record, replay, saved_overrides
from tests.conftest import read_metrics, run_cli

SECRET_URL = "https://user:secret@127.0.0.1:1/data"


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> Path:
    """The run dir a real `python -m train` leaves when its data.root (a URL with credentials) turns out not to be
    there: Hydra's `.hydra/` record with the URL masked and the frozen keys as this machine resolved them
    (hardware=auto). A checkpoint file stands in for training: a resume is judged before one is read."""
    run_dir = tmp_path_factory.mktemp("failed") / "run"
    result = run_cli(["hardware=auto", f"data.root={SECRET_URL}", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2, result.stdout + result.stderr
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.pt").touch()
    return run_dir


@pytest.fixture
def run_dir(failed_run, tmp_path) -> Path:
    """A copy of `failed_run` this test may change."""
    return Path(shutil.copytree(failed_run, tmp_path / "run"))


@pytest.mark.slow
def test_a_masked_url_is_asked_for_again_not_replayed(run_dir):
    assert "data.root=https://***@127.0.0.1:1/data" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: data.root: the run's URL had credentials, masked in .hydra/; give "
                                     "data.root=... again (or data.root='${oc.env:VAR}')"), result.stderr
    given = replay(["trainer.resume=auto", f"data.root={SECRET_URL}"], run_dir)
    assert f"data.root={SECRET_URL}" in given and not any("***" in override for override in given)


@pytest.mark.slow
def test_the_frozen_keys_are_compared_as_the_run_resolved_them(run_dir):
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["data"]["image_size"] == 64, "hardware=auto's ${if_cuda:224,64} as this CPU run resolved it"
    text = (run_dir / ".hydra" / "config.yaml").read_text()  # as a GPU run writes it
    (run_dir / ".hydra" / "config.yaml").write_text(text.replace("image_size: 64", "image_size: 224"))
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", "data.root=/no/such/dataset"])
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: data.image_size=64: the run in {run_dir} has data.image_size=224 and "
                                     "its checkpoints are tied to it; resume it unchanged, or start a new run "
                                     "(another hydra.run.dir) for the change"), result.stderr


@pytest.mark.parametrize("text, line", [
    ("- at: now\n  overrides: [trainer.epochs=5\n", "unreadable (while parsing a flow sequence)"),
    ("- trainer.epochs=5\n", "an entry without a list of overrides ('trainer.epochs=5')"),
])
@pytest.mark.slow
def test_a_damaged_resumes_yaml_is_one_line(run_dir, text, line):
    path = run_dir / ".hydra" / RESUMES
    path.write_text(text)
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", "data.root=/no/such/dataset"])
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {path}: {line}; repair it") and len(result.stderr.splitlines()) == 1, \
        result.stderr


@pytest.mark.slow
def test_record_rewrites_resumes_yaml_whole_with_urls_masked(run_dir):
    record(run_dir, ["hardware=auto", "trainer.epochs=5"])
    record(run_dir, ["trainer.epochs=6", f"data.root={SECRET_URL}"])
    entries = yaml.safe_load((run_dir / ".hydra" / RESUMES).read_text())
    assert [entry["overrides"] for entry in entries] == [
        ["trainer.epochs=5"], ["trainer.epochs=6", "data.root=https://***@127.0.0.1:1/data"]]
    assert sorted(path.name for path in (run_dir / ".hydra").iterdir()) == [
        "config.yaml", "hydra.yaml", "overrides.yaml", RESUMES], "no temporary file left beside it"
    assert saved_overrides(run_dir)[-2:] == ["trainer.epochs=6", "data.root=https://***@127.0.0.1:1/data"]
    with pytest.raises(ConfigError, match=r"^data.root: the run's URL had credentials"):
        replay(["trainer.resume=auto"], run_dir)


def test_replay_removes_a_key_the_run_added_as_typed(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- +trainer.extra=1\n- trainer.epochs=2\n")
    assert replay(["~trainer.extra"], tmp_path) == ["trainer.epochs=2", "~trainer.extra", "hydra.output_subdir=null"]
    assert replay(["trainer.extra=2"], tmp_path) == ["trainer.epochs=2", "+trainer.extra=2",
                                                     "hydra.output_subdir=null"]


def test_a_group_chosen_again_replays_none_of_the_runs_keys_inside_it(tmp_path):
    """The run named its class and an added key; the resume picks the same dataset by its YAML (which has that key)."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- dataset._target_=csv_images.CsvImages\n- +dataset.csv=list.csv\n- trainer.epochs=2\n")
    assert replay(["dataset=csv", "trainer.resume=auto"], tmp_path) == [
        "trainer.epochs=2", "dataset=csv", "trainer.resume=auto", "hydra.output_subdir=null"]


@pytest.mark.slow
def test_a_run_from_before_the_task_group_resumes(run_dir):
    """A run dir written before `task=` existed: no task in its config.yaml and `trainer.label_smoothing` among its
    overrides. The resume replays the value under its new key and does not refuse the missing frozen task."""
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    del config["task"]
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    overrides = run_dir / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text() + "- trainer.label_smoothing=0.1\n")
    assert "task.label_smoothing=0.1" in replay(["trainer.resume=auto", "data.root=/no/such/dataset"], run_dir)
    result = run_cli(["trainer.resume=auto", f"hydra.run.dir={run_dir}", "data.root=/no/such/dataset"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: data.root='/no/such/dataset' does not exist"), result.stderr


@pytest.mark.slow
def test_a_run_from_before_the_library_moved_resumes(small_run_args, tmp_path):
    """A run dir written while the loader lived in train/: its saved config and overrides name `train.data.*`
    targets (a `_target_` given on its command line among them). It resumes and trains on from its checkpoint."""
    run_dir = tmp_path / "run"
    target = "dataset._target_=loadout.data.datasets.ImageFolderDataset"
    first = run_cli([*small_run_args, "trainer.epochs=1", target])
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("config.yaml", "overrides.yaml"):
        path = run_dir / ".hydra" / name
        old = (path.read_text().replace("loadout.data.", "train.data.").replace("loadout.observe.", "train.observe.")
               .replace("train.augment.", "train.data.augment."))
        assert "train.data.datasets.ImageFolderDataset" in old and "loadout." not in old
        path.write_text(old)
    result = run_cli([*small_run_args, "trainer.epochs=2", "trainer.resume=auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["epoch"] for row in read_metrics(run_dir)] == [1, 2]
