"""The Makefile from a clean clone: help lists every target, dataset and train work (reusing this .venv)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_metrics

VENV = Path(sys.prefix)


def make(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    # -o: treat the shared venv's install stamp as up to date, so the clone does not reinstall into it.
    cmd = ["make", f"VENV={VENV}", "-o", f"{VENV}/.installed", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def clean_clone(tmp_path_factory) -> Path:
    if shutil.which("make") is None or not (ROOT / ".git").exists():
        pytest.skip("needs make and a git checkout")
    clone = tmp_path_factory.mktemp("clone") / "loadout"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    return clone


@pytest.mark.slow
def test_help_lists_every_documented_target(clean_clone):
    targets = re.findall(r"^([a-zA-Z_-]+):.*## ", (clean_clone / "Makefile").read_text(), flags=re.M)
    assert {"setup", "dataset", "train", "test", "help"} <= set(targets)
    result = make(["help"], clean_clone)
    assert result.returncode == 0, result.stderr
    for target in targets:
        assert re.search(rf"^\s*{target}\s", result.stdout, flags=re.M), target
    assert "\033" not in result.stdout  # into a pipe: no colour codes


@pytest.mark.slow
def test_dataset_then_train_from_a_clean_clone(clean_clone, tmp_path):
    result = make(["dataset"], clean_clone)
    assert result.returncode == 0, result.stderr
    assert len(list((clean_clone / "data/synthetic/train").glob("*/*.jpg"))) == 1500
    again = make(["dataset"], clean_clone)
    assert "scripts/make_dataset.py" not in again.stdout  # made once, then left alone
    run_dir = tmp_path / "run"
    args = f"hardware=cpu trainer.epochs=1 trainer.max_steps=3 trainer.progress=false data.num_workers=1 " \
           f"hydra.run.dir={run_dir}"
    result = make(["train", f"ARGS={args}"], clean_clone)
    assert result.returncode == 0, result.stderr
    assert read_metrics(run_dir)[0]["epoch"] == 1


def test_setup_on_a_python_older_than_the_lock_allows_fails_in_one_line(clean_clone, tmp_path):
    old = tmp_path / "python3"  # stands in for Ubuntu 22.04's python3: answers the version query with 3.10
    old.write_text("#!/bin/sh\necho 3.10\n")
    old.chmod(0o755)
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "setup", f"PYTHON={old}", f"VENV={venv}"], cwd=clean_clone, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and not venv.exists()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: loadout needs Python >= 3.11 (the lock's numpy and matplotlib do); {old} is 3.10: "
                      "install python3.11 and run make PYTHON=python3.11 setup"], result.stderr
    requires = re.search(r'^requires-python = ">=(\S+)"', (clean_clone / "pyproject.toml").read_text(), re.M)
    assert requires[1] == "3.11", "pyproject's promise and the Makefile's check must agree"
