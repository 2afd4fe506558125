"""The library without the template: loadout installed from the checkout as `pip install .` installs it (a wheel,
not editable), and examples/plain_loop/train.py (a plain PyTorch loop on loadout's loader) run from outside the
checkout against it, with real workers and the shared-memory ring, the doctor's line each epoch, and a run cut
mid-epoch that resumes at the exact next sample."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "plain_loop" / "train.py"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
BATCH_LINE = re.compile(r"^epoch (\d+) batch (\d+)/(\d+) loss (\S+)$", re.M)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """loadout installed into a folder of its own, offline, from a copy of the checkout's sources: pip builds in the
    tree it is given (build/, *.egg-info), and a stale build/ would carry deleted modules into the next wheel, so
    the checkout is left alone. The copy holds the template's train/ too, as a checkout does: the wheel must leave it
    out (test_the_installed_library_stands_alone), so `pip install loadout` adds no top-level `train` package."""
    src, site = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("site")
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("loadout", "train"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(src)], check=True, capture_output=True,
                   timeout=300)
    return site


def outside(site: Path, args: list[str], cwd: Path) -> dict:
    """subprocess.run's keywords: `args` run by this interpreter in `cwd`, seeing the installed copy and this
    interpreter's packages (torch, ...) and nothing of the checkout: `-S` skips site's .pth files, among them an
    editable install's finder, which maps `loadout` to the checkout wherever Python runs."""
    packages = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *packages])
    return dict(args=[sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_every_public_name_resolves_and_is_documented():
    import loadout

    documented = (ROOT / "docs" / "library.md").read_text()
    names = [name for name in loadout.__all__ if name != "__version__"]
    assert all(getattr(loadout, name) is not None for name in names)
    assert [name for name in names if f"| `{name}` |" not in documented] == []
    assert f"### {VERSION}" in documented, "docs/library.md's changelog names pyproject's version"


def test_import_loadout_imports_no_torch():
    """Every `import loadout.<module>` runs loadout/__init__.py first: it must not cost a torch import. Nor does what
    checks `python -m train`'s command line (the schemas, the command line, loadout.data's package file)."""
    probe = ("import sys, loadout, loadout.errors, loadout.data.config, loadout.dist_env, loadout.run.command_line, "
             "train.config; print(sorted({'torch', 'numpy'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr[-2000:]


def test_build_data_checks_a_plain_data_config_before_any_worker(tiny_dataset):
    import loadout

    env = loadout.DistEnv()
    settings = loadout.DataConfig(image_size=32, resize_size=16, batch_size=8, num_workers=0)
    device = loadout.select_device("cpu", env)
    plan = loadout.LoaderPlan.from_config(settings, env, device)
    sources = loadout.ImageFolderDataset(tiny_dataset, "train"), loadout.ImageFolderDataset(tiny_dataset, "val")
    with pytest.raises(loadout.ConfigError, match=r"^data.resize_size=16: use a size >= data.image_size \(32\)"):
        loadout.build_data(settings, sources, None, plan, env, device, seed=0, epochs=1, channels_last=False)


@pytest.mark.slow
def test_the_installed_library_stands_alone(installed, tmp_path):
    assert (installed / "loadout" / "__init__.py").is_file()
    probe = ("import loadout; print(loadout.__file__); print(loadout.__version__); "
             "[getattr(loadout, name) for name in loadout.__all__]; import train")
    result = subprocess.run(**outside(installed, ["-c", probe], tmp_path))
    assert len(result.stdout.split()) == 2, result.stderr[-2000:]
    where, version = result.stdout.split()
    assert Path(where).is_relative_to(installed) and version == VERSION
    assert "No module named 'train'" in result.stderr.splitlines()[-1], result.stderr[-2000:]


@pytest.mark.slow
def test_a_plain_loop_trains_on_the_loader_and_resumes_at_the_exact_next_sample(installed, tiny_dataset, tmp_path):
    """The uninterrupted run and the run cut at step 20 (epoch 2, batch 5 of 15; epoch 1 ended in its checkpoint)
    then resumed print the same loss for every batch and the same validation figures: the same samples in the same
    order, augmented alike, into the same weights."""
    script = tmp_path / "plain_loop" / "train.py"
    script.parent.mkdir()
    shutil.copy(EXAMPLE, script)
    common = [str(script), str(tiny_dataset), "--epochs", "2", "-b", "16", "-j", "2", "--image-size", "24",
              "--lr", "0.01", "-p", "1"]
    # the uninterrupted run beside the cut one and its resume
    whole_run = subprocess.Popen(**popen(outside(installed, [*common, "--checkpoint", "whole.pt"], tmp_path)))
    cut = subprocess.run(**outside(installed, [*common, "--checkpoint", "cut.pt", "--max-steps", "20"], tmp_path))
    rest = subprocess.run(**outside(installed, [*common, "--checkpoint", "cut.pt", "--resume", "cut.pt"], tmp_path))
    out, err = whole_run.communicate(timeout=600)
    whole = subprocess.CompletedProcess(whole_run.args, whole_run.returncode, out, err)
    for run in (whole, cut, rest):
        assert run.returncode == 0, run.stderr[-3000:]
        assert "loader: 2 workers, a shared-memory ring of 4 batches each" in run.stdout  # the ring: workers > 0

    batches = BATCH_LINE.findall(whole.stdout)
    assert [(int(e), int(b)) for e, b, _, _ in batches] == [(e, b) for e in (1, 2) for b in range(1, 16)]
    assert all(math.isfinite(float(loss)) for *_, loss in batches)
    assert BATCH_LINE.findall(cut.stdout) + BATCH_LINE.findall(rest.stdout) == batches
    assert "stopped: --resume cut.pt continues at epoch 2, batch 6" in cut.stdout
    assert "resumed from cut.pt: epoch 2, batch 6 next" in rest.stdout
    assert lines(cut, "epoch 1: ") == lines(whole, "epoch 1: ")  # its train loss (timings aside), its validation
    assert lines(rest, "epoch 2: val") == lines(whole, "epoch 2: val")
    # the doctor's one line for each epoch trained to its end, after the stage table
    assert [len(lines(run, "doctor: ", stream="stderr")) for run in (whole, cut, rest)] == [2, 1, 1]


def popen(kwargs: dict) -> dict:
    """subprocess.run's keywords as Popen takes them (its timeout goes to communicate)."""
    return {key: value for key, value in kwargs.items() if key not in ("capture_output", "timeout")} | dict(
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def lines(run: subprocess.CompletedProcess, start: str, stream: str = "stdout") -> list[str]:
    """The lines of `run`'s output that start with `start`, an epoch's train line without its timings."""
    found = [line for line in getattr(run, stream).splitlines() if line.startswith(start)]
    return [line.split(", ")[0] if ": train loss" in line else line for line in found]
